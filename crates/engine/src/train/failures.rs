//! What keeps a run from ending silently: a panic in the trainer thread becomes an `end` event
//! with the reason, a diverged run ends as such, and knob changes or a model that would not fit
//! the machine's memory are refused before anything is allocated.

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::Device;
use tokio::sync::mpsc::UnboundedReceiver;

use super::{EventSink, Trainer};
use crate::control::{Control, ControlMsg};
use crate::end::EndReason;
use crate::hf::Arch;
use crate::limits::BoundError;
use crate::memory::estimate::{changes_memory, Config};
use crate::memory::fit;
use crate::scenario::Scenario;
use crate::telemetry::{EndEvent, Event, StepEvent};

/// `super::run`, turning a panic into an error log and an `end` event: without it the thread
/// dies silently while the sampler keeps the event channel open, and the UI waits forever.
pub(crate) fn run_catching_panics(
    trainer: Trainer,
    controls: UnboundedReceiver<ControlMsg>,
    sink: EventSink,
) {
    let watcher = sink.clone();
    let outcome = catch_unwind(AssertUnwindSafe(move || {
        super::run(trainer, controls, sink)
    }));
    if let Err(payload) = outcome {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown cause".into());
        let reason = EndReason::Crashed(what);
        let step = watcher.last_step();
        send_error(&watcher, step, &reason.to_string());
        watcher.send(Event::End(EndEvent { step, reason }));
    }
}

/// An error the user must see: the UI's event log, the recording, headless stderr.
pub(crate) fn send_error(sink: &EventSink, step: u64, message: &str) {
    sink.send(Event::error(step, message));
}

/// Counts consecutive windows whose loss or gradient norm was not finite, and remembers the
/// last loss: a run too short to reach the limit still must not end "completed" on NaN.
pub(crate) struct Divergence {
    limit: u64,
    run: u64,
    last_loss: Option<(u64, f64)>,
}

impl Divergence {
    /// `limit` 0: never end the run early.
    pub(crate) fn new(limit: u64) -> Divergence {
        Divergence {
            limit,
            run: 0,
            last_loss: None,
        }
    }

    /// The end reason once `limit` windows in a row were non-finite.
    pub(crate) fn observe(&mut self, step: &StepEvent) -> Option<EndReason> {
        self.last_loss = Some((step.step, step.loss));
        let finite = step.loss.is_finite() && step.grad_norm.is_finite() && !step.skipped;
        self.observe_window(step.step, finite)
    }

    /// `observe` for the window that made optimizer step `step`.
    pub(crate) fn observe_window(&mut self, step: u64, finite: bool) -> Option<EndReason> {
        self.run = if finite { 0 } else { self.run + 1 };
        (self.limit > 0 && self.run >= self.limit).then(|| {
            EndReason::Diverged(format!(
                "the loss or gradients were not finite for {} consecutive windows \
                 (steps {}–{}; train.max_nonfinite_windows = {})",
                self.run,
                step + 1 - self.run,
                step,
                self.limit
            ))
        })
    }

    /// For a run ending otherwise fine: diverged when its last loss was not finite, whatever
    /// the limit (an f16 overflow skip keeps a finite loss and does not count here).
    pub(crate) fn at_end(&self) -> Option<EndReason> {
        let (step, loss) = self.last_loss?;
        (!loss.is_finite()).then(|| {
            EndReason::Diverged(format!(
                "the loss at the last step ({step}) is {loss}: training broke down before \
                 train.max_nonfinite_windows windows in a row (lower train.lr, or keep \
                 train.clip on)"
            ))
        })
    }
}

/// The memory the check may use on `device`: what the kernel says is available on the CPU;
/// unknown elsewhere.
fn budget(device: &Device) -> Option<u64> {
    match device {
        Device::Cpu => fit::available_bytes(),
        _ => None,
    }
}

/// A model or a knob change refused before anything is allocated for it.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The model and its first window need more memory than the machine has.
    #[error("the model does not fit: {0}")]
    Model(fit::FitError),
    /// The change makes a window whose sizes overflow.
    #[error(transparent)]
    Window(#[from] BoundError),
    /// The change's memory growth is more than the machine has left.
    #[error("it does not fit: {0}")]
    Growth(fit::FitError),
}

/// Refuse a model of architecture `arch` (the scenario's: a model directory's, or this
/// engine's GPT) this machine cannot hold, before any weight is allocated.
pub(crate) fn check_model_fits(
    scenario: &Scenario,
    arch: &Arch,
    device: &Device,
) -> Result<(), Refused> {
    let knobs = crate::control::Knobs::from_scenario(scenario);
    let cfg =
        Config::for_arch(arch, &scenario.model, &knobs, device.is_cpu()).with_lora(&scenario.train);
    fit::check_fits(&cfg, budget(device)).map_err(Refused::Model)
}

/// Refuse, at the boundary, a knob change whose window overflows or that would not fit.
pub(crate) fn check_knob_change(trainer: &Trainer, c: &Control) -> Result<(), Refused> {
    let mut next = trainer.knobs().clone();
    next.apply(c);
    let model = &trainer.scenario().model;
    crate::limits::check_window(next.micro_batch, next.accum_steps, model.seq_len)?;
    if !changes_memory(c) {
        return Ok(());
    }
    let current = trainer.estimate_config(trainer.knobs());
    let wanted = trainer.estimate_config(&next);
    fit::check_growth(Some(&current), &wanted, budget(trainer.device())).map_err(Refused::Growth)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divergence_needs_consecutive_non_finite_windows() {
        let mut d = Divergence::new(3);
        assert!(d.observe_window(1, false).is_none());
        assert!(d.observe_window(2, false).is_none());
        assert!(
            d.observe_window(3, true).is_none(),
            "a finite window resets the count"
        );
        assert!(d.observe_window(4, false).is_none());
        assert!(d.observe_window(5, false).is_none());
        let reason = d
            .observe_window(6, false)
            .expect("third in a row ends the run");
        assert!(
            reason.is_failure() && reason.to_string().contains("steps 4–6"),
            "{reason}"
        );
        let mut off = Divergence::new(0);
        assert!((1..100).all(|n| off.observe_window(n, false).is_none()));
    }
}
