//! The CUDA default memory pool's counters (`cuda` builds). cudarc allocates with
//! `cuMemAllocAsync` from the device's default pool, so the pool's "used" figure is the bytes
//! Candle's tensors hold, and its resettable high-water mark gives per-phase peaks.

use std::ffi::c_void;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext};
use candle_core::Device;

use super::gpu::{GpuSource, SampleError};
use super::ledger::TotalMeter;
use crate::telemetry::{DeviceEvent, MemorySource};

use sys::CUmemPool_attribute::{
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT as RESERVED, CU_MEMPOOL_ATTR_USED_MEM_CURRENT as USED,
    CU_MEMPOOL_ATTR_USED_MEM_HIGH as USED_HIGH,
};

/// The default memory pool of one CUDA device, read for its used, reserved and peak bytes.
pub(crate) struct CudaPool {
    ctx: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
}

// SAFETY: the pool handle names a driver object owned by the device, valid for the process;
// every call binds the context to the calling thread first.
unsafe impl Send for CudaPool {}

impl CudaPool {
    /// The pool of `device`; an error when it is not a CUDA device or does not allocate from
    /// a pool.
    pub(crate) fn for_device(device: &Device) -> Result<CudaPool, SampleError> {
        let ctx = device
            .as_cuda_device()
            .map_err(|e| SampleError::CudaPool(e.to_string()))?
            .cuda_stream()
            .context()
            .clone();
        if !ctx.has_async_alloc() {
            return Err(SampleError::CudaPool(
                "this GPU does not allocate from a pool".into(),
            ));
        }
        ctx.bind_to_thread()
            .map_err(|e| SampleError::CudaPool(e.to_string()))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: the context is bound to this thread and `pool` is a valid out-pointer.
        check(unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) })?;
        Ok(CudaPool { ctx, pool })
    }

    fn get(&self, attr: sys::CUmemPool_attribute) -> Result<u64, SampleError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| SampleError::CudaPool(e.to_string()))?;
        let mut value: u64 = 0;
        let out = &mut value as *mut u64 as *mut c_void;
        // SAFETY: the context is bound; every attribute read here is a u64, which `out` holds.
        check(unsafe { sys::cuMemPoolGetAttribute(self.pool, attr, out) })?;
        Ok(value)
    }
}

fn check(r: sys::CUresult) -> Result<(), SampleError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(SampleError::CudaPool(format!("{r:?}")))
    }
}

impl TotalMeter for CudaPool {
    fn source(&self) -> MemorySource {
        MemorySource::CudaPool
    }
    fn unified(&self) -> bool {
        false
    }
    fn live(&self) -> u64 {
        self.get(USED).unwrap_or(0)
    }
    fn peak(&self) -> u64 {
        self.get(USED_HIGH).unwrap_or(0)
    }
    fn reset_peak(&self) {
        // Writing 0 resets the high-water mark to the current use.
        if self.ctx.bind_to_thread().is_ok() {
            let mut zero: u64 = 0;
            let value = &mut zero as *mut u64 as *mut c_void;
            // SAFETY: the context is bound; USED_HIGH takes a u64, which `value` points to.
            let _ = unsafe { sys::cuMemPoolSetAttribute(self.pool, USED_HIGH, value) };
        }
    }
}

impl GpuSource for CudaPool {
    fn source(&self) -> MemorySource {
        MemorySource::CudaPool
    }
    fn sample(&mut self) -> Result<DeviceEvent, SampleError> {
        Ok(DeviceEvent {
            source: MemorySource::CudaPool,
            used: Some(self.get(USED)?),
            reserved: Some(self.get(RESERVED)?),
            peak: Some(self.get(USED_HIGH)?),
            ..DeviceEvent::default()
        })
    }
}
