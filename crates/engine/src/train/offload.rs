//! Optimizer-state offload as DeepSpeed's ZeRO-Offload does it. With offload on in half
//! precision the device keeps only the compute-dtype weights; the f32 master weights and AdamW's
//! moments live in host memory, the update runs there (the fused CPU AdamW), and the updated
//! weights are cast and copied back. Where a window's gradients accumulate is
//! `train.offload_grads`: on the device (one f32 buffer there, copied to the host once per
//! window) or on the host (no buffer on the device, each micro-batch's gradients copied as soon
//! as its backward is done).
//!
//! Every crossing is counted in bytes ([`Traffic`]) by one rule, also on the CPU, where host and
//! device are one memory and the copies are no-ops: a run's figures do not depend on where it
//! ran. Only model state is counted (gradients and weights), not the scalars read back each
//! step (the loss, the norms).

use candle_core::{DType, Device, Result, Tensor};

use crate::control::{Knobs, OffloadGrads};

/// Where the weights, the optimizer state and the gradients live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The optimizer state (and the update) is in host memory.
    pub offload: bool,
    /// The dtype the forward computes in.
    pub compute: DType,
    /// The window's gradients accumulate in host memory (only while offloaded).
    pub grads_on_host: bool,
}

impl Placement {
    /// The placement the knobs in force ask for.
    pub fn of(k: &Knobs) -> Placement {
        Placement {
            offload: k.offload,
            compute: k.dtype.candle(),
            grads_on_host: k.offload && k.offload_grads == OffloadGrads::Host,
        }
    }

    /// Offload in half precision: the device's weights are the compute-dtype copies and the f32
    /// master weights live in host memory.
    pub fn half_weights(&self) -> bool {
        self.offload && self.compute != DType::F32
    }

    /// The dtype of the weights the device keeps.
    pub fn device_weights(&self) -> DType {
        if self.half_weights() {
            self.compute
        } else {
            DType::F32
        }
    }
}

/// Bytes of a tensor's elements.
pub(crate) fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Bytes that crossed between host and device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Traffic {
    /// Model-state bytes moved so far in this step.
    pub bytes: u64,
}

impl Traffic {
    /// `t` in host memory, its bytes counted.
    pub(crate) fn move_to_host(&mut self, t: &Tensor) -> Result<Tensor> {
        self.bytes += tensor_bytes(t);
        t.to_device(&Device::Cpu)
    }

    /// `t` on `device`, its bytes counted.
    pub(crate) fn move_to(&mut self, t: &Tensor, device: &Device) -> Result<Tensor> {
        self.bytes += tensor_bytes(t);
        t.to_device(device)
    }
}

/// One micro-batch's gradients where the window accumulates them, in f32: unchanged without
/// offload (the f32 weights' gradients, on the device), cast on the device when the buffer is
/// there, copied in the weights' dtype and cast on the host when it is there. A half-precision
/// gradient cast to f32 is exact, so every placement accumulates the same values.
pub(crate) fn land(
    grads: Vec<Tensor>,
    placement: &Placement,
    traffic: &mut Traffic,
) -> Result<Vec<Tensor>> {
    if !placement.offload {
        return Ok(grads);
    }
    grads
        .into_iter()
        .map(|g| {
            let g = if placement.grads_on_host {
                traffic.move_to_host(&g)?
            } else {
                g
            };
            g.to_dtype(DType::F32)
        })
        .collect()
}
