//! NCCL on the CUDA devices, for the gradients (cudarc's bindings, the `nccl` feature).
//!
//! One GPU per rank. Rank 0 makes the communicator's id and MPI carries it to the others, as
//! in Candle's multi-process example; the communicator then runs on the stream Candle's device
//! computes on, so the all-reduce is ordered after the backward that made the gradients.
//! Everything that is not a gradient (the window's token count, controls, telemetry, ZeRO's
//! host pieces) stays on MPI.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Device, Layout, Shape, Tensor};

use super::{Collectives, DistError, Transport};

/// This rank's NCCL communicator and the device it reduces on.
pub(super) struct Nccl {
    comm: Comm,
    device: Device,
    rank: usize,
}

// SAFETY: a communicator may be driven from any thread as long as no two threads call it at
// once (NCCL's thread-safety rules). `Nccl` lives inside one `Group`, which moves with the
// trainer to its thread and is never shared, so every call comes from one thread at a time.
unsafe impl Send for Nccl {}

impl Nccl {
    /// Joins the ranks of `bootstrap` in one NCCL communicator on `device` (a CUDA device);
    /// `bootstrap` (MPI) carries rank 0's id to the others (alone, there are none).
    pub(super) fn start(bootstrap: &mut dyn Transport, device: &Device) -> Result<Nccl, DistError> {
        let rank = bootstrap.rank();
        let failed = |what: String| DistError::Nccl { rank, what };
        let Device::Cuda(cuda) = device else {
            return Err(failed("NCCL needs a CUDA device".into()));
        };
        let mut id_bytes = match rank {
            0 => {
                let id = Id::new().map_err(|e| failed(format!("making the id: {e:?}")))?;
                id.internal().iter().map(|&c| c as u8).collect()
            }
            _ => Vec::new(),
        };
        bootstrap.broadcast_bytes(&mut id_bytes);
        let internal: [std::ffi::c_char; 128] = id_bytes
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|v: Vec<_>| {
                failed(format!("rank 0 sent an id of {} bytes, not 128", v.len()))
            })?;
        let comm = Comm::from_rank(
            cuda.cuda_stream(),
            rank,
            bootstrap.ranks(),
            Id::uninit(internal),
        )
        .map_err(|e| failed(format!("joining {} ranks: {e:?}", bootstrap.ranks())))?;
        Ok(Nccl {
            comm,
            device: device.clone(),
            rank,
        })
    }

    /// The sum over the ranks of `flat` (f32, on this rank's device), waited for: the time
    /// the group measures is the reduce's, not its launch's.
    fn sum(&self, flat: &Tensor) -> Result<Tensor, DistError> {
        let summed = flat.apply_op1_no_bwd(&AllReduceSum { comm: &self.comm })?;
        self.device.synchronize()?;
        Ok(summed)
    }
}

/// NCCL's sum as a Candle op: a new tensor, the input untouched.
struct AllReduceSum<'a> {
    comm: &'a Comm,
}

impl CustomOp1 for AllReduceSum<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce-sum"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL sums tensors on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("NCCL sums contiguous tensors only")
        };
        let src = storage.as_cuda_slice::<f32>()?.slice(start..end);
        let device = storage.device().clone();
        let mut dst = device.alloc_zeros::<f32>(end - start)?;
        self.comm
            .all_reduce(&src, &mut dst, &ReduceOp::Sum)
            .map_err(|e| candle_core::Error::Msg(format!("NCCL all-reduce: {e:?}")))?;
        Ok((
            CudaStorage::wrap_cuda_slice(dst, device),
            layout.shape().clone(),
        ))
    }
}

/// Another transport (MPI; alone, `Solo`) for everything, NCCL for the CUDA gradients.
pub(super) struct WithNccl {
    rest: Box<dyn Transport>,
    nccl: Nccl,
}

impl WithNccl {
    pub(super) fn new(rest: Box<dyn Transport>, nccl: Nccl) -> WithNccl {
        WithNccl { rest, nccl }
    }
}

impl Transport for WithNccl {
    fn rank(&self) -> usize {
        self.rest.rank()
    }
    fn ranks(&self) -> usize {
        self.rest.ranks()
    }
    fn sum_f32(&mut self, values: &mut [f32]) {
        self.rest.sum_f32(values)
    }
    fn sum_f64(&mut self, values: &mut [f64]) {
        self.rest.sum_f64(values)
    }
    fn sum_u64(&mut self, values: &mut [u64]) {
        self.rest.sum_u64(values)
    }
    fn max_u64(&mut self, values: &mut [u64]) {
        self.rest.max_u64(values)
    }
    fn gather_u64(&mut self, values: &[u64]) -> Vec<u64> {
        self.rest.gather_u64(values)
    }
    fn gather_f32(&mut self, values: &[f32]) -> Vec<f32> {
        self.rest.gather_f32(values)
    }
    fn reduce_scatter_f32(&mut self, values: &[f32]) -> Vec<f32> {
        self.rest.reduce_scatter_f32(values)
    }
    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>) {
        self.rest.broadcast_bytes(bytes)
    }
    fn collectives(&self) -> Collectives {
        Collectives::Nccl
    }
    fn sum_tensor(&mut self, flat: &Tensor) -> Result<Tensor, DistError> {
        if !flat.device().same_device(&self.nccl.device) {
            return Err(DistError::Nccl {
                rank: self.nccl.rank,
                what: "a tensor on another device than the communicator's".into(),
            });
        }
        self.nccl.sum(flat)
    }
}
