//! A decoder-only GPT: token + position embeddings, N pre-LayerNorm blocks (causal multi-head
//! attention, 4× GELU MLP), a final norm and an untied LM head.
//!
//! Weights are f32 `Var`s (the master copy). A forward in bf16/f16 casts each weight once into a
//! low-precision "compute weight"; gradients flow back through the cast to the f32 Vars. Under
//! offload in bf16/f16 the `Var`s are the compute-dtype weights themselves and the f32 master copy
//! lives with the optimizer in host memory (`train::offload`; `Gpt::with_vars` swaps them). Linear
//! weights are stored `[in, out]` so a layer is `x.matmul(w) + b`.

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::ops;
use crate::ops::fused::{Branch, GradSink};
use crate::scenario::ModelConfig;
use crate::telemetry::Checkpointing;

mod recompute;
pub use recompute::ParamGrads;

const LN_EPS: f64 = 1e-5;

/// A trainable tensor and how the optimizer treats it.
pub struct Param {
    /// The checkpoint's name for it (`h0.attn.qkv.w`).
    pub name: String,
    /// The tensor, in f32.
    pub var: Var,
    /// Weight decay applies to matrices (linear layers, embeddings), not to biases and norm gains.
    pub decay: bool,
}

/// `x·w + b`; `w` stored `[in, out]`.
#[derive(Clone)]
pub struct Linear {
    /// The weight, `[in, out]`.
    pub w: Var,
    /// The bias, `[out]`.
    pub b: Var,
}

/// Layer norm's gain and bias.
#[derive(Clone)]
pub struct LayerNorm {
    /// The gain, initialised to 1.
    pub g: Var,
    /// The bias, initialised to 0.
    pub b: Var,
}

/// Token and position embeddings (`wte`, `wpe`).
pub struct Embeddings {
    /// Token embeddings, `[vocab, d_model]`.
    pub wte: Var,
    /// Position embeddings, `[seq_len, d_model]`.
    pub wpe: Var,
}

/// Causal multi-head self-attention: one fused query/key/value projection, one output projection.
#[derive(Clone)]
pub struct Attention {
    /// The fused query/key/value projection, `d_model → 3·d_model`.
    pub qkv: Linear,
    /// The output projection back to `d_model`.
    pub proj: Linear,
}

/// The 4× GELU MLP.
#[derive(Clone)]
pub struct Mlp {
    /// The widening layer, `d_model → 4·d_model`, before the GELU.
    pub fc: Linear,
    /// The narrowing layer back to `d_model`.
    pub proj: Linear,
}

/// One pre-LayerNorm transformer block (`h{l}.*`).
#[derive(Clone)]
pub struct Block {
    /// The norm before attention.
    pub ln1: LayerNorm,
    /// Causal self-attention.
    pub attn: Attention,
    /// The norm before the MLP.
    pub ln2: LayerNorm,
    /// The MLP.
    pub mlp: Mlp,
}

/// The untied LM head (no bias).
pub struct Head {
    /// The projection to the vocabulary, `[d_model, vocab]`.
    pub w: Var,
}

/// The GPT being trained: embeddings, pre-LayerNorm blocks, final norm and an untied head.
pub struct Gpt {
    /// Its shape.
    pub cfg: ModelConfig,
    /// Every parameter in creation order (the checkpoint and optimizer order); the same `Var`s
    /// as the named layers below.
    pub params: Vec<Param>,
    /// The input embeddings.
    pub embeddings: Embeddings,
    /// The transformer blocks, first to last.
    pub blocks: Vec<Block>,
    /// The final norm before the head.
    pub lnf: LayerNorm,
    /// The LM head.
    pub head: Head,
}

/// What one forward produced: everything up to the LM head, and the head's weight. The logits
/// are made on demand (`logits`) or never at once (`nll_sum`, the training loss).
pub struct Forward {
    /// The final norm's output `[B*T, D]` in the compute dtype: the head's input.
    pub features: Tensor,
    /// The head's weight `[D, vocab]` as this forward computes with it.
    pub head: Tensor,
    /// The low-precision weight copies made for this forward (empty in f32).
    pub compute_weights: Vec<Tensor>,
    /// Parameter gradients computed outside the loss's graph, filled during the backward: those
    /// of the blocks' fused CPU steps (`ops::fused::branch`: the weights are not graph
    /// inputs) and of checkpointed blocks (recomputed outside the graph).
    pub recomputed: ParamGrads,
}

/// The weights one forward computes with: the f32 Vars, detached when no graph is wanted, cast
/// once each to the compute dtype.
pub struct Weights {
    dtype: DType,
    track: bool,
    /// Where gradients computed outside the graph go (a graph is wanted).
    grads: Option<ParamGrads>,
    /// The casts made so far (the forward's compute weights).
    casts: Vec<Tensor>,
}

impl Weights {
    /// Weights for a forward in `dtype`. With `grads` they stay in the graph (training), and
    /// gradients computed outside it are left there; without, they are detached (evaluation).
    pub fn new(dtype: DType, grads: Option<&ParamGrads>) -> Weights {
        Weights {
            dtype,
            track: grads.is_some(),
            grads: grads.cloned(),
            casts: Vec::new(),
        }
    }

    /// `vars` as this forward computes with them, and the sink a fused step hands their
    /// gradients to (none when the weights are detached). A gradient arrives in the compute
    /// dtype and lands in the `Var`'s (exactly: widening is exact).
    fn branch(&mut self, vars: [&Var; 6]) -> Result<([Tensor; 6], Option<GradSink>)> {
        let tensors = [
            self.get(vars[0])?,
            self.get(vars[1])?,
            self.get(vars[2])?,
            self.get(vars[3])?,
            self.get(vars[4])?,
            self.get(vars[5])?,
        ];
        let sink = self.grads.clone().map(|grads| {
            let vars = vars.map(Var::clone);
            Box::new(move |g: Vec<Tensor>| {
                for (var, g) in vars.iter().zip(g) {
                    grads.add(var, g.to_dtype(var.dtype())?)?;
                }
                Ok(())
            }) as GradSink
        });
        Ok((tensors, sink))
    }

    /// `var` as this forward computes with it.
    pub fn get(&mut self, var: &Var) -> Result<Tensor> {
        let w = if self.track {
            var.as_tensor().clone()
        } else {
            var.as_tensor().detach()
        };
        if w.dtype() == self.dtype {
            return Ok(w);
        }
        let cast = w.to_dtype(self.dtype)?;
        self.casts.push(cast.clone());
        Ok(cast)
    }

    /// The casts made, which the ledger counts as compute weights.
    pub fn into_casts(self) -> Vec<Tensor> {
        self.casts
    }
}

/// The shape of the activations a block works on.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    /// Samples.
    pub batch: usize,
    /// Positions per sample.
    pub tokens: usize,
    /// Attention heads.
    pub heads: usize,
}

impl Linear {
    fn new(init: &mut Init, name: &str, shape: [usize; 2], std: f64) -> Result<Linear> {
        Ok(Linear {
            w: init.normal(&format!("{name}.w"), &shape, std)?,
            b: init.constant(&format!("{name}.b"), &[shape[1]], 0.0)?,
        })
    }
}

impl LayerNorm {
    fn new(init: &mut Init, name: &str, d: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            g: init.constant(&format!("{name}.g"), &[d], 1.0)?,
            b: init.constant(&format!("{name}.b"), &[d], 0.0)?,
        })
    }

    fn forward(&self, x: &Tensor, w: &mut Weights) -> Result<Tensor> {
        ops::layer_norm(x, &w.get(&self.g)?, &w.get(&self.b)?, LN_EPS)
    }
}

impl Block {
    fn new(init: &mut Init, l: usize, d: usize, proj_std: f64) -> Result<Block> {
        let p = |s: &str| format!("h{l}.{s}");
        Ok(Block {
            ln1: LayerNorm::new(init, &p("ln1"), d)?,
            attn: Attention {
                qkv: Linear::new(init, &p("attn.qkv"), [d, 3 * d], 0.02)?,
                proj: Linear::new(init, &p("attn.proj"), [d, d], proj_std)?,
            },
            ln2: LayerNorm::new(init, &p("ln2"), d)?,
            mlp: Mlp {
                fc: Linear::new(init, &p("mlp.fc"), [d, 4 * d], 0.02)?,
                proj: Linear::new(init, &p("mlp.proj"), [4 * d, d], proj_std)?,
            },
        })
    }

    /// `x` `[B·T, D]` → `x + attn(ln1(x))`, then `+ mlp(ln2(·))`.
    pub fn forward(&self, x: &Tensor, shape: Dims, w: &mut Weights) -> Result<Tensor> {
        let x = self.attention_step(x, shape, w)?;
        self.mlp_step(&x, w)
    }

    /// `x + attn(ln1(x))`: on the CPU one fused op (`ops::fused::branch`), else op by op.
    fn attention_step(&self, x: &Tensor, s: Dims, w: &mut Weights) -> Result<Tensor> {
        let (a, ln) = (&self.attn, &self.ln1);
        let vars = [&ln.g, &ln.b, &a.qkv.w, &a.qkv.b, &a.proj.w, &a.proj.b];
        let (ws, sink) = w.branch(vars)?;
        if fused_branch(x, &ws) {
            let kind = Branch::Attention {
                batch: s.batch,
                t: s.tokens,
                heads: s.heads,
            };
            return ops::fused::branch(x, kind, ws, LN_EPS, sink);
        }
        let normed = ops::layer_norm(x, &ws[0], &ws[1], LN_EPS)?;
        let qkv = ops::linear(&normed, &ws[2], &ws[3])?;
        let y = ops::causal_attention(&qkv, s.batch, s.tokens, s.heads)?;
        x + ops::linear(&y, &ws[4], &ws[5])?
    }

    /// `x + mlp(ln2(x))`: on the CPU one fused op, else op by op.
    fn mlp_step(&self, x: &Tensor, w: &mut Weights) -> Result<Tensor> {
        let (m, ln) = (&self.mlp, &self.ln2);
        let vars = [&ln.g, &ln.b, &m.fc.w, &m.fc.b, &m.proj.w, &m.proj.b];
        let (ws, sink) = w.branch(vars)?;
        if fused_branch(x, &ws) {
            return ops::fused::branch(x, Branch::Mlp, ws, LN_EPS, sink);
        }
        let normed = ops::layer_norm(x, &ws[0], &ws[1], LN_EPS)?;
        let hidden = ops::linear(&normed, &ws[2], &ws[3])?;
        x + ops::gelu_linear(&hidden, &ws[4], &ws[5])?
    }

    /// The block's parameters, in creation order.
    pub fn vars(&self) -> [&Var; 12] {
        let (a, m) = (&self.attn, &self.mlp);
        [
            &self.ln1.g,
            &self.ln1.b,
            &a.qkv.w,
            &a.qkv.b,
            &a.proj.w,
            &a.proj.b,
            &self.ln2.g,
            &self.ln2.b,
            &m.fc.w,
            &m.fc.b,
            &m.proj.w,
            &m.proj.b,
        ]
    }
}

/// Whether a residual step of `x` with weights `ws` runs as one fused op: on the CPU, unless this
/// thread asked for the composite ops (`ops::force_composite`).
fn fused_branch(x: &Tensor, ws: &[Tensor; 6]) -> bool {
    let mut all = vec![x];
    all.extend(ws);
    ops::fused_model_domain(&all)
}

impl Gpt {
    /// A freshly initialised model; identical on every device for the same seed.
    pub fn new(cfg: &ModelConfig, seed: u64, device: &Device) -> Result<Gpt> {
        Gpt::build(
            cfg,
            Init {
                rng: ChaCha8Rng::seed_from_u64(seed),
                device,
                params: Vec::new(),
                adopt: None,
            },
        )
    }

    /// The same model over other weights, one `Var` per parameter in creation order (the
    /// optimizer's placement swaps the device's weights for copies of another dtype this way).
    pub fn with_vars(&self, vars: Vec<Var>) -> Result<Gpt> {
        let same_shapes = vars.len() == self.params.len()
            && vars
                .iter()
                .zip(&self.params)
                .all(|(v, p)| v.shape() == p.var.shape());
        if !same_shapes {
            return Err(candle_core::Error::Msg(
                "replacement weights do not match the model's parameters".into(),
            ));
        }
        let device = self.params[0].var.device().clone();
        Gpt::build(
            &self.cfg,
            Init {
                rng: ChaCha8Rng::seed_from_u64(0),
                device: &device,
                params: Vec::new(),
                adopt: Some(vars.into_iter()),
            },
        )
    }

    fn build(cfg: &ModelConfig, mut init: Init) -> Result<Gpt> {
        let (v, d, t) = (cfg.vocab, cfg.d_model, cfg.seq_len);
        let proj_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
        let embeddings = Embeddings {
            wte: init.normal("wte", &[v, d], 0.02)?,
            wpe: init.normal("wpe", &[t, d], 0.02)?,
        };
        let blocks = (0..cfg.layers)
            .map(|l| Block::new(&mut init, l, d, proj_std))
            .collect::<Result<Vec<_>>>()?;
        let lnf = LayerNorm::new(&mut init, "lnf", d)?;
        let head = Head {
            w: init.normal("head.w", &[d, v], 0.02)?,
        };
        Ok(Gpt {
            cfg: cfg.clone(),
            params: init.params,
            embeddings,
            blocks,
            lnf,
            head,
        })
    }

    /// Trainable parameters, head included.
    pub fn param_count(&self) -> u64 {
        self.params.iter().map(|p| p.var.elem_count() as u64).sum()
    }

    /// Bytes of the f32 master weights.
    pub fn param_bytes(&self) -> u64 {
        self.param_count() * 4
    }

    /// Every parameter's `Var`, in creation order.
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.params.iter().map(|p| &p.var)
    }

    /// Logits for token ids `[B, T]` (u32). `track` = false detaches the weights (evaluation:
    /// no graph is kept alive).
    pub fn forward(&self, ids: &Tensor, dtype: DType, track: bool) -> Result<Forward> {
        self.forward_checkpointed(ids, dtype, track, Checkpointing::None)
    }

    /// `forward`, keeping only each segment's input instead of its blocks' graphs when
    /// `checkpointing` says so (training only: `track` must be true for it to matter).
    pub fn forward_checkpointed(
        &self,
        ids: &Tensor,
        dtype: DType,
        track: bool,
        checkpointing: Checkpointing,
    ) -> Result<Forward> {
        let (b, t) = ids.dims2()?;
        let shape = Dims {
            batch: b,
            tokens: t,
            heads: self.cfg.heads,
        };
        let recomputed = ParamGrads::default();
        let mut w = Weights::new(dtype, track.then_some(&recomputed));
        let mut x = self.embed(ids, &mut w)?;
        match checkpointing.segment().filter(|_| track) {
            None => {
                for block in &self.blocks {
                    x = block.forward(&x, shape, &mut w)?;
                }
            }
            Some(n) => {
                for segment in self.blocks.chunks(n) {
                    x = recompute::segment(segment, &x, shape, dtype, &recomputed)?;
                }
            }
        }
        let features = self.lnf.forward(&x, &mut w)?;
        let head = w.get(&self.head.w)?;
        Ok(Forward {
            features,
            head,
            compute_weights: w.into_casts(),
            recomputed,
        })
    }

    /// Token + position embeddings, `[B·T, D]`.
    fn embed(&self, ids: &Tensor, w: &mut Weights) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let d = self.cfg.d_model;
        let wte = w.get(&self.embeddings.wte)?;
        let wpe = w.get(&self.embeddings.wpe)?;
        let tok = ops::embedding(&wte, &ids.flatten_all()?)?.reshape((b, t, d))?;
        let pos = wpe.narrow(0, 0, t)?;
        ops::broadcast_add(&tok, &pos)?.reshape((b * t, d))
    }
}

impl Forward {
    /// The logits `[B·T, vocab]` in the compute dtype (all of them at once).
    pub fn logits(&self) -> Result<Tensor> {
        ops::project(&self.features, &self.head)
    }

    /// The summed token NLL over counted positions (`ops::linear_nll_sum`): on the fused path
    /// without holding every logit at once.
    pub fn nll_sum(&self, targets: &Tensor, mask: &Tensor) -> Result<Tensor> {
        ops::linear_nll_sum(&self.features, &self.head, targets, mask)
    }
}

struct Init<'a> {
    rng: ChaCha8Rng,
    device: &'a Device,
    params: Vec<Param>,
    /// Existing weights to take in creation order instead of initialising new ones.
    adopt: Option<std::vec::IntoIter<Var>>,
}

impl Init<'_> {
    fn normal(&mut self, name: &str, shape: &[usize], std: f64) -> Result<Var> {
        self.push(name, true, |rng, device| {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = (0..n).map(|_| (gaussian(rng) * std) as f32).collect();
            Tensor::from_vec(values, shape, device)
        })
    }

    fn constant(&mut self, name: &str, shape: &[usize], value: f32) -> Result<Var> {
        self.push(name, false, |_, device| {
            let n: usize = shape.iter().product();
            Tensor::from_vec(vec![value; n], shape, device)
        })
    }

    /// Record a new parameter (creation order is checkpoint order) and hand back its `Var`:
    /// the next adopted one, or a new one made by `make`.
    fn push(
        &mut self,
        name: &str,
        decay: bool,
        make: impl FnOnce(&mut ChaCha8Rng, &Device) -> Result<Tensor>,
    ) -> Result<Var> {
        let var = match self.adopt.as_mut() {
            Some(vars) => vars.next().ok_or_else(|| {
                candle_core::Error::Msg(format!("no replacement weight for {name}"))
            })?,
            None => Var::from_tensor(&make(&mut self.rng, self.device)?)?,
        };
        self.params.push(Param {
            name: name.to_string(),
            var: var.clone(),
            decay,
        });
        Ok(var)
    }
}

/// Box–Muller: a standard normal from two uniforms (keeps init identical across platforms).
fn gaussian(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block on the CPU joins the graph as two nodes (its residual steps, one op each) with no
    /// weight among their inputs, so the backward crosses Candle's add in the compute dtype
    /// twice per block (an `[N, D]` tensor each) and never for a weight; every weight still gets
    /// its gradient, in its own dtype. Op by op (the composite kernels) the same block is nine
    /// ops with the twelve weights among their inputs.
    #[test]
    fn a_cpu_block_is_two_graph_nodes_and_its_weights_get_gradients() {
        let cfg = ModelConfig {
            vocab: 16,
            d_model: 16,
            layers: 1,
            heads: 2,
            seq_len: 8,
        };
        let gpt = Gpt::new(&cfg, 3, &Device::Cpu).unwrap();
        let dims = Dims {
            batch: 2,
            tokens: 8,
            heads: 2,
        };
        let block = &gpt.blocks[0];
        for (composite, dtype) in [
            (false, DType::F32),
            (false, DType::BF16),
            (true, DType::F32),
        ] {
            let _kernels = ops::force_composite(composite);
            let x = Tensor::randn(0f32, 1.0, (16, 16), &Device::Cpu).unwrap();
            let x = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
            let grads = ParamGrads::default();
            let mut w = Weights::new(dtype, Some(&grads));
            let y = block.forward(x.as_tensor(), dims, &mut w).unwrap();
            // The input, then the nodes the block made.
            let made = y.sorted_nodes().len() - 1;
            if composite {
                assert!(made > 2, "op by op: {made} nodes");
                continue;
            }
            assert_eq!(made, 2, "{dtype:?}");
            let store = y.to_dtype(DType::F32).unwrap().sum_all().unwrap();
            let store = store.backward().unwrap();
            assert_eq!(store.get(x.as_tensor()).unwrap().dtype(), dtype);
            for var in block.vars() {
                assert!(store.get(var.as_tensor()).is_none());
                let g = grads
                    .get(&store, var)
                    .expect("every weight gets a gradient");
                assert_eq!((g.dtype(), g.dims()), (var.dtype(), var.dims()));
                assert!(
                    g.abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                        > 0.0
                );
            }
        }
    }
}
