//! The window boundary: unscale once → non-finite check → global L2 norm → clip → AdamW step
//! (or skip on overflow) → loss-scaler update; and the learning rate it steps with.

use candle_core::{Result, Tensor};

use super::window::WindowGrads;
use super::{inplace, schedule, zero, Trainer};
use crate::end::EndReason;

/// Global L2 norm over a set of tensors, in f64 on the host.
pub fn global_norm(tensors: &[Tensor]) -> Result<f64> {
    let (host, device): (Vec<&Tensor>, Vec<&Tensor>) = tensors
        .iter()
        .partition(|t| crate::ops::fused_domain(&[*t]));
    let mut sum = 0f64;
    for s in crate::ops::fused::sums_of_squares(&host)? {
        sum += s;
    }
    // Per-tensor sums of squares left on the device, read back together: one host sync.
    let on_device = device
        .iter()
        .map(|t| t.sqr()?.sum_all()?.to_dtype(candle_core::DType::F32))
        .collect::<Result<Vec<_>>>()?;
    if !on_device.is_empty() {
        let sums = Tensor::stack(&on_device, 0)?.to_vec1::<f32>()?;
        sum += sums.iter().map(|&s| f64::from(s)).sum::<f64>();
    }
    Ok(sum.sqrt())
}

/// What the boundary did.
pub(super) struct Update {
    pub(super) grad_norm: f64,
    pub(super) grad_norm_clipped: f64,
    pub(super) lr: f64,
    pub(super) skipped: bool,
    pub(super) grad_error: Option<f64>,
    /// Bytes the update moved between host and device (`AdamW::step`).
    pub(super) transferred: u64,
}

impl Trainer {
    /// The boundary: unscale → non-finite check → norm → clip → step or skip → scaler update.
    pub(super) fn apply_window(&mut self, w: WindowGrads, scale: f64) -> Result<Update> {
        let mut grads = w.grads;
        // The pitfall's error is a ratio, the same before unscaling (one factor on both
        // buffers), so the reference is never unscaled and is freed before the step.
        let grad_error = match w.reference {
            Some(r) => Some(inplace::relative_error(&grads, &r)?),
            None => None,
        };
        if scale != 1.0 {
            inplace::scale_in_place(&mut grads, 1.0 / scale)?;
        }
        let grad_norm = self.grad_norm(&grads)?;
        let finite = grad_norm.is_finite();
        let lr = self.lr();
        let mut grad_norm_clipped = grad_norm;
        let mut transferred = 0;
        if finite {
            let clip = match self.knobs.clip {
                Some(max) if grad_norm > max => Some(max / grad_norm),
                _ => None,
            };
            match clip {
                // The factor goes into the fused update: no pass to scale the gradients, none
                // to measure them again (the same bits as the two passes).
                Some(factor)
                    if self.zero.is_none() && self.opt.folds_clip(&self.model.params, &grads) =>
                {
                    let params = &self.model.params;
                    let squares = self.opt.step_clipped(params, &grads, lr, factor as f32)?;
                    grad_norm_clipped = squares.sqrt();
                }
                Some(factor) => {
                    inplace::scale_in_place(&mut grads, factor)?;
                    grad_norm_clipped = self.grad_norm(&grads)?;
                    transferred = self.optimizer_step(&grads, lr)?;
                }
                None => transferred = self.optimizer_step(&grads, lr)?,
            }
            self.lr_step += 1;
        } else {
            self.overflow_count += 1;
        }
        if self.knobs.dtype.needs_loss_scaling() {
            self.scaler.update(finite);
        }
        self.step += 1;
        Ok(Update {
            grad_norm,
            grad_norm_clipped,
            lr,
            skipped: !finite,
            grad_error: grad_error.filter(|_| finite),
            transferred,
        })
    }

    /// The global L2 norm of the window's gradient: under ZeRO-2 each rank holds its pieces, so
    /// their squares are summed over the ranks.
    pub(super) fn grad_norm(&mut self, grads: &[Tensor]) -> Result<f64> {
        let norm = global_norm(grads)?;
        if self.zero_stage() != 2 || !self.group.is_parallel() {
            return Ok(norm);
        }
        let mut squares = [norm * norm];
        self.group.sum_scalars(&mut squares);
        Ok(squares[0].sqrt())
    }

    /// AdamW on every parameter, or under ZeRO on this rank's pieces, then the all-gather.
    /// Returns the bytes that crossed between host and device (offload, `AdamW::step`).
    fn optimizer_step(&mut self, grads: &[Tensor], lr: f64) -> Result<u64> {
        let Some(shard) = &self.zero else {
            return self.opt.step(&self.model.params, grads, lr);
        };
        let pieces = match self.knobs.zero {
            2 => grads.to_vec(),
            _ => shard.pieces_of(grads)?,
        };
        zero::step(
            &mut self.opt,
            shard,
            &self.model.params,
            &pieces,
            lr,
            &mut self.group,
        )?;
        // ZeRO runs without offload: no model state crosses between host and device.
        Ok(0)
    }

    /// The loss scale in force: only f16 scales.
    pub fn loss_scale(&self) -> f64 {
        if self.knobs.dtype.needs_loss_scaling() {
            self.scaler.scale
        } else {
            1.0
        }
    }

    /// Why the run must end, once f16 gradients keep overflowing at the loss-scale floor.
    pub fn overflow_exhausted(&self) -> Option<EndReason> {
        (self.knobs.dtype.needs_loss_scaling() && self.scaler.exhausted())
            .then(|| EndReason::LossScaleExhausted(self.scaler.exhausted_reason()))
    }

    /// Learning rate for the next step: schedule × LR rule for the current effective batch.
    ///
    /// The schedule's clock is `lr_step`, the applied steps: a skipped (overflowed) step changed
    /// no weight, so it spends no schedule. Warm-up and the decay horizon (`decay_steps`, else
    /// `steps`) are counted in applied steps too, so a run of `steps` optimizer steps with s
    /// skipped ends s applied steps short of the horizon, its last LR a little above the floor.
    /// (PyTorch gives the same when `scheduler.step()` follows only the steps `GradScaler` took.)
    pub fn lr(&self) -> f64 {
        let t = &self.scenario.train;
        let decay_steps = if t.decay_steps > 0 {
            t.decay_steps
        } else {
            t.steps
        };
        self.knobs.lr
            * schedule::schedule(self.lr_step, t.warmup, decay_steps, t.min_lr_ratio)
            * self
                .knobs
                .lr_rule
                .factor(self.global_batch(), self.base_batch)
    }
}
