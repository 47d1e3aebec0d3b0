//! One training session, wired the same way for the headless run and the screen: the recorder
//! is opened first (a refused file starts nothing), then the trainer thread, then the device
//! sampler on the same event stream.

use std::path::Path;

use crate::memory::gpu::SamplerHandle;
use crate::record::{RecordError, Recorder};
use crate::safe_write::Overwrite;
use crate::train::{Trainer, TrainerHandle};

pub struct Session {
    pub handle: TrainerHandle,
    /// Stops sampling when dropped.
    pub sampler: SamplerHandle,
    pub recorder: Option<Recorder>,
    /// The run's `train.steps` (0: until stopped).
    pub steps: u64,
    /// The trainer's event stream, for other producers (a timed-out collective's `end`).
    pub sink: crate::telemetry::EventSink,
}

impl Session {
    /// Start `trainer`, recording to `record` when given (with `rules.force`: replace an existing
    /// regular file that is not an input, once the new recording is complete; otherwise an
    /// existing file is refused).
    pub fn start(
        trainer: Trainer,
        record: Option<&Path>,
        rules: &Overwrite,
    ) -> anyhow::Result<Session> {
        let recorder = record.map(|p| open_recorder(p, rules)).transpose()?;
        let steps = trainer.scenario().train.steps;
        let device = trainer.device().clone();
        let (handle, sink) = crate::train::spawn_trainer(trainer)?;
        let sampler = crate::memory::gpu::start_sampler(sink.clone(), &device);
        Ok(Session {
            handle,
            sampler,
            recorder,
            steps,
            sink,
        })
    }
}

/// A new recording, or (`rules.force`) one that replaces the file when it is complete.
pub fn open_recorder(path: &Path, rules: &Overwrite) -> Result<Recorder, RecordError> {
    if rules.force {
        Recorder::create_replacing(path, rules)
    } else {
        Recorder::create(path)
    }
}
