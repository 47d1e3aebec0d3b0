//! A model family as data: the architecture (`Arch`: widths, heads, norm, MLP, biases, tied
//! head), what the forward needs beyond it (the norm's epsilon, the rotary embedding), and how
//! the family names and stores its tensors (`Naming`). One decoder (`model::Gpt`) is built from
//! it, whatever the family: this engine's GPT, GPT-2, Llama, Mistral or Qwen2.

use std::path::Path;

use serde_json::{Map, Value};

use crate::hf::config as hf_config;
use crate::hf::{Arch, Mlp, Norm, Positions};
use crate::ops::rope::{Llama3Scaling, Rope};
use crate::ops::{Activation, NormKind, WeightLayout};
use crate::scenario::ModelConfig;

/// The families the engine builds and trains.
pub(crate) const TRAINED: [&str; 4] = ["gpt2", "llama", "mistral", "qwen2"];

/// How a family names its tensors and stores its matrices.
#[derive(Debug, PartialEq, Eq)]
pub struct Naming {
    /// The token embedding's name.
    pub embed: &'static str,
    /// The learned position table's name (families with learned positions).
    pub positions: &'static str,
    /// Every block's prefix, `{l}` standing for its index.
    pub block: &'static str,
    /// The norm before attention, within a block.
    pub norm1: &'static str,
    /// The norm before the MLP.
    pub norm2: &'static str,
    /// Attention's first layer: one module (q, k, v fused) or three (q, k, v).
    pub attn_in: &'static [&'static str],
    /// Attention's output projection.
    pub attn_out: &'static str,
    /// The MLP's first layer: one module, or gate and up.
    pub mlp_in: &'static [&'static str],
    /// The MLP's second layer.
    pub mlp_out: &'static str,
    /// The final norm.
    pub final_norm: &'static str,
    /// The untied head's name.
    pub head: &'static str,
    /// A linear module's weight suffix.
    pub weight: &'static str,
    /// A module's bias suffix.
    pub bias: &'static str,
    /// A norm's gain suffix.
    pub gain: &'static str,
    /// How the source stores linear weights (the engine holds them `[in, out]`).
    pub stored: WeightLayout,
    /// How the source stores the untied head (an `nn.Linear` in every Hugging Face family).
    pub head_stored: WeightLayout,
    /// A prefix some checkpoints leave off (GPT-2's original files have no `transformer.`).
    pub optional_prefix: &'static str,
}

/// This engine's own GPT.
pub(crate) const GACCWB: Naming = Naming {
    embed: "wte",
    positions: "wpe",
    block: "h{l}.",
    norm1: "ln1",
    norm2: "ln2",
    attn_in: &["attn.qkv"],
    attn_out: "attn.proj",
    mlp_in: &["mlp.fc"],
    mlp_out: "mlp.proj",
    final_norm: "lnf",
    head: "head.w",
    weight: ".w",
    bias: ".b",
    gain: ".g",
    stored: WeightLayout::InOut,
    head_stored: WeightLayout::InOut,
    optional_prefix: "",
};

/// GPT-2 (`GPT2LMHeadModel`): `Conv1D` weights are stored `[in, out]`.
pub(crate) const GPT2: Naming = Naming {
    embed: "transformer.wte.weight",
    positions: "transformer.wpe.weight",
    block: "transformer.h.{l}.",
    norm1: "ln_1",
    norm2: "ln_2",
    attn_in: &["attn.c_attn"],
    attn_out: "attn.c_proj",
    mlp_in: &["mlp.c_fc"],
    mlp_out: "mlp.c_proj",
    final_norm: "transformer.ln_f",
    head: "lm_head.weight",
    weight: ".weight",
    bias: ".bias",
    gain: ".weight",
    stored: WeightLayout::InOut,
    head_stored: WeightLayout::OutIn,
    optional_prefix: "transformer.",
};

/// Llama, Mistral and Qwen2 (`nn.Linear` weights stored `[out, in]`).
pub(crate) const LLAMA: Naming = Naming {
    embed: "model.embed_tokens.weight",
    positions: "",
    block: "model.layers.{l}.",
    norm1: "input_layernorm",
    norm2: "post_attention_layernorm",
    attn_in: &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    attn_out: "self_attn.o_proj",
    mlp_in: &["mlp.gate_proj", "mlp.up_proj"],
    mlp_out: "mlp.down_proj",
    final_norm: "model.norm",
    head: "lm_head.weight",
    weight: ".weight",
    bias: ".bias",
    gain: ".weight",
    stored: WeightLayout::OutIn,
    head_stored: WeightLayout::OutIn,
    optional_prefix: "",
};

/// A model family's full description.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// Widths, heads, the norm, the MLP, the biases, the tied head.
    pub arch: Arch,
    /// The norm's epsilon.
    pub norm_eps: f64,
    /// The rotary embedding (rotary families).
    pub rope: Option<Rope>,
    /// The window of sliding-window attention (Mistral), when the config sets one: the run's
    /// sequence length must not exceed it (attention is then exactly causal).
    pub sliding_window: Option<u64>,
    /// The standard deviation of random initial weights (`initializer_range`).
    pub init_std: f64,
    /// The end-of-text token, joining documents of a data file.
    pub eos: Option<u32>,
    /// The dtype the source's tensors are stored in (`torch_dtype`), which saving keeps.
    pub source_dtype: Option<String>,
}

/// Why a model's `config.json` cannot be built here.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The planner's reader refused the file.
    #[error(transparent)]
    Config(#[from] hf_config::HfConfigError),
    /// A family or feature the engine does not train, with what to do.
    #[error("{path}: {what}")]
    Unsupported {
        /// The file.
        path: String,
        /// What is not supported, and the fix.
        what: String,
    },
}

/// How the family `family` names and stores its tensors.
pub(crate) fn naming_of(family: &str) -> &'static Naming {
    match family {
        "gpt2" => &GPT2,
        "llama" | "mistral" | "qwen2" => &LLAMA,
        _ => &GACCWB,
    }
}

impl Spec {
    /// This engine's GPT of `cfg`: pre-LN blocks, learned positions, untied head.
    pub fn gaccwb(cfg: &ModelConfig) -> Spec {
        Spec {
            arch: Arch::engine(cfg),
            norm_eps: 1e-5,
            rope: None,
            sliding_window: None,
            init_std: 0.02,
            eos: None,
            source_dtype: None,
        }
    }

    /// How this family names and stores its tensors.
    pub fn naming(&self) -> &'static Naming {
        naming_of(&self.arch.family)
    }

    /// The Hugging Face family the model saves as (this engine's GPT saves as GPT-2).
    pub fn naming_family(&self) -> &str {
        match self.arch.family.as_str() {
            "gaccwb" => "gpt2",
            family => family,
        }
    }

    /// The norm's form.
    pub fn norm(&self) -> NormKind {
        match self.arch.norm {
            Norm::LayerNorm => NormKind::Layer,
            Norm::RmsNorm => NormKind::Rms,
        }
    }

    /// The MLP's activation.
    pub fn activation(&self) -> Activation {
        match self.arch.mlp {
            Mlp::Gelu => Activation::Gelu,
            Mlp::SwiGlu => Activation::SwiGlu,
            // Only Gemma's MLP is GeGLU, and `from_config` refuses the families not `TRAINED`.
            Mlp::GeGlu => unreachable!("no family the engine trains has a GeGLU MLP"),
        }
    }

    /// Whether positions are a learned table (else rotary).
    pub fn learned_positions(&self) -> bool {
        self.arch.positions == Positions::Learned
    }

    /// The longest sequence the model takes: its position table, or its configured context.
    pub fn max_positions(&self) -> u64 {
        self.arch.max_context
    }

    /// The `ModelConfig` a scenario records for this model, at sequence length `seq_len`.
    pub fn model_config(&self, seq_len: usize) -> ModelConfig {
        ModelConfig {
            vocab: self.arch.vocab as usize,
            d_model: self.arch.hidden as usize,
            layers: self.arch.layers as usize,
            heads: self.arch.heads as usize,
            seq_len,
            ..ModelConfig::default()
        }
    }

    /// The family described by a Hugging Face `config.json`'s text; `path` names it in errors.
    pub fn from_config(path: &Path, text: &str) -> Result<Spec, SpecError> {
        let arch = hf_config::parse(path, text)?;
        let unsupported = |what: String| SpecError::Unsupported {
            path: path.display().to_string(),
            what,
        };
        if !TRAINED.contains(&arch.family.as_str()) {
            return Err(unsupported(format!(
                "model_type `{}` is not one the engine trains (it trains {}); `gaccwb estimate --config` plans for it",
                arch.family,
                TRAINED.join(", ")
            )));
        }
        let map: Map<String, Value> = serde_json::from_str(text.trim_start_matches('\u{feff}'))
            .map_err(|e| unsupported(format!("not a JSON object: {e}")))?;
        let fields = Fields {
            map: &map,
            unsupported: &unsupported,
        };
        fields.refuse_moe()?;
        let spec = match arch.family.as_str() {
            "gpt2" => {
                fields.activation("activation_function", &["gelu_new", "gelu_pytorch_tanh"])?;
                Spec {
                    norm_eps: fields.number("layer_norm_epsilon", 1e-5)?,
                    rope: None,
                    sliding_window: None,
                    ..fields.common(arch)?
                }
            }
            _ => {
                fields.activation("hidden_act", &["silu"])?;
                let head_dim = arch.head_dim as usize;
                let sliding_window = match arch.family.as_str() {
                    "mistral" => fields.size("sliding_window")?,
                    "qwen2" if fields.flag("use_sliding_window")? => {
                        fields.size("sliding_window")?
                    }
                    _ => None,
                };
                Spec {
                    norm_eps: fields.number("rms_norm_eps", 1e-6)?,
                    rope: Some(fields.rope(head_dim)?),
                    sliding_window,
                    ..fields.common(arch)?
                }
            }
        };
        Ok(spec)
    }
}

/// The config's object and how to refuse.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    unsupported: &'a dyn Fn(String) -> SpecError,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn number(&self, key: &str, default: f64) -> Result<f64, SpecError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| (self.unsupported)(format!("`{key}`: expected a number, got {v}"))),
        }
    }

    fn size(&self, key: &str) -> Result<Option<u64>, SpecError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().filter(|&n| n > 0).map(Some).ok_or_else(|| {
                (self.unsupported)(format!("`{key}`: expected a positive integer, got {v}"))
            }),
        }
    }

    fn flag(&self, key: &str) -> Result<bool, SpecError> {
        match self.get(key) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err((self.unsupported)(format!(
                "`{key}`: expected true or false, got {v}"
            ))),
        }
    }

    /// The activation named by `key` must be one of `accepted`.
    fn activation(&self, key: &str, accepted: &[&str]) -> Result<(), SpecError> {
        match self.get(key).and_then(Value::as_str) {
            None => Ok(()),
            Some(name) if accepted.contains(&name) => Ok(()),
            Some(name) => Err((self.unsupported)(format!(
                "`{key}` = \"{name}\" is not supported; the engine computes {}",
                accepted.join(" / ")
            ))),
        }
    }

    /// Mixture-of-experts fields are refused (the planner reads those families).
    fn refuse_moe(&self) -> Result<(), SpecError> {
        for key in ["num_local_experts", "num_experts", "n_routed_experts"] {
            if self.get(key).is_some() {
                return Err((self.unsupported)(format!(
                    "`{key}`: mixture-of-experts models are not trained by the engine; `gaccwb estimate --config` plans for them"
                )));
            }
        }
        Ok(())
    }

    /// What every family reads alike: initializer range, end-of-text token, stored dtype.
    fn common(&self, arch: Arch) -> Result<Spec, SpecError> {
        let eos = match self.get("eos_token_id") {
            Some(Value::Array(ids)) => ids.first().and_then(Value::as_u64),
            Some(v) => v.as_u64(),
            None => None,
        };
        let dtype = self
            .get("torch_dtype")
            .or_else(|| self.get("dtype"))
            .and_then(Value::as_str)
            .map(str::to_string);
        Ok(Spec {
            arch,
            norm_eps: 1e-5,
            rope: None,
            sliding_window: None,
            init_std: self.number("initializer_range", 0.02)?,
            eos: eos.map(|e| e as u32),
            source_dtype: dtype,
        })
    }

    /// The rotary embedding: `rope_theta` and `rope_scaling` at the top level, or both inside
    /// `rope_parameters` (newer configs). Llama 3's scaling is computed; `default` and absent
    /// are plain; the others (linear, dynamic, yarn, longrope) are refused.
    fn rope(&self, head_dim: usize) -> Result<Rope, SpecError> {
        if let Some(f) = self.get("partial_rotary_factor").and_then(Value::as_f64) {
            if f != 1.0 {
                return Err((self.unsupported)(format!(
                    "`partial_rotary_factor` = {f}: only full rotary embeddings are supported"
                )));
            }
        }
        let params = self.get("rope_parameters").and_then(Value::as_object);
        let in_params = |key: &str| params.and_then(|p| p.get(key)).filter(|v| !v.is_null());
        let theta = match in_params("rope_theta").or_else(|| self.get("rope_theta")) {
            Some(v) => v
                .as_f64()
                .filter(|t| *t > 0.0)
                .ok_or_else(|| (self.unsupported)(format!("`rope_theta`: got {v}")))?,
            None => 10_000.0,
        };
        // Both places are read: a scaling named in either is computed or refused, never passed
        // over because the other says `default`.
        let mut scaling = None;
        if let Some(p) = params.filter(|p| p.contains_key("rope_type") || p.contains_key("type")) {
            scaling = self.scaling(p)?;
        }
        match self.get("rope_scaling") {
            Some(Value::Object(s)) => scaling = self.scaling(s)?.or(scaling),
            Some(Value::Null) | None => {}
            Some(v) => {
                return Err((self.unsupported)(format!(
                    "`rope_scaling`: expected an object, got {v}"
                )))
            }
        }
        Ok(Rope {
            theta,
            head_dim,
            scaling,
        })
    }

    fn scaling(&self, s: &Map<String, Value>) -> Result<Option<Llama3Scaling>, SpecError> {
        let kind = s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let number = |key: &str| {
            s.get(key)
                .and_then(Value::as_f64)
                .ok_or_else(|| (self.unsupported)(format!("rope scaling `{kind}` needs `{key}`")))
        };
        match kind {
            "default" => Ok(None),
            "llama3" => Ok(Some(Llama3Scaling {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_positions: number("original_max_position_embeddings")?,
            })),
            other => Err((self.unsupported)(format!(
                "rope scaling `{other}` is not supported (the engine computes `default` and `llama3`)"
            ))),
        }
    }
}
