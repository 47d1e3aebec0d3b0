//! The process's counting global allocator: live bytes, peak bytes, and a peak that can be reset
//! at the start of each phase (forward, backward, optimizer step).
//!
//! It wraps `Inner`, named in exactly one place so a faster allocator can replace the system one
//! without touching the counting. Counting costs two relaxed atomic operations per allocation
//! (one more only when a new peak is set).

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The allocator that does the real work.
type Inner = std::alloc::System;
const INNER: Inner = std::alloc::System;

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static HIGH_WATER: AtomicU64 = AtomicU64::new(0);

/// Counts bytes in flight through `Inner`.
pub struct CountingAlloc;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn added(bytes: usize) {
    let live = LIVE.fetch_add(bytes as u64, Relaxed) + bytes as u64;
    if live > PEAK.load(Relaxed) {
        PEAK.fetch_max(live, Relaxed);
        if live > HIGH_WATER.load(Relaxed) {
            HIGH_WATER.fetch_max(live, Relaxed);
        }
    }
}

fn removed(bytes: usize) {
    LIVE.fetch_sub(bytes as u64, Relaxed);
}

// SAFETY: every call is forwarded unchanged to `Inner`, a correct allocator; the counters only
// observe sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's `layout` contract passes unchanged to a correct allocator.
        let p = unsafe { INNER.alloc(layout) };
        if !p.is_null() {
            added(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe { INNER.alloc_zeroed(layout) };
        if !p.is_null() {
            added(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `INNER` with `layout` (the caller's contract).
        unsafe { INNER.dealloc(ptr, layout) };
        removed(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as in `dealloc`, with the caller's `new_size` contract.
        let p = unsafe { INNER.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            removed(layout.size());
            added(new_size);
        }
        p
    }
}

/// Bytes currently allocated by the whole process (every thread).
pub fn live() -> u64 {
    LIVE.load(Relaxed)
}

/// Highest `live()` since the last `reset_peak()` (or since the process started).
pub fn peak() -> u64 {
    PEAK.load(Relaxed).max(live())
}

/// Highest `live()` since the process started (never reset).
pub fn high_water() -> u64 {
    HIGH_WATER.load(Relaxed).max(live())
}

/// Start a new peak window at the current live figure.
pub fn reset_peak() {
    PEAK.store(live(), Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_a_large_allocation_and_its_release() {
        // Other test threads allocate too; a 64 MiB buffer stands far above their noise.
        const N: usize = 64 << 20;
        let before = live();
        reset_peak();
        let buffer = vec![1u8; N];
        let during = live();
        assert!(
            during >= before + N as u64 - (1 << 20),
            "{before} → {during}"
        );
        drop(buffer);
        assert!(peak() >= before + N as u64 - (1 << 20));
        assert!(live() < during - N as u64 / 2);
    }
}
