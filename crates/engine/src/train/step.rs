//! One optimizer step, top to bottom: the window's samples, its gradients (retried smaller
//! when it runs out of memory), their sums over the ranks, the boundary, the step's event.

use std::time::Instant;

use super::boundary::Update;
use super::window::{rank_window_gradients, Interrupt, Share, WindowGrads, WindowObserver};
use super::{oom_guard, Trainer};
use crate::control::Control;
use crate::data::{Sample, Split};
use crate::telemetry::{PhaseMs, StepEvent};

/// What the step event takes from a finished window (every rank's, under data parallel).
struct WindowSummary {
    loss: f64,
    tokens: u64,
    forward_ms: f64,
    backward_ms: f64,
    /// Gradient bytes the window sent to the host (offload with host accumulation).
    transferred: u64,
}

impl WindowSummary {
    fn of(w: &WindowGrads, tokens: u64) -> WindowSummary {
        WindowSummary {
            loss: w.loss,
            tokens,
            transferred: w.transferred,
            forward_ms: w.forward_ms,
            backward_ms: w.backward_ms,
        }
    }
}

/// The step's times, taken once the boundary's work has finished on the device.
struct StepTiming {
    optimizer_ms: f64,
    step_ms: f64,
}

impl Trainer {
    /// One optimizer step: the window's gradients, then the update at the boundary. `between`
    /// runs before each micro-batch; returning false abandons the window (the data cursor is
    /// rewound, nothing is applied).
    pub fn train_step(
        &mut self,
        mut between: impl FnMut() -> bool,
    ) -> std::result::Result<StepEvent, Interrupt> {
        let _kernels = crate::ops::force_lean(self.lean);
        let _pool = self.serial.then(|| crate::ops::pool::serial(true));
        let started = Instant::now();
        if self.device.is_cpu() {
            crate::ops::workspace::reserve();
        }
        let scale = self.loss_scale();
        let (mut window, window_tokens) = self.window_with_retries(scale, &mut between)?;
        self.sum_over_ranks(&mut window)?;
        self.pool_noise_over_ranks(&mut window, scale)?;
        let optimizer_started = Instant::now();
        self.memory.optimizer_start(&window.buffer());
        let norms = window.noise.take();
        let summary = WindowSummary::of(&window, window_tokens);
        let update = self.apply_window(window, scale)?;
        self.device.synchronize()?;
        let noise = self.noise.observe(norms.as_ref(), update.skipped);
        self.memory
            .finish_window(self.step, self.persistent_memory());
        // Inside the step's time, as its bytes and collective time are.
        self.gather_if_due()?;
        let timing = StepTiming {
            optimizer_ms: optimizer_started.elapsed().as_secs_f64() * 1e3,
            step_ms: started.elapsed().as_secs_f64() * 1e3,
        };
        let comm = self.group.is_parallel().then(|| {
            let sync = self.knobs.sync;
            self.group.finish_window(sync, self.memory.last_step_peak())
        });
        Ok(self.step_event(summary, update, timing, scale, noise, comm))
    }

    /// The window's gradients, and its counted tokens (every rank's). A window that runs out of
    /// memory is retried from the same cursor at a smaller micro-batch (`oom_guard`); its partial
    /// gradients are dropped with the failed attempt. Under data parallel a failure ends the
    /// run: one rank cannot retry alone while the others wait in a collective.
    fn window_with_retries(
        &mut self,
        scale: f64,
        between: &mut impl FnMut() -> bool,
    ) -> std::result::Result<(WindowGrads, u64), Interrupt> {
        let cursor = self.cursor;
        let mut failures_at_one = 0;
        loop {
            let samples = self.next_window();
            let params = self.model.vars().map(|v| v.as_tensor().clone()).collect();
            let frozen = self.model.frozen.iter().map(|p| p.var.as_tensor().clone());
            self.memory
                .begin_window(params, frozen.collect(), self.persistent_memory());
            match self.window_attempt(&samples, scale, &mut *between) {
                Ok(w) => return Ok(w),
                Err(e) if self.group.is_parallel() => return Err(e),
                Err(e) => {
                    self.cursor = cursor;
                    let after =
                        self.guard
                            .after_failure(&self.knobs, self.step, e, &mut failures_at_one);
                    match after {
                        oom_guard::AfterFailure::Retry(now) => self.apply_at_once(&now),
                        oom_guard::AfterFailure::GiveUp(e) => return Err(e),
                    }
                }
            }
        }
    }

    /// This rank's samples of the next window; advances the data cursor past every rank's.
    /// Rank r trains samples `[r·K·B, (r+1)·K·B)` of the window's W·K·B, so W ranks at K see
    /// the samples one process at W·K sees.
    fn next_window(&mut self) -> Vec<Sample> {
        let n = self.knobs.effective_batch() as u64;
        let start = self.cursor + self.group.rank() as u64 * n;
        let samples = (start..start + n)
            .map(|i| self.corpus.sample(Split::Train, i))
            .collect();
        self.cursor += self.global_batch() as u64;
        samples
    }

    /// Knob changes that cannot wait for the boundary: the guard's smaller split for the retry
    /// of a window that ran out of memory (already checked by the guard, announced by it).
    fn apply_at_once(&mut self, controls: &[Control]) {
        for c in controls {
            self.knobs.apply(c);
        }
    }

    /// One attempt at the window's gradients, watched by the ledger and the observers added
    /// with [`Trainer::observe_windows`].
    fn window_attempt(
        &mut self,
        samples: &[Sample],
        scale: f64,
        between: impl FnMut() -> bool,
    ) -> std::result::Result<(WindowGrads, u64), Interrupt> {
        let step = self.step + 1;
        for o in &mut self.window_observers {
            o.window_start(step)?;
        }
        let rank_tokens = Share::tokens_of(samples);
        let window_tokens = self.group.sum_tokens(rank_tokens);
        let scatter = self.zero.as_ref().filter(|_| self.scatters_micro_batches());
        let mut share = Share {
            window_tokens,
            rank_tokens,
            rank_loss_norm: self.scenario.train.rank_loss_norm,
            sync: self.knobs.sync,
            scatter,
            group: &mut self.group,
        };
        let mut observers: Vec<&mut dyn WindowObserver> = vec![&mut self.memory];
        for o in &mut self.window_observers {
            observers.push(o.as_mut());
        }
        let window = rank_window_gradients(
            &self.model,
            samples,
            &self.knobs,
            scale,
            &self.device,
            between,
            &mut observers,
            &mut share,
        )?;
        Ok((window, window_tokens))
    }

    /// The step's event, built once from what the window and the boundary returned.
    fn step_event(
        &self,
        window: WindowSummary,
        update: Update,
        timing: StepTiming,
        loss_scale: f64,
        noise: Option<crate::telemetry::NoiseEvent>,
        comm: Option<crate::dist::CommEvent>,
    ) -> StepEvent {
        StepEvent {
            step: self.step,
            loss: window.loss,
            grad_norm: update.grad_norm,
            grad_norm_clipped: update.grad_norm_clipped,
            lr: update.lr,
            accum_steps: self.knobs.accum_steps,
            micro_batch: self.knobs.micro_batch,
            tokens: window.tokens,
            tokens_per_s: window.tokens as f64 / (timing.step_ms / 1e3),
            step_ms: timing.step_ms,
            cpu_threads: self
                .runs_fused_cpu_in_parallel()
                .then(crate::ops::pool::threads),
            skipped: update.skipped,
            loss_scale,
            overflow_count: self.overflow_count,
            dtype: self.knobs.dtype,
            offload: self.knobs.offload,
            host_device_bytes: window.transferred + update.transferred,
            clip: self.knobs.clip,
            phase_ms: PhaseMs {
                forward: window.forward_ms,
                backward: window.backward_ms,
                optimizer: timing.optimizer_ms,
            },
            grad_error: update.grad_error,
            noise,
            comm,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::{DataConfig, ModelConfig, Scenario, TrainConfig};
    use candle_core::Device;

    fn trainer(micro_batch: usize, accum_steps: usize) -> Trainer {
        let scenario = Scenario {
            model: ModelConfig {
                vocab: 32,
                d_model: 32,
                layers: 2,
                heads: 2,
                seq_len: 32,
                path: None,
                adapter: None,
            },
            data: DataConfig {
                min_doc_len: 4,
                ..Default::default()
            },
            train: TrainConfig {
                micro_batch,
                accum_steps,
                eval_every: 0,
                ..Default::default()
            },
            ..Default::default()
        };
        Trainer::new(scenario, Device::Cpu).unwrap()
    }

    #[test]
    fn the_data_stream_does_not_depend_on_how_a_window_is_split() {
        let (mut a, mut b) = (trainer(2, 1), trainer(1, 2));
        assert_eq!(a.next_window(), b.next_window());
        assert_eq!(a.cursor(), b.cursor());
    }
}
