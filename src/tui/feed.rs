//! Where the App's events come from: the live trainer (with the recorder beside it) or a
//! recording replayed at a chosen speed. Both move the same `Event`s into `App::update`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use tokio::time::Instant;

use crate::memory::gpu::SamplerHandle;
use crate::record::Recorder;
use crate::telemetry::Event;
use crate::train::TrainerHandle;

use super::app::{App, ReplayStatus};
use super::keymap::Action;

pub enum Feed {
    Live(Live),
    Replay(Replay),
}

impl Feed {
    /// Wait for the next event(s) and fold them into `app`. Never resolves once there is
    /// nothing more to come (a finished trainer, a paused or finished replay).
    pub async fn next(&mut self, app: &mut App) -> anyhow::Result<()> {
        match self {
            Feed::Live(l) => l.next(app).await,
            Feed::Replay(r) => r.next(app).await,
        }
    }

    /// The one place an action is handled. The view's own actions and knob changes go through
    /// `App::apply` (knob changes then on to the trainer); recording belongs to the live feed,
    /// transport (pause, step, seek, speed) to the replay. With the help overlay open, any key
    /// only closes it (`App::apply`).
    pub fn act(&mut self, app: &mut App, action: Action) -> anyhow::Result<()> {
        tracing::debug!(?action, "action");
        if app.view.help {
            app.apply(action);
            return Ok(());
        }
        match self {
            Feed::Live(live) if action == Action::RecordToggle => live.toggle_recording(app),
            Feed::Live(live) => {
                for control in app.apply(action) {
                    live.handle.send(control, crate::control::Origin::Key);
                }
            }
            Feed::Replay(replay) => {
                if !replay.transport(app, action) {
                    let controls = app.apply(action);
                    if let Some(steer) = replay.steer.as_mut() {
                        for c in &controls {
                            steer.send(c).with_context(|| {
                                format!("writing a control to {}", steer.path().display())
                            })?;
                        }
                    }
                }
                replay.publish(app);
            }
        }
        Ok(())
    }

    /// Stop the trainer and flush the recording.
    pub fn finish(&mut self, app: &mut App) -> anyhow::Result<()> {
        match self {
            Feed::Live(l) => l.finish(app),
            Feed::Replay(_) => Ok(()),
        }
    }
}

/// A running trainer.
pub struct Live {
    pub handle: TrainerHandle,
    /// The device sampler feeding the same stream; stopped when the run ends.
    sampler: Option<SamplerHandle>,
    recorder: Option<Recorder>,
    /// Where `--record` writes, or the base name for recordings started with the key.
    record_base: PathBuf,
    recordings_started: u32,
    trainer_done: bool,
}

impl Live {
    /// `record`: record from the first event to this file (which must not exist yet).
    pub fn new(handle: TrainerHandle, record: Option<&Path>) -> anyhow::Result<Live> {
        let recorder = record.map(Recorder::create).transpose()?;
        Ok(Live::with_recorder(handle, recorder, record))
    }

    /// A started session; `record` is its recording's path (the base name for recordings
    /// started with the key).
    pub fn from_session(session: crate::session::Session, record: Option<&Path>) -> Live {
        let crate::session::Session {
            handle,
            sampler,
            recorder,
            ..
        } = session;
        Live::with_recorder(handle, recorder, record).with_sampler(sampler)
    }

    fn with_recorder(
        handle: TrainerHandle,
        recorder: Option<Recorder>,
        record: Option<&Path>,
    ) -> Live {
        let record_base = record
            .map(Path::to_path_buf)
            .unwrap_or_else(default_record_path);
        Live {
            handle,
            sampler: None,
            recordings_started: u32::from(recorder.is_some()),
            recorder,
            record_base,
            trainer_done: false,
        }
    }

    pub fn with_sampler(mut self, sampler: SamplerHandle) -> Live {
        self.sampler = Some(sampler);
        self
    }

    /// Where recordings started with the key go (default: `gaccwb-<unix time>.jsonl`).
    pub fn set_record_base(&mut self, path: PathBuf) {
        self.record_base = path;
    }

    /// The path of the recording in progress, for the header line.
    pub fn recording_path(&self) -> Option<String> {
        self.recorder
            .as_ref()
            .map(|r| r.path().display().to_string())
    }

    async fn next(&mut self, app: &mut App) -> anyhow::Result<()> {
        if self.trainer_done {
            return std::future::pending().await;
        }
        let Some(first) = self.handle.events.recv().await else {
            self.trainer_done = true;
            return Ok(());
        };
        self.take(app, first)?;
        // Drain what else is waiting so a fast trainer costs one wake-up per burst.
        while let Ok(e) = self.handle.events.try_recv() {
            self.take(app, e)?;
        }
        Ok(())
    }

    /// One event from the trainer: recorded (the recorder holds what comes before the header),
    /// then shown.
    fn take(&mut self, app: &mut App, mut e: Event) -> anyhow::Result<()> {
        crate::signals::mark_end(&mut e);
        if let Some(r) = self.recorder.as_mut() {
            r.write(&e)?;
        }
        app.update(&e);
        if let Event::End(end) = &e {
            // Nothing is measured after the run: the recording ends with `end`.
            if let Some(mut s) = self.sampler.take() {
                s.stop();
            }
            // A failed run (an error, a crash, divergence) closes the screen; `finish` reports it.
            if end.reason.is_failure() {
                app.view.quit = true;
            }
        }
        Ok(())
    }

    /// `r`: start or stop recording. One that cannot start is reported in the event log; the
    /// run goes on.
    fn toggle_recording(&mut self, app: &mut App) {
        app.view.dirty = true;
        if let Err(e) = self.try_toggle_recording(app) {
            note(app, format!("recording not started: {e:#}"));
        }
    }

    fn try_toggle_recording(&mut self, app: &mut App) -> anyhow::Result<()> {
        if let Some(mut r) = self.recorder.take() {
            // Said in the file, so that its replay tells a stop by key from a run cut off.
            r.write(&Event::info(
                app.last_step(),
                crate::headless::RECORDING_STOPPED,
            ))?;
            r.flush()?;
            let path = r.path().display().to_string();
            note(app, format!("recording saved to {path}"));
            app.view.recording = None;
            return Ok(());
        }
        let (path, mut r) = self.next_free_recording()?;
        if let Some(header) = header_now(app) {
            r.write(&Event::Header(header))?;
        }
        self.recordings_started += 1;
        app.view.recording = Some(path.display().to_string());
        note(app, format!("recording to {}", path.display()));
        self.recorder = Some(r);
        Ok(())
    }

    fn finish(&mut self, app: &mut App) -> anyhow::Result<()> {
        if let Some(mut s) = self.sampler.take() {
            s.stop();
        }
        self.handle.stop();
        // Events sent before the trainer stopped (its `end` among them) belong in the file.
        while let Ok(e) = self.handle.events.try_recv() {
            self.take(app, e)?;
        }
        if let Some(r) = self.recorder.take() {
            r.finish()?;
        }
        match &app.run.ended {
            Some(reason) if reason.is_failure() => {
                Err(crate::headless::RunEnded(reason.clone()).into())
            }
            _ => Ok(()),
        }
    }

    /// The next numbered recording name that is free (a file left by an earlier session is
    /// skipped, never truncated), opened.
    fn next_free_recording(&mut self) -> anyhow::Result<(PathBuf, Recorder)> {
        const TRIES: u32 = 1000;
        for _ in 0..TRIES {
            let path = numbered(&self.record_base, self.recordings_started);
            if path.symlink_metadata().is_err() {
                return Ok((path.clone(), Recorder::create(&path)?));
            }
            self.recordings_started += 1;
        }
        anyhow::bail!(
            "no free recording name after {TRIES} tries beside {}",
            self.record_base.display()
        )
    }
}

/// A recording must open with a header; started mid-run, it carries the knobs in force now (all
/// of them: pitfalls included) and the part of the timeline still to come.
fn header_now(app: &App) -> Option<crate::telemetry::Header> {
    let mut header = app.run.header.clone()?;
    app.run.knobs.write_into(&mut header.config.train);
    header.config.timeline.retain(|e| e.step >= app.last_step());
    Some(header)
}

fn note(app: &mut App, message: String) {
    app.update(&Event::info(app.last_step(), message));
}

fn default_record_path() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    PathBuf::from(format!("gaccwb-{secs}.jsonl"))
}

/// The n-th recording of a session: `base` first, then `base-2`, `base-3`, … (never overwrite).
fn numbered(base: &Path, n: u32) -> PathBuf {
    if n == 0 {
        return base.to_path_buf();
    }
    let stem = base
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match base.extension() {
        Some(ext) => format!("{stem}-{}.{}", n + 1, ext.to_string_lossy()),
        None => format!("{stem}-{}", n + 1),
    };
    base.with_file_name(name)
}

/// Speeds a replay can run at.
const MIN_SPEED: f64 = 1.0 / 16.0;
const MAX_SPEED: f64 = 256.0;
/// A recorded pause longer than this is not worth waiting for.
const MAX_GAP: Duration = Duration::from_secs(2);
/// Steps a seek key moves.
pub const SEEK_STEPS: u64 = 10;

/// How often a followed recording is read for new lines.
const FOLLOW_POLL: Duration = Duration::from_millis(250);

/// A recording played back through the same `App::update`.
pub struct Replay {
    events: Vec<Event>,
    /// Index of the next event to feed.
    cursor: usize,
    speed: f64,
    paused: bool,
    next_at: Instant,
    /// A recording still being written: read for new events until its end event.
    tail: Option<crate::record::Tail>,
    /// Where knob keys go while following a run that reads them (`run --ranks N`).
    steer: Option<crate::steer::ControlWriter>,
}

impl Replay {
    pub fn new(events: Vec<Event>, speed: f64, app: &mut App) -> Replay {
        let r = Replay {
            events,
            cursor: 0,
            speed: speed.clamp(MIN_SPEED, MAX_SPEED),
            paused: false,
            next_at: Instant::now(),
            tail: None,
            steer: None,
        };
        r.publish(app);
        r
    }

    /// Follows a recording as it grows: what is there is shown at once, then each new event as
    /// it is written.
    pub fn follow(tail: crate::record::Tail, app: &mut App) -> Replay {
        let mut r = Replay::new(Vec::new(), 1.0, app);
        r.tail = Some(tail);
        r.publish(app);
        r
    }

    /// [`Replay::follow`], with knob keys written to `steer` for the run to read.
    pub fn steer(
        tail: crate::record::Tail,
        steer: crate::steer::ControlWriter,
        app: &mut App,
    ) -> Replay {
        let mut r = Replay::follow(tail, app);
        r.steer = Some(steer);
        r.publish(app);
        r
    }

    fn publish(&self, app: &mut App) {
        app.view.replay = Some(ReplayStatus {
            speed: self.speed,
            paused: self.paused,
            last_step: self.last_recorded_step(),
            following: self.tail.is_some(),
            steerable: self.steer.is_some(),
            finished: self.at_end() && !self.still_written(),
        });
        app.view.dirty = true;
    }

    /// Whether the followed recording still has events to come (no end event yet).
    fn still_written(&self) -> bool {
        self.tail.is_some() && !matches!(self.events.last(), Some(Event::End(_)))
    }

    /// Waits for new lines of the followed recording and takes their events. The wait is a
    /// deadline (`next_at`), so the event loop may drop this future for a frame and call again.
    async fn poll_tail(&mut self, app: &mut App) -> anyhow::Result<()> {
        tokio::time::sleep_until(self.next_at).await;
        self.next_at = Instant::now() + FOLLOW_POLL;
        let Some(tail) = self.tail.as_mut() else {
            return Ok(());
        };
        let mut new = tail.poll()?;
        if new.is_empty() {
            // A writer that ended wrote its last line first: read once more before believing it.
            if let crate::record::Liveness::Gone(why) = tail.liveness() {
                new = tail.poll()?;
                if new.is_empty() {
                    self.writer_gone(app, &why);
                    return Ok(());
                }
            }
        }
        if !new.is_empty() {
            self.events.extend(new);
            self.publish(app);
        }
        Ok(())
    }

    /// The followed recording will not grow any more and has no `end`: say so and stop
    /// following (what was recorded stays on screen).
    fn writer_gone(&mut self, app: &mut App, why: &str) {
        let message = format!(
            "the recording stopped growing without an end event ({why}): the run was killed or \
             failed; what it recorded stays on screen"
        );
        app.update(&Event::log(
            app.last_step(),
            crate::telemetry::Level::Error,
            message,
        ));
        self.tail = None;
        self.publish(app);
    }

    fn last_recorded_step(&self) -> u64 {
        self.events
            .iter()
            .rev()
            .find_map(|e| match e {
                Event::Step(s) => Some(s.step),
                _ => None,
            })
            .unwrap_or(0)
    }

    pub fn at_end(&self) -> bool {
        self.cursor >= self.events.len()
    }

    async fn next(&mut self, app: &mut App) -> anyhow::Result<()> {
        if self.paused {
            return std::future::pending().await;
        }
        if self.at_end() {
            if !self.still_written() {
                return std::future::pending().await;
            }
            return self.poll_tail(app).await;
        }
        if self.tail.is_some() {
            // Following: everything written so far is shown at once.
            while !self.at_end() {
                self.feed_one_step(app);
            }
            self.publish(app);
            return Ok(());
        }
        tokio::time::sleep_until(self.next_at).await;
        let step_ms = self.feed_one_step(app);
        if self.at_end() {
            self.publish(app);
        }
        // A recorded step time may be anything (1e308, inf): never longer than MAX_GAP.
        let wait = Duration::try_from_secs_f64((step_ms / 1e3 / self.speed).max(0.0))
            .unwrap_or(MAX_GAP)
            .min(MAX_GAP);
        self.next_at = Instant::now() + wait;
        Ok(())
    }

    /// Feed events up to and including the next step; returns that step's recorded duration.
    pub fn feed_one_step(&mut self, app: &mut App) -> f64 {
        while let Some(e) = self.events.get(self.cursor) {
            self.cursor += 1;
            app.update(e);
            if let Event::Step(s) = e {
                return s.step_ms;
            }
        }
        0.0
    }

    /// Transport actions (pause, step, seek, speed); false for any other action.
    fn transport(&mut self, app: &mut App, action: Action) -> bool {
        match action {
            // Ranks cannot pause: each would wait in a collective until the watchdog ends it.
            // Pausing the display alone would look like a paused run while it trains on.
            Action::PauseResume | Action::SingleStep if self.steer.is_some() => {
                note(
                    app,
                    "the ranks cannot pause (each would wait on the others); q stops them".into(),
                );
            }
            Action::PauseResume => {
                self.paused = !self.paused;
                self.next_at = Instant::now();
            }
            Action::SingleStep => {
                self.paused = true;
                self.feed_one_step(app);
            }
            Action::SpeedUp => self.speed = (self.speed * 2.0).min(MAX_SPEED),
            Action::SpeedDown => self.speed = (self.speed / 2.0).max(MIN_SPEED),
            Action::SeekBack => self.seek(app, app.last_step().saturating_sub(SEEK_STEPS)),
            Action::SeekForward => self.seek(app, app.last_step() + SEEK_STEPS),
            _ => return false,
        }
        true
    }

    /// Rebuild the state as it was right after `step`: replay from the start up to there.
    pub fn seek(&mut self, app: &mut App, step: u64) {
        app.reset_run();
        self.cursor = 0;
        while let Some(e) = self.events.get(self.cursor) {
            if matches!(e, Event::Step(s) if s.step > step) {
                break;
            }
            app.update(e);
            self.cursor += 1;
        }
        self.next_at = Instant::now();
        self.publish(app);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_recordings_never_overwrite_the_first() {
        let base = Path::new("/tmp/run.jsonl");
        assert_eq!(numbered(base, 0), PathBuf::from("/tmp/run.jsonl"));
        assert_eq!(numbered(base, 1), PathBuf::from("/tmp/run-2.jsonl"));
    }

    #[test]
    fn a_recording_started_during_a_pitfall_carries_it_in_its_header() {
        use crate::control::{Control, LossNorm, Origin, ZeroGrad};
        use crate::telemetry::ControlEvent;
        let mut app = App::new(100);
        app.update(&Event::Header(crate::tui::testing::header()));
        for control in [
            Control::SetZeroGrad {
                value: ZeroGrad::PerMicroBatch,
            },
            Control::SetLossNorm {
                value: LossNorm::MeanOfMeans,
            },
            Control::SetAccumSteps { value: 4 },
        ] {
            app.update(&Event::Control(ControlEvent {
                step: 3,
                origin: Origin::Key,
                control,
            }));
        }
        let t = header_now(&app).unwrap().config.train;
        assert_eq!(t.zero_grad, ZeroGrad::PerMicroBatch);
        assert_eq!(t.loss_norm, LossNorm::MeanOfMeans);
        assert_eq!(t.accum_steps, 4);
    }
}
