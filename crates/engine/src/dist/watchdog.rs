//! Ends a rank that has waited in a collective past the timeout.
//!
//! A collective blocks until every rank joins. A rank that died is noticed by the MPI launcher,
//! which ends the others; a rank that is alive but stuck (stopped, swapping, deadlocked) is not.
//! The watchdog is the rank's own limit: past the timeout it says what it was waiting for and
//! exits non-zero, which the launcher turns into the end of the whole job.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// What this process does with a timed-out collective before it exits: the run's recorder
/// writes its `end` (set by the command line, which holds the recorder).
static ON_TIMEOUT: OnceLock<Hook> = OnceLock::new();

/// A closure called with the reason a collective timed out.
type Hook = Box<dyn Fn(&str) + Send + Sync>;
/// The trainer thread is stuck in a collective and must not be waited for (one timed out, or
/// the run ended while the other ranks did not answer).
static ABANDONED: AtomicBool = AtomicBool::new(false);
/// When this process entered the collective it is in: milliseconds since [`EPOCH`] plus one,
/// 0 when in none.
static ENTERED: AtomicU64 = AtomicU64::new(0);
/// The clock [`ENTERED`] counts from.
static EPOCH: OnceLock<Instant> = OnceLock::new();
/// How long the hook may take before the process exits all the same.
const LAST_WORDS: Duration = Duration::from_secs(3);

/// Call `hook` with the reason when a collective times out, before the rank exits (at most a
/// few seconds later): the recording gets its `end`. Set once per process.
pub fn on_timeout(hook: impl Fn(&str) + Send + Sync + 'static) {
    let _ = ON_TIMEOUT.set(Box::new(hook));
}

/// Whether this process's trainer thread is stuck in a collective for good (one timed out, or
/// [`abandon`] was called): it is not waited for.
pub fn abandoned() -> bool {
    ABANDONED.load(Ordering::SeqCst)
}

/// The run ends without the trainer thread, which is stuck in a collective.
pub fn abandon() {
    ABANDONED.store(true, Ordering::SeqCst);
}

/// When this process entered the collective it is waiting in, if it is in one.
pub fn collective_entered() -> Option<Instant> {
    let epoch = *EPOCH.get()?;
    match ENTERED.load(Ordering::SeqCst) {
        0 => None,
        ms => Some(epoch + Duration::from_millis(ms - 1)),
    }
}

/// The collective in progress, if any.
type Waiting = Option<(Instant, &'static str)>;

pub(super) struct Watchdog {
    waiting: Arc<Mutex<Waiting>>,
}

impl Watchdog {
    /// Watches this rank's collectives from a thread of its own.
    pub(super) fn start(rank: usize, timeout: Duration) -> Watchdog {
        let waiting: Arc<Mutex<Waiting>> = Arc::default();
        let watched = Arc::clone(&waiting);
        let tick = (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let spawned = std::thread::Builder::new()
            .name("gaccwb-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(tick);
                let current = *watched.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some((since, what)) = current {
                    if since.elapsed() > timeout {
                        let why = format!(
                            "rank {rank}: {what}: no answer from the other ranks in {} s \
                             (train.comm_timeout); ending this rank",
                            timeout.as_secs_f64()
                        );
                        eprintln!("gaccwb: {why}");
                        abandon();
                        if let Some(hook) = ON_TIMEOUT.get() {
                            hook(&why);
                            std::thread::sleep(LAST_WORDS);
                        }
                        std::process::exit(1);
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no watchdog over collectives ({e}): a stuck rank will hang the run");
        }
        Watchdog { waiting }
    }

    pub(super) fn enter(&self, what: &'static str) {
        let now = Instant::now();
        let epoch = *EPOCH.get_or_init(|| now);
        ENTERED.store(
            now.duration_since(epoch).as_millis() as u64 + 1,
            Ordering::SeqCst,
        );
        *self.waiting.lock().unwrap_or_else(PoisonError::into_inner) = Some((now, what));
    }

    pub(super) fn leave(&self) {
        ENTERED.store(0, Ordering::SeqCst);
        *self.waiting.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}
