//! Lean versions of the composite ops: the same functions, built from Candle tensor ops that
//! exist on every backend (so the code CUDA runs is the code the CPU tests run), but with their
//! own backward and only what that backward needs kept for it.
//!
//! Candle's autograd keeps every intermediate of a composite expression (each op holds its
//! inputs). Here each op runs its forward on detached inputs, so none of its intermediates
//! becomes a graph node, and joins the graph through one custom op (`apply`) whose output is
//! that result and whose inputs are the op's own inputs: those and the output are the only
//! nodes. Small per-row tensors the backward reuses (a layer norm's mean and reciprocal std,
//! attention's log-sum-exp) ride in the op and are booked beside its output
//! (`tensors::keep_beside`), so the ledger counts them. The backward rebuilds what it needs
//! from those with ordinary tensor ops on detached tensors, so the gradients it returns
//! reference no graph.
//!
//! What each keeps: attention, its `qkv` input and its output plus an f32 log-sum-exp per
//! (sequence, head, row), and no `T×T` tensor (`attention`); layer norm, its input plus an f32
//! mean and reciprocal std per row, RMS norm its input and a reciprocal root mean square (`norm`); the linear layers and the MLP's output layer,
//! their input (for the MLP the GELU's input, not its output: `linear`); the LM head and loss,
//! nothing but its input and weight, its logits made and dropped a chunk of rows at a time
//! (`head`).

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Storage,
    Tensor,
};

use crate::tensors::{keep_beside, KeptBeside};

mod attention;
mod branch;
mod head;
mod linear;
mod norm;

pub use attention::{causal_attention, sequences_per_chunk};
pub use branch::branch;
pub use head::{chunk_rows as head_chunk_rows, linear_nll_sum};
pub use linear::{gelu_linear, linear};
pub use norm::{layer_norm, rms_norm};

/// A lean op's backward: from its inputs and its output (both detached) and the incoming
/// gradient, one gradient per input (`None`: no gradient flows there).
type Backward =
    Box<dyn Fn(&[Tensor], &Tensor, &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// `output`, already computed from `inputs` (detached), joined to the graph as the result of one
/// op of those inputs whose backward is `backward`. `kept` are the tensors `backward` holds
/// besides the inputs and the output, booked for the ledger. Without a graph (no input tracks
/// one) the output is returned as it is.
pub fn apply(
    name: &'static str,
    inputs: &[&Tensor],
    output: Tensor,
    kept: Vec<Tensor>,
    backward: impl Fn(&[Tensor], &Tensor, &Tensor) -> Result<Vec<Option<Tensor>>>
        + Send
        + Sync
        + 'static,
) -> Result<Tensor> {
    if !inputs.iter().any(|t| t.track_op()) {
        return Ok(output);
    }
    let booking = Arc::new(Mutex::new(None));
    let op = Lean {
        name,
        arity: inputs.len(),
        tracks: inputs.iter().map(|t| t.track_op()).collect(),
        output: Mutex::new(Some(output.contiguous()?)),
        backward: Box::new(backward),
        _booking: booking.clone(),
    };
    let y = match inputs {
        [a] => a.apply_op1(op)?,
        [a, b] => a.apply_op2(b, op)?,
        [a, b, c] => a.apply_op3(b, c, op)?,
        _ => candle_core::bail!("{name}: a lean op takes 1 to 3 inputs"),
    };
    if !kept.is_empty() {
        *booking.lock().unwrap_or_else(PoisonError::into_inner) = Some(keep_beside(&y, kept));
    }
    Ok(y)
}

struct Lean {
    name: &'static str,
    arity: usize,
    /// Which inputs take part in the graph: the others (a frozen weight) get no gradient.
    tracks: Vec<bool>,
    /// The result, computed before the op runs; handed over once by the forward.
    output: Mutex<Option<Tensor>>,
    backward: Backward,
    /// The ledger's booking of what `backward` keeps; released with the op.
    _booking: Arc<Mutex<Option<KeptBeside>>>,
}

impl Lean {
    /// The output's storage, copied out of its tensor (which is then freed).
    fn output_storage<S: BackendStorage>(
        &self,
        pick: impl Fn(&Storage) -> Option<&S>,
    ) -> Result<(S, Shape)> {
        let taken = self
            .output
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let y =
            taken.ok_or_else(|| candle_core::Error::Msg(format!("{}: ran twice", self.name)))?;
        take_storage(&y, pick, self.name)
    }

    fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        self.output_storage(|s| match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        })
    }

    fn cuda(&self) -> Result<(CudaStorage, Shape)> {
        self.output_storage(|s| match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        })
    }

    fn grads(
        &self,
        inputs: &[&Tensor],
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let inputs: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        let grads = (self.backward)(&inputs, &res.detach(), &grad.detach())?;
        if grads.len() != self.arity {
            candle_core::bail!(
                "{}: {} gradients for {} inputs",
                self.name,
                grads.len(),
                self.arity
            );
        }
        Ok(grads
            .into_iter()
            .zip(&self.tracks)
            .map(|(g, &tracks)| g.filter(|_| tracks))
            .collect())
    }
}

/// A contiguous tensor's storage, copied out for a custom op's forward to return.
pub fn take_storage<S: BackendStorage>(
    y: &Tensor,
    pick: impl Fn(&Storage) -> Option<&S>,
    op: &str,
) -> Result<(S, Shape)> {
    let (storage, layout) = y.storage_and_layout();
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        candle_core::bail!("{op}: the result must be contiguous");
    }
    let s = pick(&storage)
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: result on another device")))?;
    Ok((s.try_clone(layout)?, layout.shape().clone()))
}

impl CustomOp1 for Lean {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu()
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        self.cuda()
    }

    fn bwd(&self, a: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut g = self.grads(&[a], res, grad)?;
        Ok(g.remove(0))
    }
}

impl CustomOp2 for Lean {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu()
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.cuda()
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b], res, grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for Lean {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu()
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.cuda()
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b, c], res, grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}
