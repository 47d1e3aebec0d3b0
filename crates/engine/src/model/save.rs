//! Saving a model in Hugging Face's layout, so `transformers.AutoModelForCausalLM
//! .from_pretrained(DIR)` loads it: `config.json`, `model.safetensors` (the family's tensor
//! names, matrices stored as the family stores them, the source's dtype, a tied matrix once,
//! `{"format": "pt"}` metadata) and `tokenizer.json`. Every file goes through `safe_write`;
//! nothing is written into the directory the model was read from.
//!
//! This engine's own GPT is GPT-2 with an untied head, LayerNorm ε 1e-5 and the tanh GELU, so it
//! saves as a `gpt2` model.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};
use serde_json::json;

use super::spec::{GACCWB, GPT2};
use super::Gpt;
use crate::ops::WeightLayout;
use crate::safe_write::{self, Overwrite, Pending, WriteError};

/// Why a model was not saved.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// The target is the source directory, or inside it.
    #[error("{target}: refusing to write into {source_dir}, the directory the model was read from; choose another directory")]
    IntoSource {
        /// Where the save was asked to go.
        target: String,
        /// The model's own directory.
        source_dir: String,
    },
    /// The directory cannot be made.
    #[error("{dir}: cannot create the directory: {err}")]
    Dir {
        /// The directory.
        dir: String,
        /// What the system said.
        err: std::io::Error,
    },
    /// A file could not be written.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// A source file could not be read.
    #[error("{path}: cannot read: {err}")]
    Read {
        /// The file.
        path: String,
        /// What the system said.
        err: std::io::Error,
    },
    /// A tensor could not be converted.
    #[error("tensor {name}: {source}")]
    Tensor {
        /// The tensor.
        name: String,
        /// Candle's error.
        source: candle_core::Error,
    },
}

/// What was written.
#[derive(Debug)]
pub struct Saved {
    /// The directory.
    pub dir: PathBuf,
    /// Tensors in `model.safetensors`.
    pub tensors: usize,
    /// Bytes of `model.safetensors`.
    pub bytes: u64,
}

/// Save `model`, whose f32 master weights are `weights` (one per parameter, in order), into
/// `dir` with the family's names; `force` replaces files gaccwb may replace (never an input).
pub fn save(
    model: &Gpt,
    weights: &[Tensor],
    dir: &Path,
    rules: &Overwrite,
) -> Result<Saved, SaveError> {
    check_target(model.cfg.path.as_deref(), dir)?;
    std::fs::create_dir_all(dir).map_err(|err| SaveError::Dir {
        dir: dir.display().to_string(),
        err,
    })?;
    let (config, tokenizer) = sources(model)?;
    safe_write::write_file(&dir.join("config.json"), &config, "model config", rules)?;
    if let Some(tokenizer) = tokenizer {
        safe_write::write_file(&dir.join("tokenizer.json"), &tokenizer, "tokenizer", rules)?;
    }
    let dtype = source_dtype(model);
    let tensors = tensors_to_save(model, weights, dtype)?;
    let bytes = write_safetensors(&dir.join("model.safetensors"), &tensors, rules)?;
    Ok(Saved {
        dir: dir.to_path_buf(),
        tensors: tensors.len(),
        bytes,
    })
}

/// `dir` may receive a model read from `source`: it is neither that directory nor inside it
/// (links resolved where they exist).
pub fn check_target(source: Option<&Path>, dir: &Path) -> Result<(), SaveError> {
    let Some(source) = source else {
        return Ok(());
    };
    // A shape alone was read from its config file's directory.
    let source = match source.is_file() {
        true => source.parent().unwrap_or(source),
        false => source,
    };
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let target = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    // The deepest existing ancestor, resolved: the target itself may not exist yet.
    let existing = target.ancestors().find(|a| a.exists()).map(canon);
    let inside =
        target.starts_with(source) || existing.is_some_and(|e| e.starts_with(canon(source)));
    if inside {
        return Err(SaveError::IntoSource {
            target: dir.display().to_string(),
            source_dir: source.display().to_string(),
        });
    }
    Ok(())
}

/// The config's and tokenizer's bytes: the source's own files, or a GPT-2 config for this
/// engine's model.
fn sources(model: &Gpt) -> Result<(Vec<u8>, Option<Vec<u8>>), SaveError> {
    let read = |p: PathBuf| {
        std::fs::read(&p).map_err(|err| SaveError::Read {
            path: p.display().to_string(),
            err,
        })
    };
    match &model.cfg.path {
        Some(path) => {
            // A model directory, or a shape's config.json alone (its tokenizer, if any, beside).
            let (config, dir) = match path.is_file() {
                true => (path.clone(), path.parent().unwrap_or(Path::new("."))),
                false => (path.join("config.json"), path.as_path()),
            };
            let tokenizer = Some(dir.join("tokenizer.json")).filter(|t| t.is_file());
            Ok((read(config)?, tokenizer.map(read).transpose()?))
        }
        None => {
            let a = &model.spec.arch;
            let config = json!({
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "vocab_size": a.vocab,
                "n_embd": a.hidden,
                "n_layer": a.layers,
                "n_head": a.heads,
                "n_positions": a.positions_table,
                "n_inner": a.intermediate,
                "activation_function": "gelu_new",
                "layer_norm_epsilon": model.spec.norm_eps,
                "tie_word_embeddings": false,
                "bos_token_id": null,
                "eos_token_id": null,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                "torch_dtype": "float32",
            });
            let text = serde_json::to_string_pretty(&config).unwrap_or_default();
            Ok((text.into_bytes(), None))
        }
    }
}

/// The dtype the source stored its weights in (`torch_dtype`), f32 when unknown.
fn source_dtype(model: &Gpt) -> DType {
    match model.spec.source_dtype.as_deref() {
        Some("bfloat16") => DType::BF16,
        Some("float16") => DType::F16,
        _ => DType::F32,
    }
}

/// Each parameter under its saved name, stored as the family stores it, in `dtype`.
fn tensors_to_save(
    model: &Gpt,
    weights: &[Tensor],
    dtype: DType,
) -> Result<Vec<(String, Tensor)>, SaveError> {
    let names = model.spec.naming();
    let gaccwb = names == &GACCWB;
    // This engine's GPT saves as GPT-2, whose head is an `nn.Linear` (`[out, in]`).
    let target = if gaccwb { &GPT2 } else { names };
    let head = model.head.as_ref().map(|h| h.id());
    let mut out = Vec::with_capacity(weights.len());
    for (p, w) in model.params.iter().zip(weights) {
        let conv = |source| SaveError::Tensor {
            name: p.name.clone(),
            source,
        };
        // Matrices of linear layers are `[in, out]` in the engine; the family may store `[out, in]`.
        let is_head = Some(p.var.id()) == head;
        let linear = p.var.rank() == 2 && p.name != names.embed && p.name != names.positions;
        let stored = match (is_head, linear) {
            (true, _) => target.head_stored,
            (false, true) => target.stored,
            (false, false) => WeightLayout::InOut,
        };
        let t = match stored {
            WeightLayout::OutIn => w.t().and_then(|t| t.contiguous()).map_err(conv)?,
            WeightLayout::InOut => w.clone(),
        };
        let t = t
            .to_dtype(dtype)
            .and_then(|t| t.to_device(&candle_core::Device::Cpu));
        out.push((saved_name(&p.name, gaccwb), t.map_err(conv)?));
    }
    Ok(out)
}

/// This engine's GPT saves under GPT-2's names; the other families keep theirs.
fn saved_name(name: &str, gaccwb: bool) -> String {
    if !gaccwb {
        return name.to_string();
    }
    let renames = [
        ("wte", GPT2.embed.to_string()),
        ("wpe", GPT2.positions.to_string()),
        ("head.w", GPT2.head.to_string()),
    ];
    if let Some((_, to)) = renames.iter().find(|(from, _)| *from == name) {
        return to.clone();
    }
    let (module, suffix) = name.rsplit_once('.').unwrap_or((name, ""));
    let suffix = match suffix {
        "w" | "g" => "weight",
        _ => "bias",
    };
    let module = match module.split_once('.') {
        Some((block, rest)) if block.starts_with('h') => {
            let layer = &block[1..];
            let rest = match rest {
                "ln1" => "ln_1",
                "ln2" => "ln_2",
                "attn.qkv" => "attn.c_attn",
                "attn.proj" => "attn.c_proj",
                "mlp.fc" => "mlp.c_fc",
                other => other
                    .strip_prefix("mlp.proj")
                    .map_or(other, |_| "mlp.c_proj"),
            };
            format!("transformer.h.{layer}.{rest}")
        }
        _ => "transformer.ln_f".to_string(),
    };
    format!("{module}.{suffix}")
}

/// `tensors` written as a safetensors file (header, then each tensor's bytes in order), through
/// a temporary file renamed into place. Returns its size.
fn write_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    rules: &Overwrite,
) -> Result<u64, SaveError> {
    let mut header = BTreeMap::new();
    header.insert("__metadata__".to_string(), json!({"format": "pt"}));
    let mut offset = 0u64;
    for (name, t) in tensors {
        let len = (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        let dtype = match t.dtype() {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            _ => "F32",
        };
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": t.dims(), "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut head = serde_json::to_vec(&header).unwrap_or_default();
    // The data starts 8-byte aligned, as the format's writers pad it.
    while (head.len() + 8) % 8 != 0 {
        head.push(b' ');
    }
    let mut pending = Pending::begin(path, "model weights", rules)?;
    let io = |err: std::io::Error| WriteError::Io {
        action: "write",
        path: path.to_path_buf(),
        err,
    };
    pending
        .file()
        .write_all(&(head.len() as u64).to_le_bytes())
        .and_then(|_| pending.file().write_all(&head))
        .map_err(io)?;
    for (name, t) in tensors {
        let bytes = tensor_bytes(t).map_err(|source| SaveError::Tensor {
            name: name.clone(),
            source,
        })?;
        pending.file().write_all(&bytes).map_err(io)?;
    }
    pending.commit()?;
    Ok(8 + head.len() as u64 + offset)
}

/// A CPU tensor's values as little-endian bytes.
fn tensor_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        _ => t
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    })
}
