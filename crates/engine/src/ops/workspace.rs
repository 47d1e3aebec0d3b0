//! `gemm`'s packing workspace, the CPU's part of the ledger's `other`: one slab the size of the
//! L2 cache on every thread that has ever multiplied, allocated on that thread's first product
//! and held until the thread ends. The fused ops (every dtype: f32 arithmetic on f32, bf16 or
//! f16 storage) multiply on the caller and the CPU pool (`ops::pool`); bf16 products on AMX
//! tiles or AVX-512 BF16 (`ops::fused::tiles`) pack into the same slab. Left to chance, the slab
//! count depends on which products happened to be large enough to split, so `reserve` allocates
//! the slabs on all those threads at once and `bytes` predicts exactly what is then held.
//! (Under `GACCWB_KERNELS=lean` Candle's own matmul multiplies on rayon's pool instead,
//! which this does not predict.)

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::Mutex;
use std::thread::ThreadId;

/// Threads holding a slab because `reserve` put it there (and still running: a caller leaves
/// the set when its thread ends, as its slab is freed then).
#[derive(Default)]
struct Reserved {
    callers: Option<HashSet<ThreadId>>,
    cpu_pool: bool,
}

static RESERVED: Mutex<Reserved> = Mutex::new(Reserved {
    callers: None,
    cpu_pool: false,
});

/// A reserved caller's mark: dropped when its thread ends, which takes the thread out of
/// `RESERVED`. Without it a process that starts many trainer threads, one after another (a
/// test binary), would count slabs long freed: 55 of them, 110 MiB, at 2 MiB of L2.
struct Caller(Cell<Option<ThreadId>>);

impl Drop for Caller {
    fn drop(&mut self) {
        if let Some(id) = self.0.get() {
            let mut r = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(callers) = r.callers.as_mut() {
                callers.remove(&id);
            }
        }
    }
}

thread_local! {
    static CALLER: Caller = const { Caller(Cell::new(None)) };
}

/// Bytes of one thread's slab.
pub fn slab_bytes() -> u64 {
    gemm_common::cache::CACHE_INFO[1].cache_bytes as u64
}

/// Allocate this thread's slab (the first touch of `gemm`'s thread-local allocates it).
pub(crate) fn touch() {
    gemm_common::gemm::L2_SLAB.with(|_| ());
}

/// Put the slabs on the calling thread (the trainer's) and the CPU pool. Cheap after the first
/// call.
pub fn reserve() {
    let threads = crate::ops::pool::cpu_threads();
    let mut r = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
    if r.callers
        .get_or_insert_with(HashSet::new)
        .insert(std::thread::current().id())
    {
        touch();
        CALLER.with(|c| c.0.set(Some(std::thread::current().id())));
    }
    if threads > 1 && !r.cpu_pool {
        crate::ops::pool::start_workers();
        r.cpu_pool = true;
    }
}

/// Bytes of workspace a CPU run holds in this process: the slabs of the reserved callers still
/// running (at least this one) and of the CPU pool's workers.
pub fn bytes() -> u64 {
    let threads = crate::ops::pool::cpu_threads();
    let r = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
    let callers = r.callers.as_ref().map_or(0, HashSet::len).max(1);
    (callers + threads - 1) as u64 * slab_bytes()
}
