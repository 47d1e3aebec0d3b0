//! The knobs and the controls that turn them: the vocabulary keys, presets, the command line,
//! the trainer, the recorder and replay share. It depends on nothing else in the engine, so
//! every layer above can name it.

use serde::{Deserialize, Serialize};

mod knob;

pub use knob::{Grid, Knob, KnobAction, OutOfBounds, Values, KNOBS};

/// Activation checkpointing: which block inputs the forward keeps instead of the blocks' graphs.
/// `blocks` recomputes every block in the backward; `every-N` keeps one input per segment of N
/// blocks and recomputes the segment (fewer inputs kept, a larger graph at the backward peak).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(try_from = "String", into = "String")]
pub enum Checkpointing {
    /// Keep every block's graph for the backward: nothing is recomputed.
    #[default]
    None,
    /// Keep each block's input and recompute the block in the backward.
    Blocks,
    /// Keep one input per segment of N blocks and recompute the segment (`every-N`).
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

    /// The values presets write, `every-N` standing for its pattern.
    pub const NAMES: &'static [&'static str] = &["none", "blocks", "every-N"];

    /// Its value as presets and `--set train.checkpointing` write it (`every-2`).
    pub fn name(self) -> String {
        match self {
            Checkpointing::None => "none".into(),
            Checkpointing::Blocks => "blocks".into(),
            Checkpointing::Every(n) => format!("every-{n}"),
        }
    }
}

/// A checkpointing value that is none of `none`, `blocks`, `every-N` (N ≥ 1).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("checkpointing `{0}`: expected \"none\", \"blocks\" or \"every-N\" (N ≥ 1)")]
pub struct UnknownCheckpointing(pub String);

impl TryFrom<String> for Checkpointing {
    type Error = UnknownCheckpointing;
    fn try_from(s: String) -> Result<Self, UnknownCheckpointing> {
        let bad = || UnknownCheckpointing(s.clone());
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
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    Default,
    strum::VariantArray,
    strum::VariantNames,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Dtype {
    /// 32-bit floats throughout.
    #[default]
    F32,
    /// bfloat16: f32's exponent range (no loss scaling needed), fewer mantissa bits.
    Bf16,
    /// IEEE half precision: a narrow exponent range, so the loss is scaled dynamically.
    F16,
}

impl Dtype {
    /// Bytes one tensor element takes in this precision.
    pub fn size_in_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// The Candle dtype the forward and backward compute in.
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

    /// The precision the `p` key moves to: f32 → bf16 → f16 → f32.
    pub fn next(self) -> Dtype {
        match self {
            Dtype::F32 => Dtype::Bf16,
            Dtype::Bf16 => Dtype::F16,
            Dtype::F16 => Dtype::F32,
        }
    }

    /// Its name in presets, recordings and on screen (`bf16`).
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// How the learning rate answers a change of effective batch, against `train.base_batch`.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    Default,
    strum::IntoStaticStr,
    strum::VariantNames,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum LrRule {
    /// The LR as given, whatever the effective batch.
    #[default]
    None,
    /// The LR times effective batch ÷ base batch.
    Linear,
    /// The LR times the square root of effective batch ÷ base batch.
    Sqrt,
}

impl LrRule {
    /// The rule the `l` key moves to: none → linear → sqrt → none.
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

    /// Its name in presets and on screen (`sqrt`).
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// When the ranks sum their gradients.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default, strum::VariantNames,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum SyncEvery {
    /// Once, at the end of the window (PyTorch's `no_sync` for the first K − 1 micro-batches).
    #[default]
    Window,
    /// After every micro-batch's backward: DDP without `no_sync`, K× the bytes.
    MicroBatch,
}

impl SyncEvery {
    /// What one gradient all-reduce covers: "window" or "micro-batch".
    pub fn noun(self) -> &'static str {
        match self {
            SyncEvery::Window => "window",
            SyncEvery::MicroBatch => "micro-batch",
        }
    }
}

/// How the ranks' losses are normalised.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default, strum::VariantNames,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum RankLossNorm {
    /// Per counted token of the whole window, all ranks together (correct).
    #[default]
    Tokens,
    /// Each rank's own per-token mean, averaged over the ranks: over-weights the tokens of a
    /// rank whose slice holds fewer (a pitfall, measured as `grad_error`).
    MeanOfMeans,
}

/// Where ZeRO-2 sums the window's gradient.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default, strum::VariantNames,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum Zero2Accumulate {
    /// A whole local buffer until the window ends, then one reduce-scatter: memory for
    /// bandwidth.
    #[default]
    Buffer,
    /// A reduce-scatter after every micro-batch, accumulating only this rank's piece: 1/W of
    /// the buffer, K× the gradient traffic.
    ReduceScatter,
}

/// How per-token losses are turned into the window's loss.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default, strum::VariantNames,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum LossNorm {
    /// Sum of per-token losses over the window / the window's counted tokens (correct).
    #[default]
    Tokens,
    /// Each micro-batch's mean / K: over-weights tokens of short micro-batches (a known bug).
    MeanOfMeans,
}

/// When the accumulation buffer is cleared.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default, strum::VariantNames,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum ZeroGrad {
    /// Once per window, after the optimizer step (correct).
    #[default]
    PerWindow,
    /// Before every micro-batch: only the last micro-batch's gradient survives (a pitfall).
    PerMicroBatch,
}

/// Where a window's gradients accumulate while offload is on (`train.offload_grads`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default, strum::IntoStaticStr,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum OffloadGrads {
    /// In one f32 buffer on the device, copied to the host once per window.
    #[default]
    Device,
    /// In host memory: each micro-batch's gradients cross as soon as its backward is done, and
    /// the device holds no buffer (DeepSpeed's ZeRO-Offload).
    Host,
}

impl OffloadGrads {
    /// Its value in `train.offload_grads` (`device` or `host`).
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// A change to the run, reported back as an `Event::Control` when it takes effect. Knob changes
/// wait for the next window boundary. Two things act sooner: `Stop`, seen between micro-batches,
/// ends the run without finishing the window, and the out-of-memory guard's retry halves the
/// micro-batch of the window it is retrying.
#[derive(
    Clone, Debug, PartialEq, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames,
)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
#[strum(serialize_all = "snake_case")]
pub enum Control {
    /// Set accumulation steps K: micro-batches summed per optimizer step.
    SetAccumSteps {
        /// K, at least 1.
        value: usize,
    },
    /// Set micro-batch B: samples per forward/backward pass.
    SetMicroBatch {
        /// B, at least 1.
        value: usize,
    },
    /// `None` turns clipping off.
    SetClip {
        /// The global-norm threshold.
        value: Option<f64>,
    },
    /// Set the base learning rate (before the schedule and the LR rule).
    SetLr {
        /// The base LR, finite and ≥ 0.
        value: f64,
    },
    /// Set how the LR follows the effective batch.
    SetLrRule {
        /// The rule from the next window on.
        value: LrRule,
    },
    /// Set the compute precision of the forward and backward.
    SetDtype {
        /// The precision from the next window on.
        value: Dtype,
    },
    /// Turn optimizer offload on or off: AdamW's state and update in host memory.
    SetOffload {
        /// `true`: offload on.
        value: bool,
    },
    /// Force the fp16 loss scale (e.g. 2^24 to demonstrate an overflow).
    SetLossScale {
        /// The fp16 loss scale, from the next window on.
        value: f64,
    },
    /// Set how per-token losses become the window's loss.
    SetLossNorm {
        /// The normalisation from the next window on.
        value: LossNorm,
    },
    /// Set when the accumulation buffer is cleared.
    SetZeroGrad {
        /// The clearing rule from the next window on.
        value: ZeroGrad,
    },
    /// Set which block inputs the forward keeps for the backward.
    SetCheckpointing {
        /// The checkpointing from the next window on.
        value: Checkpointing,
    },
    /// Who chooses K: fixed, or the measured gradient noise scale.
    SetAccumPolicy {
        /// The policy from the next window on.
        value: AccumPolicy,
    },
    /// Data parallel: sum gradients once per window or after every micro-batch.
    SetSync {
        /// When gradients are summed from the next window on.
        value: SyncEvery,
    },
    /// Data parallel: the ZeRO stage (0, 1 or 2); the moments move with it.
    SetZero {
        /// The stage from the next window on.
        value: u8,
    },
    /// ZeRO-2: a whole buffer and one reduce-scatter, or one per micro-batch.
    SetZero2Accumulate {
        /// Where ZeRO-2 sums from the next window on.
        value: Zero2Accumulate,
    },
    /// Hold the run at the next window boundary until `Resume`.
    Pause,
    /// Let a paused run go on.
    Resume,
    /// While paused: run exactly one more window, then pause again.
    SingleStep,
    /// End the run between micro-batches, without finishing the window.
    Stop,
}

impl Control {
    /// A short human label, used by the event log, `controls.csv` and the pending-changes
    /// line: `K=8`, `micro-batch=4`, `clip off`.
    pub fn describe(&self) -> String {
        match (self, self.knob()) {
            (_, Some(knob)) => match self.value() {
                None => format!("{} off", knob.name),
                value => format!("{}={}", knob.name, knob.values.show(value.as_ref())),
            },
            (Control::SetLossScale { value }, None) => format!("loss scale=2^{:.0}", value.log2()),
            (Control::SingleStep, None) => "single step".into(),
            (flow, None) => flow.kind().into(),
        }
    }

    /// What the control changed, from the knobs before it, in the user's words: "B 32→4",
    /// "dtype f32→bf16". A control that sets no knob (the loss scale, flow) says `describe()`.
    pub fn describe_change(&self, before: &Knobs) -> String {
        let Some(knob) = self.knob() else {
            return self.describe();
        };
        let mut after = before.clone();
        after.apply(self);
        format!("{} {}→{}", knob.label, knob.show(before), knob.show(&after))
    }

    /// Flow controls act immediately; knob changes wait for the window boundary.
    pub fn is_flow(&self) -> bool {
        matches!(
            self,
            Control::Pause | Control::Resume | Control::SingleStep | Control::Stop
        )
    }

    /// It changes how ranks share their work, which a run of one process does not do: the
    /// knob is set, and nothing else changes.
    pub fn needs_ranks(&self) -> bool {
        matches!(
            self,
            Control::SetSync { .. } | Control::SetZero { .. } | Control::SetZero2Accumulate { .. }
        )
    }
}

/// The knobs a control can turn: the trainer's live configuration, and the UI's picture of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Knobs {
    /// Accumulation steps K: micro-batches per optimizer step.
    pub accum_steps: usize,
    /// Samples per forward/backward pass (B).
    pub micro_batch: usize,
    /// Global-norm clip threshold; `None`: no clipping.
    pub clip: Option<f64>,
    /// Base learning rate (before schedule and LR rule).
    pub lr: f64,
    /// How the LR follows the effective batch.
    pub lr_rule: LrRule,
    /// Compute precision of the forward and backward.
    pub dtype: Dtype,
    /// Optimizer offload: AdamW's state and update in host memory.
    pub offload: bool,
    /// Where gradients accumulate while offload is on (`train.offload_grads`; set at the start).
    #[serde(default)]
    pub offload_grads: OffloadGrads,
    /// How per-token losses become the window's loss.
    pub loss_norm: LossNorm,
    /// When the accumulation buffer is cleared.
    pub zero_grad: ZeroGrad,
    /// Which block inputs the forward keeps; the rest is recomputed in the backward.
    #[serde(default)]
    pub checkpointing: Checkpointing,
    /// Who chooses K: fixed, or the measured gradient noise scale.
    #[serde(default)]
    pub accum_policy: AccumPolicy,
    /// Measure the gradient noise scale in windows with K ≥ 2 (`train.noise`).
    #[serde(default = "measure_noise_by_default")]
    pub noise: bool,
    /// Data parallel: when the ranks sum their gradients (`train.sync`).
    #[serde(default)]
    pub sync: SyncEvery,
    /// Data parallel: the ZeRO stage, 0 to 2 (`train.zero`).
    #[serde(default)]
    pub zero: u8,
    /// ZeRO-2: where the window's gradient is summed (`train.zero2_accumulate`).
    #[serde(default)]
    pub zero2_accumulate: Zero2Accumulate,
}

fn measure_noise_by_default() -> bool {
    true
}

impl Knobs {
    /// Samples per optimizer step: B × K.
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
            Control::SetSync { value } => self.sync = value,
            Control::SetZero { value } => self.zero = value,
            Control::SetZero2Accumulate { value } => self.zero2_accumulate = value,
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
    /// The user, live: a key in the workbench, a control line on stdin, an interrupt.
    Key,
    /// The preset's timeline.
    Scenario,
    /// A `--control` argument.
    Cli,
    /// The memory guard (`train::oom_guard`): a budget or an out-of-memory error moved B and K.
    Guard,
    /// The adaptive accumulation policy (`train.accum_policy = "noise-scale"`).
    Policy,
}

/// A control on its way to the trainer.
#[derive(Clone, Debug, PartialEq)]
pub struct ControlMsg {
    /// The change asked for.
    pub control: Control,
    /// Who asked, as the event log and `controls.csv` report it.
    pub origin: Origin,
}

/// Who chooses K.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    Default,
    strum::IntoStaticStr,
    strum::VariantNames,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum AccumPolicy {
    /// K changes only when asked (keys, timeline, command line).
    #[default]
    Fixed,
    /// K follows the measured gradient noise scale.
    NoiseScale,
}

impl AccumPolicy {
    /// The policy the `a` key switches to.
    pub fn toggled(self) -> AccumPolicy {
        match self {
            AccumPolicy::Fixed => AccumPolicy::NoiseScale,
            AccumPolicy::NoiseScale => AccumPolicy::Fixed,
        }
    }

    /// Its name in presets and on screen (`noise-scale`).
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// Knobs for the tests of this layer: the defaults with K 2, B 8, clip 1 (what they assert on,
/// stated here rather than read from the defaults).
#[cfg(test)]
pub(crate) fn test_knobs() -> Knobs {
    Knobs {
        accum_steps: 2,
        micro_batch: 8,
        clip: Some(1.0),
        ..Knobs::default()
    }
}

#[cfg(test)]
mod tests;
