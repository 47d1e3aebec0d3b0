//! Whether the fused CPU ops hand their row blocks to Candle's pool or run them on the calling
//! thread. The work is split by shape alone, so both give the same bits; only the time differs.
//! When another process wants the cores, the pool's barriers wait on descheduled workers and the
//! calling thread alone is faster (`train::pool_governor` measures and chooses).

use std::cell::Cell;

thread_local! {
    static SERIAL: Cell<bool> = const { Cell::new(false) };
}

/// Threads the fused ops on this thread may use: 1 while `serial` is on, else Candle's count.
pub fn threads() -> usize {
    if SERIAL.with(Cell::get) {
        1
    } else {
        candle_core::utils::get_num_threads()
    }
}

/// Run this thread's fused ops without the pool (`true`) until the guard drops. Thread-local,
/// as `force_composite` is.
pub fn serial(on: bool) -> SerialGuard {
    SerialGuard {
        previous: SERIAL.with(|c| c.replace(on)),
    }
}

/// Restores the thread's previous choice when dropped.
#[must_use = "the choice lasts only while the guard lives"]
pub struct SerialGuard {
    previous: bool,
}

impl Drop for SerialGuard {
    fn drop(&mut self) {
        SERIAL.with(|c| c.set(self.previous));
    }
}
