//! How a command that did not do what was asked ends: its error's class decides the exit code.

use std::process::ExitCode;

use gaccwb::end::EndReason;
use gaccwb::headless::RunEnded;
use gaccwb::signals::Signalled;

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
        if let Some(said) = cause.downcast_ref::<super::rank_check::Said>() {
            return Some(ExitClass::from_code(i32::from(said.code)));
        }
        if let Some(refused) = cause.downcast_ref::<super::rank_check::PeerRefused>() {
            return Some(ExitClass::from_code(i32::from(refused.code)));
        }
        // What the user wrote: an argument, a preset, a `--set`, a `--control`.
        if cause.is::<UsageError>()
            || cause.is::<gaccwb::headless::NeedsScreen>()
            || cause.is::<gaccwb::scenario::ScenarioError>()
            || cause.is::<gaccwb::scenario::Invalid>()
            || cause.is::<gaccwb::scenario::ControlArgError>()
        {
            return Some(ExitClass::Usage);
        }
        if let Some(e) = cause.downcast_ref() {
            return Some(Self::of_train(e));
        }
        if let Some(e) = cause.downcast_ref() {
            return Some(Self::of_checkpoint(e));
        }
        if let Some(e) = cause.downcast_ref() {
            return Some(Self::of_dist(e));
        }
        if let Some(gaccwb::record::RecordError::File(e)) = cause.downcast_ref() {
            return Self::of_cause(e);
        }
        // A `--config` that cannot be read is a file that cannot be read (1), as the table
        // says; one that reads but is wrong is a usage error like any bad value.
        use gaccwb::hf::HfConfigError;
        use gaccwb::planner::OptionsError;
        if let Some(OptionsError::Config(HfConfigError::Read { .. })) = cause.downcast_ref() {
            return Some(ExitClass::Failure);
        }
        // Engine errors that only ever describe what the user typed.
        use gaccwb::budget::BudgetError;
        if matches!(cause.downcast_ref(), Some(BudgetError::Unreadable { .. }))
            || cause.is::<gaccwb::limits::BoundError>()
            || cause.is::<gaccwb::memory::ShapeError>()
            || cause.is::<gaccwb::planner::OptionsError>()
            || cause.is::<gaccwb::model::hf::HfError>()
            || cause.is::<gaccwb::model::SpecError>()
            || matches!(
                cause.downcast_ref(),
                Some(gaccwb::model::OpenError::Hf(_) | gaccwb::model::OpenError::Adapter(_))
            )
            || cause.is::<gaccwb::model::AdaptError>()
            || cause.is::<gaccwb::model::AdapterError>()
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

    /// A trainer that could not be built, joined or started: what the user asked for (a
    /// scenario, a model directory, a ZeRO stage, a control) is usage; the machine failing is
    /// a failure. Wrapped errors are classed by their own type.
    fn of_train(e: &gaccwb::train::TrainError) -> ExitClass {
        use gaccwb::train::TrainError as E;
        let inner = |cause: &(dyn std::error::Error + 'static)| {
            Self::of_cause(cause).unwrap_or(ExitClass::Failure)
        };
        match e {
            E::Model(_) | E::Scenario(_) | E::Control(_) | E::Zero(_) => ExitClass::Usage,
            E::Open(e) => inner(e.as_ref()),
            E::Budget(e) => inner(e),
            E::Dist(e) => Self::of_dist(e),
            E::Data(_)
            | E::Refused(_)
            | E::OverBudget(_)
            | E::Env(_)
            | E::Tensor(_)
            | E::Sync(_)
            | E::Thread(_) => ExitClass::Failure,
        }
    }

    /// A checkpoint directory another run holds, or a checkpoint of another number of ranks,
    /// is a wrong argument; one that cannot be read or written is a failure.
    fn of_checkpoint(e: &gaccwb::checkpoint::CheckpointError) -> ExitClass {
        use gaccwb::checkpoint::CheckpointError as E;
        match e {
            E::Ranks { .. } | E::Locked { .. } | E::Dir(_) | E::Occupied { .. } => ExitClass::Usage,
            E::File(e) => Self::of_cause(e).unwrap_or(ExitClass::Failure),
            E::Train(e) => Self::of_train(e.as_ref()),
            _ => ExitClass::Failure,
        }
    }

    /// Started as a rank wrongly (a build without MPI, a garbled launcher variable) is usage;
    /// a collective or MPI itself failing is a failure.
    fn of_dist(e: &gaccwb::dist::DistError) -> ExitClass {
        use gaccwb::dist::DistError as E;
        match e {
            E::NotBuiltWithMpi { .. } | E::Launch(_) => ExitClass::Usage,
            E::AlreadyInitialised
            | E::Disagree { .. }
            | E::Controls(_)
            | E::Tensor(_)
            | E::Nccl { .. } => ExitClass::Failure,
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

/// An error as the command line prints it: one line on standard error, its chain joined.
pub fn print(e: &anyhow::Error) {
    gaccwb::out::note(&format!("gaccwb: {e:#}"));
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
        let seq_len = gaccwb::planner::OptionsError::SeqLen;
        assert_eq!(ExitClass::of(&seq_len.into()), ExitClass::Usage);
        let shape = gaccwb::memory::named_shape("gpt4").unwrap_err();
        assert_eq!(ExitClass::of(&shape.into()), ExitClass::Usage);
    }

    /// A trainer's error is classed by what failed, not by the call that met it: joining the
    /// ranks with a ZeRO stage the knobs refuse is usage, a tensor failing while resharding
    /// is a failure; a checkpoint of another number of ranks is usage.
    #[test]
    fn a_trainers_errors_are_classed_by_their_type() {
        use gaccwb::train::{TrainError, ZeroRefused};
        let why = "ZeRO shards the optimizer state instead of offloading it";
        let refused = TrainError::from(ZeroRefused::Stage { stage: 1, why });
        let refused = anyhow::Error::new(refused).context("joining the ranks");
        assert_eq!(ExitClass::of(&refused), ExitClass::Usage);
        let failed = TrainError::from(candle_core::Error::Msg("all-gather failed".into()));
        assert_eq!(ExitClass::of(&failed.into()), ExitClass::Failure);
        let lost = gaccwb::dist::DistError::Nccl {
            rank: 1,
            what: "timed out".into(),
        };
        assert_eq!(
            ExitClass::of(&TrainError::from(lost).into()),
            ExitClass::Failure
        );
        let ranks = gaccwb::checkpoint::CheckpointError::Ranks {
            path: "ck/checkpoint.json".into(),
            saved: 2,
            ranks: 1,
            taken: 4,
            expected: 8,
        };
        assert_eq!(ExitClass::of(&ranks.into()), ExitClass::Usage);
    }
}
