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
    /// The probability dropout zeroes an element of the adapter's input in training.
    pub dropout: f64,
    /// The layer's dropout key (`ops::dropout::site_key` of the run's seed and its name).
    pub key: u64,
}

impl Adapter {
    /// The dropout mask of this adapter in a forward over `dims`: none in evaluation (no
    /// sample indices) or at p = 0.
    pub fn dropout(&self, dims: &super::Dims) -> Option<crate::ops::dropout::Dropout> {
        let samples = dims.samples.as_ref().filter(|_| self.dropout > 0.0)?;
        Some(crate::ops::dropout::Dropout::new(
            self.dropout as f32,
            self.key,
            samples.clone(),
            dims.tokens,
        ))
    }
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
    /// The dropout on each adapter's input in training (PEFT's `lora_dropout`), in `[0, 1)`.
    pub dropout: f64,
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
    /// The settings `train.lora_*` give.
    pub fn of(train: &crate::scenario::TrainConfig) -> Lora {
        Lora {
            rank: train.lora_rank,
            alpha: train.lora_alpha,
            targets: train.lora_targets.clone(),
            rslora: train.lora_rslora,
            dropout: train.lora_dropout,
        }
    }

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
pub(crate) fn param_name(module: &str, part: &str) -> String {
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
                let mut adapter = new_adapter(dense, lora, &mut rng, &device)?;
                adapter.key = crate::ops::dropout::site_key(seed, &dense.module);
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
        dropout: lora.dropout,
        key: 0,
    })
}

/// PEFT's prefix of an adapter tensor's name before the module's.
const PEFT_PREFIX: &str = "base_model.model.";

/// Why a PEFT adapter directory could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// A file is missing, unreadable or not what PEFT writes.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What is wrong, and the fix.
        message: String,
    },
    /// Adapting the model failed.
    #[error(transparent)]
    Adapt(#[from] AdaptError),
    /// Writing failed.
    #[error(transparent)]
    Write(#[from] crate::safe_write::WriteError),
}

/// The LoRA settings a PEFT `adapter_config.json` holds.
pub fn read_adapter_config(dir: &std::path::Path) -> std::result::Result<Lora, AdapterError> {
    let path = dir.join("adapter_config.json");
    let bad = |message: String| AdapterError::File {
        path: path.display().to_string(),
        message,
    };
    let text = crate::limits::read_bounded_text(&path, 1 << 20, "the adapter config")
        .map_err(|e| bad(e.to_string()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    if v["peft_type"].as_str() != Some("LORA") {
        return Err(bad(format!(
            "peft_type {}: only LORA adapters are read",
            v["peft_type"]
        )));
    }
    for (key, why) in [("use_dora", "DoRA"), ("lora_bias", "adapter biases")] {
        if v[key].as_bool() == Some(true) {
            return Err(bad(format!(
                "`{key}`: {why} are not computed by the engine"
            )));
        }
    }
    let rank = v["r"]
        .as_u64()
        .filter(|&r| r > 0)
        .ok_or_else(|| bad("`r`: expected a positive integer".into()))?;
    let alpha = v["lora_alpha"]
        .as_f64()
        .ok_or_else(|| bad("`lora_alpha`: expected a number".into()))?;
    let targets = match &v["target_modules"] {
        serde_json::Value::Array(names) => names
            .iter()
            .map(|n| n.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("`target_modules`: expected a list of names".into()))?,
        serde_json::Value::String(s) if s == "all-linear" => Vec::new(),
        other => {
            return Err(bad(format!(
                "`target_modules` {other}: expected a list of names or \"all-linear\""
            )))
        }
    };
    let dropout = match &v["lora_dropout"] {
        serde_json::Value::Null => 0.0,
        p => p
            .as_f64()
            .filter(|p| (0.0..1.0).contains(p))
            .ok_or_else(|| bad(format!("`lora_dropout` {p}: expected a number in [0, 1)")))?,
    };
    Ok(Lora {
        rank: rank as usize,
        alpha,
        targets,
        rslora: v["use_rslora"].as_bool().unwrap_or(false),
        dropout,
    })
}

impl Gpt {
    /// The adapters' A and B replaced by those of the PEFT adapter in `dir` (an adapted model
    /// of the adapter's settings: `read_adapter_config`). Every adapter of the model must be in
    /// the file, with PEFT's names and shapes, and nothing else.
    pub fn load_adapter(&mut self, dir: &std::path::Path) -> std::result::Result<(), AdapterError> {
        let path = dir.join("adapter_model.safetensors");
        let bad = |message: String| AdapterError::File {
            path: path.display().to_string(),
            message,
        };
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| bad(format!("not a readable safetensors file: {e}")))?;
        let mut used = 0;
        for p in &self.params {
            let name = format!("{PEFT_PREFIX}{}", p.name);
            let t = tensors
                .get(&name)
                .ok_or_else(|| bad(format!("tensor `{name}` is missing")))?;
            // PEFT holds A `[r, in]` and B `[out, r]`: the engine's turned.
            let t = t
                .t()
                .and_then(|t| t.contiguous())
                .map_err(|e| bad(e.to_string()))?;
            if t.dims() != p.var.dims() {
                return Err(bad(format!(
                    "tensor `{name}` has shape {:?}, the adapter's settings say {:?}",
                    t.dims().iter().rev().collect::<Vec<_>>(),
                    p.var.dims().iter().rev().collect::<Vec<_>>()
                )));
            }
            let t = t
                .to_dtype(p.var.dtype())
                .and_then(|t| t.to_device(p.var.device()))
                .map_err(|e| bad(e.to_string()))?;
            p.var.set(&t).map_err(|e| bad(e.to_string()))?;
            used += 1;
        }
        if let Some(extra) = tensors.keys().find(|k| {
            !self
                .params
                .iter()
                .any(|p| format!("{PEFT_PREFIX}{}", p.name) == **k)
        }) {
            return Err(bad(format!(
                "tensor `{extra}` is not one of this model's adapters ({used} are); the adapter was made for another model or targets"
            )));
        }
        Ok(())
    }
}

/// Write the adapters of `model` (whose trained values are `weights`, one per parameter) as
/// PEFT does: `adapter_config.json` and `adapter_model.safetensors` (f32, PEFT's names, A
/// `[r, in]`, B `[out, r]`), each through `safe_write`.
pub(crate) fn save_adapter(
    model: &Gpt,
    lora: &Lora,
    weights: &[Tensor],
    dir: &std::path::Path,
    rules: &crate::safe_write::Overwrite,
) -> std::result::Result<usize, AdapterError> {
    let io = |e: std::io::Error| AdapterError::File {
        path: dir.display().to_string(),
        message: format!("cannot create the directory: {e}"),
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let targets: Vec<String> = match lora.targets.is_empty() {
        true => {
            let mut names: Vec<String> = model.blocks[0]
                .layers()
                .iter()
                .map(|d| d.module.rsplit('.').next().unwrap_or(&d.module).to_string())
                .collect();
            names.sort();
            names.dedup();
            names
        }
        false => lora.targets.clone(),
    };
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "use_rslora": lora.rslora,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "base_model_name_or_path": model.cfg.path.as_ref().map(|p| p.display().to_string()),
    });
    let text = serde_json::to_string_pretty(&config).unwrap_or_default();
    crate::safe_write::write_file(
        &dir.join("adapter_config.json"),
        text.as_bytes(),
        "adapter config",
        rules,
    )?;
    let tensors: std::collections::BTreeMap<String, Tensor> = model
        .params
        .iter()
        .zip(weights)
        .map(|(p, w)| {
            let t = w
                .t()?
                .contiguous()?
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?;
            Ok((format!("{PEFT_PREFIX}{}", p.name), t))
        })
        .collect::<Result<_>>()
        .map_err(|e: candle_core::Error| AdapterError::File {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?;
    let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes =
        safetensors::serialize(&tensors, Some(metadata)).map_err(|e| AdapterError::File {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?;
    crate::safe_write::write_file(
        &dir.join("adapter_model.safetensors"),
        &bytes,
        "adapter weights",
        rules,
    )?;
    Ok(tensors.len())
}

impl Gpt {
    /// The model with each adapter folded into its layer (`W + scale·A·B`, in f32, A and B
    /// from `trained`, one per parameter) and no adapter left: every weight trainable again,
    /// as saving a merged model or training on in full needs.
    pub fn merged(&self, trained: &[Tensor]) -> Result<Gpt> {
        let value: std::collections::HashMap<_, &Tensor> = self
            .params
            .iter()
            .map(|p| p.var.id())
            .zip(trained)
            .collect();
        let mut folded = std::collections::HashMap::new();
        for block in &self.blocks {
            for d in block.layers() {
                let Some(a) = &d.adapter else { continue };
                let (av, bv) = (value[&a.a.id()], value[&a.b.id()]);
                let delta =
                    (av.to_dtype(DType::F32)?.matmul(&bv.to_dtype(DType::F32)?)? * a.scale)?;
                let w = (d.w.as_tensor().to_dtype(DType::F32)? + delta.to_device(d.w.device())?)?;
                folded.insert(d.w.id(), w);
            }
        }
        let swaps: std::collections::HashMap<_, Var> = self
            .frozen
            .iter()
            .map(|p| {
                let t = match folded.remove(&p.var.id()) {
                    Some(w) => w,
                    None => p.var.as_tensor().to_dtype(DType::F32)?,
                };
                Ok((p.var.id(), Var::from_tensor(&t)?))
            })
            .collect::<Result<_>>()?;
        let mut model =
            self.map_vars(&|v: &Var| swaps.get(&v.id()).cloned().unwrap_or_else(|| v.clone()));
        model.params = std::mem::take(&mut model.frozen);
        for p in &mut model.params {
            p.decay = p.var.rank() == 2;
        }
        for block in &mut model.blocks {
            block.frozen = false;
            for d in block_layers(block) {
                d.adapter = None;
            }
        }
        Ok(model)
    }
}
