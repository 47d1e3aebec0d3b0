//! Scenarios (presets): the model, the data, the training knobs and a timeline of controls
//! keyed by optimizer step. Loaded from TOML; every field has a default so a preset states only
//! what its story needs.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::control::{
    AccumPolicy, Checkpointing, Control, Dtype, Knob, LossNorm, LrRule, OffloadGrads, ZeroGrad,
    KNOBS,
};

mod args;
mod bounds;
mod checks;
mod error;
mod fields;
mod knobs;
mod text;

pub use args::{keys_of, parse_control_arg, Assignment, SECTIONS};
pub use bounds::{check_needs, check_schedule, ScheduleError};
pub use checks::validate_control;
use checks::*;
pub use error::{BadValue, ControlArgError, ControlError, Invalid, ScenarioError};
use text::{explain_serde_message, span_of_key};
pub use text::{line_col, nearest};

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
    pub sync: crate::control::SyncEvery,
    /// Data parallel: "tokens" (per token of the whole window) or "mean-of-means" (a pitfall).
    pub rank_loss_norm: crate::control::RankLossNorm,
    /// Data parallel: seconds a rank waits in a collective before it ends the run.
    pub comm_timeout: f64,
    /// Data parallel: ZeRO stage. 1 shards the AdamW moments over the ranks, 2 also the summed
    /// gradient; 0 keeps everything on every rank.
    pub zero: u8,
    /// ZeRO-2: "buffer" (a whole local buffer, one reduce-scatter per window) or
    /// "reduce-scatter" (one per micro-batch, 1/W of the buffer).
    pub zero2_accumulate: crate::control::Zero2Accumulate,
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
            sync: crate::control::SyncEvery::Window,
            rank_loss_norm: crate::control::RankLossNorm::Tokens,
            comm_timeout: 60.0,
            zero: 0,
            zero2_accumulate: crate::control::Zero2Accumulate::Buffer,
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

#[cfg(test)]
mod tests;
