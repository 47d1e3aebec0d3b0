//! A Hugging Face `config.json` read into an [`Arch`]: the fields each supported `model_type`
//! needs, with the defaults the `transformers` classes give the optional ones. A multimodal
//! wrapper's `text_config` is read as the language model. An unknown type, a missing field or a
//! value of the wrong kind is refused naming the file and the field; the file must be a regular
//! file of at most [`MAX_BYTES`] (a FIFO or a device is refused before it is opened).

use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::Arch;

mod families;

/// The `model_type`s read.
pub(crate) const SUPPORTED: [&str; 12] = [
    "gpt2",
    "gpt_neox",
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "phi3",
];

/// The largest `config.json` read. Published ones are a few KiB (Phi-3.5's, with its two lists
/// of RoPE factors, about 5 KiB).
pub(crate) const MAX_BYTES: u64 = 1 << 20;

/// The largest size any field may give (sizes are multiplied together in 64 bits).
const MAX_SIZE: u64 = 1 << 31;

/// Why a `config.json` was refused.
#[derive(Debug, thiserror::Error)]
pub enum HfConfigError {
    /// The file cannot be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// Not a regular file (a directory, a FIFO, a device): nothing is read from it.
    #[error("{path}: not a regular file; give the model's config.json itself")]
    NotAFile {
        /// The path.
        path: PathBuf,
    },
    /// Larger than any `config.json`.
    #[error("{path}: {size} bytes, more than the {MAX_BYTES} a config.json may have; is it the model's config.json?")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (at least this).
        size: u64,
    },
    /// The file is not JSON.
    #[error("{path}: not JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// Where parsing stopped.
        source: serde_json::Error,
    },
    /// JSON, but not an object.
    #[error("{path}: the top level must be a JSON object")]
    NotObject {
        /// The file.
        path: PathBuf,
    },
    /// A `model_type` the planner does not know.
    #[error("{path}: {field} `{found}` is not supported{hint}; supported: {}", SUPPORTED.join(", "))]
    UnknownType {
        /// The file.
        path: PathBuf,
        /// `model_type`, or `text_config.model_type`.
        field: String,
        /// The type it names.
        found: String,
        /// What to do instead, when there is something (empty otherwise).
        hint: String,
    },
    /// A field the model type needs is absent.
    #[error("{path}: field `{field}` is missing (model_type {model_type} needs it)")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// The model type that needs it.
        model_type: String,
    },
    /// A field with a value that cannot be used.
    #[error("{path}: field `{field}`: {why}")]
    Bad {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong with it.
        why: String,
    },
}

/// Reads and interprets `path`: a regular file of at most `MAX_BYTES` (1 MiB), UTF-8 (a
/// byte-order mark is accepted).
pub fn read_config(path: &Path) -> Result<Arch, HfConfigError> {
    let read = |source| HfConfigError::Read {
        path: path.to_path_buf(),
        source,
    };
    // Checked before opening: opening a FIFO blocks until a writer comes.
    let meta = std::fs::metadata(path).map_err(read)?;
    if !meta.is_file() {
        return Err(HfConfigError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let too_large = |size| HfConfigError::TooLarge {
        path: path.to_path_buf(),
        size,
    };
    if meta.len() > MAX_BYTES {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(read)?
        .take(MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        read(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 ({e})"),
        ))
    })?;
    parse(path, &text)
}

/// Interprets the text of a `config.json`; `path` names it in errors.
pub(crate) fn parse(path: &Path, text: &str) -> Result<Arch, HfConfigError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let value: Value = serde_json::from_str(text).map_err(|source| HfConfigError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let Value::Object(map) = value else {
        return Err(HfConfigError::NotObject {
            path: path.to_path_buf(),
        });
    };
    let top = Fields {
        path,
        map: &map,
        prefix: "",
        model_type: String::new(),
    };
    let model_type = top.string("model_type")?;
    if SUPPORTED.contains(&model_type.as_str()) {
        return families::read(&Fields { model_type, ..top });
    }
    // A multimodal wrapper (LLaVA, Gemma 3, …): its language model is `text_config`.
    let Some(Value::Object(text_config)) = top.get("text_config") else {
        return Err(HfConfigError::UnknownType {
            path: path.to_path_buf(),
            field: "model_type".into(),
            found: model_type,
            hint: String::new(),
        });
    };
    let inner = Fields {
        path,
        map: text_config,
        prefix: "text_config.",
        model_type: String::new(),
    };
    let text_type = inner.string("model_type")?;
    if !SUPPORTED.contains(&text_type.as_str()) {
        return Err(HfConfigError::UnknownType {
            path: path.to_path_buf(),
            field: "text_config.model_type".into(),
            found: text_type,
            hint: format!(
                " (the language model of this `{model_type}`; if its text model is one of \
                 the supported families, save `text_config` as a config.json with that \
                 model_type and plan it)"
            ),
        });
    }
    let mut arch = families::read(&Fields {
        model_type: text_type,
        ..inner
    })?;
    arch.wrapper = Some(model_type);
    Ok(arch)
}

/// The object and what errors need to name.
pub(super) struct Fields<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
    /// `text_config.` when reading a wrapper's language model.
    prefix: &'static str,
    /// The `model_type` being read (empty before it is known).
    pub(super) model_type: String,
}

impl Fields<'_> {
    fn name(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }

    pub(super) fn bad(&self, field: &str, why: &str) -> HfConfigError {
        HfConfigError::Bad {
            path: self.path.to_path_buf(),
            field: self.name(field),
            why: why.to_string(),
        }
    }

    fn missing(&self, field: &str) -> HfConfigError {
        HfConfigError::Missing {
            path: self.path.to_path_buf(),
            field: self.name(field),
            model_type: if self.model_type.is_empty() {
                "(any)".into()
            } else {
                self.model_type.clone()
            },
        }
    }

    /// A present, non-null value.
    pub(super) fn get(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    fn string(&self, field: &str) -> Result<String, HfConfigError> {
        match self.get(field) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(self.bad(field, "expected a string")),
            None => Err(self.missing(field)),
        }
    }

    /// A positive integer, required.
    pub(super) fn size(&self, field: &str) -> Result<u64, HfConfigError> {
        self.size_or(field, None)
    }

    /// A positive integer, or `default` when absent or null.
    pub(super) fn size_or(&self, field: &str, default: Option<u64>) -> Result<u64, HfConfigError> {
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
            None => default.ok_or_else(|| self.missing(field)),
        }
    }

    /// A positive integer, or `None` when absent or null.
    pub(super) fn optional_size(&self, field: &str) -> Result<Option<u64>, HfConfigError> {
        match self.get(field) {
            Some(_) => self.size(field).map(Some),
            None => Ok(None),
        }
    }

    pub(super) fn flag_or(&self, field: &str, default: bool) -> Result<bool, HfConfigError> {
        match self.get(field) {
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.bad(field, &format!("expected true or false, got {v}"))),
            None => Ok(default),
        }
    }

    /// A positive number, or `None` when absent or null (a soft cap).
    pub(super) fn optional_positive(&self, field: &str) -> Result<Option<f64>, HfConfigError> {
        match self.get(field) {
            Some(v) => v
                .as_f64()
                .filter(|x| *x > 0.0 && x.is_finite())
                .map(Some)
                .ok_or_else(|| {
                    self.bad(
                        field,
                        &format!("expected a positive number or null, got {v}"),
                    )
                }),
            None => Ok(None),
        }
    }

    /// A probability (dropout); absent is `default`.
    pub(super) fn rate_or(&self, field: &str, default: f64) -> Result<f64, HfConfigError> {
        match self.get(field) {
            Some(v) => v
                .as_f64()
                .filter(|p| (0.0..1.0).contains(p))
                .ok_or_else(|| self.bad(field, &format!("expected a number in [0, 1), got {v}"))),
            None => Ok(default),
        }
    }

    /// Whether any of these dropout rates is above 0 (absent: 0).
    pub(super) fn any_dropout(&self, fields: &[&str]) -> Result<bool, HfConfigError> {
        for f in fields {
            if self.rate_or(f, 0.0)? > 0.0 {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// A list of layer indices (`mlp_only_layers`); absent is empty.
    pub(super) fn indices(&self, field: &str) -> Result<Vec<u64>, HfConfigError> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .ok_or_else(|| self.bad(field, &format!("expected layer indices, got {v}")))
                })
                .collect(),
            Some(v) => Err(self.bad(field, &format!("expected a list of layer indices, got {v}"))),
        }
    }

    /// How many entries of a list of strings equal `value` (`layer_types`), if the list is there.
    pub(super) fn count_of(&self, field: &str, value: &str) -> Result<Option<u64>, HfConfigError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(
                items.iter().filter(|v| v.as_str() == Some(value)).count() as u64,
            )),
            Some(v) => Err(self.bad(field, &format!("expected a list of strings, got {v}"))),
        }
    }

    /// `heads` must divide `width` when the head width is derived from it.
    pub(super) fn head_dim(&self, width: u64, heads: u64) -> Result<u64, HfConfigError> {
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

#[cfg(test)]
mod tests;
