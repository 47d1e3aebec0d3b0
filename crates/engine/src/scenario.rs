//! Scenarios (presets): the model, the data, the training knobs and a timeline of controls
//! keyed by optimizer step. Loaded from TOML; every field has a default so a preset states only
//! what its story needs.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::control::{
    AccumPolicy, Checkpointing, Control, Dtype, Knob, LossNorm, LrRule, OffloadGrads, OutOfBounds,
    ZeroGrad, KNOBS,
};

mod bounds;
mod fields;
mod knobs;

pub use bounds::{check_needs, check_schedule, ScheduleError};

/// A run's whole configuration as a preset writes it: the model, the data, the training knobs
/// and a timeline of controls.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The preset's name; a file without one takes its file stem.
    #[serde(default)]
    pub name: String,
    /// One line shown by `gaccwb presets`.
    #[serde(default)]
    pub description: String,
    /// The story this preset tells, shown in the UI.
    #[serde(default)]
    pub explanation: String,
    /// The transformer's shape (`[model]`).
    #[serde(default)]
    pub model: ModelConfig,
    /// The text it trains on and how it is tokenized (`[data]`).
    #[serde(default)]
    pub data: DataConfig,
    /// The optimizer, batch, precision, memory and data-parallel settings (`[train]`).
    #[serde(default)]
    pub train: TrainConfig,
    /// Controls applied at given optimizer steps (`[[timeline]]`).
    #[serde(default)]
    pub timeline: Vec<TimelineEntry>,
    /// What `gaccwb compare PRESET` runs when no `--grid` is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compare: Option<CompareSpec>,
}

/// A preset's `[compare]` table: a grid spec (as `--grid` takes) and steps per configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CompareSpec {
    /// The configurations to run, as `--grid` writes them.
    pub grid: String,
    /// Optimizer steps per configuration, unless `--steps` is given.
    #[serde(default)]
    pub steps: Option<u64>,
}

/// `[model]`: the transformer's shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Tokens the embedding and the head cover; a BPE tokenizer sets it to its own size.
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block; they must divide `d_model`.
    pub heads: usize,
    /// Tokens per sample: the context length.
    pub seq_len: usize,
    /// A Hugging Face model directory (or `ORG/NAME[@REVISION]` in the local cache) to
    /// fine-tune instead of this engine's GPT; its `config.json` then sets the other fields
    /// but `seq_len`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// A PEFT LoRA adapter (`adapter_config.json`, `adapter_model.safetensors`) for the model
    /// at `path`: its settings become `train.lora_*`, its weights the adapters' start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter: Option<PathBuf>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            vocab: 256,
            d_model: 128,
            layers: 4,
            heads: 4,
            seq_len: 128,
            path: None,
            adapter: None,
        }
    }
}

/// Where the training text comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// Seeded order-2 Markov documents with a closed-form entropy floor.
    #[default]
    Synthetic,
    /// Bytes of `data.path`.
    File,
    /// The project's own docs and sources (`assets/corpus.txt`), compiled into the binary so a
    /// preset can train on real text from any directory with no download.
    Docs,
}

/// How text is cut into tokens (file and docs sources).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per byte (vocabulary 256).
    #[default]
    Bytes,
    /// Byte-level BPE: trained on the text (`data.vocab` tokens) or `data.tokenizer_file`.
    Bpe,
}

/// `[data]`: the text the model trains on and how it is tokenized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Synthetic documents, a file, or the project's own docs.
    pub source: DataSource,
    /// The file read when `source = "file"`.
    pub path: Option<PathBuf>,
    /// Seed of the data stream: the same seed gives the same samples in the same order.
    pub seed: u64,
    /// Shortest synthetic document, in tokens after the delimiter.
    pub min_doc_len: usize,
    /// Longest synthetic document; 0 means seq_len.
    pub max_doc_len: usize,
    /// Symbols the synthetic source draws from (a subset of the byte vocabulary).
    pub alphabet: usize,
    /// Fraction of a data file held out for validation.
    pub val_fraction: f64,
    /// Bytes or BPE; with BPE the model's vocabulary is the tokenizer's.
    pub tokenizer: TokenizerKind,
    /// Vocabulary size of the BPE trained on the text.
    pub vocab: usize,
    /// A `tokenizer.json` to load instead of training one.
    pub tokenizer_file: Option<PathBuf>,
    /// The order training windows come in: seeded random offsets, or consecutive windows of
    /// `seq_len + 1` tokens from the file's start (to compare with another trainer's stream).
    pub order: DataOrder,
}

/// The order training windows of a text come in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DataOrder {
    /// Each sample at a seeded random offset of the training split.
    #[default]
    Random,
    /// Sample i is the i-th window of `seq_len + 1` tokens in file order (wrapping around).
    Sequential,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            source: DataSource::Synthetic,
            path: None,
            seed: 0,
            min_doc_len: 16,
            max_doc_len: 0,
            alphabet: 8,
            val_fraction: 0.1,
            tokenizer: TokenizerKind::Bytes,
            vocab: 8192,
            tokenizer_file: None,
            order: DataOrder::Random,
        }
    }
}

/// `[train]`: the optimizer, the batch, precision, memory and data-parallel settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps to run; 0 runs until stopped.
    pub steps: u64,
    /// Seed of the model's initial weights.
    pub seed: u64,
    /// Samples per forward/backward pass (B).
    pub micro_batch: usize,
    /// Micro-batches summed per optimizer step (K).
    pub accum_steps: usize,
    /// Peak learning rate at the base effective batch.
    pub lr: f64,
    /// How the LR follows the effective batch against `base_batch`.
    pub lr_rule: LrRule,
    /// Effective batch the LR is tuned for; 0 means the starting micro_batch × accum_steps.
    pub base_batch: usize,
    /// Linear warm-up steps.
    pub warmup: u64,
    /// Steps of the cosine decay to `min_lr_ratio` × lr; 0 means `steps` (or no decay when steps is 0).
    /// Counted in applied steps: steps skipped on overflow do not advance the schedule.
    pub decay_steps: u64,
    /// Where the cosine decay ends, as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Global-norm clip threshold; absent means off.
    pub clip: Option<f64>,
    /// How per-token losses become the window's loss.
    pub loss_norm: LossNorm,
    /// When the accumulation buffer is cleared.
    pub zero_grad: ZeroGrad,
    /// AdamW's decoupled weight decay (none on biases and norm gains).
    pub weight_decay: f64,
    /// AdamW's decay of the first moment (the gradient's running mean).
    pub beta1: f64,
    /// AdamW's decay of the second moment (the squared gradient's running mean).
    pub beta2: f64,
    /// Added to AdamW's denominator so a zero second moment cannot divide by zero.
    pub eps: f64,
    /// Compute precision of the forward and backward; master weights stay f32.
    pub dtype: Dtype,
    /// Optimizer offload: AdamW's state and update in host memory.
    pub offload: bool,
    /// Where a window's gradients accumulate while offload is on: "device" (one f32 buffer
    /// there, one transfer per window) or "host" (none there, one transfer per micro-batch).
    pub offload_grads: OffloadGrads,
    /// Initial fp16 loss scale.
    pub loss_scale: f64,
    /// Clean steps before the loss scale doubles.
    pub scale_growth_interval: u64,
    /// Validation every N steps; 0 turns it off.
    pub eval_every: u64,
    /// Size of the validation set, in micro-batches of the starting `micro_batch`: the same
    /// `eval_batches × micro_batch` samples at every evaluation, whatever B and K become.
    pub eval_batches: usize,
    /// Activation checkpointing: "none", "blocks" or "every-N".
    pub checkpointing: Checkpointing,
    /// Consecutive windows with a non-finite loss or gradient (fp16 overflow skips included)
    /// after which the run ends as diverged; 0 never ends it.
    pub max_nonfinite_windows: u64,
    /// Memory the run may use: bytes, "6 GiB" or "80%" of the device; "off" by default. The
    /// memory guard (`train::oom_guard`) keeps the run under it by trading micro-batch for K.
    pub memory_budget: crate::budget::MemoryBudget,
    /// Out-of-memory failures tolerated at micro-batch 1 before the run ends.
    pub guard_retries: u32,
    /// Measure the gradient noise scale in windows of two micro-batches or more, every rank's
    /// counted (docs/NOISE.md).
    pub noise: bool,
    /// EMA factor smoothing |G|² and tr(Σ) of the noise scale.
    pub noise_ema: f64,
    /// Who chooses K: "fixed" or "noise-scale".
    pub accum_policy: AccumPolicy,
    /// Smallest K the noise-scale policy may choose.
    pub accum_min: usize,
    /// Largest K the noise-scale policy may choose.
    pub accum_max: usize,
    /// Windows a new K must be asked for (and at least held) before the policy changes it.
    pub accum_patience: u64,
    /// Data parallel: ranks `gaccwb run` starts through mpirun when not given `--ranks` and not
    /// itself started by a launcher (1: one process).
    pub ranks: usize,
    /// Data parallel: when the ranks sum their gradients, "window" or "micro-batch".
    pub sync: crate::dist::SyncEvery,
    /// Data parallel: "tokens" (per token of the whole window) or "mean-of-means" (a pitfall).
    pub rank_loss_norm: crate::dist::RankLossNorm,
    /// Data parallel: seconds a rank waits in a collective before it ends the run.
    pub comm_timeout: f64,
    /// Data parallel: ZeRO stage. 1 shards the AdamW moments over the ranks, 2 also the summed
    /// gradient; 0 keeps everything on every rank.
    pub zero: u8,
    /// ZeRO-2: "buffer" (a whole local buffer, one reduce-scatter per window) or
    /// "reduce-scatter" (one per micro-batch, 1/W of the buffer).
    pub zero2_accumulate: crate::dist::Zero2Accumulate,
    /// LoRA's rank r: 0 trains every weight; r ≥ 1 freezes them and trains a rank-r adapter on
    /// each targeted layer (`model::lora`).
    pub lora_rank: usize,
    /// LoRA's alpha: the adapters' update is scaled by alpha / r (PEFT's default 8).
    pub lora_alpha: f64,
    /// The layers LoRA adapts, by name or name suffix (`["q_proj", "v_proj"]`, `["c_attn"]`,
    /// `["attn.qkv"]`); empty: every linear layer of the blocks.
    pub lora_targets: Vec<String>,
    /// rsLoRA: scale the update by alpha / √r instead of alpha / r.
    pub lora_rslora: bool,
    /// Dropout on each adapter's input in training (PEFT's `lora_dropout`), in `[0, 1)`:
    /// `base(x) + B(A(dropout(x)))·scale`, kept elements scaled by `1/(1 − p)`, none dropped in
    /// evaluation. Masks are drawn from the seed, the layer and the sample's place in the data
    /// stream (`ops::dropout`). An adapter read with `--adapter` brings its own value when
    /// this one is 0.
    pub lora_dropout: f64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 0,
            seed: 0,
            micro_batch: 8,
            accum_steps: 1,
            lr: 3e-3,
            lr_rule: LrRule::None,
            base_batch: 0,
            warmup: 20,
            decay_steps: 0,
            min_lr_ratio: 0.1,
            clip: Some(1.0),
            loss_norm: LossNorm::Tokens,
            zero_grad: ZeroGrad::PerWindow,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            dtype: Dtype::F32,
            offload: false,
            offload_grads: OffloadGrads::Device,
            loss_scale: 65536.0,
            scale_growth_interval: 2000,
            eval_every: 25,
            eval_batches: 4,
            checkpointing: Checkpointing::None,
            max_nonfinite_windows: 20,
            memory_budget: crate::budget::MemoryBudget::Off,
            guard_retries: 3,
            noise: true,
            noise_ema: 0.95,
            accum_policy: AccumPolicy::Fixed,
            accum_min: 2,
            accum_max: 64,
            accum_patience: 10,
            ranks: 1,
            sync: crate::dist::SyncEvery::Window,
            rank_loss_norm: crate::dist::RankLossNorm::Tokens,
            comm_timeout: 60.0,
            zero: 0,
            zero2_accumulate: crate::dist::Zero2Accumulate::Buffer,
            lora_rank: 0,
            lora_alpha: 8.0,
            lora_targets: Vec::new(),
            lora_rslora: false,
            lora_dropout: 0.0,
        }
    }
}

/// A control the timeline applies before the window of `step + 1` (i.e. once `step` steps are done).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimelineEntry {
    /// Optimizer steps done when it applies (0: before the first window).
    pub step: u64,
    /// The change it makes.
    pub control: Control,
}

/// A problem with a scenario, written for the user.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// A preset file that cannot be read.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// Why it cannot be read.
        message: String,
    },
    /// A preset that is not valid TOML or fails a check.
    #[error("{location}: {message}")]
    Parse {
        /// `file:line:col` of the offending value (the file alone when it is not found).
        location: String,
        /// What is wrong and the fix.
        message: String,
    },
    /// A preset name that is neither built in nor a file; the message lists the built-in ones.
    #[error("{0}")]
    Invalid(String),
    /// A `--set` override that cannot be applied.
    #[error("--set {key}: {message}")]
    Set {
        /// The `section.key` given.
        key: String,
        /// What is wrong and the fix.
        message: String,
    },
}

/// A check serde cannot express, failed: the key it concerns (`train.clip`,
/// `timeline[2].control`, so a file error can point at its line) and the message, which names
/// the key and the fix.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct Invalid {
    /// The dotted key concerned, so a file error can point at its line.
    pub key: String,
    /// What is wrong, naming the key and the fix.
    pub message: String,
}

impl Invalid {
    fn new(key: &str, message: String) -> Invalid {
        Invalid {
            key: key.to_string(),
            message,
        }
    }
}

/// A control that may not be applied: a knob value out of its bounds, a loss scale that is not
/// positive, a window too large, or a policy that needs a measurement the run has off.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ControlError {
    /// A knob value outside its bounds.
    #[error("{what} {bound}")]
    Bounds {
        /// The knob, in words (`accumulation steps`).
        what: &'static str,
        /// The bound it breaks.
        bound: OutOfBounds,
    },
    /// A loss scale that is 0, negative or not finite.
    #[error("loss scale must be positive")]
    LossScale,
    /// A window (B, K, B × K × seq_len) beyond `crate::limits`; the message says which.
    #[error("{0}")]
    Window(String),
    /// The noise-scale K policy while `train.noise` is off.
    #[error(
        "set_accum_policy=noise-scale needs train.noise = true (the policy reads the gradient \
         noise scale); drop it or --set train.noise=true"
    )]
    NeedsNoise,
}

/// A `--control STEP:KIND[=VALUE]` argument that cannot be used, and why.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("--control {arg}: {message}")]
pub struct ControlArgError {
    /// The argument as given.
    pub arg: String,
    /// What is wrong with it and the fix.
    pub message: String,
}

/// A `--set` or `--control` value TOML cannot hold.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BadValue {
    /// A number too large for an f64.
    #[error("bad value `{0}`: beyond the largest number (about 1.8e308)")]
    BeyondFloat(String),
    /// An integer beyond `limits::MAX_INTEGER`.
    #[error("bad value `{0}`: beyond the largest integer ({max})", max = crate::limits::MAX_INTEGER)]
    BeyondInteger(String),
}

/// One `section.key = value` override, parsed: what `--set` and a compare grid item make. Its
/// `Display` is the `--set` argument that makes it again.
#[derive(Clone, Debug, PartialEq)]
pub struct Assignment {
    /// `section.key`, e.g. `train.accum_steps`.
    pub key: String,
    /// The value, as TOML reads it.
    pub value: toml::Value,
}

impl Assignment {
    /// `section.key=value`, the value in TOML syntax (bare strings accepted).
    pub fn parse(text: &str) -> Result<Assignment, ScenarioError> {
        let (key, raw) = text.split_once('=').ok_or_else(|| ScenarioError::Set {
            key: text.to_string(),
            message: "expected section.key=value, e.g. train.accum_steps=4".into(),
        })?;
        Assignment::new(key.trim(), raw)
    }

    /// `key` set to `raw`, read as TOML (bare strings accepted).
    pub fn new(key: &str, raw: &str) -> Result<Assignment, ScenarioError> {
        let value = parse_value(raw.trim()).map_err(|e| ScenarioError::Set {
            key: key.to_string(),
            message: e.to_string(),
        })?;
        let key = key.to_string();
        Ok(Assignment { key, value })
    }

    /// A knob's `train.KEY = raw`.
    pub fn knob(knob: &Knob, raw: &str) -> Result<Assignment, ScenarioError> {
        Assignment::new(&format!("train.{}", knob.key), raw)
    }
}

impl std::fmt::Display for Assignment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

impl Scenario {
    /// Parse TOML text; `origin` names the file in errors (`file:line:col`).
    pub fn from_toml(text: &str, origin: &str) -> Result<Scenario, ScenarioError> {
        let located = |offset: Option<usize>| match offset {
            Some(offset) => {
                let (line, col) = line_col(text, offset);
                format!("{origin}:{line}:{col}")
            }
            None => origin.to_string(),
        };
        let scenario: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            location: located(e.span().map(|s| s.start)),
            message: explain_serde_message(e.message().trim()),
        })?;
        scenario.check().map_err(|p| ScenarioError::Parse {
            location: located(span_of_key(text, &p.key)),
            message: p.message,
        })?;
        Ok(scenario)
    }

    /// Read a preset file (size-bounded); a preset without a `name` takes the file's stem.
    pub fn from_file(path: &Path) -> Result<Scenario, ScenarioError> {
        let limit = crate::limits::MAX_CONFIG_BYTES;
        let text = crate::limits::read_bounded_text(path, limit, "preset").map_err(|e| {
            ScenarioError::Io {
                path: path.display().to_string(),
                message: e.to_string(),
            }
        })?;
        let mut s = Scenario::from_toml(&text, &path.display().to_string())?;
        if s.name.is_empty() {
            s.name = path
                .file_stem()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
        }
        Ok(s)
    }

    /// Override one field: `section.key=value`, value in TOML syntax (bare strings accepted).
    pub fn set(&mut self, assignment: &str) -> Result<(), ScenarioError> {
        self.apply(&Assignment::parse(assignment)?, true)
    }

    /// `set` without the trainability checks (`validate`): the estimator plans for shapes this
    /// program cannot train (e.g. a 50257-token vocabulary). Types are still checked.
    pub fn set_unvalidated(&mut self, assignment: &str) -> Result<(), ScenarioError> {
        self.apply(&Assignment::parse(assignment)?, false)
    }

    /// Apply a parsed override; with `validate`, the result must pass `validate` too.
    pub fn apply(&mut self, a: &Assignment, validate: bool) -> Result<(), ScenarioError> {
        let key = a.key.as_str();
        let set_err = |message: String| ScenarioError::Set {
            key: key.to_string(),
            message,
        };
        let mut root = toml::Value::try_from(&*self).map_err(|e| set_err(e.to_string()))?;
        let (section, field) = key.split_once('.').ok_or_else(|| {
            set_err(format!(
                "expected section.key; sections: {}",
                SECTIONS.join(", ")
            ))
        })?;
        let table = root
            .get_mut(section)
            .and_then(|v| v.as_table_mut())
            .filter(|_| SECTIONS.contains(&section))
            .ok_or_else(|| {
                set_err(format!(
                    "unknown section `{section}`; sections: {}",
                    SECTIONS.join(", ")
                ))
            })?;
        let accepted = keys_of(section);
        if !accepted.contains(&field) {
            let hint = nearest(field, &accepted)
                .map(|n| format!(", did you mean `{n}`?"))
                .unwrap_or_default();
            return Err(set_err(format!(
                "unknown key `{field}`{hint}; {section} keys: {}",
                accepted.join(", ")
            )));
        }
        table.insert(field.to_string(), a.value.clone());
        let updated: Scenario = root.try_into().map_err(|e: toml::de::Error| {
            let given = match &a.value {
                toml::Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            set_err(format!(
                "bad value `{given}`: {}",
                explain_serde_message(e.message().trim())
            ))
        })?;
        if validate {
            updated.validate().map_err(|e| set_err(e.message))?;
        }
        *self = updated;
        Ok(())
    }

    /// Checks that serde cannot express. Messages name the key and the fix.
    pub fn validate(&self) -> Result<(), Invalid> {
        self.check()
    }

    fn check(&self) -> Result<(), Invalid> {
        let m = &self.model;
        let t = &self.train;
        let d = &self.data;
        let at_least_one = [
            ("model.vocab", m.vocab),
            ("model.d_model", m.d_model),
            ("model.layers", m.layers),
            ("model.heads", m.heads),
            ("model.seq_len", m.seq_len),
        ];
        for (key, v) in at_least_one {
            if v == 0 {
                return Err(Invalid::new(
                    key,
                    format!("{key} must be at least 1 (got 0)"),
                ));
            }
        }
        check_knobs(t)?;
        bounds::check_scenario(self)?;
        // A model from a directory takes its head width from its config.
        if m.path.is_none() && !m.d_model.is_multiple_of(m.heads) {
            return Err(Invalid::new(
                "model.heads",
                format!(
                    "model.d_model ({}) must be divisible by model.heads ({})",
                    m.d_model, m.heads
                ),
            ));
        }
        if d.tokenizer == TokenizerKind::Bpe {
            check_bpe(d)?;
        } else if d.tokenizer_file.is_some() {
            return Err(Invalid::new(
                "data.tokenizer_file",
                "data.tokenizer_file needs data.tokenizer = \"bpe\"".into(),
            ));
        } else if m.vocab > 256 && m.path.is_none() {
            return Err(Invalid::new(
                "model.vocab",
                format!(
                    "model.vocab ({}) must be at most 256: tokens are bytes (data.tokenizer = \"bpe\" sizes it from the text)",
                    m.vocab
                ),
            ));
        }
        if d.source == DataSource::Synthetic && (d.alphabet < 2 || d.alphabet + 1 > m.vocab) {
            return Err(Invalid::new(
                "data.alphabet",
                format!(
                    "data.alphabet ({}) must be between 2 and model.vocab - 1 ({})",
                    d.alphabet,
                    m.vocab - 1
                ),
            ));
        }
        if d.source == DataSource::File && d.path.is_none() {
            return Err(Invalid::new(
                "data.source",
                "data.source = \"file\" needs data.path (or use --data FILE)".into(),
            ));
        }
        if !(0.0..1.0).contains(&d.val_fraction) {
            return Err(Invalid::new(
                "data.val_fraction",
                format!("data.val_fraction ({}) must be in [0, 1)", d.val_fraction),
            ));
        }
        if !positive(t.loss_scale) {
            return Err(Invalid::new(
                "train.loss_scale",
                format!("train.loss_scale ({}) must be positive", t.loss_scale),
            ));
        }
        check_noise(t)?;
        check_comm_timeout(t)?;
        check_lora(t)?;
        for (i, e) in self.timeline.iter().enumerate() {
            validate_control(&e.control).map_err(|m| {
                Invalid::new(
                    &format!("timeline[{i}].control"),
                    format!("timeline[{i}] (step {}): {m}", e.step),
                )
            })?;
        }
        Ok(())
    }

    /// The effective batch the LR is tuned for, over `ranks` ranks: `train.base_batch` as
    /// given (a batch of every rank's samples together), else the starting W·K·B. The LR
    /// rules compare it with the window's W·K·B, so adding ranks scales the LR as adding
    /// micro-batches does.
    pub fn base_batch(&self, ranks: usize) -> usize {
        if self.train.base_batch > 0 {
            self.train.base_batch
        } else {
            self.train.micro_batch * self.train.accum_steps * ranks
        }
    }
}

/// Data parallel's timeout (a collective must be given some time) and ZeRO stage.
fn check_comm_timeout(t: &TrainConfig) -> Result<(), Invalid> {
    if t.ranks == 0 || t.ranks > crate::limits::MAX_RANKS {
        return Err(Invalid::new(
            "train.ranks",
            format!(
                "train.ranks ({}) must be from 1 to {}",
                t.ranks,
                crate::limits::MAX_RANKS
            ),
        ));
    }
    if t.zero > 2 {
        return Err(Invalid::new(
            "train.zero",
            format!(
                "train.zero ({}) must be 0, 1 or 2 (stage 3 is in `gaccwb estimate --zero 3`, \
                 not in training)",
                t.zero
            ),
        ));
    }
    if t.comm_timeout.is_finite() && t.comm_timeout > 0.0 {
        return Ok(());
    }
    Err(Invalid::new(
        "train.comm_timeout",
        format!(
            "train.comm_timeout ({}) must be a positive number of seconds, e.g. 60",
            t.comm_timeout
        ),
    ))
}

/// The noise scale's and the adaptive policy's keys.
fn check_noise(t: &TrainConfig) -> Result<(), Invalid> {
    if !(0.0..1.0).contains(&t.noise_ema) {
        return Err(Invalid::new(
            "train.noise_ema",
            format!(
                "train.noise_ema ({}) must be in [0, 1), e.g. 0.95",
                t.noise_ema
            ),
        ));
    }
    if t.accum_min < 2 {
        return Err(Invalid::new(
            "train.accum_min",
            format!(
                "train.accum_min ({}) must be at least 2: the noise scale needs K ≥ 2",
                t.accum_min
            ),
        ));
    }
    if t.accum_max < t.accum_min {
        return Err(Invalid::new(
            "train.accum_max",
            format!(
                "train.accum_max ({}) must be at least train.accum_min ({})",
                t.accum_max, t.accum_min
            ),
        ));
    }
    if t.accum_patience == 0 {
        return Err(Invalid::new(
            "train.accum_patience",
            "train.accum_patience must be at least 1 window".into(),
        ));
    }
    if t.accum_policy == AccumPolicy::NoiseScale && !t.noise {
        return Err(Invalid::new(
            "train.accum_policy",
            "train.accum_policy = \"noise-scale\" needs train.noise = true".into(),
        ));
    }
    Ok(())
}

/// Every knob's preset value within the knob's bounds (`knob::Values`).
fn check_knobs(t: &TrainConfig) -> Result<(), Invalid> {
    let values = serde_json::to_value(t).map_err(|e| Invalid::new("train", e.to_string()))?;
    for knob in KNOBS {
        let value = values.get(knob.key).filter(|v| !v.is_null());
        knob.check(value).map_err(|bound| {
            let key = format!("train.{}", knob.key);
            Invalid::new(&key, format!("{key} {bound}"))
        })?;
    }
    Ok(())
}

/// Byte offset of a dotted key (`train.clip`, `timeline[2].control`) in TOML text, so a value
/// error points at the value the user wrote. `None` when the key is not written (a default).
fn span_of_key(text: &str, key: &str) -> Option<usize> {
    use toml::de::{DeTable, DeValue};
    let root = DeTable::parse(text).ok()?;
    let mut table = root.get_ref();
    let mut found = None;
    for part in key.split('.') {
        let (name, index) = match part.split_once('[') {
            Some((n, rest)) => (n, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (part, None),
        };
        let value = table.iter().find(|(k, _)| k.get_ref() == name)?.1;
        let value = match (value.get_ref(), index) {
            (DeValue::Array(items), Some(i)) => items.get(i)?,
            _ => value,
        };
        found = Some(value.span().start);
        match value.get_ref() {
            DeValue::Table(t) => table = t,
            _ => break,
        }
    }
    found
}

/// serde's "unknown field `acum_steps`, expected one of `steps`, ..." becomes
/// "unknown field `acum_steps`, did you mean `accum_steps`? (expected one of ...)"; the same for
/// unknown variants (`dtype = "f61"`, `kind = "set_acum_steps"`).
fn explain_serde_message(message: &str) -> String {
    let Some((what, expected)) = message.split_once(", expected one of ") else {
        return message.to_string();
    };
    let Some(given) = what.split('`').nth(1) else {
        return message.to_string();
    };
    let candidates: Vec<&str> = expected
        .split(", ")
        .map(|c| c.trim().trim_matches('`'))
        .collect();
    match nearest(given, &candidates) {
        Some(best) => format!("{what}, did you mean `{best}`? (expected one of {expected})"),
        None => message.to_string(),
    }
}

/// The candidate closest to `given`, if it is close enough to be a likely misspelling.
pub fn nearest<'a>(given: &str, candidates: &[&'a str]) -> Option<&'a str> {
    // Edits (a swap counts as one) first; similarity of prefixes breaks ties and catches
    // longer slips such as `micro_batch_size`.
    let max_edits = (given.chars().count() / 3).max(1);
    candidates
        .iter()
        .map(|c| {
            (
                strsim::osa_distance(given, c),
                strsim::jaro_winkler(given, c),
                *c,
            )
        })
        .filter(|(edits, similarity, _)| *edits <= max_edits || *similarity >= 0.9)
        .min_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)))
        .map(|(_, _, c)| c)
}

/// LoRA's settings: the adapters' scale must be finite, and dropout a probability below 1.
fn check_lora(t: &TrainConfig) -> Result<(), Invalid> {
    if t.lora_rank > 0 && !t.lora_alpha.is_finite() {
        return Err(Invalid::new(
            "train.lora_alpha",
            format!(
                "train.lora_alpha ({}) must be a finite number",
                t.lora_alpha
            ),
        ));
    }
    if !(0.0..1.0).contains(&t.lora_dropout) {
        return Err(Invalid::new(
            "train.lora_dropout",
            format!(
                "train.lora_dropout ({}) must be at least 0 and below 1 (0.05 or 0.1 are usual)",
                t.lora_dropout
            ),
        ));
    }
    Ok(())
}

/// Value checks shared by presets, the command line and hotkeys: a knob's value within the
/// bounds its row in the knob table gives, and a positive loss scale.
pub fn validate_control(c: &Control) -> Result<(), ControlError> {
    if let Some(knob) = c.knob() {
        return knob
            .check(c.value().as_ref())
            .map_err(|bound| ControlError::Bounds {
                what: knob.what,
                bound,
            });
    }
    match c {
        Control::SetLossScale { value } if !positive(*value) => Err(ControlError::LossScale),
        _ => Ok(()),
    }
}

/// The sections a `--set` key may name (`section.key`).
pub const SECTIONS: [&str; 3] = ["model", "data", "train"];

/// The keys a section accepts, in declaration order: read from the section's `Deserialize`
/// impl, so they cannot drift from the struct.
pub fn keys_of(section: &str) -> Vec<&'static str> {
    match section {
        "model" => fields::of::<ModelConfig>(),
        "data" => fields::of::<DataConfig>(),
        "train" => fields::of::<TrainConfig>(),
        _ => &[],
    }
    .to_vec()
}

/// A control from the command line: `STEP:KIND[=VALUE]`, e.g. `100:set_accum_steps=8`,
/// `0:set_clip` (clipping off), `50:set_dtype=f16`.
pub fn parse_control_arg(arg: &str) -> Result<TimelineEntry, ControlArgError> {
    let fail = |message: String| ControlArgError {
        arg: arg.to_string(),
        message,
    };
    let usage = "expected STEP:KIND[=VALUE], e.g. 100:set_accum_steps=8";
    let (step, rest) = arg.split_once(':').ok_or_else(|| fail(usage.into()))?;
    let step: u64 = step
        .trim()
        .parse()
        .map_err(|_| fail(format!("`{step}` is not a step number; {usage}")))?;
    let mut table = toml::Table::new();
    let (kind, value) = match rest.split_once('=') {
        Some((k, v)) => (
            k.trim(),
            Some(parse_value(v.trim()).map_err(|e| fail(e.to_string()))?),
        ),
        None => (rest.trim(), None),
    };
    table.insert("kind".into(), toml::Value::String(kind.to_string()));
    let given = value.is_some();
    if let Some(v) = value {
        table.insert("value".into(), v);
    }
    let control: Control = toml::Value::Table(table)
        .try_into()
        .map_err(|e: toml::de::Error| fail(e.message().trim().to_string()))?;
    // Serde ignores a value the kind does not take (`stop=1`): refuse it instead.
    let takes_value = toml::Value::try_from(&control)
        .ok()
        .and_then(|t| t.get("value").cloned())
        .is_some();
    if given && !takes_value {
        return Err(fail(format!(
            "`{kind}` takes no value; write {step}:{kind}"
        )));
    }
    validate_control(&control).map_err(|m| fail(m.to_string()))?;
    Ok(TimelineEntry { step, control })
}

/// A `--set` or `--control` value as TOML reads it: `4` → integer, `1e-3` → float, `true` →
/// bool; text TOML does not read is a string, unless it is a number TOML cannot hold (`1e309`),
/// which is refused as such.
fn parse_value(raw: &str) -> Result<toml::Value, BadValue> {
    let wrapped = format!("v = {raw}");
    match toml::from_str::<toml::Table>(&wrapped) {
        Ok(mut t) => Ok(t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into()))),
        Err(_) => match raw.parse::<f64>() {
            Ok(x) if x.is_infinite() => Err(BadValue::BeyondFloat(raw.into())),
            Ok(_)
                if raw
                    .bytes()
                    .all(|b| b.is_ascii_digit() || b == b'-' || b == b'+') =>
            {
                Err(BadValue::BeyondInteger(raw.into()))
            }
            _ => Ok(toml::Value::String(raw.trim_matches('"').to_string())),
        },
    }
}

/// 1-based line and column of a byte offset.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before
        .rsplit('\n')
        .next()
        .map(|l| l.chars().count())
        .unwrap_or(0)
        + 1;
    (line, col)
}

fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Largest BPE vocabulary accepted: Llama 3's is 128,256.
const MAX_BPE_VOCAB: usize = 1 << 18;

/// A BPE needs text, and a trained one more tokens than the 256 bytes it starts from.
fn check_bpe(d: &DataConfig) -> Result<(), Invalid> {
    if d.source == DataSource::Synthetic {
        return Err(Invalid::new(
            "data.tokenizer",
            "data.tokenizer = \"bpe\" needs text: set data.source = \"file\" (--data FILE) or \"docs\""
                .into(),
        ));
    }
    if d.tokenizer_file.is_none() && !(257..=MAX_BPE_VOCAB).contains(&d.vocab) {
        return Err(Invalid::new(
            "data.vocab",
            format!(
                "data.vocab ({}) must be between 257 and {MAX_BPE_VOCAB}: a byte-level BPE starts from the 256 bytes",
                d.vocab
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The LR rules see W·K·B: with the LR tuned at 4 samples (B = 2), two ranks at K = 2 get
    /// the factor one process gets at K = 4, twice that of K = 2; unset, the base is the
    /// starting W·K·B, so a run starts at its LR however many ranks it has.
    #[test]
    fn the_lr_rules_count_every_ranks_samples() {
        let linear = |ranks: usize, k: usize, base: usize| {
            let mut s = Scenario::default();
            (s.train.micro_batch, s.train.accum_steps) = (2, k);
            s.train.base_batch = base;
            LrRule::Linear.factor(ranks * k * 2, s.base_batch(ranks))
        };
        assert_eq!(linear(2, 2, 4), 2.0);
        assert_eq!(linear(1, 4, 4), 2.0);
        assert_eq!(linear(1, 2, 4), 1.0);
        assert_eq!(linear(2, 2, 0), 1.0);
    }

    #[test]
    fn set_overrides_and_rejects_unknown_keys() {
        let mut s = Scenario::default();
        s.set("train.accum_steps=4").unwrap();
        s.set("train.lr=0").unwrap();
        s.set("train.dtype=bf16").unwrap();
        assert_eq!(s.train.accum_steps, 4);
        assert_eq!(s.train.lr, 0.0);
        assert_eq!(s.train.dtype, Dtype::Bf16);
        let err = s.set("train.acum_steps=4").unwrap_err().to_string();
        assert!(
            err.contains("unknown key `acum_steps`, did you mean `accum_steps`?"),
            "{err}"
        );
        let err = s.set("train.accum_steps=0").unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
        let err = s.set("train.dtype=f8").unwrap_err().to_string();
        assert!(err.contains("f8"), "{err}");
    }

    #[test]
    fn lora_dropout_is_a_probability_below_one() {
        let mut s = Scenario::default();
        s.set("train.lora_dropout=0.1").unwrap();
        assert_eq!(s.train.lora_dropout, 0.1);
        for bad in ["1", "-0.1", "1.5"] {
            let err = s.set(&format!("train.lora_dropout={bad}")).unwrap_err();
            assert!(err.to_string().contains("below 1"), "{bad}: {err}");
        }
    }

    #[test]
    fn command_line_controls_parse_like_timeline_entries() {
        let e = parse_control_arg("100:set_accum_steps=8").unwrap();
        assert_eq!(
            (e.step, e.control),
            (100, Control::SetAccumSteps { value: 8 })
        );
        let e = parse_control_arg("0:set_clip").unwrap();
        assert_eq!(e.control, Control::SetClip { value: None });
        let e = parse_control_arg("5:set_dtype=f16").unwrap();
        assert_eq!(e.control, Control::SetDtype { value: Dtype::F16 });
        let err = |arg: &str| parse_control_arg(arg).unwrap_err().to_string();
        assert!(err("x:set_clip").contains("step number"));
        assert!(err("3:set_accum_steps=0").contains("at least 1"));
        assert!(err("3:set_acum_steps=2").contains("set_acum_steps"));
        assert_eq!(parse_control_arg("5:stop").unwrap().control, Control::Stop);
        let e = err("5:stop=1");
        assert!(e.contains("`stop` takes no value"), "{e}");
        let e = err("5:set_lr=1e309");
        assert!(e.contains("beyond the largest number"), "{e}");
    }

    #[test]
    fn numbers_toml_cannot_hold_are_named_as_such() {
        let mut s = Scenario::default();
        let err = s.set("train.lr=1e309").unwrap_err().to_string();
        assert!(err.contains("`1e309`: beyond the largest number"), "{err}");
        let err = s
            .set("train.steps=99999999999999999999")
            .unwrap_err()
            .to_string();
        assert!(err.contains("beyond the largest integer"), "{err}");
        s.set("train.lr=1e-3").unwrap();
    }

    #[test]
    fn keys_of_matches_the_structs() {
        // Options serialise only when set: each is set here.
        let root = toml::Value::try_from(Scenario {
            model: ModelConfig {
                path: Some("m".into()),
                adapter: Some("a".into()),
                ..Default::default()
            },
            data: DataConfig {
                path: Some("x".into()),
                tokenizer_file: Some("t.json".into()),
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        for section in SECTIONS {
            let mut actual: Vec<String> =
                root[section].as_table().unwrap().keys().cloned().collect();
            let mut listed: Vec<String> = keys_of(section).iter().map(|s| s.to_string()).collect();
            // `clip` is an Option that serialises only when set; it is on by default.
            actual.sort();
            listed.sort();
            assert_eq!(actual, listed, "section {section}");
        }
    }

    #[test]
    fn parse_errors_name_file_line_and_column() {
        let err = Scenario::from_toml("[train]\nmicro_batch = \"eight\"\n", "p.toml")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("p.toml:2:"), "{err}");
    }
}
