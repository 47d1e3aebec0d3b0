//! AdamW with decoupled weight decay, written out so its moments can be measured, moved to host
//! memory (offload) and checkpointed. All state and update math is f32.

use candle_core::{Device, Result, Tensor};

use crate::model::Param;
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
    /// Host copies of the f32 master weights while offloaded from a separate device; `None` when
    /// the state lives with the weights (no offload, or a CPU run where host and device coincide).
    pub master: Option<Vec<Tensor>>,
    /// Whether the state lives in host memory (`train.offload`).
    pub offloaded: bool,
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

    /// Move the state to host memory (`true`) or back to the weights' device, keeping its values.
    pub fn set_offload(&mut self, on: bool, params: &[Param]) -> Result<()> {
        if on == self.offloaded {
            return Ok(());
        }
        self.offloaded = on;
        let target = self.state_device(params);
        let move_all = |ts: &mut Vec<Tensor>| -> Result<()> {
            for t in ts.iter_mut() {
                *t = t.to_device(&target)?;
            }
            Ok(())
        };
        move_all(&mut self.m)?;
        move_all(&mut self.v)?;
        let separate = !target.same_device(params[0].var.device());
        self.master = if on && separate {
            Some(
                params
                    .iter()
                    .map(|p| p.var.as_tensor().to_device(&target))
                    .collect::<Result<_>>()?,
            )
        } else {
            None
        };
        Ok(())
    }

    /// One update with learning rate `lr` from the (unscaled, clipped) gradients. CPU f32 state
    /// is updated in place by one fused kernel; elsewhere by Candle ops (same maths).
    pub fn step(&mut self, params: &[Param], grads: &[Tensor], lr: f64) -> Result<()> {
        let Hyper {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.hyper;
        self.t += 1;
        // Past i32::MAX steps β^t is 0 in any float; a wrapped exponent would make it huge.
        let t = i32::try_from(self.t).unwrap_or(i32::MAX);
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        let state_device = self.state_device(params);
        let mut fused = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let g = grads[i].to_device(&state_device)?;
            let decay = if p.decay {
                1.0 - lr * weight_decay
            } else {
                1.0
            };
            let w = p.var.as_tensor();
            if self.master.is_none() && ops::fused_domain(&[w, &self.m[i], &self.v[i], &g]) {
                let step = AdamWStep {
                    beta1: beta1 as f32,
                    beta2: beta2 as f32,
                    eps: eps as f32,
                    step_size: (lr / bc1) as f32,
                    inv_bc2: (1.0 / bc2) as f32,
                    decay: decay as f32,
                };
                fused.push((i, g, step));
                continue;
            }
            let w = match &self.master {
                Some(master) => master[i].clone(),
                None => p.var.as_tensor().clone(),
            };
            self.m[i] = (self.m[i].affine(beta1, 0.0)? + g.affine(1.0 - beta1, 0.0)?)?;
            self.v[i] = (self.v[i].affine(beta2, 0.0)? + g.sqr()?.affine(1.0 - beta2, 0.0)?)?;
            let denom = (self.v[i].affine(1.0 / bc2, 0.0)?.sqrt()? + eps)?;
            let update = self.m[i].affine(lr / bc1, 0.0)?.div(&denom)?;
            let updated = (w.affine(decay, 0.0)? - update)?;
            p.var.set(&updated.to_device(p.var.device())?)?;
            if let Some(master) = &mut self.master {
                master[i] = updated;
            }
        }
        let jobs: Vec<AdamWJob> = fused
            .into_iter()
            .map(|(i, g, step)| AdamWJob {
                w: params[i].var.as_tensor(),
                m: &self.m[i],
                v: &self.v[i],
                g,
                step,
            })
            .collect();
        ops::fused::adamw_update_all(&jobs)
    }
}
