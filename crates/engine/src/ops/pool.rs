//! The threads the fused CPU ops share their row blocks with, and whether they use them.
//!
//! The work is split by shape alone, so the pool and the calling thread alone give the same bits;
//! only the time differs. When another process wants the cores, the calling thread alone can be
//! faster (`train::pool_governor` measures and chooses; `serial` switches).
//!
//! Why a pool of our own rather than Candle's: Candle's barrier pool makes the caller wait, spinning,
//! for every worker it signalled, started or not, so one worker descheduled by another process
//! stalls each product for a time slice. Here the caller and the workers take chunks from one
//! cursor, and the caller waits only for workers that took part; a worker that wakes after the
//! chunks are gone leaves the job alone. Idle workers spin briefly, then sleep.

use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::thread::Thread;

thread_local! {
    static SERIAL: Cell<bool> = const { Cell::new(false) };
}

/// Threads of the CPU path: Candle's count (`RAYON_NUM_THREADS`, else the physical cores), at
/// most the CPUs this process may run on (its affinity mask and cgroup quota): a second thread
/// on the one CPU a container grants only waits. The pool, the workspace and the estimator all
/// read this.
pub fn cpu_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
        candle_core::utils::get_num_threads().clamp(1, allowed)
    })
}

/// Threads the fused ops on this thread may use: 1 while `serial` is on, else `cpu_threads`.
pub(crate) fn threads() -> usize {
    if SERIAL.with(Cell::get) {
        1
    } else {
        cpu_threads()
    }
}

/// Run this thread's fused ops without the pool (`true`) until the guard drops. Thread-local,
/// as `force_lean` is.
pub(crate) fn serial(on: bool) -> SerialGuard {
    SerialGuard {
        previous: SERIAL.with(|c| c.replace(on)),
    }
}

/// Restores the thread's previous choice when dropped.
#[must_use = "the choice lasts only while the guard lives"]
pub(crate) struct SerialGuard {
    previous: bool,
}

impl Drop for SerialGuard {
    fn drop(&mut self) {
        SERIAL.with(|c| c.set(self.previous));
    }
}

/// For a program's `main`, before it starts any thread: Candle's element-wise kernels run on the
/// calling thread. Their pool makes the caller spin until every worker it signalled has run, so
/// beside another busy process each large add (every backward node above 64K elements) waits a
/// time slice for a descheduled worker, and its spinning workers take the cores this pool's
/// products need (docs/PERFORMANCE.md). An explicit `CANDLE_NUM_THREADS` is kept.
pub fn configure_process() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // Candle sizes its pool from this variable when it first uses it, later in the run.
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// `f` over disjoint ranges covering `0..units`: on the pool when this thread may use more than
/// one thread, else here. Ranges are about an eighth of a thread's share, so a slow thread's
/// work is taken by the others.
pub(crate) fn for_chunks(units: usize, f: impl Fn(Range<usize>) + Sync) {
    let threads = threads();
    if units <= 1 || threads <= 1 {
        f(0..units);
        return;
    }
    let chunk = units.div_ceil(threads * 8).max(1);
    pool().run(units, chunk, &f);
}

/// Start the pool's workers (each allocates `gemm`'s thread-local workspace as it starts) and
/// wait until they have; nothing when this thread runs alone.
pub(crate) fn start_workers() {
    if cpu_threads() > 1 {
        pool();
    }
}

/// Spins an idle worker makes before it sleeps: enough to catch the next product of a step
/// (tens of microseconds), short enough to give the core away when the step is done.
const IDLE_SPINS: u32 = 20_000;

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::start(cpu_threads() - 1))
}

/// One job: a lifetime-erased `&dyn Fn(Range)`, valid while the job is open or taken part in.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(Range<usize>) + Sync),
    units: usize,
    chunk: usize,
}

// SAFETY: `f` is `Sync` and `Pool::run` keeps it alive until no worker can reach it.
unsafe impl Send for Job {}

struct Slot {
    /// Bumped for every job; a worker takes part in a generation at most once.
    generation: u64,
    /// The open job; `None` once the caller has closed it.
    job: Option<Job>,
    /// Workers taking part in the current job.
    active: usize,
}

struct Pool {
    slot: Mutex<Slot>,
    /// Workers sleep here between jobs.
    wake: Condvar,
    /// Mirrors `slot.generation` for spinning workers.
    generation: AtomicUsize,
    cursor: AtomicUsize,
    /// Set when the last worker taking part has finished; the caller sleeps on `done`.
    finished: AtomicBool,
    caller: Mutex<Option<Thread>>,
    panicked: AtomicBool,
    /// Serialises callers: one job at a time.
    call: Mutex<()>,
}

impl Pool {
    /// A pool of `workers` threads besides its callers, alive for the rest of the process.
    // A process that cannot start a thread at its first product cannot train; the panic says so.
    #[allow(clippy::expect_used)]
    fn start(workers: usize) -> &'static Pool {
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            slot: Mutex::new(Slot {
                generation: 0,
                job: None,
                active: 0,
            }),
            wake: Condvar::new(),
            generation: AtomicUsize::new(0),
            cursor: AtomicUsize::new(0),
            finished: AtomicBool::new(true),
            caller: Mutex::new(None),
            panicked: AtomicBool::new(false),
            call: Mutex::new(()),
        }));
        let ready = std::sync::Arc::new(std::sync::Barrier::new(workers + 1));
        for i in 0..workers {
            let ready = ready.clone();
            std::thread::Builder::new()
                .name(format!("gaccwb-cpu-{i}"))
                .spawn(move || {
                    crate::ops::workspace::touch();
                    ready.wait();
                    pool.work();
                })
                .expect("spawning a CPU pool thread");
        }
        ready.wait();
        pool
    }

    /// `f` over `0..units` in chunks of `chunk`, the caller taking part; returns when every
    /// chunk is done and no worker holds `f`.
    fn run(&self, units: usize, chunk: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let _one_at_a_time = self.call.lock().unwrap_or_else(|e| e.into_inner());
        self.cursor.store(0, Ordering::Relaxed);
        self.finished.store(false, Ordering::Relaxed);
        *self.caller.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::thread::current());
        // SAFETY: the job is closed below, and this function returns only once no worker
        // takes part, so no worker dereferences `f` after it is gone.
        let f_static: *const (dyn Fn(Range<usize>) + Sync) = unsafe { std::mem::transmute(f) };
        {
            let mut slot = self.lock_slot();
            slot.generation += 1;
            slot.job = Some(Job {
                f: f_static,
                units,
                chunk,
            });
            slot.active = 0;
            self.generation
                .store(slot.generation as usize, Ordering::Release);
        }
        self.wake.notify_all();
        // A panic here must still close the job and wait for the workers: they hold `f`.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.take_chunks(f, units, chunk)
        }));
        if ran.is_err() {
            self.cursor.store(units, Ordering::Relaxed);
        }
        let active = {
            let mut slot = self.lock_slot();
            slot.job = None;
            slot.active
        };
        if active > 0 {
            self.wait_finished();
        }
        if let Err(payload) = ran {
            std::panic::resume_unwind(payload);
        }
        if self.panicked.swap(false, Ordering::Relaxed) {
            panic!("a CPU pool thread panicked in a fused op");
        }
    }

    fn lock_slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take_chunks(&self, f: &(dyn Fn(Range<usize>) + Sync), units: usize, chunk: usize) {
        loop {
            let start = self.cursor.fetch_add(chunk, Ordering::Relaxed);
            if start >= units {
                return;
            }
            f(start..units.min(start + chunk));
        }
    }

    /// The caller's wait for workers that took part: they are running chunks, so spin, then
    /// sleep (a worker descheduled mid-chunk should not cost a spinning core).
    fn wait_finished(&self) {
        for _ in 0..IDLE_SPINS {
            if self.finished.load(Ordering::Acquire) {
                return;
            }
            std::hint::spin_loop();
        }
        while !self.finished.load(Ordering::Acquire) {
            std::thread::park();
        }
    }

    /// A worker's life: wait for a generation it has not seen, take part if the job is still
    /// open, repeat.
    fn work(&self) {
        let mut seen = 0u64;
        loop {
            self.wait_for_job(seen);
            let job = {
                let mut slot = self.lock_slot();
                seen = slot.generation;
                match slot.job {
                    Some(job) => {
                        slot.active += 1;
                        job
                    }
                    None => continue,
                }
            };
            // SAFETY: the job was open when this worker registered in `active`, and the caller
            // does not return (dropping `f`) until `active` is back to zero.
            let f = unsafe { &*job.f };
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.take_chunks(f, job.units, job.chunk)
            }));
            if ran.is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            let last = {
                let mut slot = self.lock_slot();
                slot.active -= 1;
                slot.active == 0 && slot.job.is_none()
            };
            if last {
                self.finish();
            }
        }
    }

    /// The last worker out of a closed job wakes the caller. (A worker finishing while the job
    /// is still open leaves this to the caller's close: it then sees `active` at zero or waits
    /// for the last one.)
    fn finish(&self) {
        self.finished.store(true, Ordering::Release);
        if let Some(caller) = self
            .caller
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            caller.unpark();
        }
    }

    fn wait_for_job(&self, seen: u64) {
        for _ in 0..IDLE_SPINS {
            if self.generation.load(Ordering::Acquire) as u64 != seen {
                return;
            }
            std::hint::spin_loop();
        }
        let mut slot = self.lock_slot();
        while slot.generation == seen {
            slot = self.wake.wait(slot).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of its own for a test, whatever this machine's thread count.
    fn three_workers() -> &'static Pool {
        static POOL: OnceLock<&'static Pool> = OnceLock::new();
        POOL.get_or_init(|| Pool::start(3))
    }

    #[test]
    fn every_unit_runs_once_whoever_takes_it() {
        for (units, chunk) in [(1, 1), (2, 1), (7, 2), (64, 3), (1000, 16)] {
            let hits: Vec<AtomicUsize> = (0..units).map(|_| AtomicUsize::new(0)).collect();
            three_workers().run(units, chunk, &|range: Range<usize>| {
                for u in range {
                    hits[u].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{units}"
            );
        }
        // Slow chunks, so the workers take some.
        let threads = Mutex::new(std::collections::HashSet::new());
        three_workers().run(64, 1, &|_| {
            threads.lock().unwrap().insert(std::thread::current().id());
            std::thread::sleep(std::time::Duration::from_millis(2));
        });
        assert!(threads.lock().unwrap().len() > 1, "only the caller ran");
    }

    #[test]
    fn a_panic_in_a_chunk_reaches_the_caller_and_the_pool_runs_on() {
        for unit in [0, 63] {
            let hit = std::panic::catch_unwind(|| {
                three_workers().run(64, 1, &|range: Range<usize>| {
                    assert!(!range.contains(&unit), "unit {unit}")
                })
            });
            assert!(hit.is_err(), "unit {unit}");
        }
        let total = AtomicUsize::new(0);
        three_workers().run(64, 1, &|range: Range<usize>| {
            total.fetch_add(range.len(), Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 64);
    }

    #[test]
    fn callers_on_several_threads_each_get_their_units() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for round in 0..200 {
                        let units = 1 + (t * 7 + round) % 50;
                        let sum = AtomicUsize::new(0);
                        three_workers().run(units, 2, &|range: Range<usize>| {
                            sum.fetch_add(range.map(|u| u + 1).sum::<usize>(), Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), units * (units + 1) / 2);
                    }
                });
            }
        });
    }

    #[test]
    fn serial_runs_on_the_calling_thread() {
        let _serial = serial(true);
        let me = std::thread::current().id();
        for_chunks(100, |_| assert_eq!(std::thread::current().id(), me));
    }
}
