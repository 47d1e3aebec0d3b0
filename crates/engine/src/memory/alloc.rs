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

/// Blocks of at least this many bytes are aligned to a cache line (`LINE`).
const LARGE: usize = 4096;
/// A cache line: AMX tile loads and stores whose rows cross lines run at a fraction of their
/// rate (a 16-byte-aligned product destination measured 10-20% slower, docs/PERFORMANCE.md),
/// and the system allocator aligns large blocks to 16 bytes only.
const LINE: usize = 64;

/// The layout a block is allocated with: `layout`, aligned to a cache line when large. One
/// rule for allocation and release, so both see the same layout.
fn inner_layout(layout: Layout) -> Layout {
    if layout.size() >= LARGE && layout.align() < LINE {
        // Cannot fail: LINE is a power of two, and the size was valid at a smaller alignment
        // and stays below isize::MAX rounded to LINE (sizes that large never allocate).
        layout.align_to(LINE).unwrap_or(layout)
    } else {
        layout
    }
}

// SAFETY: every call is forwarded to `Inner`, a correct allocator, with the caller's layout or
// the same size at a larger alignment (`inner_layout`, the same rule for every call on one
// block); the counters only observe sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's `layout` contract passes to a correct allocator, only aligned more.
        let p = unsafe { INNER.alloc(inner_layout(layout)) };
        if !p.is_null() {
            added(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe { INNER.alloc_zeroed(inner_layout(layout)) };
        if !p.is_null() {
            added(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `INNER` with `inner_layout(layout)` (the caller's contract).
        unsafe { INNER.dealloc(ptr, inner_layout(layout)) };
        removed(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (old, new) = (
            inner_layout(layout),
            // SAFETY: the caller's contract: `new_size` is valid at `layout`'s alignment.
            inner_layout(unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) }),
        );
        let p = if old.align() == new.align() {
            // SAFETY: as in `dealloc`, with the caller's `new_size` contract.
            unsafe { INNER.realloc(ptr, old, new_size) }
        } else {
            // The block crosses `LARGE`: move it to a block of the new alignment.
            // SAFETY: `new` is a valid layout; the copy reads the old block's bytes that both
            // hold; `ptr` came from `INNER` with `old`.
            unsafe {
                let p = INNER.alloc(new);
                if !p.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    INNER.dealloc(ptr, old);
                }
                p
            }
        };
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
