//! Activation checkpointing: a segment of blocks runs its forward without keeping a graph, and
//! joins the loss's graph through one custom op that keeps only the segment's input.
//!
//! Candle's autograd keeps every op's inputs, so the segment runs on a detached input with
//! detached weights; the custom op's output is that result. Its backward (1) rebuilds the
//! segment's forward with the graph on from the saved input, (2) backpropagates the incoming
//! gradient through it via `sum(y · grad_y)`, (3) returns the input's gradient to the outer graph
//! and leaves the blocks' parameter gradients in a `ParamGrads` the window folds in (they are not
//! inputs of the op, so the outer `GradStore` never sees them). The recompute runs the same
//! kernels in the same order as the plain forward, so the gradients are the same bits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, TensorId,
    Var,
};

use super::{Block, Dims, Weights};
use crate::ops::{GradTarget, GradWrite};
use crate::tensors::{activation_bytes, StorageSet};

/// Parameter gradients computed outside the loss's graph, by parameter (`Var`) id, and the size
/// of the largest graph a recompute built.
#[derive(Clone, Default)]
pub struct ParamGrads(Arc<Held>);

#[derive(Default)]
struct Held {
    /// Tensors a step's or a recompute's backward handed over, in the parameter's dtype.
    grads: Mutex<HashMap<TensorId, Tensor>>,
    /// f32 values the ops add into in place (`ops::GradTarget`): the head's and the token
    /// embedding's weights on the fused CPU path; and the compute dtype, to which the sum is
    /// rounded once when taken.
    buffers: Mutex<HashMap<TensorId, (Vec<f32>, DType)>>,
    /// Bytes of the largest recomputed graph (the input's copy, the blocks' activations, the
    /// `y · grad` product), parameters and compute weights not counted.
    graph_bytes: AtomicU64,
}

impl ParamGrads {
    /// The gradient of `var`: the sum of what the loss's `store`, the recomputed blocks and the
    /// ops' buffers hold for it (a tied head's weight may have parts in two of them), taken.
    pub fn get(&self, store: &GradStore, var: &Var) -> Result<Option<Tensor>> {
        let buffer = match lock(&self.0.buffers).remove(&var.id()) {
            Some((mut values, compute)) => {
                crate::ops::fused::round_in_place(&mut values, compute);
                Some(Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?)
            }
            None => None,
        };
        let parts = [
            store.get(var.as_tensor()).map(Tensor::detach),
            lock(&self.0.grads).remove(&var.id()),
            buffer,
        ];
        parts.into_iter().flatten().try_fold(None, |sum, part| {
            Ok(Some(match sum {
                None => part,
                Some(sum) => (sum + part)?,
            }))
        })
    }

    /// Add `grad` to what is held for `var` (a gradient computed outside the loss's graph).
    pub(super) fn add(&self, var: &Var, grad: Tensor) -> Result<()> {
        let mut held = lock(&self.0.grads);
        let sum = match held.remove(&var.id()) {
            Some(before) => (before + grad)?,
            None => grad,
        };
        held.insert(var.id(), sum);
        Ok(())
    }

    /// Where the fused CPU ops add `var`'s f32 gradient in place, for a forward computing in
    /// `compute`: the sum is rounded once to it, as the fused ops round every gradient they
    /// return (so a half-precision run trains the same bits whether or not its weights are
    /// offloaded, where the gradient comes in the compute dtype).
    pub(super) fn target(&self, var: &Var, compute: DType) -> Arc<dyn GradTarget> {
        Arc::new(Target {
            grads: self.clone(),
            var: var.id(),
            compute,
        })
    }

    /// The gradient tensors held here, not yet taken (the ops' buffers not included).
    pub fn tensors(&self) -> Vec<Tensor> {
        lock(&self.0.grads).values().cloned().collect()
    }

    /// Bytes of what is held here and not yet taken, tensors `seen` already counted left out.
    pub fn bytes(&self, seen: &mut StorageSet) -> u64 {
        let buffers: usize = lock(&self.0.buffers).values().map(|b| b.0.len()).sum();
        seen.add_all(&self.tensors()) + 4 * buffers as u64
    }

    /// Bytes of the largest graph one recompute kept (0 before the backward, or without
    /// checkpointing): the activations the backward adds at its peak.
    pub fn recomputed_graph_bytes(&self) -> u64 {
        self.0.graph_bytes.load(Ordering::Relaxed)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One parameter's f32 buffer in a `ParamGrads`, lent to the op that computes its gradient.
struct Target {
    grads: ParamGrads,
    var: TensorId,
    compute: DType,
}

impl GradTarget for Target {
    fn add_into(&self, len: usize, write: &mut GradWrite) -> Result<()> {
        let mut buffers = lock(&self.grads.0.buffers);
        if let Some((held, _)) = buffers.get_mut(&self.var) {
            if held.len() != len {
                candle_core::bail!("gradient of {len} values added to one of {}", held.len());
            }
            if write(Some(held)).is_some() {
                candle_core::bail!("a gradient was returned where it should have been added");
            }
            return Ok(());
        }
        match write(None) {
            Some(first) if first.len() == len => {
                buffers.insert(self.var, (first, self.compute));
                Ok(())
            }
            Some(first) => candle_core::bail!("gradient of {} values for {len}", first.len()),
            None => candle_core::bail!("no gradient was returned for a weight with none held"),
        }
    }
}

/// `blocks` applied to `x` with only `x` kept for the backward.
pub(super) fn segment(
    blocks: &[Block],
    x: &Tensor,
    dims: &Dims,
    dtype: DType,
    grads: &ParamGrads,
) -> Result<Tensor> {
    // The casts made here are transient: the recompute makes its own.
    let mut weights = Weights::new(dtype, None);
    let mut y = x.detach();
    for block in blocks {
        y = block.forward(&y, dims, &mut weights)?;
    }
    let op = Recompute {
        blocks: blocks.to_vec(),
        dims: dims.clone(),
        dtype,
        output: Mutex::new(Some(y.contiguous()?)),
        grads: grads.clone(),
    };
    x.apply_op1(op)
}

struct Recompute {
    blocks: Vec<Block>,
    dims: Dims,
    dtype: DType,
    /// The segment's result, computed before the op runs; handed over once by the forward.
    output: Mutex<Option<Tensor>>,
    grads: ParamGrads,
}

impl Recompute {
    fn take_output(&self) -> Result<Tensor> {
        let out = self
            .output
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        out.ok_or_else(|| candle_core::Error::Msg("recompute: forward ran twice".into()))
    }

    /// The output's storage, copied out of its tensor (which is then freed).
    fn output_storage<S>(&self, pick: impl Fn(&Storage) -> Option<&S>) -> Result<(S, Shape)>
    where
        S: BackendStorage,
    {
        crate::ops::lean::take_storage(&self.take_output()?, pick, "recompute")
    }
}

impl Recompute {
    fn record_graph(&self, loss: &Tensor, casts: Vec<Tensor>) {
        let mut seen = StorageSet::default();
        seen.add_all(
            self.blocks
                .iter()
                .flat_map(Block::vars)
                .map(|v| v.as_tensor()),
        );
        seen.add_all(&casts);
        let bytes = activation_bytes(loss, &mut seen);
        self.grads.0.graph_bytes.fetch_max(bytes, Ordering::Relaxed);
    }
}

impl CustomOp1 for Recompute {
    fn name(&self) -> &'static str {
        "checkpointed-blocks"
    }

    fn cpu_fwd(&self, _x: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.output_storage(|s| match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        })
    }

    fn cuda_fwd(&self, _x: &CudaStorage, _l: &Layout) -> Result<(CudaStorage, Shape)> {
        self.output_storage(|s| match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        })
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let input = Var::from_tensor(&x.detach())?;
        let mut weights = Weights::new(self.dtype, Some(&self.grads));
        let mut y = input.as_tensor().clone();
        for block in &self.blocks {
            y = block.forward(&y, &self.dims, &mut weights)?;
        }
        // d/dy of sum(y · g) is g exactly (1 · g), so the blocks see the incoming gradient.
        let loss = (y * grad.detach())?.sum_all()?;
        self.record_graph(&loss, weights.into_casts());
        let store = loss.backward()?;
        let mut held = lock(&self.grads.0.grads);
        for var in self.blocks.iter().flat_map(Block::vars) {
            if let Some(g) = store.get(var.as_tensor()) {
                held.insert(var.id(), g.detach());
            }
        }
        Ok(store.get(input.as_tensor()).map(Tensor::detach))
    }
}
