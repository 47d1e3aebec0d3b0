//! A Hugging Face `config.json` read into an [`Arch`]: the fields each supported `model_type`
//! needs, with the defaults the `transformers` classes give the optional ones. An unknown type,
//! a missing field or a value of the wrong kind is refused naming the file and the field.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{Arch, Mlp, Norm, Positions};

/// The `model_type`s read.
pub const SUPPORTED: [&str; 5] = ["gpt2", "llama", "mistral", "qwen2", "gpt_neox"];

/// The largest size any field may give (sizes are multiplied together in 64 bits).
const MAX_SIZE: u64 = 1 << 31;

/// Why a `config.json` was refused.
#[derive(Debug, thiserror::Error)]
pub enum HfConfigError {
    /// The file cannot be read: missing, not a regular file (a FIFO, a device), too large or
    /// not UTF-8.
    #[error("{path}: {err}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why (in the message, not a cause of its own: said once).
        err: crate::limits::ReadError,
    },
    /// The file is not JSON.
    #[error("{path}: not JSON: {err}")]
    Json {
        /// The file.
        path: PathBuf,
        /// Where parsing stopped.
        err: serde_json::Error,
    },
    /// JSON, but not an object.
    #[error("{path}: the top level must be a JSON object")]
    NotObject {
        /// The file.
        path: PathBuf,
    },
    /// A `model_type` the planner does not know.
    #[error("{path}: model_type `{found}` is not supported; supported: {}{hint}", SUPPORTED.join(", "))]
    UnknownType {
        /// The file.
        path: PathBuf,
        /// The type it names.
        found: String,
        /// Where a multimodal config keeps its language model, when it has one.
        hint: String,
    },
    /// A field the model type needs is absent.
    #[error("{path}: field `{field}` is missing (model_type {model_type} needs it)")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// The model type that needs it.
        model_type: String,
    },
    /// A field with a value that cannot be used.
    #[error("{path}: field `{field}`: {why}")]
    Bad {
        /// The file.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

/// Reads and interprets `path`.
pub fn load(path: &Path) -> Result<Arch, HfConfigError> {
    let limit = crate::limits::MAX_CONFIG_BYTES;
    let text = crate::limits::read_bounded_text(path, limit, "model config").map_err(|err| {
        HfConfigError::Read {
            path: path.to_path_buf(),
            err,
        }
    })?;
    parse(path, &text)
}

/// Interprets the text of a `config.json`; `path` names it in errors.
pub fn parse(path: &Path, text: &str) -> Result<Arch, HfConfigError> {
    // Editors on some systems start UTF-8 files with a byte-order mark; JSON has no use for it.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let value: Value = serde_json::from_str(text).map_err(|err| HfConfigError::Json {
        path: path.to_path_buf(),
        err,
    })?;
    let Value::Object(map) = value else {
        return Err(HfConfigError::NotObject {
            path: path.to_path_buf(),
        });
    };
    let fields = Fields {
        path,
        map: &map,
        model_type: String::new(),
    };
    let model_type = fields.string("model_type")?;
    let f = Fields {
        model_type: model_type.clone(),
        ..fields
    };
    match model_type.as_str() {
        "gpt2" => gpt2(&f),
        "llama" | "mistral" | "qwen2" => llama_like(&f),
        "gpt_neox" => gpt_neox(&f),
        _ => Err(HfConfigError::UnknownType {
            path: path.to_path_buf(),
            found: model_type,
            hint: text_config_hint(&map),
        }),
    }
}

/// A multimodal config (LLaVA, Gemma 3, …) keeps its language model under `text_config`:
/// say so, with that model's type, when it has one.
fn text_config_hint(map: &Map<String, Value>) -> String {
    let Some(Value::Object(inner)) = map.get("text_config") else {
        return String::new();
    };
    let kind = inner
        .get("model_type")
        .and_then(Value::as_str)
        .map(|t| format!(" (model_type `{t}`)"))
        .unwrap_or_default();
    format!(
        "; its language model is under `text_config`{kind}: save that object as a config.json \
         of its own to plan it"
    )
}

/// The object and what errors need to name.
struct Fields<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
    model_type: String,
}

impl Fields<'_> {
    fn bad(&self, field: &'static str, why: &str) -> HfConfigError {
        HfConfigError::Bad {
            path: self.path.to_path_buf(),
            field,
            why: why.to_string(),
        }
    }

    /// A present, non-null value.
    fn get(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    fn string(&self, field: &'static str) -> Result<String, HfConfigError> {
        match self.get(field) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(self.bad(field, "expected a string")),
            None => Err(HfConfigError::Missing {
                path: self.path.to_path_buf(),
                field,
                model_type: if self.model_type.is_empty() {
                    "(any)".into()
                } else {
                    self.model_type.clone()
                },
            }),
        }
    }

    /// A positive integer, required.
    fn size(&self, field: &'static str) -> Result<u64, HfConfigError> {
        self.size_or(field, None)
    }

    /// A positive integer, or `default` when absent or null.
    fn size_or(&self, field: &'static str, default: Option<u64>) -> Result<u64, HfConfigError> {
        match self.get(field) {
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0 && n <= MAX_SIZE)
                .ok_or_else(|| {
                    self.bad(
                        field,
                        &format!("expected a positive integer up to {MAX_SIZE}, got {v}"),
                    )
                }),
            None => default.ok_or_else(|| HfConfigError::Missing {
                path: self.path.to_path_buf(),
                field,
                model_type: self.model_type.clone(),
            }),
        }
    }

    fn flag_or(&self, field: &'static str, default: bool) -> Result<bool, HfConfigError> {
        match self.get(field) {
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.bad(field, &format!("expected true or false, got {v}"))),
            None => Ok(default),
        }
    }

    /// A probability (dropout); absent is `default`.
    fn rate_or(&self, field: &'static str, default: f64) -> Result<f64, HfConfigError> {
        match self.get(field) {
            Some(v) => v
                .as_f64()
                .filter(|p| (0.0..1.0).contains(p))
                .ok_or_else(|| self.bad(field, &format!("expected a number in [0, 1), got {v}"))),
            None => Ok(default),
        }
    }

    /// `heads` must divide `width` when the head width is derived from it.
    fn head_dim(&self, width: u64, heads: u64) -> Result<u64, HfConfigError> {
        match self.get("head_dim") {
            Some(_) => self.size("head_dim"),
            None if width.is_multiple_of(heads) => Ok(width / heads),
            None => Err(self.bad(
                "num_attention_heads",
                &format!("{heads} heads do not divide the width {width}"),
            )),
        }
    }
}

/// GPT-2: LayerNorm, 4×GELU (or `n_inner`), learned positions, biases everywhere, fused qkv;
/// the head tied unless `tie_word_embeddings` is false.
fn gpt2(f: &Fields) -> Result<Arch, HfConfigError> {
    let hidden = f.size("n_embd")?;
    let heads = f.size("n_head")?;
    let positions = f.size("n_positions")?;
    let dropout = ["resid_pdrop", "embd_pdrop", "attn_pdrop"]
        .into_iter()
        .map(|k| f.rate_or(k, 0.1))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Arch {
        family: "gpt2".into(),
        vocab: f.size("vocab_size")?,
        hidden,
        layers: f.size("n_layer")?,
        heads,
        kv_heads: heads,
        head_dim: f.head_dim(hidden, heads)?,
        intermediate: f.size_or("n_inner", Some(4 * hidden))?,
        seq_len: positions,
        positions_table: positions,
        mlp: Mlp::Gelu,
        norm: Norm::LayerNorm,
        positions: Positions::Learned,
        qkv_bias: true,
        out_bias: true,
        mlp_bias: true,
        fused_qkv: true,
        tied: f.flag_or("tie_word_embeddings", true)?,
        dropout: dropout.iter().any(|&p| p > 0.0),
    })
}

/// Llama, Mistral and Qwen2: RMSNorm, SwiGLU, rotary positions, grouped-query attention.
/// Biases: Llama's `attention_bias` covers q, k, v and the output projection; Qwen2 has q, k, v
/// biases and none on the output; Mistral has none.
fn llama_like(f: &Fields) -> Result<Arch, HfConfigError> {
    let hidden = f.size("hidden_size")?;
    let heads = f.size("num_attention_heads")?;
    let kv_heads = f.size_or("num_key_value_heads", Some(heads))?;
    if !heads.is_multiple_of(kv_heads) {
        return Err(f.bad(
            "num_key_value_heads",
            &format!("{kv_heads} key/value heads must divide the {heads} attention heads"),
        ));
    }
    let (qkv_bias, out_bias, mlp_bias) = match f.model_type.as_str() {
        "llama" => {
            let attention = f.flag_or("attention_bias", false)?;
            (attention, attention, f.flag_or("mlp_bias", false)?)
        }
        "qwen2" => (true, false, false),
        _ => (false, false, false),
    };
    Ok(Arch {
        family: f.model_type.clone(),
        vocab: f.size("vocab_size")?,
        hidden,
        layers: f.size("num_hidden_layers")?,
        heads,
        kv_heads,
        head_dim: f.head_dim(hidden, heads)?,
        intermediate: f.size("intermediate_size")?,
        seq_len: f.size("max_position_embeddings")?,
        positions_table: 0,
        mlp: Mlp::SwiGlu,
        norm: Norm::RmsNorm,
        positions: Positions::Rotary,
        qkv_bias,
        out_bias,
        mlp_bias,
        fused_qkv: false,
        tied: f.flag_or("tie_word_embeddings", false)?,
        dropout: f.rate_or("attention_dropout", 0.0)? > 0.0,
    })
}

/// GPT-NeoX (Pythia): LayerNorm, GELU MLP of `intermediate_size`, rotary positions, fused qkv
/// with biases, an untied `embed_out` head.
fn gpt_neox(f: &Fields) -> Result<Arch, HfConfigError> {
    let hidden = f.size("hidden_size")?;
    let heads = f.size("num_attention_heads")?;
    let bias = f.flag_or("attention_bias", true)?;
    Ok(Arch {
        family: "gpt_neox".into(),
        vocab: f.size("vocab_size")?,
        hidden,
        layers: f.size("num_hidden_layers")?,
        heads,
        kv_heads: heads,
        head_dim: f.head_dim(hidden, heads)?,
        intermediate: f.size("intermediate_size")?,
        seq_len: f.size("max_position_embeddings")?,
        positions_table: 0,
        mlp: Mlp::Gelu,
        norm: Norm::LayerNorm,
        positions: Positions::Rotary,
        qkv_bias: bias,
        out_bias: bias,
        mlp_bias: true,
        fused_qkv: true,
        tied: f.flag_or("tie_word_embeddings", false)?,
        dropout: ["attention_dropout", "hidden_dropout"]
            .into_iter()
            .map(|k| f.rate_or(k, 0.0))
            .collect::<Result<Vec<_>, _>>()?
            .iter()
            .any(|&p| p > 0.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        parse(Path::new("c.json"), text).unwrap_err().to_string()
    }

    #[test]
    fn refusals_name_the_file_and_the_field() {
        assert_eq!(
            err(r#"{"model_type": "t5"}"#),
            "c.json: model_type `t5` is not supported; supported: gpt2, llama, mistral, qwen2, gpt_neox"
        );
        assert_eq!(
            err(r#"{"vocab_size": 8}"#),
            "c.json: field `model_type` is missing (model_type (any) needs it)"
        );
        let llama = r#"{"model_type": "llama", "vocab_size": 8, "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "max_position_embeddings": 32}"#;
        assert_eq!(
            err(llama),
            "c.json: field `intermediate_size` is missing (model_type llama needs it)"
        );
        assert!(
            err(&llama.replace("\"hidden_size\": 64", "\"hidden_size\": -1")).starts_with(
                "c.json: field `hidden_size`: expected a positive integer up to 2147483648, got -1"
            )
        );
        assert!(err("[1]").contains("top level"));
        assert!(err("{").starts_with("c.json: not JSON"));
    }

    /// A BOM was "not JSON"; a multimodal config was refused with no word of its text model.
    #[test]
    fn a_byte_order_mark_is_read_past_and_text_config_is_pointed_to() {
        let gpt2 = r#"{"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_head": 2,
            "n_layer": 1, "n_positions": 16}"#;
        let plain = parse(Path::new("c.json"), gpt2).unwrap();
        let with_bom = parse(Path::new("c.json"), &format!("\u{feff}{gpt2}")).unwrap();
        assert_eq!(with_bom.param_count(), plain.param_count());
        let llava = r#"{"model_type": "llava", "text_config": {"model_type": "llama"}}"#;
        let e = err(llava);
        assert!(
            e.contains("under `text_config` (model_type `llama`)"),
            "{e}"
        );
    }

    /// `--config /dev/zero` read until memory ran out; a FIFO blocked forever.
    #[test]
    fn a_config_that_is_not_a_regular_file_is_refused_at_once() {
        let e = load(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(
            e.contains("/dev/zero") && e.contains("not a regular file"),
            "{e}"
        );
    }

    #[test]
    fn defaults_of_the_optional_fields() {
        let text = r#"{"model_type": "llama", "vocab_size": 8, "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "max_position_embeddings": 32,
            "intermediate_size": 128}"#;
        let a = parse(Path::new("c.json"), text).unwrap();
        assert_eq!((a.kv_heads, a.head_dim, a.tied), (4, 16, false));
        let grouped = text.replace(
            "\"intermediate_size\"",
            "\"num_key_value_heads\": 3, \"intermediate_size\"",
        );
        assert!(err(&grouped).contains("`num_key_value_heads`: 3 key/value heads"));
    }
}
