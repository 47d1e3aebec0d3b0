//! How a command that did not do what was asked ends: its error's class decides the exit code.

use std::process::ExitCode;

use gaccwb::headless::RunEnded;
use gaccwb::signals::Signalled;
use gaccwb::telemetry::EndReason;

/// A problem with what the user asked for (a bad argument, file or value): exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Wrap anything printable as a [`UsageError`], for `map_err`.
pub fn usage(e: impl std::fmt::Display) -> UsageError {
    UsageError(e.to_string())
}

/// The classes of failure, each with its exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitClass {
    /// The request itself was wrong: 2, as for a usage error.
    Usage,
    /// The command ran and failed: 1.
    Failure,
    /// A signal ended it: 128 + the signal's number.
    Signal(u8),
}

impl ExitClass {
    /// The class of `e`, found by type anywhere in its chain of causes.
    pub fn of(e: &anyhow::Error) -> ExitClass {
        e.chain()
            .find_map(Self::of_cause)
            .unwrap_or(ExitClass::Failure)
    }

    /// The class one error in the chain asks for, if its type has one.
    fn of_cause(cause: &(dyn std::error::Error + 'static)) -> Option<ExitClass> {
        if let Some(signal) = cause.downcast_ref::<Signalled>() {
            return Some(ExitClass::Signal(signal.exit_code()));
        }
        if let Some(RunEnded(reason)) = cause.downcast_ref::<RunEnded>() {
            return Some(match reason {
                EndReason::Signalled(_) => ExitClass::Signal(reason.exit_code()),
                _ => ExitClass::Failure,
            });
        }
        if let Some(super::ranks::RanksFailed(code)) = cause.downcast_ref() {
            return Some(ExitClass::from_code(*code));
        }
        if let Some(refused) = cause.downcast_ref::<super::rank_check::PeerRefused>() {
            return Some(ExitClass::from_code(i32::from(refused.code)));
        }
        if cause.downcast_ref::<UsageError>().is_some() {
            return Some(ExitClass::Usage);
        }
        // A `--config` that cannot be read is a file that cannot be read (1), as the table
        // says; one that reads but is wrong is a usage error like any bad value.
        use gaccwb::hf::config::HfConfigError;
        use gaccwb::planner::options::OptionsError;
        if let Some(OptionsError::Config(HfConfigError::Read { .. })) = cause.downcast_ref() {
            return Some(ExitClass::Failure);
        }
        // Engine errors that only ever describe what the user typed.
        use gaccwb::budget::BudgetError;
        if matches!(cause.downcast_ref(), Some(BudgetError::Unreadable { .. }))
            || cause.is::<gaccwb::limits::BoundError>()
            || cause.is::<gaccwb::memory::verdict::ShapeError>()
            || cause.is::<gaccwb::planner::options::OptionsError>()
            || cause.is::<gaccwb::model::hf::HfError>()
            || cause.is::<gaccwb::model::spec::SpecError>()
            || matches!(
                cause.downcast_ref(),
                Some(gaccwb::model::OpenError::Hf(_) | gaccwb::model::OpenError::Adapter(_))
            )
            || cause.is::<gaccwb::model::lora::AdaptError>()
            || cause.is::<gaccwb::model::lora::AdapterError>()
        {
            return Some(ExitClass::Usage);
        }
        // An output that can never be written as named: a wrong argument, not a failed run.
        use gaccwb::safe_write::WriteError;
        match cause.downcast_ref() {
            Some(WriteError::NotRegular { .. } | WriteError::IsInput { .. }) => {
                Some(ExitClass::Usage)
            }
            _ => None,
        }
    }

    /// The class another process's exit code stands for (a rank's, the launcher's).
    pub fn from_code(code: i32) -> ExitClass {
        match code {
            2 => ExitClass::Usage,
            129..=255 => ExitClass::Signal(code as u8),
            _ => ExitClass::Failure,
        }
    }

    pub fn exit_code(self) -> ExitCode {
        match self {
            ExitClass::Usage => ExitCode::from(2),
            ExitClass::Failure => ExitCode::FAILURE,
            ExitClass::Signal(code) => ExitCode::from(code),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    /// The engine's errors about what the user typed exit 2 by their type, under any context;
    /// one that is not about the input (a device whose total is unknown) stays a failure.
    #[test]
    fn engine_errors_about_the_input_are_usage_errors_by_type() {
        use gaccwb::budget::MemoryBudget;
        let bad_budget = MemoryBudget::parse("6 GiX")
            .context("--budget")
            .unwrap_err();
        assert_eq!(ExitClass::of(&bad_budget), ExitClass::Usage);
        let unknown_total = MemoryBudget::Percent(50.0).resolve(None).unwrap_err();
        assert_eq!(
            ExitClass::of(&anyhow::Error::new(unknown_total)),
            ExitClass::Failure
        );
        let steps = gaccwb::limits::at_most("--steps", 2, 1).unwrap_err();
        assert_eq!(ExitClass::of(&steps.into()), ExitClass::Usage);
        let seq_len = gaccwb::planner::options::OptionsError::SeqLen;
        assert_eq!(ExitClass::of(&seq_len.into()), ExitClass::Usage);
        let shape = gaccwb::memory::verdict::named_shape("gpt4").unwrap_err();
        assert_eq!(ExitClass::of(&shape.into()), ExitClass::Usage);
    }
}
