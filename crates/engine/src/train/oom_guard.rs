//! The memory guard: keeps a run under `train.memory_budget` by trading micro-batch for K, so
//! the effective batch B·K, the LR and the sample order never change.
//!
//! Three sources of truth, in order (docs/PLANNER.md, "A budget for runs"):
//! 1. before the run, the estimator: if the configured micro-batch's predicted peak exceeds the
//!    budget, the largest micro-batch dividing B·K that fits is chosen (or the run is refused
//!    with the estimate's verdict);
//! 2. during the run, the ledger's measured phase peaks: over the budget, B halves and K doubles
//!    at the next boundary;
//! 3. an out-of-memory error inside a window (CUDA returns one; the CPU allocator aborts instead,
//!    so there only 1 and 2 apply): the window's partial gradients are dropped, the data cursor
//!    rewound and the same samples retried at half B; `train.guard_retries` failures at B=1 end
//!    the run.
//!
//! Every change is a `Control` with origin `guard`, logged with the figure that caused it.

use super::{Interrupt, Knobs, OverBudget};
use crate::control::{Control, Origin};
use crate::memory::estimate::{estimate, largest_micro_batch, Config};
use crate::memory::verdict::{human_bytes, Verdict};
use crate::telemetry::{ControlEvent, Event, MemoryEvent, Phase};

/// The guard's state on the trainer.
#[derive(Debug, Default)]
pub(crate) struct Guard {
    /// The budget in bytes (resolved against the device's total); `None`: no budget.
    budget: Option<u64>,
    /// Out-of-memory failures tolerated at micro-batch 1 (`train.guard_retries`).
    retries: u32,
    /// Changes for the next boundary (origin `guard`).
    queued: Vec<Control>,
    /// Events describing what the guard did inside the last window (applied retries).
    announcements: Vec<Event>,
    /// The micro-batch in force before the guard first split it, while its split stands: the
    /// adaptive policy counts K against it (`adaptive::AdaptiveK::decide`).
    split_from: Option<usize>,
    /// Whether "already at micro-batch 1" was logged since the guard last had B to trade.
    said_nothing_left: bool,
}

impl Guard {
    /// A guard for `budget` bytes (`None`: none) that retries out-of-memory at B=1 `retries` times.
    pub(crate) fn new(budget: Option<u64>, retries: u32) -> Guard {
        Guard {
            budget,
            retries,
            ..Default::default()
        }
    }

    /// The budget in bytes, resolved once against the device's total; `None`: none.
    pub(crate) fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Follow a control applied at the boundary (`b_before`: the micro-batch before it): the
    /// guard's own split keeps the micro-batch it started from; a split or K chosen by anyone
    /// but the guard or the policy ends the guard's split.
    pub(crate) fn note_applied(&mut self, origin: Origin, control: &Control, b_before: usize) {
        let split_change = matches!(
            control,
            Control::SetMicroBatch { .. } | Control::SetAccumSteps { .. }
        );
        match origin {
            Origin::Guard if split_change => {
                self.split_from.get_or_insert(b_before);
            }
            Origin::Guard | Origin::Policy => {}
            _ if split_change => self.split_from = None,
            _ => {}
        }
    }

    /// The micro-batch the adaptive policy counts K against.
    pub(crate) fn reference_micro_batch(&self, current: usize) -> usize {
        self.split_from.unwrap_or(current)
    }

    /// Controls for the next boundary, taken once.
    pub(crate) fn take_queued(&mut self) -> Vec<Control> {
        std::mem::take(&mut self.queued)
    }

    /// What the guard did inside the last window, taken once.
    pub(crate) fn take_announcements(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.announcements)
    }
}

/// The largest divisor of `effective` that is at most half of `micro_batch` (at least 1): the
/// guard's next micro-batch, keeping B·K = `effective` exact.
pub(crate) fn smaller_micro_batch(micro_batch: usize, effective: usize) -> usize {
    (1..=(micro_batch / 2).max(1))
        .rev()
        .find(|b| effective.is_multiple_of(*b))
        .unwrap_or(1)
}

/// The split of `effective` the guard's micro-batch `micro_batch` allows: the largest divisor
/// of `effective` that is at most `micro_batch`, and K to match.
pub(crate) fn split(effective: usize, micro_batch: usize) -> (usize, usize) {
    let b = (1..=micro_batch.clamp(1, effective.max(1)))
        .rev()
        .find(|b| effective.is_multiple_of(*b))
        .unwrap_or(1);
    (b, effective / b)
}

fn split_controls(micro_batch: usize, effective: usize) -> [Control; 2] {
    [
        Control::SetMicroBatch { value: micro_batch },
        Control::SetAccumSteps {
            value: effective / micro_batch,
        },
    ]
}

impl Guard {
    /// Before the run: fit the configured micro-batch of `cfg` (the estimate's configuration
    /// of the model and its first knobs) to the budget by the estimate (the split is queued for
    /// the first boundary), or refuse the run.
    pub(crate) fn plan_start(&mut self, cfg: &Config, step: u64) -> Result<(), OverBudget> {
        let Some(budget) = self.budget else {
            return Ok(());
        };
        let effective = cfg.micro_batch * cfg.accum_steps;
        let peak = estimate(cfg).peak();
        if peak <= budget {
            return Ok(());
        }
        let Some(row) = largest_micro_batch(cfg, effective, budget) else {
            return Err(OverBudget {
                budget,
                verdict: Verdict::new(cfg, effective, budget).summary(),
            });
        };
        self.queued
            .extend(split_controls(row.micro_batch, effective));
        self.announcements.push(Event::warn(
            step,
            format!(
                "guard: predicted peak {} at B={} exceeds the budget {}; starting at B={} K={} \
                 (predicted {})",
                human_bytes(peak),
                cfg.micro_batch,
                human_bytes(budget),
                row.micro_batch,
                row.accum_steps,
                human_bytes(row.peak)
            ),
        ));
        Ok(())
    }

    /// After step `step`: compare the measured phase peaks with the budget; over it, queue half
    /// the micro-batch (and K to match) for the next boundary. Returns the log to send, if any.
    pub(crate) fn after_step(
        &mut self,
        knobs: &Knobs,
        step: u64,
        memory: &[MemoryEvent],
    ) -> Option<Event> {
        let budget = self.budget?;
        let worst = memory
            .iter()
            .filter(|m| m.phase != Phase::Step)
            .max_by_key(|m| m.peak)?;
        if worst.peak <= budget {
            return None;
        }
        let (b, effective) = (knobs.micro_batch, knobs.effective_batch());
        let (peak, limit) = distinct_sizes(worst.peak, budget);
        let measured = format!(
            "measured {} peak {peak} ({}) at step {} exceeds the budget {limit}",
            worst.phase.label(),
            worst.source.label(),
            worst.step,
        );
        if b == 1 {
            // Said once: every later step at B=1 would say the same.
            if std::mem::replace(&mut self.said_nothing_left, true) {
                return None;
            }
            return Some(Event::warn(
                step,
                format!("guard: {measured}; already at micro-batch 1, nothing left to trade for K"),
            ));
        }
        self.said_nothing_left = false;
        let smaller = smaller_micro_batch(b, effective);
        self.queued.extend(split_controls(smaller, effective));
        Some(Event::warn(
            step,
            format!(
                "guard: {measured}; B {b}→{smaller}, K {}→{} at the next boundary",
                knobs.accum_steps,
                effective / smaller
            ),
        ))
    }

    /// The window of step `step + 1` failed under `knobs`: on an out-of-memory error, halve B
    /// (doubling K) and retry, or at B=1 retry up to `retries` times; anything else ends the
    /// window as before.
    pub(super) fn after_failure(
        &mut self,
        knobs: &Knobs,
        step: u64,
        failure: Interrupt,
        failures_at_one: &mut u32,
    ) -> AfterFailure {
        let Interrupt::Failed(e) = failure else {
            return AfterFailure::GiveUp(failure);
        };
        if !is_out_of_memory(&e) {
            return AfterFailure::GiveUp(Interrupt::Failed(e));
        }
        let (b, effective) = (knobs.micro_batch, knobs.effective_batch());
        if b == 1 {
            *failures_at_one += 1;
            if *failures_at_one > self.retries {
                return AfterFailure::GiveUp(Interrupt::Failed(candle_core::Error::Msg(format!(
                    "out of memory at micro-batch 1 after {} retries (train.guard_retries); the \
                     run cannot go smaller: {e}",
                    self.retries
                ))));
            }
            self.announcements.push(Event::warn(
                step,
                format!(
                    "guard: out of memory at micro-batch 1 (retry {} of {}): {e}",
                    failures_at_one, self.retries
                ),
            ));
            return AfterFailure::Retry(Vec::new());
        }
        let smaller = smaller_micro_batch(b, effective);
        self.split_from.get_or_insert(b);
        let now = split_controls(smaller, effective);
        for control in &now {
            self.announcements.push(Event::Control(ControlEvent {
                step,
                origin: Origin::Guard,
                control: control.clone(),
            }));
        }
        self.announcements.push(Event::warn(
            step,
            format!(
                "guard: out of memory inside the window of step {}: {e}; partial gradients dropped, \
                 cursor rewound, the same samples retried at B={smaller} K={}",
                step + 1,
                effective / smaller
            ),
        ));
        AfterFailure::Retry(now.into())
    }
}

/// Two sizes as the log shows them, in bytes when the rounded figures would look equal
/// ("1.86 MiB exceeds 1.86 MiB").
fn distinct_sizes(a: u64, b: u64) -> (String, String) {
    let (ha, hb) = (human_bytes(a), human_bytes(b));
    if ha == hb && a != b {
        return (format!("{ha} ({a} B)"), format!("{hb} ({b} B)"));
    }
    (ha, hb)
}

/// Whether `e` is an out-of-memory error. By type where Candle keeps one: with the `cuda`
/// feature, the driver's `CUDA_ERROR_OUT_OF_MEMORY` or cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED`,
/// under any backtrace, context or path Candle wrapped around it. Errors that carry only text
/// (`Error::Msg`, `Error::Wrapped`, a backend without typed errors) are judged by
/// [`says_out_of_memory`].
pub(crate) fn is_out_of_memory(e: &candle_core::Error) -> bool {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } | E::WithPath { inner, .. } => {
            is_out_of_memory(inner)
        }
        #[cfg(feature = "cuda")]
        E::Cuda(inner) => match inner.downcast_ref::<candle_core::cuda::CudaError>() {
            Some(cuda) => cuda_out_of_memory(cuda),
            None => says_out_of_memory(&inner.to_string()),
        },
        _ => says_out_of_memory(&e.to_string()),
    }
}

#[cfg(feature = "cuda")]
fn cuda_out_of_memory(e: &candle_core::cuda::CudaError) -> bool {
    use candle_core::cuda::cudarc::{cublas, driver};
    use candle_core::cuda::CudaError as C;
    match e {
        C::Cuda(driver::DriverError(code))
        | C::Load {
            cuda: driver::DriverError(code),
            ..
        } => *code == driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        C::Cublas(cublas::result::CublasError(status)) => {
            *status == cublas::sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED
        }
        _ => false,
    }
}

/// The one place an out-of-memory error is recognised by its words, for errors that reach the
/// trainer as text only: cudarc's `CUDA_ERROR_OUT_OF_MEMORY`, or "out of memory".
pub(crate) fn says_out_of_memory(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    text.contains("out of memory") || text.contains("out_of_memory")
}

/// What to do after a window failed.
pub(super) enum AfterFailure {
    /// Apply these controls at once (the guard's smaller split), then retry the window's samples.
    Retry(Vec<Control>),
    /// End the window with this interrupt.
    GiveUp(Interrupt),
}

#[cfg(test)]
mod tests;
