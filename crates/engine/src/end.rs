//! Why a run ended, and the one rule that turns it into an exit code.
//!
//! The trainer, headless runs, the screen, replay and the recorder all speak `EndReason`. In a
//! recording it is the `end` event's `reason` text, in the form gaccwb has always written
//! (`completed`, `stopped by SIGTERM`, `diverged: …`, `error: …`), so older readers still show
//! it and treat the failures as failures; `parse` reads any of those texts back.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Text of the fp16 loss-scale floor's reason; it has no prefix of its own in recordings.
const LOSS_SCALE_PREFIX: &str = "gradients overflowed";
const CRASH_PREFIX: &str = "the trainer crashed: ";
const CHECKPOINT_PREFIX: &str = "checkpointing failed: ";

/// How a run ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// Every step asked for ran.
    Completed,
    /// The user stopped it (`q`, the `stop` control, the event channel closing).
    Stopped,
    /// SIGINT, SIGTERM or SIGHUP stopped it (the signal's number).
    Signalled(i32),
    /// The loss or the gradients stopped being finite (the detail says where).
    Diverged(String),
    /// f16 gradients kept overflowing at the loss-scale floor (the full message).
    LossScaleExhausted(String),
    /// No checkpoint the run tried to save could be written.
    CheckpointingFailed(String),
    /// The trainer returned an error (also a reason this version does not know).
    Error(String),
    /// The trainer thread panicked.
    Crashed(String),
}

impl EndReason {
    /// The process exit code this ending asks for: 0 for a run that completed or that the user
    /// stopped, 128 + the signal's number for a signal, 1 for every failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            EndReason::Completed | EndReason::Stopped => 0,
            EndReason::Signalled(n) => (128 + n).clamp(1, 255) as u8,
            _ => 1,
        }
    }

    /// The run failed (exit code 1): divergence, the loss-scale floor, checkpointing, an
    /// error or a crash.
    pub fn is_failure(&self) -> bool {
        self.exit_code() == 1
    }

    /// The run failed with `error`: its message, then each cause's not already in it (the
    /// event is text, so the chain is rendered here, once).
    pub fn error(error: &(dyn std::error::Error + 'static)) -> EndReason {
        EndReason::Error(chain(error))
    }

    /// Read an `end` event's text back; never fails (an unknown text is an `Error`).
    pub fn parse(text: &str) -> EndReason {
        if let Some(detail) = text.strip_prefix("diverged: ") {
            return EndReason::Diverged(detail.to_string());
        }
        if text.starts_with(LOSS_SCALE_PREFIX) {
            return EndReason::LossScaleExhausted(text.to_string());
        }
        if let Some(name) = text.strip_prefix("stopped by ") {
            if let Some(n) = signal_number(name) {
                return EndReason::Signalled(n);
            }
        }
        if let Some(message) = text.strip_prefix("error: ") {
            if let Some(what) = message.strip_prefix(CRASH_PREFIX) {
                return EndReason::Crashed(what.to_string());
            }
            if let Some(what) = message.strip_prefix(CHECKPOINT_PREFIX) {
                return EndReason::CheckpointingFailed(what.to_string());
            }
            return EndReason::Error(message.to_string());
        }
        match text {
            "completed" => EndReason::Completed,
            "stopped" => EndReason::Stopped,
            other => EndReason::Error(other.to_string()),
        }
    }
}

/// An error's message and its causes', `: `-separated; a cause whose text the message already
/// holds (an error that prints its source) is not repeated.
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

/// `SIGINT`, `SIGTERM`, `SIGHUP`, or `signal N`.
pub fn signal_name(signo: i32) -> String {
    match signo {
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        1 => "SIGHUP".into(),
        n => format!("signal {n}"),
    }
}

fn signal_number(name: &str) -> Option<i32> {
    match name {
        "SIGINT" => Some(2),
        "SIGTERM" => Some(15),
        "SIGHUP" => Some(1),
        other => other.strip_prefix("signal ")?.parse().ok(),
    }
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndReason::Completed => f.write_str("completed"),
            EndReason::Stopped => f.write_str("stopped"),
            EndReason::Signalled(n) => write!(f, "stopped by {}", signal_name(*n)),
            EndReason::Diverged(d) => write!(f, "diverged: {d}"),
            EndReason::LossScaleExhausted(m) => f.write_str(m),
            EndReason::CheckpointingFailed(m) => write!(f, "error: {CHECKPOINT_PREFIX}{m}"),
            EndReason::Error(m) => write!(f, "error: {m}"),
            EndReason::Crashed(m) => write!(f, "error: {CRASH_PREFIX}{m}"),
        }
    }
}

impl FromStr for EndReason {
    type Err = std::convert::Infallible;

    fn from_str(text: &str) -> Result<EndReason, Self::Err> {
        Ok(EndReason::parse(text))
    }
}

impl Serialize for EndReason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for EndReason {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<EndReason, D::Error> {
        String::deserialize(d).map(|text| EndReason::parse(&text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kind() -> Vec<EndReason> {
        vec![
            EndReason::Completed,
            EndReason::Stopped,
            EndReason::Signalled(15),
            EndReason::Signalled(7),
            EndReason::Diverged("the loss was not finite".into()),
            EndReason::LossScaleExhausted(
                "gradients overflowed 20 windows in a row at the loss-scale floor (1)".into(),
            ),
            EndReason::CheckpointingFailed("creating ck: Not a directory".into()),
            EndReason::Error("out of memory".into()),
            EndReason::Crashed("index out of bounds".into()),
        ]
    }

    #[test]
    fn every_reason_reads_back_from_its_text() {
        for reason in every_kind() {
            let json = serde_json::to_string(&reason).unwrap();
            let back: EndReason = serde_json::from_str(&json).unwrap();
            assert_eq!(back, reason, "{json}");
        }
    }

    /// The texts recordings made before the type existed hold.
    #[test]
    fn todays_texts_keep_their_meaning() {
        let cases = [
            ("completed", 0),
            ("stopped", 0),
            ("stopped by SIGINT", 130),
            ("stopped by SIGHUP", 129),
            ("stopped by SIGTERM", 143),
            ("diverged: the loss … (steps 4–6)", 1),
            ("error: the trainer crashed: boom", 1),
            ("error: CUDA out of memory", 1),
            (
                "gradients overflowed 20 windows in a row at the loss-scale floor (1)",
                1,
            ),
        ];
        for (text, code) in cases {
            let reason = EndReason::parse(text);
            assert_eq!(reason.exit_code(), code, "{text}");
            assert_eq!(reason.to_string(), text);
        }
        assert_eq!(
            EndReason::parse("something newer").to_string(),
            "error: something newer"
        );
    }

    /// Readers from before the type only knew the `error`/`diverged` prefixes as failures:
    /// every failure is written so that they see it as one too (the loss-scale text aside,
    /// which they already printed as it is).
    #[test]
    fn failures_keep_a_prefix_older_readers_count() {
        for reason in every_kind() {
            let text = reason.to_string();
            let old_rule = text.starts_with("error") || text.starts_with("diverged");
            let exempt = matches!(reason, EndReason::LossScaleExhausted(_));
            assert_eq!(old_rule || exempt, reason.is_failure(), "{text}");
        }
    }

    /// An error that ends a run keeps its causes, each said once: one that prints its source
    /// is not followed by it again.
    #[test]
    fn an_errors_chain_is_rendered_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("disk full")]
        struct Io;
        #[derive(Debug, thiserror::Error)]
        #[error("writing run.jsonl")]
        struct Plain(#[source] Io);
        #[derive(Debug, thiserror::Error)]
        #[error("writing run.jsonl: {0}")]
        struct Prints(#[source] Io);
        let expected = EndReason::Error("writing run.jsonl: disk full".into());
        assert_eq!(EndReason::error(&Plain(Io)), expected);
        assert_eq!(EndReason::error(&Prints(Io)), expected);
    }
}
