//! LoRA as PEFT computes it: each adapted layer outputs `base(x) + (x·A)·B · scale`, A drawn
//! Kaiming-uniform (PEFT's `a = √5`: bound `1/√in`), B zero (so adapting leaves the model's
//! function unchanged), `scale = alpha / r` (`alpha / √r` with rsLoRA). Only A and B train:
//! every base weight is frozen, held in the run's dtype, and gets no gradient (the steps compute
//! none for it; `ops::step`). The engine holds A `[in, r]` and B `[r, out]`; PEFT's files hold
//! them turned (`lora_A.weight` `[r, in]`, `lora_B.weight` `[out, r]`).

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{Block, Dense, Gpt, Param};

/// A layer's adapter.
#[derive(Clone)]
pub struct Adapter {
    /// `A`, `[in, r]`.
    pub a: Var,
    /// `B`, `[r, out]`.
    pub b: Var,
    /// `alpha / r` (`alpha / √r` with rsLoRA).
    pub scale: f64,
}

/// LoRA's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Lora {
    /// The rank r.
    pub rank: usize,
    /// `alpha`: the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// Modules to adapt by name or name suffix (`q_proj`, `c_attn`, `attn.proj`); empty: every
    /// linear layer of the blocks (PEFT's `all-linear`, without the head).
    pub targets: Vec<String>,
    /// rsLoRA's scale, `alpha / √r`.
    pub rslora: bool,
}

/// A LoRA target that adapts no layer of the model.
#[derive(Debug, thiserror::Error)]
#[error("train.lora_targets: `{target}` names no layer of this {family} model; its layers are {}", layers.join(", "))]
pub struct UnknownTarget {
    /// The target given.
    pub target: String,
    /// The model's family.
    pub family: String,
    /// The block's layer names a target may give.
    pub layers: Vec<String>,
}

impl Lora {
    /// The factor the adapter's output is multiplied by.
    pub fn scale(&self) -> f64 {
        match self.rslora {
            true => self.alpha / (self.rank as f64).sqrt(),
            false => self.alpha / self.rank as f64,
        }
    }

    /// Whether the layer `module` (its full name) is adapted: PEFT's rule, the name equal to a
    /// target or ending with `.` and the target.
    pub fn adapts(&self, module: &str) -> bool {
        self.targets.is_empty()
            || self
                .targets
                .iter()
                .any(|t| module == t || module.ends_with(&format!(".{t}")))
    }
}

/// The adapted name of parameter `part` (`lora_A` or `lora_B`) of `module`.
pub fn param_name(module: &str, part: &str) -> String {
    format!("{module}.{part}.weight")
}

impl Gpt {
    /// This model under `lora`: every targeted layer gets an adapter (A drawn from `seed`, B
    /// zero), every base weight is frozen and held in `base` (the run's dtype), and the
    /// adapters become `params`, the weights the optimizer trains.
    pub fn adapt(
        &self,
        lora: &Lora,
        seed: u64,
        base: DType,
    ) -> std::result::Result<Gpt, AdaptError> {
        self.check_targets(lora)?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6c6f_7261);
        let device = self.embed.device().clone();
        // The base, cast once into the run's dtype.
        let cast = |v: &Var| -> Result<Var> { Var::from_tensor(&v.as_tensor().to_dtype(base)?) };
        let frozen = self
            .params
            .iter()
            .map(|p| {
                Ok(Param {
                    name: p.name.clone(),
                    var: cast(&p.var)?,
                    decay: false,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let swaps: std::collections::HashMap<_, Var> = self
            .params
            .iter()
            .map(|p| p.var.id())
            .zip(frozen.iter().map(|p| p.var.clone()))
            .collect();
        let mut model =
            self.map_vars(&|v: &Var| swaps.get(&v.id()).cloned().unwrap_or_else(|| v.clone()));
        let mut params = Vec::new();
        for block in &mut model.blocks {
            block.frozen = true;
            for dense in block_layers(block) {
                if !lora.adapts(&dense.module) {
                    continue;
                }
                let adapter = new_adapter(dense, lora, &mut rng, &device)?;
                for (part, var) in [("lora_A", &adapter.a), ("lora_B", &adapter.b)] {
                    params.push(Param {
                        name: param_name(&dense.module, part),
                        var: var.clone(),
                        decay: true,
                    });
                }
                dense.adapter = Some(adapter);
            }
        }
        model.params = params;
        model.frozen = frozen;
        Ok(model)
    }

    /// Every target adapts at least one layer.
    fn check_targets(&self, lora: &Lora) -> std::result::Result<(), AdaptError> {
        let modules: Vec<&str> = self
            .blocks
            .iter()
            .flat_map(|b| b.layers().into_iter().map(|d| d.module.as_str()))
            .collect();
        let unknown = lora.targets.iter().find(|t| {
            let one = Lora {
                targets: vec![(*t).clone()],
                ..lora.clone()
            };
            !modules.iter().any(|m| one.adapts(m))
        });
        if lora.rank == 0 {
            return Err(AdaptError::Rank);
        }
        match unknown {
            None => Ok(()),
            Some(target) => {
                let prefix = self.spec.naming().block.replace("{l}", "0");
                let layers = self.blocks[0]
                    .layers()
                    .iter()
                    .map(|d| d.module.trim_start_matches(&prefix).to_string())
                    .collect();
                Err(AdaptError::Target(UnknownTarget {
                    target: target.clone(),
                    family: self.spec.arch.family.clone(),
                    layers,
                }))
            }
        }
    }
}

/// Why a model could not be adapted.
#[derive(Debug, thiserror::Error)]
pub enum AdaptError {
    /// A target names no layer.
    #[error(transparent)]
    Target(#[from] UnknownTarget),
    /// Rank 0 is no adapter.
    #[error("train.lora_rank must be at least 1 to adapt a model")]
    Rank,
    /// Candle failed making or casting a weight.
    #[error("adapting the model: {0}")]
    Candle(#[from] candle_core::Error),
}

impl Block {
    /// The block's linear layers in order.
    pub fn layers(&self) -> Vec<&Dense> {
        self.attn_in
            .iter()
            .chain([&self.attn_out])
            .chain(&self.mlp_in)
            .chain([&self.mlp_out])
            .collect()
    }
}

/// `block`'s linear layers, to change.
fn block_layers(block: &mut Block) -> Vec<&mut Dense> {
    block
        .attn_in
        .iter_mut()
        .chain([&mut block.attn_out])
        .chain(block.mlp_in.iter_mut())
        .chain([&mut block.mlp_out])
        .collect()
}

/// An adapter for `dense`: A uniform in ±1/√in, B zero, both f32 (the trained precision).
fn new_adapter(
    dense: &Dense,
    lora: &Lora,
    rng: &mut ChaCha8Rng,
    device: &Device,
) -> Result<Adapter> {
    let (i, o) = dense.w.dims2()?;
    let r = lora.rank;
    let bound = 1.0 / (i as f64).sqrt();
    let a: Vec<f32> = (0..i * r)
        .map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * bound) as f32)
        .collect();
    Ok(Adapter {
        a: Var::from_tensor(&Tensor::from_vec(a, (i, r), device)?)?,
        b: Var::from_tensor(&Tensor::zeros((r, o), DType::F32, device)?)?,
        scale: lora.scale(),
    })
}
