//! AdamW with decoupled weight decay, written out so its moments can be measured, moved to host
//! memory (offload) and checkpointed. All state and update math is f32. Where the weights and
//! the state live is `place`'s business (`train::offload`).

use candle_core::{Device, Result, Tensor, Var};

use super::offload::{Placement, Traffic};
use crate::model::{Gpt, Param};
use crate::ops::{
    self,
    fused::{AdamWJob, AdamWStep},
};

#[derive(Clone, Copy, Debug, PartialEq)]
/// AdamW's hyper-parameters, fixed for the run.
pub struct Hyper {
    /// β₁, the first moment's decay.
    pub beta1: f64,
    /// β₂, the second moment's decay.
    pub beta2: f64,
    /// ε, added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices only (not biases or norm gains).
    pub weight_decay: f64,
}

/// AdamW's state for every parameter, on the weights' device or offloaded to the host.
pub struct AdamW {
    /// The hyper-parameters.
    pub hyper: Hyper,
    /// First and second moments, one per parameter, on `state_device`.
    pub m: Vec<Tensor>,
    /// Second moments, one per parameter, beside `m`.
    pub v: Vec<Tensor>,
    /// Applied steps (for bias correction).
    pub t: u64,
    /// The f32 master weights in host memory, where the update writes, when the device's weights
    /// are not them: offload in half precision (the device keeps compute-dtype copies; on the
    /// CPU too), or offload from a separate device. `None` when the state lives with the f32
    /// weights (no offload, or f32 on the CPU where host and device coincide).
    pub master: Option<Vec<Tensor>>,
    /// Whether the state lives in host memory (`train.offload`).
    pub offloaded: bool,
    /// The gradients a step receives are already in host memory (`train.offload_grads = "host"`).
    pub grads_on_host: bool,
}

/// One step's scalars: the hyper-parameters, the learning rate and both bias corrections.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepScalars {
    hyper: Hyper,
    lr: f64,
    /// 1 − β1^t.
    bc1: f64,
    /// 1 − β2^t.
    bc2: f64,
}

/// A parameter's weights and moments after one update by Candle ops.
pub(crate) struct Updated {
    /// The updated weights.
    pub(crate) w: Tensor,
    /// The updated first moment.
    pub(crate) m: Tensor,
    /// The updated second moment.
    pub(crate) v: Tensor,
}

impl StepScalars {
    /// The factor decoupled weight decay multiplies `p` by (1 where it does not decay).
    fn decay(&self, p: &Param) -> f64 {
        match p.decay {
            true => 1.0 - self.lr * self.hyper.weight_decay,
            false => 1.0,
        }
    }

    /// One update of `w` with moments `m`, `v` and gradient `g` by Candle ops (any device, the
    /// maths of the fused kernel): the new weights and moments, as new tensors.
    pub(crate) fn update_by_ops(
        &self,
        p: &Param,
        w: &Tensor,
        m: &Tensor,
        v: &Tensor,
        g: &Tensor,
    ) -> Result<Updated> {
        let Hyper {
            beta1, beta2, eps, ..
        } = self.hyper;
        let m = (m.affine(beta1, 0.0)? + g.affine(1.0 - beta1, 0.0)?)?;
        let v = (v.affine(beta2, 0.0)? + g.sqr()?.affine(1.0 - beta2, 0.0)?)?;
        let denom = (v.affine(1.0 / self.bc2, 0.0)?.sqrt()? + eps)?;
        let update = m.affine(self.lr / self.bc1, 0.0)?.div(&denom)?;
        let w = (w.affine(self.decay(p), 0.0)? - update)?;
        Ok(Updated { w, m, v })
    }

    /// The fused kernel's scalars for `p`.
    pub(crate) fn fused(&self, p: &Param) -> AdamWStep {
        AdamWStep {
            beta1: self.hyper.beta1 as f32,
            beta2: self.hyper.beta2 as f32,
            eps: self.hyper.eps as f32,
            step_size: (self.lr / self.bc1) as f32,
            inv_bc2: (1.0 / self.bc2) as f32,
            decay: self.decay(p) as f32,
        }
    }
}

impl AdamW {
    /// Zero moments for `params`, with the state on their device.
    pub fn new(params: &[Param], hyper: Hyper) -> Result<AdamW> {
        let zeros = || {
            params
                .iter()
                .map(|p| p.var.zeros_like())
                .collect::<Result<Vec<_>>>()
        };
        Ok(AdamW {
            hyper,
            m: zeros()?,
            v: zeros()?,
            t: 0,
            master: None,
            offloaded: false,
            grads_on_host: false,
        })
    }

    /// Where the state and the update math live.
    pub fn state_device(&self, params: &[Param]) -> Device {
        if self.offloaded {
            Device::Cpu
        } else {
            params[0].var.device().clone()
        }
    }

    /// Replace the moments with saved ones (moved to where the state lives) and the step count
    /// with `t`.
    pub fn load_moments(
        &mut self,
        params: &[Param],
        m: Vec<Tensor>,
        v: Vec<Tensor>,
        t: u64,
    ) -> Result<()> {
        let device = self.state_device(params);
        self.m = m
            .iter()
            .map(|m| m.to_device(&device))
            .collect::<Result<_>>()?;
        self.v = v
            .iter()
            .map(|v| v.to_device(&device))
            .collect::<Result<_>>()?;
        self.t = t;
        Ok(())
    }

    /// Bytes of the two moments.
    pub fn moment_bytes(&self) -> u64 {
        self.m
            .iter()
            .chain(&self.v)
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// Bytes of host master copies (0 unless offloaded from a GPU).
    pub fn master_bytes(&self) -> u64 {
        self.master
            .iter()
            .flatten()
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// The f32 master weights, wherever they are: the host copies, or else the weights.
    pub fn master_weights(&self, params: &[Param]) -> Vec<Tensor> {
        match &self.master {
            Some(master) => master.clone(),
            None => params.iter().map(|p| p.var.as_tensor().clone()).collect(),
        }
    }

    /// Put the state, the master weights and the device's weights where `placement` says,
    /// keeping every value: the moments in host memory while offloaded; in half precision under
    /// offload the device's weights become compute-dtype copies of the f32 master weights, which
    /// move to the host (the model is rebuilt over the new `Var`s), and back again after.
    pub fn place(&mut self, placement: Placement, model: &mut Gpt) -> Result<()> {
        let device = model.params[0].var.device().clone();
        let master = self.master_weights(&model.params);
        self.offloaded = placement.offload;
        self.grads_on_host = placement.grads_on_host;
        let state_device = self.state_device(&model.params);
        for t in self.m.iter_mut().chain(self.v.iter_mut()) {
            *t = t.to_device(&state_device)?;
        }
        let weights = placement.device_weights();
        if model.params[0].var.dtype() != weights {
            let vars = master
                .iter()
                .map(|w| Var::from_tensor(&w.to_dtype(weights)?.to_device(&device)?))
                .collect::<Result<Vec<_>>>()?;
            *model = model.with_vars(vars)?;
        }
        let separate = !device.same_device(&Device::Cpu);
        let keep_master = placement.half_weights() || (placement.offload && separate);
        self.master = match keep_master {
            true => Some(
                master
                    .iter()
                    .map(|w| w.to_device(&Device::Cpu))
                    .collect::<Result<_>>()?,
            ),
            false => None,
        };
        Ok(())
    }

    /// One update with learning rate `lr` from the (unscaled, clipped) gradients. CPU f32 state
    /// is updated in place by one fused kernel; elsewhere by Candle ops (same maths). With host
    /// master weights the device's weights are then overwritten by their casts. Returns the bytes
    /// that crossed between host and device while offloaded (`train::offload`).
    pub fn step(&mut self, params: &[Param], grads: &[Tensor], lr: f64) -> Result<u64> {
        self.update(params, grads, lr, None).map(|(bytes, _)| bytes)
    }

    /// Whether `step_clipped` can take these gradients: every parameter's update runs in the
    /// fused CPU kernel on the weights where they lie (no offload, no host master copies).
    pub fn folds_clip(&self, params: &[Param], grads: &[Tensor]) -> bool {
        let fused = |(i, (p, g)): (usize, (&Param, &Tensor))| {
            ops::fused_domain(&[p.var.as_tensor(), &self.m[i], &self.v[i], g])
        };
        !self.offloaded
            && self.master.is_none()
            && params.len() == grads.len()
            && params.iter().zip(grads).enumerate().all(fused)
    }

    /// `step` with the gradients multiplied by `clip` (gradient clipping's factor) inside the
    /// fused update, so they are neither scaled in a pass of their own nor read again for their
    /// norm: returns Σ ‖clip·g‖² over the parameters in order, the same bits as the square of
    /// `global_norm` of the scaled gradients. Needs `folds_clip`.
    pub fn step_clipped(
        &mut self,
        params: &[Param],
        grads: &[Tensor],
        lr: f64,
        clip: f32,
    ) -> Result<f64> {
        if !self.folds_clip(params, grads) {
            candle_core::bail!("adamw: clipping inside the update needs every parameter fused");
        }
        let (_, squares) = self.update(params, grads, lr, Some(clip))?;
        // In parameter order from zero, as `global_norm` adds them.
        Ok(squares.iter().fold(0f64, |sum, s| sum + s))
    }

    /// The update, with `clip` only when `folds_clip` holds; the bytes moved and, with `clip`,
    /// each parameter's Σ (clip·g)².
    fn update(
        &mut self,
        params: &[Param],
        grads: &[Tensor],
        lr: f64,
        clip: Option<f32>,
    ) -> Result<(u64, Vec<f64>)> {
        let step = self.begin_step(lr);
        let state_device = self.state_device(params);
        let mut traffic = Traffic::default();
        let mut fused = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let g = if self.offloaded && !self.grads_on_host {
                traffic.move_to(&grads[i], &state_device)?
            } else {
                grads[i].to_device(&state_device)?
            };
            let w = match &self.master {
                Some(master) => master[i].clone(),
                None => p.var.as_tensor().clone(),
            };
            if ops::fused_domain(&[&w, &self.m[i], &self.v[i], &g]) {
                fused.push((i, g, step.fused(p)));
                continue;
            }
            let updated = step.update_by_ops(p, &w, &self.m[i], &self.v[i], &g)?;
            (self.m[i], self.v[i]) = (updated.m, updated.v);
            match &mut self.master {
                Some(master) => master[i] = updated.w,
                None => p.var.set(&updated.w.to_device(p.var.device())?)?,
            }
        }
        let masters = self.master_weights(params);
        let jobs: Vec<AdamWJob> = fused
            .into_iter()
            .map(|(i, g, step)| AdamWJob {
                w: &masters[i],
                m: &self.m[i],
                v: &self.v[i],
                g,
                step,
            })
            .collect();
        let squares = ops::fused::adamw_update_all(&jobs, clip)?;
        drop(jobs);
        self.copy_back(params, &mut traffic)?;
        Ok((traffic.bytes, squares))
    }

    /// Counts one more step and returns its scalars: the one rule for the unsharded step and
    /// ZeRO's step on pieces, so both update each element alike.
    pub(crate) fn begin_step(&mut self, lr: f64) -> StepScalars {
        self.t += 1;
        // Past i32::MAX steps β^t is 0 in any float; a wrapped exponent would make it huge.
        let t = i32::try_from(self.t).unwrap_or(i32::MAX);
        StepScalars {
            hyper: self.hyper,
            lr,
            bc1: 1.0 - self.hyper.beta1.powi(t),
            bc2: 1.0 - self.hyper.beta2.powi(t),
        }
    }

    /// While offloaded, the updated weights cross back to the device: cast from the host master
    /// weights to the device's dtype, one parameter at a time. Without host master weights (f32
    /// on the CPU) the update wrote the weights where they are; their bytes count all the same.
    fn copy_back(&self, params: &[Param], traffic: &mut Traffic) -> Result<()> {
        if !self.offloaded {
            return Ok(());
        }
        for (i, p) in params.iter().enumerate() {
            match &self.master {
                Some(master) => {
                    let cast = master[i].to_dtype(p.var.dtype())?;
                    p.var.set(&traffic.move_to(&cast, p.var.device())?)?;
                }
                None => traffic.bytes += super::offload::tensor_bytes(p.var.as_tensor()),
            }
        }
        Ok(())
    }
}
