//! The trainer on its own OS thread, and the handle the faces hold: controls in, events out.

use candle_core::Device;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::{failures, EventSink, TrainError, Trainer};
use crate::control::{Control, ControlMsg, Origin};
use crate::scenario::Scenario;
use crate::telemetry::Event;

/// A trainer running on its own thread.
pub struct TrainerHandle {
    /// Controls for the trainer; they act at the next window boundary (Stop between micro-batches).
    pub controls: UnboundedSender<ControlMsg>,
    /// Everything the trainer reports, in order.
    pub events: UnboundedReceiver<Event>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TrainerHandle {
    /// Send `control` with `origin`; a trainer that has ended ignores it.
    pub fn send(&self, control: Control, origin: Origin) {
        let _ = self.controls.send(ControlMsg { control, origin });
    }

    /// Ask the trainer to stop and wait for its thread.
    pub fn stop(&mut self) {
        self.send(Control::Stop, Origin::Key);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TrainerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Build the trainer here (so bad input fails before any thread starts), then run it on its
/// own thread. Returns its handle and a sender into the same event stream for other producers
/// (the device sampler).
pub fn spawn(scenario: Scenario, device: Device) -> Result<(TrainerHandle, EventSink), TrainError> {
    spawn_trainer(Trainer::new(scenario, device)?)
}

/// `spawn` for a trainer built (or resumed from a checkpoint) by the caller.
pub fn spawn_trainer(trainer: Trainer) -> Result<(TrainerHandle, EventSink), TrainError> {
    // The model and optimizer state were created on this thread; the trainer's thread must
    // find them complete (on CUDA, work queued here may still be in flight).
    trainer.device.synchronize().map_err(TrainError::Sync)?;
    let (ctx, crx) = unbounded_channel();
    let (etx, erx) = unbounded_channel();
    let sink = EventSink::new(etx);
    let thread_sink = sink.clone();
    let thread = std::thread::Builder::new()
        .name("gaccwb-trainer".into())
        .spawn(move || failures::run_catching_panics(trainer, crx, thread_sink))
        .map_err(TrainError::Thread)?;
    Ok((
        TrainerHandle {
            controls: ctx,
            events: erx,
            thread: Some(thread),
        },
        sink,
    ))
}
