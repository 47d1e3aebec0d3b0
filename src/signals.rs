//! SIGINT, SIGTERM and SIGHUP stop a run cleanly: the trainer ends at its next micro-batch, the
//! recording gets its `end`, the summary is printed and the process exits with the shell's
//! convention, 128 + the signal number (130, 143, 129).
//!
//! The handlers only record the signal in atomics (async-signal-safe); the watchers poll them
//! every few milliseconds. Nothing here needs a file descriptor, so a process that has used up
//! its descriptors (`ulimit -n`) still stops cleanly, and setting up can only fail with an
//! error, never a panic.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::time::Duration;

use crate::end::EndReason;

/// The first stopping signal this process caught (0: none).
static CAUGHT: AtomicI32 = AtomicI32::new(0);
/// The latest one, and how many arrived.
static LATEST: AtomicI32 = AtomicI32::new(0);
static COUNT: AtomicU32 = AtomicU32::new(0);
/// A run's own handling (`watch`, the screen's `Stoppers`) has taken over from `until_started`.
static STARTED: AtomicBool = AtomicBool::new(false);

/// How often the watchers look at the atomics.
const POLL: Duration = Duration::from_millis(20);

/// The run was stopped by a signal; `main` exits with `128 + signo`.
#[derive(Debug)]
pub struct Signalled(pub i32);

impl std::fmt::Display for Signalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped by {}", name(self.0))
    }
}

impl std::error::Error for Signalled {}

impl Signalled {
    pub fn exit_code(&self) -> u8 {
        EndReason::Signalled(self.0).exit_code()
    }
}

/// `SIGINT`, `SIGTERM`, `SIGHUP`, or `signal N`.
pub fn name(signo: i32) -> String {
    crate::end::signal_name(signo)
}

/// The first stopping signal caught so far.
pub fn caught() -> Option<Signalled> {
    match CAUGHT.load(Ordering::SeqCst) {
        0 => None,
        n => Some(Signalled(n)),
    }
}

/// If a signal stopped the run, say so in its `end` event (the trainer only knows "stopped";
/// a run that failed before it stopped keeps its failure).
pub fn mark_end(event: &mut crate::telemetry::Event) -> Option<Signalled> {
    let crate::telemetry::Event::End(end) = event else {
        return None;
    };
    if end.reason != EndReason::Stopped {
        return None;
    }
    let signal = caught()?;
    end.reason = EndReason::Signalled(signal.0);
    Some(signal)
}

extern "C" fn on_signal(signo: libc::c_int) {
    // Only lock-free atomics: async-signal-safe.
    let _ = CAUGHT.compare_exchange(0, signo, Ordering::SeqCst, Ordering::SeqCst);
    LATEST.store(signo, Ordering::SeqCst);
    COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Catch the three stopping signals from here on (their default action, dying, is off).
pub fn install() -> std::io::Result<()> {
    for signo in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `action` is fully initialised (zeroed, then the handler and flags set) before
        // sigaction reads it, and the handler only touches lock-free atomics.
        let installed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signo, &action, std::ptr::null_mut())
        };
        if installed != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The signals after the first `seen`, one at a time.
pub struct Stoppers {
    seen: u32,
}

impl Stoppers {
    /// Install the handlers; signals already caught count as delivered. From here on a signal
    /// is this run's to handle (`until_started` lets go).
    pub fn register() -> std::io::Result<Stoppers> {
        install()?;
        STARTED.store(true, Ordering::SeqCst);
        Ok(Stoppers { seen: 0 })
    }

    /// Signals caught so far count as handled (another watcher took them).
    pub fn skip_past(&mut self) {
        self.seen = COUNT.load(Ordering::SeqCst);
    }

    /// The next signal, or `None` if none has arrived since the last call.
    pub fn poll(&mut self) -> Option<i32> {
        if COUNT.load(Ordering::SeqCst) <= self.seen {
            return None;
        }
        self.seen += 1;
        Some(LATEST.load(Ordering::SeqCst))
    }

    /// Resolves with the next signal (in a Tokio runtime with its timer).
    pub async fn next(&mut self) -> i32 {
        loop {
            if let Some(signo) = self.poll() {
                return signo;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Blocks the thread until the next signal.
    pub fn wait(&mut self) -> i32 {
        loop {
            if let Some(signo) = self.poll() {
                return signo;
            }
            std::thread::sleep(POLL);
        }
    }
}

/// Before a run starts (building the model, training a tokenizer) there is nothing to stop
/// cleanly: a signal ends the process at once, with a line saying so and 128 + its number.
/// Once `Stoppers::register` is called the run handles signals itself.
pub fn until_started() -> std::io::Result<()> {
    install()?;
    let mut early = Stoppers { seen: 0 };
    std::thread::Builder::new()
        .name("gaccwb-signals-early".into())
        .spawn(move || loop {
            if STARTED.load(Ordering::SeqCst) {
                return;
            }
            if let Some(signo) = early.poll() {
                if STARTED.load(Ordering::SeqCst) {
                    return;
                }
                crate::out::note(&format!(
                    "gaccwb: stopped by {} before the run started",
                    name(signo)
                ));
                std::process::exit(i32::from(Signalled(signo).exit_code()));
            }
            std::thread::sleep(POLL);
        })?;
    Ok(())
}

/// Without a screen: on the first signal call `stop` with it (ask the trainer to end); on a
/// second one, the user insists, exit at once. The handlers are installed before this returns.
pub fn watch(stop: impl FnOnce(i32) + Send + 'static) -> anyhow::Result<()> {
    let mut stoppers = Stoppers::register()?;
    std::thread::Builder::new()
        .name("gaccwb-signals".into())
        .spawn(move || {
            let first = stoppers.wait();
            // Stop first: stderr may be a closed pipe, and nothing must keep the run going.
            stop(first);
            crate::out::note(&format!(
                "gaccwb: {}: stopping at the next micro-batch",
                name(first)
            ));
            let again = stoppers.wait();
            std::process::exit(i32::from(Signalled(again).exit_code()));
        })?;
    Ok(())
}
