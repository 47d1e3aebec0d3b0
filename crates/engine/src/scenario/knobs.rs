//! The knobs' one link to the configuration: read from it at the start, written back into it
//! when a run's knobs must be saved (a recording started mid-run, a checkpoint).

use super::{Scenario, TrainConfig};
use crate::control::Knobs;

impl Knobs {
    pub fn from_scenario(s: &Scenario) -> Knobs {
        let t = &s.train;
        Knobs {
            accum_steps: t.accum_steps,
            micro_batch: t.micro_batch,
            clip: t.clip,
            lr: t.lr,
            lr_rule: t.lr_rule,
            dtype: t.dtype,
            offload: t.offload,
            offload_grads: t.offload_grads,
            loss_norm: t.loss_norm,
            zero_grad: t.zero_grad,
            checkpointing: t.checkpointing,
            accum_policy: t.accum_policy,
            noise: t.noise,
        }
    }

    /// Write the knobs back into a configuration (the header of a recording started mid-run, a
    /// checkpoint). The destructuring names every field, so a new knob cannot be forgotten here.
    pub fn write_into(&self, t: &mut TrainConfig) {
        let Knobs {
            accum_steps,
            micro_batch,
            clip,
            lr,
            lr_rule,
            dtype,
            offload,
            offload_grads,
            loss_norm,
            zero_grad,
            checkpointing,
            accum_policy,
            noise,
        } = self.clone();
        t.accum_steps = accum_steps;
        t.micro_batch = micro_batch;
        t.clip = clip;
        t.lr = lr;
        t.lr_rule = lr_rule;
        t.dtype = dtype;
        t.offload = offload;
        t.offload_grads = offload_grads;
        t.loss_norm = loss_norm;
        t.zero_grad = zero_grad;
        t.checkpointing = checkpointing;
        t.accum_policy = accum_policy;
        t.noise = noise;
    }
}
