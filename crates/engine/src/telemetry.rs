//! The one vocabulary every part speaks.
//!
//! `Control`s flow *into* the trainer (from keys, a preset's timeline, or the command line);
//! `Event`s flow *out* of it (and out of the device sampler). The recorder writes `Event`s as
//! JSON Lines and the replayer reads them back into the same `App::update`, so there is exactly
//! one path from "something happened" to "a pane shows it".

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedSender;

use crate::scenario::{Scenario, TrainConfig};
pub use crate::train::adaptive::AccumPolicy;
pub use crate::train::noise::NoiseEvent;

/// Major version of the event format. Readers reject a newer major version.
pub const FORMAT_VERSION: u32 = 1;

/// Activation checkpointing: which block inputs the forward keeps instead of the blocks' graphs.
/// `blocks` recomputes every block in the backward; `every-N` keeps one input per segment of N
/// blocks and recomputes the segment (fewer inputs kept, a larger graph at the backward peak).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(try_from = "String", into = "String")]
pub enum Checkpointing {
    #[default]
    None,
    Blocks,
    Every(usize),
}

impl Checkpointing {
    /// Blocks per recomputed segment; `None` when the whole graph is kept.
    pub fn segment(self) -> Option<usize> {
        match self {
            Checkpointing::None => None,
            Checkpointing::Blocks => Some(1),
            Checkpointing::Every(n) => Some(n.max(1)),
        }
    }

    pub fn name(self) -> String {
        match self {
            Checkpointing::None => "none".into(),
            Checkpointing::Blocks => "blocks".into(),
            Checkpointing::Every(n) => format!("every-{n}"),
        }
    }
}

impl TryFrom<String> for Checkpointing {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        let bad =
            || format!("checkpointing `{s}`: expected \"none\", \"blocks\" or \"every-N\" (N ≥ 1)");
        match s.as_str() {
            "none" => Ok(Checkpointing::None),
            "blocks" => Ok(Checkpointing::Blocks),
            other => match other.strip_prefix("every-").map(str::parse::<usize>) {
                Some(Ok(n)) if n >= 1 => Ok(Checkpointing::Every(n)),
                _ => Err(bad()),
            },
        }
    }
}

impl From<Checkpointing> for String {
    fn from(c: Checkpointing) -> String {
        c.name()
    }
}

/// Compute precision of the forward/backward. Master weights, the gradients that are applied and
/// the AdamW moments always stay f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

    pub fn size_in_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    pub fn candle(self) -> candle_core::DType {
        match self {
            Dtype::F32 => candle_core::DType::F32,
            Dtype::Bf16 => candle_core::DType::BF16,
            Dtype::F16 => candle_core::DType::F16,
        }
    }

    /// Only f16 has the narrow exponent range that needs dynamic loss scaling.
    pub fn needs_loss_scaling(self) -> bool {
        self == Dtype::F16
    }

    pub fn next(self) -> Dtype {
        match self {
            Dtype::F32 => Dtype::Bf16,
            Dtype::Bf16 => Dtype::F16,
            Dtype::F16 => Dtype::F32,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

/// How the learning rate answers a change of effective batch, against `train.base_batch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LrRule {
    #[default]
    None,
    Linear,
    Sqrt,
}

impl LrRule {
    pub fn next(self) -> LrRule {
        match self {
            LrRule::None => LrRule::Linear,
            LrRule::Linear => LrRule::Sqrt,
            LrRule::Sqrt => LrRule::None,
        }
    }

    /// Multiplier on the base LR for an effective batch `eff` against the base effective batch.
    pub fn factor(self, eff: usize, base: usize) -> f64 {
        let ratio = eff as f64 / base.max(1) as f64;
        match self {
            LrRule::None => 1.0,
            LrRule::Linear => ratio,
            LrRule::Sqrt => ratio.sqrt(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            LrRule::None => "none",
            LrRule::Linear => "linear",
            LrRule::Sqrt => "sqrt",
        }
    }
}

/// How per-token losses are turned into the window's loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum LossNorm {
    /// Sum of per-token losses over the window / the window's counted tokens (correct).
    #[default]
    Tokens,
    /// Each micro-batch's mean / K: over-weights tokens of short micro-batches (a known bug).
    MeanOfMeans,
}

/// When the accumulation buffer is cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ZeroGrad {
    /// Once per window, after the optimizer step (correct).
    #[default]
    PerWindow,
    /// Before every micro-batch: only the last micro-batch's gradient survives (a pitfall).
    PerMicroBatch,
}

/// A change to the run. Every variant is applied by the trainer at the next window boundary
/// (never inside a window) and reported back as an `Event::Control` when it takes effect.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Control {
    SetAccumSteps {
        value: usize,
    },
    SetMicroBatch {
        value: usize,
    },
    /// `None` turns clipping off.
    SetClip {
        value: Option<f64>,
    },
    SetLr {
        value: f64,
    },
    SetLrRule {
        value: LrRule,
    },
    SetDtype {
        value: Dtype,
    },
    SetOffload {
        value: bool,
    },
    /// Force the fp16 loss scale (e.g. 2^24 to demonstrate an overflow).
    SetLossScale {
        value: f64,
    },
    SetLossNorm {
        value: LossNorm,
    },
    SetZeroGrad {
        value: ZeroGrad,
    },
    SetCheckpointing {
        value: Checkpointing,
    },
    /// Who chooses K: fixed, or the measured gradient noise scale.
    SetAccumPolicy {
        value: AccumPolicy,
    },
    Pause,
    Resume,
    /// While paused: run exactly one more window, then pause again.
    SingleStep,
    Stop,
}

impl Control {
    /// A short human label, used by the event log and the pending-changes line.
    pub fn describe(&self) -> String {
        match self {
            Control::SetAccumSteps { value } => format!("K={value}"),
            Control::SetMicroBatch { value } => format!("micro-batch={value}"),
            Control::SetClip { value: Some(v) } => format!("clip={v}"),
            Control::SetClip { value: None } => "clip off".into(),
            Control::SetLr { value } => format!("lr={value:.2e}"),
            Control::SetLrRule { value } => format!("lr rule={}", value.name()),
            Control::SetDtype { value } => format!("dtype={}", value.name()),
            Control::SetOffload { value } => {
                format!("offload={}", if *value { "on" } else { "off" })
            }
            Control::SetLossScale { value } => format!("loss scale=2^{:.0}", value.log2()),
            Control::SetLossNorm {
                value: LossNorm::Tokens,
            } => "loss norm=tokens".into(),
            Control::SetLossNorm {
                value: LossNorm::MeanOfMeans,
            } => "loss norm=mean-of-means".into(),
            Control::SetZeroGrad {
                value: ZeroGrad::PerWindow,
            } => "zero-grad per window".into(),
            Control::SetZeroGrad {
                value: ZeroGrad::PerMicroBatch,
            } => "zero-grad per micro-batch".into(),
            Control::SetCheckpointing { value } => format!("checkpointing={}", value.name()),
            Control::SetAccumPolicy { value } => format!("K policy={}", value.name()),
            Control::Pause => "pause".into(),
            Control::Resume => "resume".into(),
            Control::SingleStep => "single step".into(),
            Control::Stop => "stop".into(),
        }
    }

    /// Flow controls act immediately; knob changes wait for the window boundary.
    pub fn is_flow(&self) -> bool {
        matches!(
            self,
            Control::Pause | Control::Resume | Control::SingleStep | Control::Stop
        )
    }
}

/// The knobs a control can turn: the trainer's live configuration, and the UI's picture of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Knobs {
    pub accum_steps: usize,
    pub micro_batch: usize,
    pub clip: Option<f64>,
    /// Base learning rate (before schedule and LR rule).
    pub lr: f64,
    pub lr_rule: LrRule,
    pub dtype: Dtype,
    pub offload: bool,
    pub loss_norm: LossNorm,
    pub zero_grad: ZeroGrad,
    #[serde(default)]
    pub checkpointing: Checkpointing,
    #[serde(default)]
    pub accum_policy: AccumPolicy,
    /// Measure the gradient noise scale in windows with K ≥ 2 (`train.noise`).
    #[serde(default = "measure_noise_by_default")]
    pub noise: bool,
}

fn measure_noise_by_default() -> bool {
    true
}

impl Knobs {
    pub fn from_scenario(s: &Scenario) -> Knobs {
        let t = &s.train;
        Knobs {
            accum_steps: t.accum_steps,
            micro_batch: t.micro_batch,
            clip: t.clip,
            lr: t.lr,
            lr_rule: t.lr_rule,
            dtype: t.dtype,
            offload: t.offload,
            loss_norm: t.loss_norm,
            zero_grad: t.zero_grad,
            checkpointing: t.checkpointing,
            accum_policy: t.accum_policy,
            noise: t.noise,
        }
    }

    /// Write the knobs back into a configuration (the header of a recording started mid-run, a
    /// checkpoint). The destructuring names every field, so a new knob cannot be forgotten here.
    pub fn write_into(&self, t: &mut TrainConfig) {
        let Knobs {
            accum_steps,
            micro_batch,
            clip,
            lr,
            lr_rule,
            dtype,
            offload,
            loss_norm,
            zero_grad,
            checkpointing,
            accum_policy,
            noise,
        } = self.clone();
        t.accum_steps = accum_steps;
        t.micro_batch = micro_batch;
        t.clip = clip;
        t.lr = lr;
        t.lr_rule = lr_rule;
        t.dtype = dtype;
        t.offload = offload;
        t.loss_norm = loss_norm;
        t.zero_grad = zero_grad;
        t.checkpointing = checkpointing;
        t.accum_policy = accum_policy;
        t.noise = noise;
    }

    pub fn effective_batch(&self) -> usize {
        self.accum_steps * self.micro_batch
    }

    /// The knob a control sets; flow controls and the loss scale (not a knob) change nothing.
    pub fn apply(&mut self, c: &Control) {
        match *c {
            Control::SetAccumSteps { value } => self.accum_steps = value,
            Control::SetMicroBatch { value } => self.micro_batch = value,
            Control::SetClip { value } => self.clip = value,
            Control::SetLr { value } => self.lr = value,
            Control::SetLrRule { value } => self.lr_rule = value,
            Control::SetDtype { value } => self.dtype = value,
            Control::SetOffload { value } => self.offload = value,
            Control::SetLossNorm { value } => self.loss_norm = value,
            Control::SetZeroGrad { value } => self.zero_grad = value,
            Control::SetCheckpointing { value } => self.checkpointing = value,
            Control::SetAccumPolicy { value } => self.accum_policy = value,
            Control::SetLossScale { .. }
            | Control::Pause
            | Control::Resume
            | Control::SingleStep
            | Control::Stop => {}
        }
    }
}

/// Where a control came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    Key,
    Scenario,
    Cli,
    /// The memory guard (`train::oom_guard`): a budget or an out-of-memory error moved B and K.
    Guard,
    /// The adaptive accumulation policy (`train.accum_policy = "noise-scale"`).
    Policy,
}

/// A control on its way to the trainer.
#[derive(Clone, Debug, PartialEq)]
pub struct ControlMsg {
    pub control: Control,
    pub origin: Origin,
}

/// Everything that leaves the trainer or the device sampler.
// The header is large but sent once; boxing it would only complicate every match.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    Header(Header),
    Step(StepEvent),
    Control(ControlEvent),
    Eval(EvalEvent),
    Memory(MemoryEvent),
    Estimate(EstimateEvent),
    Device(DeviceEvent),
    Log(LogEvent),
    End(EndEvent),
}

/// Written once, first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub version: u32,
    pub config: Scenario,
    /// "cpu" or "cuda:N".
    pub device: String,
    pub build: BuildInfo,
    /// Trainable parameter count.
    pub params: u64,
    /// Loss floor of the data source in nats/token, when it is known in closed form.
    pub entropy_floor: Option<f64>,
    /// The text's tokenizer (BPE runs only): kind, vocabulary and hash. Replay does not need it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<crate::tokenizer::TokenizerInfo>,
    /// Seconds since the Unix epoch when the run started.
    pub started_unix: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BuildInfo {
    pub version: String,
    pub features: Vec<String>,
    pub threads: usize,
}

impl BuildInfo {
    pub fn current() -> Self {
        let mut features = Vec::new();
        if cfg!(feature = "cuda") {
            features.push("cuda".to_string());
        }
        BuildInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            features,
            threads: candle_core::utils::get_num_threads(),
        }
    }
}

/// Wall time of the three phases of one optimizer step, summed over the window's micro-steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseMs {
    pub forward: f64,
    pub backward: f64,
    pub optimizer: f64,
}

/// One optimizer step (one window of K micro-batches).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
    pub lr: f64,
    pub accum_steps: usize,
    pub micro_batch: usize,
    /// Counted (non-padding) target tokens in this window.
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub step_ms: f64,
    /// True when the optimizer step was skipped (non-finite gradients under loss scaling).
    pub skipped: bool,
    /// The loss scale used for this window (1 when scaling is off).
    pub loss_scale: f64,
    /// Skipped steps so far.
    pub overflow_count: u64,
    pub dtype: Dtype,
    pub offload: bool,
    pub clip: Option<f64>,
    pub phase_ms: PhaseMs,
    /// With a pitfall switched on (mean-of-means, zero-grad per micro-batch): relative L2 error of
    /// the gradient actually applied against the correct window gradient, from the same backward passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_error: Option<f64>,
    /// The gradient noise scale, from windows with K ≥ 2 that did not overflow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise: Option<NoiseEvent>,
}

impl StepEvent {
    pub fn effective_batch(&self) -> usize {
        self.accum_steps * self.micro_batch
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ControlEvent {
    /// The step the control takes effect before: the first window that uses it is `step + 1`.
    pub step: u64,
    pub origin: Origin,
    pub control: Control,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalEvent {
    pub step: u64,
    #[serde(with = "json_float")]
    pub val_loss: f64,
}

/// Which part of an optimizer step a memory figure describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Forward,
    Backward,
    Optimizer,
    /// After the step completed (what persists between steps).
    Step,
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

/// Bytes per ledger category. See DESIGN.md "Memory truth model".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Categories {
    pub parameters: u64,
    pub compute_weights: u64,
    pub gradients: u64,
    pub gradients_transient: u64,
    pub optimizer_state: u64,
    pub offloaded: u64,
    pub activations: u64,
    pub other: u64,
}

impl Categories {
    pub const NAMES: [&'static str; 8] = [
        "parameters",
        "compute_weights",
        "gradients",
        "gradients_transient",
        "optimizer_state",
        "offloaded",
        "activations",
        "other",
    ];

    /// Values in the order of `NAMES`.
    pub fn values(&self) -> [u64; 8] {
        [
            self.parameters,
            self.compute_weights,
            self.gradients,
            self.gradients_transient,
            self.optimizer_state,
            self.offloaded,
            self.activations,
            self.other,
        ]
    }

    pub fn sum(&self) -> u64 {
        self.values().iter().sum()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryEvent {
    pub step: u64,
    pub phase: Phase,
    pub source: MemorySource,
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
    pub step: u64,
    pub phase: Phase,
    pub categories: Categories,
    /// Predicted bytes in the measured memory (offloaded bytes excluded unless unified).
    pub total: u64,
    #[serde(default)]
    pub unified: bool,
}

/// A sample from the device sampler thread.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceEvent {
    /// Milliseconds since the run started.
    pub t_ms: u64,
    pub source: MemorySource,
    pub used: Option<u64>,
    pub total: Option<u64>,
    pub process_used: Option<u64>,
    pub utilization: Option<u32>,
    pub temperature_c: Option<u32>,
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
pub enum Level {
    Info,
    Warn,
    Error,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogEvent {
    pub step: u64,
    pub level: Level,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EndEvent {
    pub step: u64,
    /// "completed", "stopped" or "error: ...".
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_event_has_the_documented_shape() {
        let e = Event::Control(ControlEvent {
            step: 5,
            origin: Origin::Key,
            control: Control::SetAccumSteps { value: 8 },
        });
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"type":"control","step":5,"origin":"key","control":{"kind":"set_accum_steps","value":8}})
        );
        let back: Event = serde_json::from_value(json).unwrap();
        assert_eq!(back, e);
    }

    #[test]
    fn lr_rules_scale_as_named() {
        assert_eq!(LrRule::None.factor(64, 16), 1.0);
        assert_eq!(LrRule::Linear.factor(64, 16), 4.0);
        assert_eq!(LrRule::Sqrt.factor(64, 16), 2.0);
    }
}

/// JSON has no NaN or infinity (serde_json writes `null`), but an overflowing fp16 step has an
/// infinite gradient norm and its loss may be NaN. Non-finite values are written as the strings
/// `"NaN"`, `"inf"`, `"-inf"`; reading also accepts `null` (as NaN) from older files.
pub mod json_float {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        if x.is_finite() {
            s.serialize_f64(*x)
        } else if x.is_nan() {
            s.serialize_str("NaN")
        } else if *x > 0.0 {
            s.serialize_str("inf")
        } else {
            s.serialize_str("-inf")
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Number(f64),
        Text(String),
        Null(()),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match Repr::deserialize(d)? {
            Repr::Number(x) => Ok(x),
            Repr::Null(()) => Ok(f64::NAN),
            Repr::Text(t) => match t.as_str() {
                "NaN" => Ok(f64::NAN),
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                other => Err(serde::de::Error::custom(format!(
                    "expected a number, \"NaN\", \"inf\" or \"-inf\", got \"{other}\""
                ))),
            },
        }
    }
}

/// Where events go. Sending never blocks; a gone receiver is noticed and ends the run. Clones
/// share the last optimizer step sent (what a crashed trainer's `end` reports).
#[derive(Clone)]
pub struct EventSink {
    tx: UnboundedSender<Event>,
    last_step: Arc<AtomicU64>,
}

impl EventSink {
    pub fn new(tx: UnboundedSender<Event>) -> Self {
        EventSink {
            tx,
            last_step: Arc::default(),
        }
    }

    /// False once nobody is listening.
    pub fn send(&self, e: Event) -> bool {
        if let Event::Step(s) = &e {
            self.last_step.store(s.step, Ordering::Relaxed);
        }
        self.tx.send(e).is_ok()
    }

    /// The last optimizer step sent.
    pub fn last_step(&self) -> u64 {
        self.last_step.load(Ordering::Relaxed)
    }
}
