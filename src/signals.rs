//! SIGINT, SIGTERM and SIGHUP stop a run cleanly: the trainer ends at its next micro-batch, the
//! recording gets its `end`, the summary is printed and the process exits with the shell's
//! convention, 128 + the signal number (130, 143, 129).

use std::sync::atomic::{AtomicI32, Ordering};

use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::telemetry::EndReason;

/// The first stopping signal this process caught (0: none).
static CAUGHT: AtomicI32 = AtomicI32::new(0);

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
        (128 + self.0).clamp(0, 255) as u8
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

/// The three stopping signals, registered (the default action, dying, is off from here on).
pub struct Stoppers {
    int: Signal,
    term: Signal,
    hup: Signal,
}

impl Stoppers {
    /// Must be called inside a Tokio runtime context.
    pub fn register() -> std::io::Result<Stoppers> {
        Ok(Stoppers {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// Resolves with the next signal (and remembers the first one for `caught`).
    pub async fn next(&mut self) -> i32 {
        let signo = tokio::select! {
            _ = self.int.recv() => libc::SIGINT,
            _ = self.term.recv() => libc::SIGTERM,
            _ = self.hup.recv() => libc::SIGHUP,
        };
        let _ = CAUGHT.compare_exchange(0, signo, Ordering::SeqCst, Ordering::SeqCst);
        signo
    }
}

/// Without a screen: on the first signal call `stop` (ask the trainer to end); on a second one,
/// the user insists, exit at once. The signals are registered before this returns.
pub fn watch(stop: impl FnOnce() + Send + 'static) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut stoppers = {
        let _context = runtime.enter();
        Stoppers::register()?
    };
    std::thread::Builder::new()
        .name("gaccwb-signals".into())
        .spawn(move || {
            runtime.block_on(async {
                let first = stoppers.next().await;
                eprintln!("gaccwb: {}: stopping at the next micro-batch", name(first));
                stop();
                let again = stoppers.next().await;
                std::process::exit(i32::from(Signalled(again).exit_code()));
            })
        })?;
    Ok(())
}
