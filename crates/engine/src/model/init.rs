//! Where a new model's parameters come from: drawn from a seeded generator, or read by name.

use super::*;

/// Where a model's weights come from.
pub(super) enum Source<'a> {
    /// Drawn from a seeded generator.
    Random(Box<ChaCha8Rng>),
    /// Read by name: `(name, shape the engine holds, how the source stores it)` → the f32
    /// tensor in the engine's shape (a `[out, in]` matrix already turned).
    Read(&'a mut ReadWeight<'a>),
}

/// Reads one weight by name: `(name, shape the engine holds, how the source stores it)`.
pub(crate) type ReadWeight<'a> = dyn FnMut(&str, &[usize], WeightLayout) -> Result<Tensor> + 'a;

/// How a new parameter starts when drawn.
#[derive(Clone, Copy)]
enum Start {
    Normal(f64),
    Constant(f32),
}

pub(super) struct Init<'a> {
    source: Source<'a>,
    device: Device,
    pub(super) params: Vec<Param>,
}

impl<'a> Init<'a> {
    pub(super) fn new(source: Source<'a>, device: &Device) -> Init<'a> {
        Init {
            source,
            device: device.clone(),
            params: Vec::new(),
        }
    }

    pub(super) fn normal(
        &mut self,
        name: &str,
        shape: &[usize],
        std: f64,
        stored: WeightLayout,
    ) -> Result<Var> {
        self.push(name, shape, true, Start::Normal(std), stored)
    }

    /// A linear layer `[i, o]` named `module` (weight and, when `bias`, a zero bias).
    fn dense(
        &mut self,
        names: &spec::Naming,
        module: &str,
        [i, o]: [usize; 2],
        std: f64,
        bias: bool,
    ) -> Result<Dense> {
        let w = self.normal(
            &format!("{module}{}", names.weight),
            &[i, o],
            std,
            names.stored,
        )?;
        let b = match bias {
            true => {
                let name = format!("{module}{}", names.bias);
                Some(self.push(
                    &name,
                    &[o],
                    false,
                    Start::Constant(0.0),
                    WeightLayout::InOut,
                )?)
            }
            false => None,
        };
        Ok(Dense {
            module: module.to_string(),
            w,
            b,
            adapter: None,
        })
    }

    /// A norm named `module`: gain 1, and bias 0 for layer norm.
    pub(super) fn norm(&mut self, spec: &Spec, module: &str) -> Result<Norm> {
        let names = spec.naming();
        let d = spec.arch.hidden as usize;
        let g = self.push(
            &format!("{module}{}", names.gain),
            &[d],
            false,
            Start::Constant(1.0),
            WeightLayout::InOut,
        )?;
        let b = match spec.norm() {
            ops::NormKind::Layer => {
                let name = format!("{module}{}", names.bias);
                Some(self.push(
                    &name,
                    &[d],
                    false,
                    Start::Constant(0.0),
                    WeightLayout::InOut,
                )?)
            }
            ops::NormKind::Rms => None,
        };
        Ok(Norm { g, b })
    }

    /// Block `l`: its norms and layers in the family's order and names.
    pub(super) fn block(&mut self, spec: &Arc<Spec>, l: usize, out_std: f64) -> Result<Block> {
        let (a, names) = (&spec.arch, spec.naming());
        let prefix = names.block.replace("{l}", &l.to_string());
        let p = |m: &str| format!("{prefix}{m}");
        let (d, std) = (a.hidden as usize, spec.init_std);
        let (q, kv, f) = (
            a.q_width() as usize,
            a.kv_width() as usize,
            a.intermediate as usize,
        );
        let norm1 = self.norm(spec, &p(names.norm1))?;
        let widths: &[usize] = match names.attn_in.len() {
            1 => &[q + 2 * kv],
            _ => &[q, kv, kv],
        };
        let attn_in = names
            .attn_in
            .iter()
            .zip(widths)
            .map(|(m, &o)| self.dense(names, &p(m), [d, o], std, a.qkv_bias))
            .collect::<Result<Vec<_>>>()?;
        let attn_out = self.dense(names, &p(names.attn_out), [q, d], out_std, a.out_bias)?;
        let norm2 = self.norm(spec, &p(names.norm2))?;
        let mlp_in = names
            .mlp_in
            .iter()
            .map(|m| self.dense(names, &p(m), [d, f], std, a.mlp_bias))
            .collect::<Result<Vec<_>>>()?;
        let mlp_out = self.dense(names, &p(names.mlp_out), [f, d], out_std, a.mlp_bias)?;
        Ok(Block {
            spec: spec.clone(),
            frozen: false,
            norm1,
            attn_in,
            attn_out,
            norm2,
            mlp_in,
            mlp_out,
        })
    }

    /// Record a new parameter (creation order is checkpoint order) and hand back its `Var`.
    fn push(
        &mut self,
        name: &str,
        shape: &[usize],
        decay: bool,
        start: Start,
        stored: WeightLayout,
    ) -> Result<Var> {
        let var = match &mut self.source {
            Source::Random(rng) => {
                let n: usize = shape.iter().product();
                let values: Vec<f32> = match start {
                    Start::Normal(std) => (0..n).map(|_| (gaussian(rng) * std) as f32).collect(),
                    Start::Constant(c) => vec![c; n],
                };
                Var::from_tensor(&Tensor::from_vec(values, shape, &self.device)?)?
            }
            Source::Read(read) => {
                let t = read(name, shape, stored)?;
                Var::from_tensor(&t.to_device(&self.device)?)?
            }
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
