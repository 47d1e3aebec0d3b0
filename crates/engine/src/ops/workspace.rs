//! `gemm`'s packing workspace, the CPU's part of the ledger's `other`: one slab the size of the
//! L2 cache on every thread that has ever multiplied, allocated on that thread's first product
//! and held until the thread ends. Which threads multiply depends on the path: the fused f32 ops
//! run on the caller and the CPU pool (`ops::pool`); Candle's own matmul (bf16, f16) on the caller and,
//! above one thread, rayon's global pool. Left to chance, the slab count depends on which
//! products happened to be large enough to split, so `reserve` allocates the slabs of a path on
//! all its threads at once and `bytes` predicts exactly what is then held.

use std::collections::HashSet;
use std::sync::Mutex;
use std::thread::ThreadId;

use crate::telemetry::Dtype;

/// Threads holding a slab because `reserve` put it there.
#[derive(Default)]
struct Reserved {
    callers: Option<HashSet<ThreadId>>,
    cpu_pool: bool,
    rayon_pool: bool,
}

static RESERVED: Mutex<Reserved> = Mutex::new(Reserved {
    callers: None,
    cpu_pool: false,
    rayon_pool: false,
});

/// Bytes of one thread's slab.
pub fn slab_bytes() -> u64 {
    gemm_common::cache::CACHE_INFO[1].cache_bytes as u64
}

/// Allocate this thread's slab (the first touch of `gemm`'s thread-local allocates it).
pub(crate) fn touch() {
    gemm_common::gemm::L2_SLAB.with(|_| ());
}

/// Candle's matmul runs on the caller alone at one thread (`Parallelism::None`).
fn uses_rayon_pool(dtype: Dtype, threads: usize) -> bool {
    dtype != Dtype::F32 && threads > 1
}

/// Put the slabs of `dtype`'s path on the calling thread (the trainer's) and the pool the path
/// multiplies on. Cheap after the first call.
pub fn reserve(dtype: Dtype) {
    let threads = crate::ops::pool::cpu_threads();
    let mut r = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
    if r.callers
        .get_or_insert_with(HashSet::new)
        .insert(std::thread::current().id())
    {
        touch();
    }
    if dtype == Dtype::F32 && threads > 1 && !r.cpu_pool {
        crate::ops::pool::start_workers();
        r.cpu_pool = true;
    }
    if uses_rayon_pool(dtype, threads) && !r.rayon_pool {
        rayon::broadcast(|_| touch());
        r.rayon_pool = true;
    }
}

/// Bytes of workspace a CPU run of `dtype` holds in this process: the slabs already reserved
/// (an earlier dtype's pool keeps its slabs) plus those `dtype`'s path needs.
pub fn bytes(dtype: Dtype) -> u64 {
    let threads = crate::ops::pool::cpu_threads();
    let r = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
    let callers = r.callers.as_ref().map_or(0, HashSet::len).max(1);
    let cpu_pool = if r.cpu_pool || dtype == Dtype::F32 {
        threads - 1
    } else {
        0
    };
    let rayon_pool = if r.rayon_pool || uses_rayon_pool(dtype, threads) {
        // `reserve` touches every thread of the pool, whatever its size.
        rayon::current_num_threads()
    } else {
        0
    };
    (callers + cpu_pool + rayon_pool) as u64 * slab_bytes()
}
