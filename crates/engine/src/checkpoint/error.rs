//! Why a checkpoint could not be saved, read or continued, each with the file and the fix.

use std::path::PathBuf;

use crate::limits::ReadError;

/// What went wrong with a checkpoint directory, its state file or its tensor file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The directory has no readable state file.
    #[error("no checkpoint in {}: {}: {err}", dir.display(), path.display())]
    Missing {
        /// The directory.
        dir: PathBuf,
        /// Its state file.
        path: PathBuf,
        /// Why it could not be read.
        err: Box<ReadError>,
    },
    /// The state file is not a checkpoint's JSON.
    #[error("{}: not a gaccwb checkpoint", path.display())]
    NotACheckpoint {
        /// The state file.
        path: PathBuf,
        /// What the parser said.
        #[source]
        err: serde_json::Error,
    },
    /// A newer gaccwb wrote it.
    #[error(
        "{}: checkpoint version {version} is newer than this gaccwb reads ({})",
        path.display(),
        super::CHECKPOINT_VERSION
    )]
    Newer {
        /// The state file.
        path: PathBuf,
        /// Its version.
        version: u32,
    },
    /// A value in the state file that a run cannot have written.
    #[error("{}: {err}", path.display())]
    State {
        /// The state file.
        path: PathBuf,
        /// The value and why.
        err: StateError,
    },
    /// Saved by a run of another number of ranks.
    #[error(
        "{}: saved by a run of {saved} rank(s), resumed on {ranks}: each window would take \
         {taken} samples instead of {expected}; resume with --ranks {saved} (mpirun -n {saved})",
        path.display()
    )]
    Ranks {
        /// The state file.
        path: PathBuf,
        /// The ranks that saved it.
        saved: usize,
        /// The ranks resuming it.
        ranks: usize,
        /// Samples a window of the resumed run would take.
        taken: usize,
        /// Samples a window of the saved run took.
        expected: usize,
    },
    /// The tensor file is not the one the state file was saved with.
    #[error(
        "{}: its contents are not the tensors {} was saved with (SHA-256 {found}, expected \
         {saved}): the file was changed or belongs to another save; restore the pair of \
         files one save wrote",
        path.display(),
        state.display()
    )]
    Tampered {
        /// The tensor file.
        path: PathBuf,
        /// The state file.
        state: PathBuf,
        /// The tensor file's SHA-256.
        found: String,
        /// The one saved.
        saved: String,
    },
    /// The tensor file could not be opened or read.
    #[error("{}: {err}", path.display())]
    TensorFile {
        /// The tensor file.
        path: PathBuf,
        /// Why.
        err: Box<ReadError>,
    },
    /// The tensor file could not be read to its end.
    #[error("reading {}", path.display())]
    ReadTensors {
        /// The tensor file.
        path: PathBuf,
        /// Why.
        #[source]
        err: std::io::Error,
    },
    /// The tensor file could not be loaded as safetensors.
    #[error("reading {}", path.display())]
    LoadTensors {
        /// The tensor file.
        path: PathBuf,
        /// Why.
        #[source]
        err: candle_core::Error,
    },
    /// A tensor the model needs is not in the file.
    #[error("{}: missing tensor {key}", path.display())]
    MissingTensor {
        /// The tensor file.
        path: PathBuf,
        /// The tensor's name.
        key: String,
    },
    /// A tensor of another shape than the model's.
    #[error("{}: {key} has shape {found:?}, the model needs {needed:?}", path.display())]
    Shape {
        /// The tensor file.
        path: PathBuf,
        /// The tensor's name.
        key: String,
        /// Its shape in the file.
        found: candle_core::Shape,
        /// The model's.
        needed: candle_core::Shape,
    },
    /// `--checkpoint-dir` is another running gaccwb's.
    #[error(
        "--checkpoint-dir {}: another gaccwb run (pid {holder}) saves its checkpoints there, \
         and two runs in one directory delete each other's; wait for it to end or choose \
         another --checkpoint-dir",
        dir.display()
    )]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// The pid holding its lock.
        holder: String,
    },
    /// `--checkpoint-dir` could not be created or locked.
    #[error("--checkpoint-dir: {0}")]
    Dir(crate::safe_write::WriteError),
    /// `--checkpoint-dir` holds another run's checkpoint.
    #[error(
        "{} already holds another run's checkpoint (step {step}); saving there would replace it. \
         Choose another --checkpoint-dir, resume it with --resume {}, or add --force to replace it",
        dir.display(),
        dir.display()
    )]
    Occupied {
        /// The directory.
        dir: PathBuf,
        /// The step of the checkpoint there (`?` when unreadable).
        step: String,
    },
    /// A resumed run asked for another model shape.
    #[error("a resumed run keeps the checkpoint's model shape; remove the model.* overrides")]
    ModelChanged,
    /// Under ZeRO the moments were not gathered at this step.
    #[error(
        "step {step}: under train.zero = {stage} the optimizer state was not gathered whole at \
         this step"
    )]
    NotGathered {
        /// The step.
        step: u64,
        /// The ZeRO stage.
        stage: u8,
    },
    /// The directory could not be created.
    #[error("creating {}", dir.display())]
    CreateDir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        err: std::io::Error,
    },
    /// The tensors could not be serialised.
    #[error("serialising the tensors for {}", path.display())]
    Serialise {
        /// The tensor file.
        path: PathBuf,
        /// Why.
        #[source]
        err: safetensors::SafeTensorError,
    },
    /// The state could not be written as JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A file could not be written or replaced.
    #[error(transparent)]
    File(#[from] crate::safe_write::WriteError),
    /// The trainer could not be rebuilt.
    #[error(transparent)]
    Train(Box<crate::train::TrainError>),
    /// The model (or its merged adapters) could not be saved.
    #[error(transparent)]
    ModelSave(Box<crate::model::save::SaveError>),
    /// The LoRA adapter could not be saved.
    #[error(transparent)]
    Adapter(Box<crate::model::lora::AdapterError>),
    /// A tensor operation failed (moving the state, merging adapters).
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

/// A value in `checkpoint.json` that a run cannot have written, named by its key.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The saved scenario does not pass a preset's checks.
    #[error("scenario: {0}")]
    Scenario(crate::scenario::Invalid),
    /// A knob outside what a control may set.
    #[error("knobs: {0}")]
    Knob(crate::scenario::ControlError),
    /// The knobs make a window whose sizes overflow.
    #[error("knobs: {0}")]
    Window(crate::limits::BoundError),
    /// A counter too large to keep counting.
    #[error(transparent)]
    Counter(#[from] crate::limits::BoundError),
    /// A counter ahead of the optimizer steps taken.
    #[error(
        "{key} ({value}) is more than step ({step}): a run cannot have taken more AdamW \
         updates, scheduled steps or overflows than optimizer steps; restore the file the run \
         wrote"
    )]
    AheadOfStep {
        /// The counter's key.
        key: &'static str,
        /// Its value.
        value: u64,
        /// The optimizer steps saved.
        step: u64,
    },
    /// A tensor file name that leaves the checkpoint's directory.
    #[error("tensors ({0}) must name a file in the checkpoint's own directory")]
    TensorsOutside(String),
}

// Boxed, as these errors are large and every checkpoint function returns this enum.
impl From<crate::train::TrainError> for CheckpointError {
    fn from(e: crate::train::TrainError) -> Self {
        CheckpointError::Train(Box::new(e))
    }
}

impl From<crate::model::save::SaveError> for CheckpointError {
    fn from(e: crate::model::save::SaveError) -> Self {
        CheckpointError::ModelSave(Box::new(e))
    }
}

impl From<crate::model::lora::AdapterError> for CheckpointError {
    fn from(e: crate::model::lora::AdapterError) -> Self {
        CheckpointError::Adapter(Box::new(e))
    }
}
