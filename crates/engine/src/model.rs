//! A decoder-only GPT: token + position embeddings, N pre-LayerNorm blocks (causal multi-head
//! attention, 4× GELU MLP), a final norm and an untied LM head.
//!
//! Weights are f32 `Var`s (the master copy). A forward in bf16/f16 casts each weight once into a
//! low-precision "compute weight"; gradients flow back through the cast to the f32 Vars. Linear
//! weights are stored `[in, out]` so a layer is `x.matmul(w) + b`.

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::ops;
use crate::scenario::ModelConfig;

const LN_EPS: f64 = 1e-5;

/// A trainable tensor and how the optimizer treats it.
pub struct Param {
    pub name: String,
    pub var: Var,
    /// Weight decay applies to matrices (linear layers, embeddings), not to biases and norm gains.
    pub decay: bool,
}

pub struct Gpt {
    pub cfg: ModelConfig,
    pub params: Vec<Param>,
}

/// What one forward produced.
pub struct Forward {
    /// `[B*T, vocab]` in the compute dtype.
    pub logits: Tensor,
    /// The low-precision weight copies made for this forward (empty in f32).
    pub compute_weights: Vec<Tensor>,
}

impl Gpt {
    /// A freshly initialised model; identical on every device for the same seed.
    pub fn new(cfg: &ModelConfig, seed: u64, device: &Device) -> Result<Gpt> {
        let mut init = Init {
            rng: ChaCha8Rng::seed_from_u64(seed),
            device,
            params: Vec::new(),
        };
        let (v, d, t) = (cfg.vocab, cfg.d_model, cfg.seq_len);
        let proj_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
        init.normal("wte", &[v, d], 0.02)?;
        init.normal("wpe", &[t, d], 0.02)?;
        for l in 0..cfg.layers {
            let p = |s: &str| format!("h{l}.{s}");
            init.constant(&p("ln1.g"), &[d], 1.0)?;
            init.constant(&p("ln1.b"), &[d], 0.0)?;
            init.normal(&p("attn.qkv.w"), &[d, 3 * d], 0.02)?;
            init.constant(&p("attn.qkv.b"), &[3 * d], 0.0)?;
            init.normal(&p("attn.proj.w"), &[d, d], proj_std)?;
            init.constant(&p("attn.proj.b"), &[d], 0.0)?;
            init.constant(&p("ln2.g"), &[d], 1.0)?;
            init.constant(&p("ln2.b"), &[d], 0.0)?;
            init.normal(&p("mlp.fc.w"), &[d, 4 * d], 0.02)?;
            init.constant(&p("mlp.fc.b"), &[4 * d], 0.0)?;
            init.normal(&p("mlp.proj.w"), &[4 * d, d], proj_std)?;
            init.constant(&p("mlp.proj.b"), &[d], 0.0)?;
        }
        init.constant("lnf.g", &[d], 1.0)?;
        init.constant("lnf.b", &[d], 0.0)?;
        init.normal("head.w", &[d, v], 0.02)?;
        Ok(Gpt {
            cfg: cfg.clone(),
            params: init.params,
        })
    }

    pub fn param_count(&self) -> u64 {
        self.params.iter().map(|p| p.var.elem_count() as u64).sum()
    }

    /// Bytes of the f32 master weights.
    pub fn param_bytes(&self) -> u64 {
        self.param_count() * 4
    }

    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.params.iter().map(|p| &p.var)
    }

    /// Logits for token ids `[B, T]` (u32). `track` = false detaches the weights (evaluation:
    /// no graph is kept alive).
    pub fn forward(&self, ids: &Tensor, dtype: DType, track: bool) -> Result<Forward> {
        let (b, t) = ids.dims2()?;
        let cfg = &self.cfg;
        let (d, h) = (cfg.d_model, cfg.heads);

        let mut compute_weights = Vec::new();
        let mut weights = self.params.iter().map(|p| {
            let w = if track {
                p.var.as_tensor().clone()
            } else {
                p.var.as_tensor().detach()
            };
            if w.dtype() == dtype {
                Ok(w)
            } else {
                let c = w.to_dtype(dtype)?;
                compute_weights.push(c.clone());
                Ok(c)
            }
        });
        let mut next =
            || -> Result<Tensor> { weights.next().expect("parameter order matches Gpt::new") };

        let wte = next()?;
        let wpe = next()?;
        let tok = ops::embedding(&wte, &ids.flatten_all()?)?.reshape((b, t, d))?;
        let pos = wpe.narrow(0, 0, t)?;
        let mut x = ops::broadcast_add(&tok, &pos)?.reshape((b * t, d))?;

        for _ in 0..cfg.layers {
            let (g1, b1) = (next()?, next()?);
            let (wqkv, bqkv, wproj, bproj) = (next()?, next()?, next()?, next()?);
            let (g2, b2) = (next()?, next()?);
            let (wfc, bfc, wout, bout) = (next()?, next()?, next()?, next()?);

            let a = ops::layer_norm(&x, &g1, &b1, LN_EPS)?;
            let qkv = ops::linear(&a, &wqkv, &bqkv)?;
            let y = ops::causal_attention(&qkv, b, t, h)?;
            x = (x + ops::linear(&y, &wproj, &bproj)?)?;

            let m = ops::layer_norm(&x, &g2, &b2, LN_EPS)?;
            let hidden = ops::linear(&m, &wfc, &bfc)?;
            x = (x + ops::gelu_linear(&hidden, &wout, &bout)?)?;
        }
        let (gf, bf) = (next()?, next()?);
        let head = next()?;
        let x = ops::layer_norm(&x, &gf, &bf, LN_EPS)?;
        let logits = ops::project(&x, &head)?;
        drop(weights);
        Ok(Forward {
            logits,
            compute_weights,
        })
    }
}

struct Init<'a> {
    rng: ChaCha8Rng,
    device: &'a Device,
    params: Vec<Param>,
}

impl Init<'_> {
    fn normal(&mut self, name: &str, shape: &[usize], std: f64) -> Result<()> {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| (gaussian(&mut self.rng) * std) as f32)
            .collect();
        self.push(name, Tensor::from_vec(values, shape, self.device)?, true)
    }

    fn constant(&mut self, name: &str, shape: &[usize], value: f32) -> Result<()> {
        let n: usize = shape.iter().product();
        self.push(
            name,
            Tensor::from_vec(vec![value; n], shape, self.device)?,
            false,
        )
    }

    fn push(&mut self, name: &str, t: Tensor, decay: bool) -> Result<()> {
        self.params.push(Param {
            name: name.to_string(),
            var: Var::from_tensor(&t)?,
            decay,
        });
        Ok(())
    }
}

/// Box–Muller: a standard normal from two uniforms (keeps init identical across platforms).
fn gaussian(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}
