//! Ends a rank that has waited in a collective past the timeout.
//!
//! A collective blocks until every rank joins. A rank that died is noticed by the MPI launcher,
//! which ends the others; a rank that is alive but stuck (stopped, swapping, deadlocked) is not.
//! The watchdog is the rank's own limit: past the timeout it says what it was waiting for and
//! exits non-zero, which the launcher turns into the end of the whole job.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

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
                        eprintln!(
                            "gaccwb: rank {rank}: {what}: no answer from the other ranks in {} s \
                             (train.comm_timeout); ending this rank",
                            timeout.as_secs_f64()
                        );
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
        *self.waiting.lock().unwrap_or_else(PoisonError::into_inner) = Some((Instant::now(), what));
    }

    pub(super) fn leave(&self) {
        *self.waiting.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}
