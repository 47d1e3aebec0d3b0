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
        first.message.contains(
            "1.86 MiB (1950001 B) (allocator) at step 1 exceeds the budget 1.86 MiB (1950000 B)"
        ),
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
    let oom =
        candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
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
