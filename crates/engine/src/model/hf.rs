//! Hugging Face model directories, offline: `config.json`, `model.safetensors` (or
//! `model.safetensors.index.json` and its shards) and `tokenizer.json`, found at a path or in
//! the local Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`: `models--ORG--NAME/snapshots/<refs/main>`). Nothing is ever
//! downloaded, and nothing is written here: the directory is read only.
//!
//! Tensors are memory-mapped, checked against the family's names, shapes and dtypes, and
//! converted once into f32 `[in, out]` master weights (`model::Gpt::read`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use super::spec::{Spec, SpecError};
use super::Gpt;
use crate::ops::WeightLayout;
use crate::scenario::{DataSource, Scenario, TokenizerKind};

/// The largest `config.json` or index read (a real one is a few KB; an index a few hundred).
const MAX_JSON_BYTES: u64 = 16 << 20;

const GIB: f64 = (1u64 << 30) as f64;

/// Why a model could not be found or loaded. Every message names the file and the fix.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// Neither a directory nor a model in the local cache.
    #[error("model `{name}` not found; looked in: {}. Nothing is downloaded: fetch it with `{fetch}`, or give a directory holding config.json and model.safetensors", looked.join(", "))]
    NotFound {
        /// What was asked for.
        name: String,
        /// Every place looked.
        looked: Vec<String>,
        /// The command that would fetch it.
        fetch: String,
    },
    /// A file the directory needs is missing or unreadable.
    #[error("{path}: {message}")]
    File {
        /// The file (or directory).
        path: String,
        /// What is wrong and the fix.
        message: String,
    },
    /// The config names a family or feature the engine does not train.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// A tensor is missing, misshapen, of a dtype not read, or not the family's.
    #[error("{file}: tensor `{name}`: {message}")]
    Tensor {
        /// The weights file (or index).
        file: String,
        /// The tensor's name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The weights alone would not fit the memory of the device they load into.
    #[error("{dir}: the f32 master weights alone need {:.2} GiB (the planner's count: {params} parameters × 4 bytes) but the {device} has {:.2} GiB available; use a machine with more memory or a smaller model", *need as f64 / GIB, *available as f64 / GIB)]
    TooLarge {
        /// The model directory.
        dir: String,
        /// Parameters, from the config.
        params: u64,
        /// Bytes needed.
        need: u64,
        /// Bytes available.
        available: u64,
        /// Where (host memory or the GPU).
        device: String,
    },
    /// A LoRA adapter's files.
    #[error(transparent)]
    Adapter(#[from] super::lora::AdapterError),
    /// Candle failed while reading or converting.
    #[error("{file}: {source}")]
    Candle {
        /// The file being read.
        file: String,
        /// Candle's error.
        source: candle_core::Error,
    },
}

/// A model directory's files.
#[derive(Clone, Debug)]
pub struct ModelDir {
    /// The directory.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub config: PathBuf,
    /// The safetensors files holding the weights (one, or the index's shards in order).
    pub weights: Vec<PathBuf>,
    /// The index of a sharded model.
    pub index: Option<PathBuf>,
    /// Its `tokenizer.json`, when present.
    pub tokenizer: Option<PathBuf>,
}

/// The Hugging Face cache roots, in the order looked: `HF_HUB_CACHE`, `HF_HOME/hub`,
/// `~/.cache/huggingface/hub`.
pub fn cache_roots() -> Vec<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(hub) = var("HF_HUB_CACHE") {
        return vec![hub];
    }
    if let Some(home) = var("HF_HOME") {
        return vec![home.join("hub")];
    }
    var("HOME")
        .map(|h| vec![h.join(".cache/huggingface/hub")])
        .unwrap_or_default()
}

/// The directory `name` stands for: a directory path as given (or a `config.json` file alone:
/// that shape with random weights), or `ORG/NAME[@REVISION]` in the local cache (the revision a
/// branch under `refs/`, or a commit hash under `snapshots/`).
pub fn resolve(name: &str) -> Result<PathBuf, HfError> {
    let as_path = Path::new(name);
    if as_path.is_dir() || is_config_file(as_path) {
        return Ok(as_path.to_path_buf());
    }
    let mut looked = vec![format!("{name} (as a directory)")];
    let (repo, revision) = name.split_once('@').unwrap_or((name, "main"));
    let repo_shaped = repo.split('/').count() == 2
        && !repo.starts_with('.')
        && repo.split('/').all(|p| !p.is_empty() && p != "..");
    if repo_shaped {
        for root in cache_roots() {
            let models = root.join(format!("models--{}", repo.replace('/', "--")));
            let commit = std::fs::read_to_string(models.join("refs").join(revision))
                .map(|c| c.trim().to_string())
                .unwrap_or_else(|_| revision.to_string());
            let snapshot = models.join("snapshots").join(&commit);
            if snapshot.join("config.json").is_file() {
                return Ok(snapshot);
            }
            looked.push(snapshot.display().to_string());
        }
    }
    Err(HfError::NotFound {
        name: name.to_string(),
        looked,
        fetch: format!(
            "hf download {repo}{}",
            match revision {
                "main" => String::new(),
                r => format!(" --revision {r}"),
            }
        ),
    })
}

/// A `.json` file given where a model directory goes: a shape to build with random weights.
fn is_config_file(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|e| e == "json")
}

fn file_error(path: &Path, message: impl Into<String>) -> HfError {
    HfError::File {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// A small JSON file's text: a regular file of at most `MAX_JSON_BYTES`.
pub fn read_json_text(path: &Path) -> Result<String, HfError> {
    crate::limits::read_bounded_text(path, MAX_JSON_BYTES, "the file")
        .map_err(|e| file_error(path, e.to_string()))
}

impl ModelDir {
    /// The files of the model directory `dir`, checked to exist; a `config.json` file alone is
    /// a shape with no weights (`random`).
    pub fn open(dir: &Path) -> Result<ModelDir, HfError> {
        if is_config_file(dir) {
            let parent = dir.parent().unwrap_or(Path::new(".")).to_path_buf();
            return Ok(ModelDir {
                tokenizer: Some(parent.join("tokenizer.json")).filter(|t| t.is_file()),
                dir: parent,
                config: dir.to_path_buf(),
                weights: Vec::new(),
                index: None,
            });
        }
        if !dir.is_dir() {
            return Err(file_error(dir, "not a directory"));
        }
        let config = dir.join("config.json");
        if !config.is_file() {
            return Err(file_error(
                dir,
                "no config.json: a Hugging Face model directory holds config.json, model.safetensors and tokenizer.json",
            ));
        }
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let (weights, index) = if single.is_file() {
            (vec![single], None)
        } else if index.is_file() {
            (shards(&index)?, Some(index))
        } else {
            let hint = if dir.join("pytorch_model.bin").exists() {
                " (pytorch_model.bin is not read: save the model with safe_serialization=True)"
            } else {
                ""
            };
            return Err(file_error(
                dir,
                format!("no model.safetensors or model.safetensors.index.json{hint}"),
            ));
        };
        let tokenizer = Some(dir.join("tokenizer.json")).filter(|t| t.is_file());
        Ok(ModelDir {
            dir: dir.to_path_buf(),
            config,
            weights,
            index,
            tokenizer,
        })
    }

    /// Whether this is a shape alone (a `config.json` given without weights).
    pub fn is_shape(&self) -> bool {
        self.weights.is_empty()
    }

    /// The path a scenario's `model.path` records: the directory, or the config file of a shape.
    pub fn source(&self) -> PathBuf {
        let path = if self.is_shape() {
            &self.config
        } else {
            &self.dir
        };
        std::path::absolute(path).unwrap_or_else(|_| path.clone())
    }

    /// The model, with its checkpoint's weights or, for a shape alone, random ones drawn from
    /// `seed` (the family's initialiser, as `Gpt::random`).
    pub fn build(
        &self,
        seq_len: usize,
        seed: u64,
        device: &Device,
        available: Option<(u64, &str)>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Gpt, HfError> {
        if !self.is_shape() {
            return self.load(seq_len, device, available, progress);
        }
        let spec = self.spec()?;
        let mut cfg = spec.model_config(seq_len);
        cfg.path = Some(self.source());
        Gpt::random(spec, cfg, seed, device).map_err(|source| HfError::Candle {
            file: self.config.display().to_string(),
            source,
        })
    }

    /// The family the config describes.
    pub fn spec(&self) -> Result<Spec, HfError> {
        Ok(Spec::from_config(
            &self.config,
            &read_json_text(&self.config)?,
        )?)
    }

    /// The model, its weights read into f32 on `device`. `available` (bytes), when known, is
    /// checked against the f32 weights before anything is read; `progress(done, total)` hears
    /// of every tensor read (bytes in the files).
    pub fn load(
        &self,
        seq_len: usize,
        device: &Device,
        available: Option<(u64, &str)>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Gpt, HfError> {
        let spec = self.spec()?;
        if let Some((bytes, place)) = available {
            let need = spec.arch.param_count() * 4;
            if need > bytes {
                return Err(HfError::TooLarge {
                    dir: self.dir.display().to_string(),
                    params: spec.arch.param_count(),
                    need,
                    available: bytes,
                    device: place.to_string(),
                });
            }
        }
        let file = self.weights_name();
        // SAFETY: the files are mapped read-only; gaccwb never writes them, and a model
        // directory is not rewritten while a run reads it (the same contract as transformers').
        let tensors =
            unsafe { MmapedSafetensors::multi(&self.weights) }.map_err(|e| HfError::File {
                path: file.clone(),
                message: format!("not a valid safetensors file: {e}"),
            })?;
        let total: u64 = tensors
            .tensors()
            .iter()
            .map(|(_, v)| v.data().len() as u64)
            .sum();
        let present: BTreeSet<String> = tensors.tensors().into_iter().map(|(n, _)| n).collect();
        let names = spec.naming();
        let mut used = BTreeSet::new();
        let mut done = 0u64;
        let mut failure = None;
        let mut read = |name: &str, shape: &[usize], stored: WeightLayout| {
            let found = [
                name.to_string(),
                name.replacen(names.optional_prefix, "", 1),
            ]
            .into_iter()
            .find(|n| present.contains(n));
            let result = match found {
                None => Err(tensor_error(&file, name, "missing from the weights".into())),
                Some(found) => {
                    used.insert(found.clone());
                    read_tensor(&tensors, &file, &found, shape, stored)
                }
            };
            match result {
                Ok((t, bytes)) => {
                    done += bytes;
                    progress(done, total);
                    Ok(t)
                }
                Err(e) => {
                    let msg = e.to_string();
                    failure = Some(e);
                    Err(candle_core::Error::Msg(msg))
                }
            }
        };
        let mut cfg = spec.model_config(seq_len);
        cfg.path = Some(self.source());
        let built = Gpt::read(spec.clone(), cfg, device, &mut read);
        let model = match (built, failure) {
            (_, Some(e)) => return Err(e),
            (Err(source), None) => return Err(HfError::Candle { file, source }),
            (Ok(m), None) => m,
        };
        let unused: Vec<&String> = present
            .iter()
            .filter(|n| !used.contains(*n) && !is_buffer(n, &spec))
            .collect();
        if let Some(first) = unused.first() {
            let more = match unused.len() {
                1 => String::new(),
                n => format!(" (and {} more)", n - 1),
            };
            return Err(tensor_error(
                &file,
                first,
                format!(
                    "not a weight of a {} model{more}: the config and the weights disagree",
                    spec.arch.family
                ),
            ));
        }
        Ok(model)
    }

    /// How errors name the weights: the single file, or the index.
    fn weights_name(&self) -> String {
        self.index
            .as_ref()
            .unwrap_or(&self.weights[0])
            .display()
            .to_string()
    }
}

fn tensor_error(file: &str, name: &str, message: String) -> HfError {
    HfError::Tensor {
        file: file.to_string(),
        name: name.to_string(),
        message,
    }
}

/// The shard files an index names, in first-use order, each checked to exist.
fn shards(index: &Path) -> Result<Vec<PathBuf>, HfError> {
    let text = read_json_text(index)?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| file_error(index, format!("not JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| file_error(index, "no `weight_map` object"))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, shard) in map {
        let shard = shard
            .as_str()
            .filter(|s| !s.contains('/') && !s.contains('\\'))
            .ok_or_else(|| {
                file_error(index, format!("`{name}` maps to {shard}, not a file name"))
            })?;
        let path = dir.join(shard);
        if !files.contains(&path) {
            if !path.is_file() {
                return Err(file_error(
                    &path,
                    format!("missing shard (the index maps `{name}` to it); fetch the whole model again"),
                ));
            }
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(file_error(index, "the weight map is empty"));
    }
    Ok(files)
}

/// Tensors a family's files carry that are not weights: GPT-2's attention mask buffers, a
/// rotary table some exports keep, a tied model's head.
fn is_buffer(name: &str, spec: &Spec) -> bool {
    name.ends_with(".attn.bias")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with("rotary_emb.inv_freq")
        || (spec.arch.tied && name == spec.naming().head)
}

/// Tensor `name` as f32 in the engine's shape `shape` (a `[out, in]` source turned), and its
/// bytes in the file.
fn read_tensor(
    tensors: &MmapedSafetensors,
    file: &str,
    name: &str,
    shape: &[usize],
    stored: WeightLayout,
) -> Result<(Tensor, u64), HfError> {
    let view = tensors
        .get(name)
        .map_err(|e| tensor_error(file, name, e.to_string()))?;
    let want: Vec<usize> = match stored {
        WeightLayout::OutIn => shape.iter().rev().copied().collect(),
        WeightLayout::InOut => shape.to_vec(),
    };
    if view.shape() != want.as_slice() {
        return Err(tensor_error(
            file,
            name,
            format!("shape {:?}, the config says {want:?}", view.shape()),
        ));
    }
    let bytes = view.data().len() as u64;
    let candle = |source: candle_core::Error| HfError::Candle {
        file: file.to_string(),
        source,
    };
    let t = tensors.load(name, &Device::Cpu).map_err(candle)?;
    if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(tensor_error(
            file,
            name,
            format!(
                "dtype {:?}; weights are read from f32, bf16 or f16",
                t.dtype()
            ),
        ));
    }
    let t = t.to_dtype(DType::F32).map_err(candle)?;
    let t = match stored {
        WeightLayout::OutIn => t.t().and_then(|t| t.contiguous()).map_err(candle)?,
        WeightLayout::InOut => t,
    };
    Ok((t, bytes))
}

/// Ties a scenario to the model its `model.path` names, when it names one: the path resolved
/// (a directory, or the local cache), `[model]`'s shape taken from `config.json` (but
/// `seq_len`, which must fit the model's positions and any sliding window), and text data
/// tokenized by the model's own `tokenizer.json` unless `data.tokenizer_file` names another.
/// Idempotent; returns the directory and its family.
pub fn prepare(scenario: &mut Scenario) -> Result<Option<(ModelDir, Spec)>, HfError> {
    let Some(path) = scenario.model.path.clone() else {
        return Ok(None);
    };
    let dir = ModelDir::open(&resolve(&path.to_string_lossy())?)?;
    let spec = dir.spec()?;
    let seq_len = scenario.model.seq_len;
    let config = dir.config.display().to_string();
    if seq_len as u64 > spec.max_positions() {
        return Err(HfError::File {
            path: config,
            message: format!(
                "model.seq_len {seq_len} is longer than the model's {} positions; set a smaller model.seq_len",
                spec.max_positions()
            ),
        });
    }
    if let Some(window) = spec.sliding_window.filter(|&w| seq_len as u64 > w) {
        return Err(HfError::File {
            path: config,
            message: format!(
                "model.seq_len {seq_len} is longer than the sliding window ({window}): the engine's attention is exact only within it; set model.seq_len <= {window}"
            ),
        });
    }
    let mut cfg = spec.model_config(seq_len);
    cfg.path = Some(dir.source());
    cfg.adapter = scenario.model.adapter.take();
    if let Some(adapter) = &cfg.adapter {
        let lora = super::lora::read_adapter_config(adapter)?;
        let t = &mut scenario.train;
        (t.lora_rank, t.lora_alpha, t.lora_targets, t.lora_rslora) =
            (lora.rank, lora.alpha, lora.targets, lora.rslora);
        // The adapter's dropout, unless this run sets one.
        if t.lora_dropout == 0.0 {
            t.lora_dropout = lora.dropout;
        }
    }
    scenario.model = cfg;
    let data = &mut scenario.data;
    if data.source != DataSource::Synthetic {
        // Text is cut by the model's own tokenizer; a shape without one trains a BPE on the text
        // (its vocabulary must fit the embedding: `data::Corpus::open_sizing` checks).
        data.tokenizer = TokenizerKind::Bpe;
        match &dir.tokenizer {
            Some(t) if data.tokenizer_file.is_none() => {
                data.tokenizer_file = Some(std::path::absolute(t).unwrap_or_else(|_| t.clone()));
            }
            None if data.tokenizer_file.is_none() && !dir.is_shape() => {
                return Err(HfError::File {
                    path: dir.dir.display().to_string(),
                    message: "no tokenizer.json to cut the text with; set data.tokenizer_file"
                        .into(),
                });
            }
            _ => {}
        }
    }
    Ok(Some((dir, spec)))
}
