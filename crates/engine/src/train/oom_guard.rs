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
use crate::memory::estimate::{estimate, largest_micro_batch, Config};
use crate::memory::verdict::{human_bytes, Verdict};
use crate::telemetry::{Control, ControlEvent, Event, MemoryEvent, Origin, Phase};

/// The guard's state on the trainer.
#[derive(Debug, Default)]
pub struct Guard {
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
    pub fn new(budget: Option<u64>, retries: u32) -> Guard {
        Guard {
            budget,
            retries,
            ..Default::default()
        }
    }

    /// The budget in bytes, resolved once against the device's total; `None`: none.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Follow a control applied at the boundary (`b_before`: the micro-batch before it): the
    /// guard's own split keeps the micro-batch it started from; a split or K chosen by anyone
    /// but the guard or the policy ends the guard's split.
    pub fn note_applied(&mut self, origin: Origin, control: &Control, b_before: usize) {
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
    pub fn reference_micro_batch(&self, current: usize) -> usize {
        self.split_from.unwrap_or(current)
    }

    /// Controls for the next boundary, taken once.
    pub fn take_queued(&mut self) -> Vec<Control> {
        std::mem::take(&mut self.queued)
    }

    /// What the guard did inside the last window, taken once.
    pub fn take_announcements(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.announcements)
    }
}

/// The largest divisor of `effective` that is at most half of `micro_batch` (at least 1): the
/// guard's next micro-batch, keeping B·K = `effective` exact.
pub fn smaller_micro_batch(micro_batch: usize, effective: usize) -> usize {
    (1..=(micro_batch / 2).max(1))
        .rev()
        .find(|b| effective.is_multiple_of(*b))
        .unwrap_or(1)
}

/// The split of `effective` the guard's micro-batch `micro_batch` allows: the largest divisor
/// of `effective` that is at most `micro_batch`, and K to match.
pub fn split(effective: usize, micro_batch: usize) -> (usize, usize) {
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
    pub fn plan_start(&mut self, cfg: &Config, step: u64) -> Result<(), OverBudget> {
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
    pub fn after_step(
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
pub fn is_out_of_memory(e: &candle_core::Error) -> bool {
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
pub fn says_out_of_memory(text: &str) -> bool {
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
mod tests {
    use super::*;
    use crate::budget::MemoryBudget;
    use crate::scenario::{DataConfig, ModelConfig, Scenario, TrainConfig};
    use crate::train::Trainer;
    use candle_core::Device;

    fn scenario(micro_batch: usize, accum_steps: usize) -> Scenario {
        Scenario {
            model: ModelConfig {
                vocab: 32,
                d_model: 32,
                layers: 2,
                heads: 2,
                seq_len: 16,
                path: None,
                adapter: None,
            },
            data: DataConfig {
                alphabet: 8,
                ..Default::default()
            },
            train: TrainConfig {
                micro_batch,
                accum_steps,
                eval_every: 0,
                warmup: 0,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn trainer(s: Scenario) -> Trainer {
        Trainer::new(s, Device::Cpu).unwrap()
    }

    /// Before micro-batch `micro_batch` (1-based) of the window of optimizer step `step`, the
    /// window fails as an out-of-memory error would, `times` times.
    #[derive(Clone, Copy, Debug)]
    struct Fault {
        step: u64,
        micro_batch: usize,
        times: u32,
    }

    /// Injects a [`Fault`] through the trainer's window observers.
    struct InjectFault {
        fault: Fault,
        armed: bool,
        micro_batches: usize,
    }

    impl crate::train::WindowObserver for InjectFault {
        fn window_start(&mut self, step: u64) -> candle_core::Result<()> {
            self.micro_batches = 0;
            self.armed = self.fault.step == step && self.fault.times > 0;
            if self.armed {
                self.fault.times -= 1;
            }
            Ok(())
        }

        fn forward_start(&mut self) -> candle_core::Result<()> {
            self.micro_batches += 1;
            if self.armed && self.micro_batches == self.fault.micro_batch {
                return Err(candle_core::Error::Msg(
                    "CUDA_ERROR_OUT_OF_MEMORY: out of memory (injected by the test)".into(),
                ));
            }
            Ok(())
        }
    }

    fn inject(t: &mut Trainer, fault: Fault) {
        t.observe_windows(Box::new(InjectFault {
            fault,
            armed: false,
            micro_batches: 0,
        }));
    }

    fn weights(t: &Trainer) -> Vec<candle_core::Tensor> {
        t.model.vars().map(|v| v.as_tensor().clone()).collect()
    }

    #[test]
    fn the_next_micro_batch_divides_the_effective_batch() {
        assert_eq!(smaller_micro_batch(8, 16), 4);
        assert_eq!(smaller_micro_batch(6, 18), 3);
        assert_eq!(smaller_micro_batch(3, 9), 1);
        assert_eq!(smaller_micro_batch(5, 10), 2);
        assert_eq!(smaller_micro_batch(1, 7), 1);
    }

    /// At B=1 there is nothing to trade: said once, not every step, with figures that differ.
    #[test]
    fn the_guard_at_micro_batch_one_says_so_once() {
        let mut t = trainer(scenario(1, 2));
        t.guard.budget = Some(1_950_000);
        let over = |step| MemoryEvent {
            step,
            phase: Phase::Backward,
            source: crate::telemetry::MemorySource::Allocator,
            categories: Default::default(),
            total: 0,
            peak: 1_950_001,
            unified: true,
        };
        let Some(Event::Log(first)) = t.guard.after_step(&t.knobs, t.step, &[over(1)]) else {
            panic!("no log at the first step over the budget");
        };
        assert!(
            first.message.contains("measured backward peak"),
            "the phase in words, not a type name: {}",
            first.message
        );
        assert!(
            first
                .message
                .contains("1.86 MiB (1950001 B) (allocator) at step 1 exceeds the budget 1.86 MiB (1950000 B)"),
            "{}",
            first.message
        );
        for step in 2..5 {
            assert!(t
                .guard
                .after_step(&t.knobs, t.step, &[over(step)])
                .is_none());
        }
    }

    /// Candle's wrappers (context, path, backtrace) do not hide an out-of-memory error.
    #[test]
    fn out_of_memory_is_found_inside_candles_wrappers() {
        let oom = candle_core::Error::Msg("out of memory".into());
        let wrapped = candle_core::Error::WithPath {
            inner: Box::new(oom),
            path: "weights.safetensors".into(),
        };
        assert!(is_out_of_memory(&wrapped));
        let other = candle_core::Error::WithPath {
            inner: Box::new(candle_core::Error::Msg("shape mismatch".into())),
            path: "out_of_memory.safetensors".into(),
        };
        assert!(!is_out_of_memory(&other), "judged by the path's name");
    }

    /// With the `cuda` feature the driver's code is read, not the message.
    #[cfg(feature = "cuda")]
    #[test]
    fn a_cuda_out_of_memory_is_recognised_by_its_code() {
        use candle_core::cuda::cudarc::driver::{sys::CUresult, DriverError};
        use candle_core::cuda::CudaError;
        let of = |code| candle_core::Error::from(CudaError::Cuda(DriverError(code)));
        assert!(is_out_of_memory(&of(CUresult::CUDA_ERROR_OUT_OF_MEMORY)));
        assert!(!is_out_of_memory(&of(CUresult::CUDA_ERROR_INVALID_VALUE)));
    }

    #[test]
    fn out_of_memory_is_told_apart_from_other_errors() {
        let oom = candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        );
        assert!(is_out_of_memory(&oom));
        assert!(!is_out_of_memory(&candle_core::Error::Msg(
            "shape mismatch".into()
        )));
    }

    #[test]
    fn a_fault_mid_window_retries_the_same_samples_at_half_the_micro_batch() {
        let mut faulted = trainer(scenario(4, 2));
        inject(
            &mut faulted,
            Fault {
                step: 1,
                micro_batch: 2,
                times: 1,
            },
        );
        let step = faulted.train_step(|| true).ok().unwrap();
        assert_eq!(
            (faulted.knobs.micro_batch, faulted.knobs.accum_steps),
            (2, 4)
        );
        assert_eq!((step.micro_batch, step.accum_steps), (2, 4));
        // Every sample of the window consumed exactly once: the cursor moved by B·K, and the
        // step counted the tokens of samples 0..8 once.
        assert_eq!(faulted.cursor, 8);
        let tokens: u64 = (0..8)
            .map(|i| faulted.corpus.sample(crate::data::Split::Train, i).len as u64)
            .sum();
        assert_eq!(step.tokens, tokens);
        let said = faulted.guard.take_announcements();
        let guarded: Vec<&Control> = said
            .iter()
            .filter_map(|e| match e {
                Event::Control(c) if c.origin == Origin::Guard => Some(&c.control),
                _ => None,
            })
            .collect();
        assert_eq!(
            guarded,
            [
                &Control::SetMicroBatch { value: 2 },
                &Control::SetAccumSteps { value: 4 }
            ]
        );
        let mut clean = trainer(scenario(2, 4));
        let clean_step = clean.train_step(|| true).ok().unwrap();
        assert_eq!(clean_step.tokens, step.tokens);
        let err = super::super::relative_error(&weights(&faulted), &weights(&clean)).unwrap();
        assert!(
            err <= 1e-6,
            "update differs from the un-faulted one at B=2: {err:e}"
        );
        assert!((clean_step.loss - step.loss).abs() <= 1e-6 * clean_step.loss.abs());
    }

    #[test]
    fn out_of_memory_at_micro_batch_one_ends_after_the_retries() {
        let mut s = scenario(1, 2);
        s.train.guard_retries = 2;
        let mut t = trainer(s);
        inject(
            &mut t,
            Fault {
                step: 1,
                micro_batch: 1,
                times: 2,
            },
        );
        // Two failures are retried, the third attempt succeeds.
        assert!(t.train_step(|| true).is_ok());
        assert_eq!(t.cursor, 2);
        inject(
            &mut t,
            Fault {
                step: 2,
                micro_batch: 2,
                times: 3,
            },
        );
        match t.train_step(|| true) {
            Err(Interrupt::Failed(e)) => {
                assert!(e.to_string().contains("guard_retries"), "{e}")
            }
            _ => panic!("the third failure at B=1 must end the run"),
        }
        assert_eq!(t.cursor, 2, "the failed window's samples are not consumed");
    }

    #[test]
    fn the_start_plan_picks_the_largest_fitting_micro_batch_or_refuses() {
        let s = scenario(8, 2);
        let cfg = Config::from_scenario(&s, true).unwrap();
        let fits_4 = estimate(&Config {
            micro_batch: 4,
            accum_steps: 4,
            ..cfg.clone()
        })
        .peak();
        let mut budgeted = s.clone();
        budgeted.train.memory_budget = MemoryBudget::Bytes(fits_4);
        let mut t = trainer(budgeted);
        assert_eq!(
            t.guard.take_queued(),
            [
                Control::SetMicroBatch { value: 4 },
                Control::SetAccumSteps { value: 4 }
            ]
        );
        let mut tiny = s;
        tiny.train.memory_budget = MemoryBudget::Bytes(1024);
        let err = Trainer::new(tiny, Device::Cpu).err().unwrap().to_string();
        assert!(
            err.contains("cannot hold") && err.contains("lever"),
            "{err}"
        );
    }
}
