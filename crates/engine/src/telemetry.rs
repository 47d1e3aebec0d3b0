//! The one vocabulary every part speaks.
//!
//! `Control`s flow *into* the trainer (from keys, a preset's timeline, or the command line);
//! `Event`s flow *out* of it (and out of the device sampler). The recorder writes `Event`s as
//! JSON Lines and the replayer reads them back into the same `App::update`, so there is exactly
//! one path from "something happened" to "a pane shows it".

use serde::{Deserialize, Serialize};

use crate::control::{Control, Dtype, Origin};
use crate::end::EndReason;
use crate::scenario::Scenario;

/// Major version of the event format. Readers reject a newer major version.
pub const FORMAT_VERSION: u32 = 1;

/// Everything that leaves the trainer or the device sampler.
// The header is large but sent once; boxing it would only complicate every match.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, strum::EnumDiscriminants)]
#[serde(tag = "type", rename_all = "snake_case")]
#[strum_discriminants(
    name(EventKind),
    derive(strum::VariantArray, strum::IntoStaticStr),
    strum(serialize_all = "snake_case")
)]
pub enum Event {
    /// The recording's first line: what ran, where, with which build.
    Header(Header),
    /// One optimizer step's figures.
    Step(StepEvent),
    /// A control applied at a boundary.
    Control(ControlEvent),
    /// A validation loss.
    Eval(EvalEvent),
    /// A measured memory ledger for one phase.
    Memory(MemoryEvent),
    /// The estimator's ledger for one phase.
    Estimate(EstimateEvent),
    /// A device sampler reading.
    Device(DeviceEvent),
    /// A line for the event log.
    Log(LogEvent),
    /// The run's last line: why it ended.
    End(EndEvent),
}

impl Event {
    /// A line for the event log at `level`, stamped with optimizer step `step`.
    pub fn log(step: u64, level: Level, message: impl Into<String>) -> Event {
        Event::Log(LogEvent {
            step,
            level,
            message: message.into(),
        })
    }

    /// [`Event::log`] at [`Level::Info`]: what happened, for the record.
    pub fn info(step: u64, message: impl Into<String>) -> Event {
        Event::log(step, Level::Info, message)
    }

    /// [`Event::log`] at [`Level::Warn`]: something the user may want to act on.
    pub fn warn(step: u64, message: impl Into<String>) -> Event {
        Event::log(step, Level::Warn, message)
    }

    /// [`Event::log`] at [`Level::Error`]: the run failed, or part of it did.
    pub fn error(step: u64, message: impl Into<String>) -> Event {
        Event::log(step, Level::Error, message)
    }
}

/// Written once, first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// The recording format's version (`FORMAT_VERSION` when written).
    pub version: u32,
    /// The scenario, with the knobs in force when the recording started.
    pub config: Scenario,
    /// "cpu" or "cuda:N".
    pub device: String,
    /// The build that ran.
    pub build: BuildInfo,
    /// Trainable parameter count.
    pub params: u64,
    /// The family of a model loaded from a directory (`config.model.path`): gpt2, llama,
    /// mistral or qwen2; absent for this engine's own GPT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family: Option<String>,
    /// Loss floor of the data source in nats/token, when it is known in closed form.
    pub entropy_floor: Option<f64>,
    /// The text's tokenizer (BPE runs only): kind, vocabulary and hash. Replay does not need it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerInfo>,
    /// Seconds since the Unix epoch when the run started.
    pub started_unix: u64,
    /// Data-parallel ranks (W); absent for a run of one process. Each window takes W·K·B
    /// samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<usize>,
    /// What carried the ranks' gradients (`mpi` or `nccl`); absent for a run of one process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collectives: Option<crate::dist::Collectives>,
    /// `train.memory_budget` resolved to bytes against this device's total, once, by the
    /// trainer; absent without a budget (and in recordings made before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_budget_bytes: Option<u64>,
    /// Whether host and device are one memory (the CPU), as the trainer's memory ledger says;
    /// absent in recordings made before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unified_memory: Option<bool>,
    /// The process writing the recording, stamped by the recorder: a follower (`replay
    /// --follow`) checks it is still writing. Absent in recordings made before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<Writer>,
}

/// The process that writes a recording, and its host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Writer {
    /// Its process id.
    pub pid: u32,
    /// Its host name (a pid is only meaningful there).
    pub host: String,
}

impl Writer {
    /// This process.
    pub fn this_process() -> Writer {
        Writer {
            pid: std::process::id(),
            host: host_name(),
        }
    }
}

/// This machine's host name ("" when it cannot be read).
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer it is given.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// What the header records about the tokenizer a run used; replay needs nothing else.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// `bpe` (trained on the data at start) or `file` (loaded from `data.tokenizer_file`).
    pub kind: String,
    /// Tokens in the vocabulary, added tokens included: the model's `vocab`.
    pub vocab: usize,
    /// FNV-1a 64 of the tokenizer's JSON, in hex.
    pub hash: String,
    /// The file it was loaded from or cached in.
    pub path: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
/// The build that made a recording.
pub struct BuildInfo {
    /// The crate version.
    pub version: String,
    /// Cargo features compiled in (`cuda`).
    pub features: Vec<String>,
    /// Threads the CPU path may use.
    pub threads: usize,
}

impl BuildInfo {
    /// This build, running its CPU path on `threads` threads.
    pub fn current(threads: usize) -> Self {
        let mut features = Vec::new();
        if cfg!(feature = "cuda") {
            features.push("cuda".to_string());
        }
        BuildInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            features,
            threads,
        }
    }
}

/// Wall time of the three phases of one optimizer step, summed over the window's micro-steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseMs {
    /// Forward time, ms.
    pub forward: f64,
    /// Backward time, ms.
    pub backward: f64,
    /// The boundary's time (unscale, norm, clip, AdamW), ms.
    pub optimizer: f64,
}

/// One optimizer step (one window of K micro-batches). `Default` is for tests that state only
/// the fields they read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepEvent {
    /// Optimizer steps completed, counting this one (1-based).
    pub step: u64,
    /// Window loss under the configured normalisation (unscaled), nats/token.
    #[serde(with = "json_float")]
    pub loss: f64,
    /// Global L2 norm of the unscaled accumulated gradient, before clipping.
    #[serde(with = "json_float")]
    pub grad_norm: f64,
    /// The same norm after clipping (equals `grad_norm` when clipping is off or not triggered).
    #[serde(with = "json_float")]
    pub grad_norm_clipped: f64,
    /// The learning rate applied (schedule × LR rule).
    pub lr: f64,
    /// K for this window.
    pub accum_steps: usize,
    /// B for this window.
    pub micro_batch: usize,
    /// Counted (non-padding) target tokens in this window.
    pub tokens: u64,
    /// Counted tokens per second of the whole step.
    pub tokens_per_s: f64,
    /// Wall time of the whole step, ms.
    pub step_ms: f64,
    /// Threads the window's fused CPU ops ran on: 1 while the pool governor keeps them on the
    /// trainer's thread alone (other processes want the cores). Absent where there is no choice:
    /// CUDA, half precision, the lean kernels, a single CPU thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_threads: Option<usize>,
    /// True when the optimizer step was skipped (non-finite gradients under loss scaling).
    pub skipped: bool,
    /// The loss scale used for this window (1 when scaling is off).
    pub loss_scale: f64,
    /// Skipped steps so far.
    pub overflow_count: u64,
    /// The compute precision.
    pub dtype: Dtype,
    /// Whether the optimizer state was in host memory.
    pub offload: bool,
    /// Model-state bytes that crossed between host and device in this step while offload is
    /// on: gradients to the host (once per window, or once per micro-batch when they accumulate
    /// there) and the updated weights back. Counted by the same rule on the CPU, where host and
    /// device are one memory and nothing moves. Absent (0) in recordings made before it existed.
    #[serde(default)]
    pub host_device_bytes: u64,
    /// The clip norm in force; `None`: no clipping.
    pub clip: Option<f64>,
    /// Time per phase.
    pub phase_ms: PhaseMs,
    /// With a pitfall switched on (mean-of-means, zero-grad per micro-batch): relative L2 error of
    /// the gradient actually applied against the correct window gradient, from the same backward passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_error: Option<f64>,
    /// The gradient noise scale, from windows with K ≥ 2 that did not overflow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise: Option<NoiseEvent>,
    /// Data parallel: the ranks, what each sent and received and its time in collectives, and
    /// each rank's peak memory. Absent in a run of one process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<crate::dist::CommEvent>,
}

impl StepEvent {
    /// B·K, the samples of the window.
    pub fn effective_batch(&self) -> usize {
        self.accum_steps * self.micro_batch
    }

    /// W·K·B, the samples of the window over every rank: what one update averages over.
    pub fn global_batch(&self) -> usize {
        self.effective_batch() * self.comm.as_ref().map_or(1, |c| c.ranks.max(1))
    }
}

/// What a `step` event says about the noise scale.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NoiseEvent {
    /// Smoothed |G|² (batch sizes in tokens).
    pub g2: f64,
    /// Smoothed tr(Σ), per counted token.
    pub trace: f64,
    /// Smoothed tr(Σ) / smoothed |G|², in tokens; absent while the smoothed |G|² is not positive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub b_simple_tokens: Option<f64>,
    /// The same ratio with batch sizes in sequences (samples).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub b_simple_seqs: Option<f64>,
    /// This window's own estimates (noisy, may be negative).
    pub raw_g2: f64,
    /// This window's own tr(Σ) estimate (noisy, may be negative).
    pub raw_trace: f64,
    /// Windows that fed the averages so far.
    pub windows: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
/// A control as applied, with who asked for it.
pub struct ControlEvent {
    /// The step the control takes effect before: the first window that uses it is `step + 1`.
    pub step: u64,
    /// Who asked: a key, the preset's timeline, `--control`, the guard or the policy.
    pub origin: Origin,
    /// The change.
    pub control: Control,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
/// The validation loss after a step (`train.eval_every`).
pub struct EvalEvent {
    /// The optimizer step it was measured after.
    pub step: u64,
    #[serde(with = "json_float")]
    /// Mean loss per counted token over the fixed validation samples.
    pub val_loss: f64,
}

/// Which part of an optimizer step a memory figure describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// A micro-batch's forward, up to the loss.
    Forward,
    /// A micro-batch's backward.
    Backward,
    /// The boundary: unscale, norm, clip and the AdamW step.
    Optimizer,
    /// After the step completed (what persists between steps).
    Step,
}

impl Phase {
    /// The phase in words, for messages and the screen.
    pub fn label(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Step => "end of step",
        }
    }
}

/// Where a memory figure was measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum MemorySource {
    /// The process's counting global allocator (CPU).
    #[default]
    Allocator,
    /// NVIDIA's management library (device memory).
    Nvml,
    /// The CUDA default memory pool's counters.
    CudaPool,
}

impl MemorySource {
    /// The source in words, for messages and the screen.
    pub fn label(self) -> &'static str {
        match self {
            MemorySource::Allocator => "allocator",
            MemorySource::Nvml => "NVML",
            MemorySource::CudaPool => "CUDA pool",
        }
    }
}

/// Bytes per ledger category; docs/MEMORY.md says what each holds and how it is measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Categories {
    /// The f32 master weights.
    pub parameters: u64,
    /// Half-precision copies of the weights a forward computes with.
    pub compute_weights: u64,
    /// The persistent accumulation buffer.
    pub gradients: u64,
    /// Gradients backward returns, before they are folded and freed.
    pub gradients_transient: u64,
    /// AdamW's moments on the device.
    pub optimizer_state: u64,
    /// What offload holds in host memory (moments, master copies).
    pub offloaded: u64,
    /// The graph kept for backward.
    pub activations: u64,
    /// Weights that are not trained (LoRA's base), in the run's dtype: no gradient, no state.
    #[serde(default)]
    pub frozen: u64,
    /// Everything else measured (gemm's per-thread packing workspaces among it).
    pub other: u64,
}

impl Categories {
    /// These categories with an accumulation buffer of `bytes` booked where it lives:
    /// `offloaded` in host memory (`on_host`), else `gradients`. The ledger and the estimator
    /// both book it by this one rule.
    pub fn with_gradient_buffer(self, bytes: u64, on_host: bool) -> Categories {
        if on_host {
            Categories {
                offloaded: self.offloaded + bytes,
                ..self
            }
        } else {
            Categories {
                gradients: self.gradients + bytes,
                ..self
            }
        }
    }

    /// The categories' names as recordings and CSV spell them, in ledger order.
    pub const NAMES: [&'static str; 9] = [
        "parameters",
        "compute_weights",
        "gradients",
        "gradients_transient",
        "optimizer_state",
        "offloaded",
        "activations",
        "frozen",
        "other",
    ];

    /// Values in the order of `NAMES`.
    pub fn values(&self) -> [u64; 9] {
        [
            self.parameters,
            self.compute_weights,
            self.gradients,
            self.gradients_transient,
            self.optimizer_state,
            self.offloaded,
            self.activations,
            self.frozen,
            self.other,
        ]
    }

    /// Bytes over every category.
    pub fn sum(&self) -> u64 {
        self.values().iter().sum()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
/// A measured memory ledger: bytes per category at one phase of one step.
pub struct MemoryEvent {
    /// The optimizer step measured.
    pub step: u64,
    /// The phase measured.
    pub phase: Phase,
    /// Where the total was measured.
    pub source: MemorySource,
    /// Bytes per category.
    pub categories: Categories,
    /// Measured total at the moment the categories were taken.
    pub total: u64,
    /// Peak of the measured total during the phase.
    pub peak: u64,
    /// True when "device" and "host" are the same memory (CPU runs): offload moves bytes
    /// between ledger categories, not between physical memories.
    #[serde(default)]
    pub unified: bool,
}

/// The analytic estimator's prediction for one phase, valid from `step` on (until the next
/// estimate for that phase). Its own event type, so no consumer can take it for a measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EstimateEvent {
    /// The first step the prediction is for.
    pub step: u64,
    /// The phase predicted.
    pub phase: Phase,
    /// Predicted bytes per category.
    pub categories: Categories,
    /// Predicted bytes in the measured memory (offloaded bytes excluded unless unified).
    pub total: u64,
    #[serde(default)]
    /// True when device and host are one memory (CPU runs).
    pub unified: bool,
}

/// A sample from the device sampler thread.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceEvent {
    /// Milliseconds since the run started.
    pub t_ms: u64,
    /// Which source read it.
    pub source: MemorySource,
    /// Bytes in use on the device, by every process.
    pub used: Option<u64>,
    /// The device's total bytes.
    pub total: Option<u64>,
    /// Bytes this process uses on the device.
    pub process_used: Option<u64>,
    /// GPU utilisation, percent.
    pub utilization: Option<u32>,
    /// GPU temperature, °C.
    pub temperature_c: Option<u32>,
    /// Power draw, W.
    pub power_w: Option<f64>,
    /// Bytes a memory pool holds from the device, used or not (CUDA memory pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved: Option<u64>,
    /// Highest `used` seen: the allocator's lifetime peak, the pool's high-water mark.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak: Option<u64>,
    /// Set when the source cannot give data, e.g. "NVML unavailable: libnvidia-ml.so not found".
    pub unavailable: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
/// How much a log line matters.
pub enum Level {
    /// For the record.
    Info,
    /// Something the user may want to act on.
    Warn,
    /// A failure.
    Error,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
/// A line for the event log (the UI's log pane, headless stderr, the recording).
pub struct LogEvent {
    /// The optimizer step it was written after.
    pub step: u64,
    /// How much it matters.
    pub level: Level,
    /// The text.
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
/// The run's end: the last line of every recording.
pub struct EndEvent {
    /// Optimizer steps completed.
    pub step: u64,
    /// Written as the text gaccwb has always written ("completed", "diverged: …").
    pub reason: EndReason,
}

mod json_float;
mod sink;

pub use sink::EventSink;

#[cfg(test)]
mod tests;
