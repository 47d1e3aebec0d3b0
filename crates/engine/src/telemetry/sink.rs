//! Where the trainer's events go, and the diagnostics log that sees each one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::{Event, EventKind, Level};

/// Where events go. Sending never blocks; a gone receiver is noticed and ends the run. Clones
/// share the last optimizer step sent (what a crashed trainer's `end` reports).
#[derive(Clone)]
pub struct EventSink {
    tx: UnboundedSender<Event>,
    last_step: Arc<AtomicU64>,
}

impl EventSink {
    /// A sink sending into `tx`.
    pub fn new(tx: UnboundedSender<Event>) -> Self {
        EventSink {
            tx,
            last_step: Arc::default(),
        }
    }

    /// False once nobody is listening.
    pub fn send(&self, e: Event) -> bool {
        trace_event(&e);
        if let Event::Step(s) = &e {
            self.last_step.store(s.step, Ordering::Relaxed);
        }
        self.tx.send(e).is_ok()
    }

    /// The last optimizer step sent.
    pub fn last_step(&self) -> u64 {
        self.last_step.load(Ordering::Relaxed)
    }
}

/// Diagnostics (`--log FILE`) see what the screen sees: every event the engine sends, at a
/// level that matches it. Without a subscriber this costs a relaxed load.
fn trace_event(e: &Event) {
    match e {
        Event::Header(h) => tracing::info!(
            preset = %h.config.name,
            device = %h.device,
            params = h.params,
            "run started"
        ),
        Event::Step(s) => tracing::debug!(
            step = s.step,
            loss = s.loss,
            grad_norm = s.grad_norm,
            step_ms = s.step_ms,
            skipped = s.skipped,
            "step"
        ),
        Event::Control(c) => tracing::info!(
            step = c.step,
            origin = ?c.origin,
            "applied {}",
            c.control.describe()
        ),
        Event::Log(l) => match l.level {
            Level::Info => tracing::info!(step = l.step, "{}", l.message),
            Level::Warn => tracing::warn!(step = l.step, "{}", l.message),
            Level::Error => tracing::error!(step = l.step, "{}", l.message),
        },
        Event::End(end) => tracing::info!(step = end.step, reason = %end.reason, "run ended"),
        other => tracing::trace!(kind = ?EventKind::from(other), "event"),
    }
}
