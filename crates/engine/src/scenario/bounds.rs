//! A scenario within the bounds of `crate::limits`: every size, and every window its timeline
//! makes. The error names the key, so a preset error can point at its line. The knobs' own
//! bounds are in the knob table (`control::KNOBS`).

use super::{ControlError, Invalid, Scenario, TimelineEntry};
use crate::control::{AccumPolicy, Control};
use crate::limits::*;

/// A scenario's sizes: every integer TOML can hold, the model and the window within bounds.
pub(super) fn check_scenario(s: &Scenario) -> Result<(), Invalid> {
    let (m, t, d) = (&s.model, &s.train, &s.data);
    let bounded: [(&'static str, u64, u64); 14] = [
        ("model.d_model", m.d_model as u64, MAX_D_MODEL as u64),
        ("model.layers", m.layers as u64, MAX_LAYERS as u64),
        ("model.heads", m.heads as u64, MAX_D_MODEL as u64),
        ("model.seq_len", m.seq_len as u64, MAX_SEQ_LEN as u64),
        ("train.steps", t.steps, MAX_INTEGER),
        ("train.seed", t.seed, MAX_INTEGER),
        ("train.base_batch", t.base_batch as u64, MAX_INTEGER),
        ("train.warmup", t.warmup, MAX_INTEGER),
        ("train.decay_steps", t.decay_steps, MAX_INTEGER),
        (
            "train.scale_growth_interval",
            t.scale_growth_interval,
            MAX_INTEGER,
        ),
        ("train.eval_every", t.eval_every, MAX_INTEGER),
        (
            "train.eval_batches",
            t.eval_batches as u64,
            MAX_MICRO_BATCH as u64,
        ),
        (
            "train.max_nonfinite_windows",
            t.max_nonfinite_windows,
            MAX_INTEGER,
        ),
        ("data.seed", d.seed, MAX_INTEGER),
    ];
    for (key, value, max) in bounded {
        at_most(key, value, max).map_err(|e| Invalid::new(key, e.to_string()))?;
    }
    for (key, value) in [
        ("data.min_doc_len", d.min_doc_len),
        ("data.max_doc_len", d.max_doc_len),
    ] {
        at_most(key, value as u64, MAX_INTEGER).map_err(|e| Invalid::new(key, e.to_string()))?;
    }
    check_window(t.micro_batch, t.accum_steps, m.seq_len)
        .map_err(|e| Invalid::new("train.accum_steps", e.to_string()))?;
    check_timeline_windows(s)
}

/// The windows the timeline's B and K changes make, in step order, each within bounds.
fn check_timeline_windows(s: &Scenario) -> Result<(), Invalid> {
    let (b, k) = (s.train.micro_batch, s.train.accum_steps);
    check_schedule(b, k, s.train.noise, s.model.seq_len, &s.timeline).map_err(|e| {
        let step = s.timeline[e.index].step;
        Invalid::new(
            "timeline",
            format!("timeline[{}] (step {step}): {}", e.index, e.error),
        )
    })
}

/// A control that needs a knob the run has off: the noise-scale K policy reads the noise
/// scale, which `train.noise = false` does not measure (the preset's own policy is refused the
/// same way).
pub fn check_needs(control: &Control, noise: bool) -> Result<(), ControlError> {
    match control {
        Control::SetAccumPolicy {
            value: AccumPolicy::NoiseScale,
        } if !noise => Err(ControlError::NeedsNoise),
        _ => Ok(()),
    }
}

/// The entry of a schedule (by index) that cannot be applied, and why.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("entry {index}: {error}")]
pub struct ScheduleError {
    /// Index of the failing entry in the slice given.
    pub index: usize,
    /// Why it cannot be applied.
    pub error: ControlError,
}

/// Walk `entries` in step order from micro-batch `b` and accumulation steps `k`: every control
/// must pass `check_needs`, and every window their changes make `check_window` (the values
/// themselves are checked where they are read: `validate_control`). The error carries the
/// entry's index.
pub fn check_schedule(
    mut b: usize,
    mut k: usize,
    noise: bool,
    seq_len: usize,
    entries: &[TimelineEntry],
) -> Result<(), ScheduleError> {
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by_key(|&i| entries[i].step);
    for index in order {
        let at = |error| ScheduleError { index, error };
        let control = &entries[index].control;
        check_needs(control, noise).map_err(at)?;
        match *control {
            Control::SetMicroBatch { value } => b = value,
            Control::SetAccumSteps { value } => k = value,
            _ => continue,
        }
        check_window(b, k, seq_len).map_err(|m| at(ControlError::Window(m.to_string())))?;
    }
    Ok(())
}
