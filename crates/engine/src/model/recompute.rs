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
use crate::tensors::{activation_bytes, StorageSet};

/// Parameter gradients computed outside the loss's graph, by parameter (`Var`) id, and the size
/// of the largest graph a recompute built.
#[derive(Clone, Default)]
pub struct ParamGrads(Arc<Held>);

#[derive(Default)]
struct Held {
    grads: Mutex<HashMap<TensorId, Tensor>>,
    /// Bytes of the largest recomputed graph (the input's copy, the blocks' activations, the
    /// `y · grad` product), parameters and compute weights not counted.
    graph_bytes: AtomicU64,
}

impl ParamGrads {
    /// The gradient of `var`: from the loss's `store`, or else from the recomputed blocks.
    pub fn get(&self, store: &GradStore, var: &Var) -> Option<Tensor> {
        match store.get(var.as_tensor()) {
            Some(g) => Some(g.detach()),
            None => self.lock().remove(&var.id()),
        }
    }

    /// Add `grad` to what is held for `var` (a gradient computed outside the loss's graph).
    pub(super) fn add(&self, var: &Var, grad: Tensor) -> Result<()> {
        let mut held = self.lock();
        let sum = match held.remove(&var.id()) {
            Some(before) => (before + grad)?,
            None => grad,
        };
        held.insert(var.id(), sum);
        Ok(())
    }

    /// The gradients held here, not yet taken.
    pub fn tensors(&self) -> Vec<Tensor> {
        self.lock().values().cloned().collect()
    }

    /// Bytes of the largest graph one recompute kept (0 before the backward, or without
    /// checkpointing): the activations the backward adds at its peak.
    pub fn recomputed_graph_bytes(&self) -> u64 {
        self.0.graph_bytes.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TensorId, Tensor>> {
        self.0.grads.lock().unwrap_or_else(PoisonError::into_inner)
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
        let mut held = self.grads.lock();
        for var in self.blocks.iter().flat_map(Block::vars) {
            if let Some(g) = store.get(var.as_tensor()) {
                held.insert(var.id(), g.detach());
            }
        }
        Ok(store.get(input.as_tensor()).map(Tensor::detach))
    }
}
