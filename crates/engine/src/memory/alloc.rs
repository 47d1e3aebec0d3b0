//! The process's counting global allocator: live bytes, peak bytes, and a peak that can be reset
//! at the start of each phase (forward, backward, optimizer step).
//!
//! It wraps `Inner`, named in exactly one place so a faster allocator can replace the system one
//! without touching the counting. Counting costs two relaxed atomic operations per allocation
//! (one more only when a new peak is set). Blocks of 4 KiB and more are handed out on a cache
//! line (`large_alloc`); the counters count the sizes asked for.

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
/// A cache line: AMX tile loads and stores whose rows cross lines run slower (docs/PERFORMANCE.md),
/// and the system allocator aligns large blocks to 16 bytes only.
const LINE: usize = 64;
/// Bytes a large block asks `Inner` for beyond its size: room to reach the next line past the
/// word that records how far back the block starts.
const SLACK: usize = LINE + WORD;
const WORD: usize = std::mem::size_of::<usize>();

/// Whether a block is handed out on a cache line (`large_alloc`).
fn is_large(layout: Layout) -> bool {
    layout.size() >= LARGE && layout.align() < LINE
}

/// The block `Inner` holds for a large `layout`: `SLACK` bytes more, word-aligned (`None` past
/// the largest size a layout may have).
fn padded(layout: Layout) -> Option<Layout> {
    let size = layout.size().checked_add(SLACK)?;
    Layout::from_size_align(size, layout.align().max(WORD)).ok()
}

/// A large block on a cache line, inside a `padded` block of `Inner`'s: the distance back to
/// that block's start sits in the word just before the pointer. Over-allocating, not asking
/// `Inner` for the alignment: asking glibc for it faulted fresh pages in every step (measured:
/// 9,258 page faults a step against 1,132 this way, GPT-2-small in bf16 at two threads).
///
/// # Safety
/// `layout` is large (`is_large`); `zeroed` asks `Inner` for zeroed bytes.
unsafe fn large_alloc(layout: Layout, zeroed: bool) -> *mut u8 {
    let Some(outer) = padded(layout) else {
        return std::ptr::null_mut();
    };
    // SAFETY: a valid layout, not zero-sized.
    let base = unsafe {
        match zeroed {
            true => INNER.alloc_zeroed(outer),
            false => INNER.alloc(outer),
        }
    };
    if base.is_null() {
        return base;
    }
    let back = (base as usize + WORD).next_multiple_of(LINE) - base as usize;
    // SAFETY: WORD ≤ back < SLACK, so the pointer and its size lie in the padded block, and
    // the word before it (8-aligned: the pointer is on a line) too.
    unsafe {
        let p = base.add(back);
        p.cast::<usize>().sub(1).write(back);
        p
    }
}

/// Releases a block from `large_alloc`.
///
/// # Safety
/// `ptr` came from `large_alloc(layout, _)`.
unsafe fn large_dealloc(ptr: *mut u8, layout: Layout) {
    // SAFETY: `large_alloc` wrote the distance back to the padded block's start before `ptr`,
    // and allocated it with `padded(layout)`, which was `Some` then and is the same now.
    unsafe {
        let back = ptr.cast::<usize>().sub(1).read();
        INNER.dealloc(ptr.sub(back), padded(layout).unwrap_unchecked());
    }
}

// SAFETY: small blocks are forwarded unchanged to `Inner`, a correct allocator; large ones are
// carved out of a larger block of `Inner`'s and released through the distance recorded beside
// them (`large_alloc`); the counters only observe sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's `layout` contract.
        let p = unsafe {
            match is_large(layout) {
                true => large_alloc(layout, false),
                false => INNER.alloc(layout),
            }
        };
        if !p.is_null() {
            added(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe {
            match is_large(layout) {
                true => large_alloc(layout, true),
                false => INNER.alloc_zeroed(layout),
            }
        };
        if !p.is_null() {
            added(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with `layout` (the caller's contract), so from the
        // same branch.
        unsafe {
            match is_large(layout) {
                true => large_dealloc(ptr, layout),
                false => INNER.dealloc(ptr, layout),
            }
        }
        removed(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract: `new_size` is valid at `layout`'s alignment.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if !is_large(layout) && !is_large(new) {
            // SAFETY: as in `dealloc`, with the caller's `new_size` contract.
            let p = unsafe { INNER.realloc(ptr, layout, new_size) };
            if !p.is_null() {
                removed(layout.size());
                added(new_size);
            }
            return p;
        }
        // A large block on either side moves: a new block, the bytes both hold, the old freed.
        // SAFETY: `new` is valid; `ptr` came from this allocator with `layout`.
        unsafe {
            let p = self.alloc(new);
            if !p.is_null() {
                std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            p
        }
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

    /// Large blocks start on a cache line, zeroed when asked, and keep their bytes when they
    /// grow and shrink across the large size.
    #[test]
    fn large_blocks_sit_on_a_cache_line_and_keep_their_bytes_across_reallocation() {
        let on_line = |p: *const u8| (p as usize).is_multiple_of(LINE);
        for size in [LARGE, LARGE + 4, 3 * LARGE + 12, 1 << 20] {
            let v = vec![0u8; size];
            assert!(on_line(v.as_ptr()), "{size} bytes, zeroed");
            assert!(v.iter().all(|&b| b == 0));
            let w: Vec<f32> = Vec::with_capacity(size / 4);
            assert!(on_line(w.as_ptr().cast()), "{size} bytes");
        }
        // Grows from small to large and shrinks back: moved, bytes kept.
        let mut v: Vec<u32> = (0..100).collect();
        v.reserve_exact(5000);
        assert!(on_line(v.as_ptr().cast()));
        v.extend(100..5000);
        v.truncate(50);
        v.shrink_to_fit();
        assert_eq!(v, (0..50).collect::<Vec<_>>());
    }
}
