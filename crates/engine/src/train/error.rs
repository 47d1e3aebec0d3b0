//! Why a trainer could not be built, joined to its ranks, changed at a boundary or started.
//! Each cause keeps its own type, so the command line decides its exit code from it.

/// What went wrong at one of the trainer's entry points (`Trainer::new`, `join`,
/// `apply_control`, `spawn`).
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The Hugging Face model directory could not be read or does not match the scenario.
    #[error(transparent)]
    Model(Box<crate::model::hf::HfError>),
    /// The model could not be built or loaded.
    #[error(transparent)]
    Open(Box<crate::model::OpenError>),
    /// The scenario breaks one of its rules (the key and the fix named).
    #[error(transparent)]
    Scenario(#[from] crate::scenario::Invalid),
    /// The data source could not be opened.
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    /// The model, or a knob change, does not fit the machine.
    #[error(transparent)]
    Refused(#[from] super::failures::Refused),
    /// The memory budget could not be read against this device.
    #[error(transparent)]
    Budget(#[from] crate::budget::BudgetError),
    /// The memory budget cannot hold the run at any micro-batch.
    #[error(transparent)]
    OverBudget(#[from] OverBudget),
    /// An environment variable gaccwb reads has a value it does not know.
    #[error(transparent)]
    Env(#[from] crate::ops::BadEnvValue),
    /// A control out of its bounds, or needing a measurement the run has off.
    #[error(transparent)]
    Control(#[from] crate::scenario::ControlError),
    /// A ZeRO stage, or a change under one, that cannot be had.
    #[error(transparent)]
    Zero(#[from] ZeroRefused),
    /// A collective between the ranks failed.
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
    /// A tensor operation failed: placing the weights and moments, resharding them.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    /// The device did not finish the work queued while the trainer was built.
    #[error("synchronizing the device before the trainer thread starts")]
    Sync(#[source] candle_core::Error),
    /// The operating system refused the trainer's thread.
    #[error("starting the trainer thread")]
    Thread(#[source] std::io::Error),
}

/// The memory budget cannot hold the run at any micro-batch, by the estimate.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the memory budget ({}) cannot hold this run at any micro-batch: {verdict} \
     (`gaccwb estimate` shows every lever)",
    crate::memory::verdict::human_bytes(*budget)
)]
pub struct OverBudget {
    /// The budget, in bytes.
    pub budget: u64,
    /// The estimate's verdict on the smallest split.
    pub verdict: String,
}

/// A ZeRO stage, or a knob change under ZeRO, refused, with the fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ZeroRefused {
    /// This stage cannot be had with the knobs in force.
    #[error("train.zero = {stage}: {why}")]
    Stage {
        /// The stage asked for.
        stage: u8,
        /// Why not, and the fix.
        why: &'static str,
    },
    /// The change cannot be had under the stage in force.
    #[error("not under train.zero = {stage}: {change}")]
    Change {
        /// The stage in force.
        stage: u8,
        /// The change, in words (`Control::describe`).
        change: String,
    },
}

// Boxed: these two are the largest, and every entry point returns this enum.
impl From<crate::model::hf::HfError> for TrainError {
    fn from(e: crate::model::hf::HfError) -> Self {
        TrainError::Model(Box::new(e))
    }
}

impl From<crate::model::OpenError> for TrainError {
    fn from(e: crate::model::OpenError) -> Self {
        TrainError::Open(Box::new(e))
    }
}
