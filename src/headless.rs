//! `gaccwb run --headless`: the trainer with a progress bar and a summary, no screen.

use std::io::IsTerminal;
use std::path::PathBuf;

use candle_core::Device;
use indicatif::{ProgressBar, ProgressStyle};

use crate::control::{Control, ControlMsg, Origin};
use crate::end::EndReason;
use crate::memory::StepFigure;
use crate::scenario::Scenario;
use crate::session::Session;
use crate::telemetry::{Event, Header, Level, MemorySource, StepEvent};
use crate::train;

/// A run that failed or that a signal stopped: the program exits with the reason's code
/// (`EndReason::exit_code`: 1, or 128 + the signal).
#[derive(Debug, thiserror::Error)]
#[error("{}", describe(.0))]
pub struct RunEnded(pub EndReason);

fn describe(reason: &EndReason) -> String {
    match reason {
        EndReason::Signalled(_) => reason.to_string(),
        _ => format!("training failed: {}", strip(&reason.to_string())),
    }
}

pub struct HeadlessOptions {
    pub record: Option<PathBuf>,
    /// Print one JSON line per event to stdout instead of a progress bar.
    pub quiet: bool,
}

/// What a headless run saw, for the summary line and for tests.
#[derive(Default)]
pub struct Summary {
    pub header: Option<Header>,
    pub steps: Vec<StepEvent>,
    pub last_val_loss: Option<f64>,
    /// Highest measured step figure (`memory::figure`), and where it was measured.
    pub peak_memory: Option<(u64, MemorySource)>,
    /// The figure of the step being measured.
    figure: Option<StepFigure>,
    /// Why the run ended; `None` until its `end` event (a recording may lack one).
    pub end_reason: Option<EndReason>,
    pub errors: Vec<String>,
    /// The recording was stopped with `r` while the run went on (its last line says so).
    stopped_by_key: bool,
}

/// The line a recording stopped with `r` ends with (an `info` log event).
pub const RECORDING_STOPPED: &str = "recording stopped with `r`; the run went on";

pub fn run(scenario: Scenario, device: Device, opts: HeadlessOptions) -> anyhow::Result<Summary> {
    run_trainer(train::Trainer::new(scenario, device)?, opts)
}

/// `run` for a trainer built by the caller (e.g. resumed from a checkpoint).
pub fn run_trainer(trainer: train::Trainer, opts: HeadlessOptions) -> anyhow::Result<Summary> {
    refuse_screen_controls(&trainer)?;
    let session = Session::start(trainer, opts.record.as_deref(), &Default::default())?;
    let progress = match opts.quiet {
        true => Progress::Hidden,
        false => Progress::Bar,
    };
    run_session(session, progress, SignalHandling::Ignore)
}

/// Whether a headless run draws a progress bar (on a terminal only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    Bar,
    Hidden,
}

/// What SIGINT, SIGTERM and SIGHUP do to a headless run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalHandling {
    /// End the run cleanly at the next boundary (the CLI).
    Stop,
    /// Leave them alone (tests, which share the process).
    Ignore,
}

/// A scripted control only a screen can answer (`pause`, `single_step`), in a headless run.
#[derive(Debug, thiserror::Error)]
#[error(
    "{from} has `{control}` at step {step}: a headless run has no screen to resume it from; \
     remove it, or run without --headless"
)]
pub struct NeedsScreen {
    /// Where it was given: the preset's timeline or `--control`.
    pub from: &'static str,
    /// The control, in words.
    pub control: String,
    /// The step it is due at.
    pub step: u64,
}

/// Without a screen nobody can resume a paused run: a scripted `pause` or `single_step` would
/// hang it, so it is refused before the run starts.
pub fn refuse_screen_controls(trainer: &train::Trainer) -> Result<(), NeedsScreen> {
    let scripted = trainer
        .scenario()
        .timeline
        .iter()
        .map(|e| (e, "the preset's timeline"));
    let cli = trainer.cli_controls().iter().map(|e| (e, "--control"));
    for (entry, from) in scripted.chain(cli) {
        if matches!(entry.control, Control::Pause | Control::SingleStep) {
            return Err(NeedsScreen {
                from,
                control: entry.control.describe(),
                step: entry.step,
            });
        }
    }
    Ok(())
}

/// Follow a started session to its end, recording as it goes.
pub fn run_session(
    session: Session,
    progress: Progress,
    signals: SignalHandling,
) -> anyhow::Result<Summary> {
    let Session {
        mut handle,
        sampler: _sampler,
        mut recorder,
        steps: total,
        sink,
    } = session;
    // A rank whose collective timed out is stuck in it: the recording gets its `end` from here,
    // and the stuck trainer thread is not waited for.
    let timed_out = sink.clone();
    crate::dist::watchdog::on_timeout(move |why| {
        send_end(&timed_out, EndReason::Error(why.to_string()));
    });
    if signals == SignalHandling::Stop {
        let controls = handle.controls.clone();
        let ender = sink.clone();
        crate::signals::watch(move |signo| {
            let _ = controls.send(ControlMsg {
                control: Control::Stop,
                origin: Origin::Key,
            });
            let _ = std::thread::Builder::new()
                .name("gaccwb-last-words".into())
                .spawn(move || end_if_stuck(&ender, signo));
        })?;
    }
    let bar = progress_bar(total, progress);
    let mut summary = Summary::default();
    while let Some(mut event) = handle.events.blocking_recv() {
        crate::signals::mark_end(&mut event);
        if let Some(r) = recorder.as_mut() {
            r.write(&event)?;
        }
        match &event {
            // A hidden bar is given no message: its length would follow the timing, and the
            // run's heap (`other`) with it.
            Event::Step(s) if !bar.is_hidden() => {
                bar.set_position(s.step);
                bar.set_message(format!("loss {:.3}  {:.0} tok/s", s.loss, s.tokens_per_s));
            }
            Event::Log(l) if l.level != Level::Info => {
                // Errors and warnings go to stderr as they happen (a hidden bar prints nothing),
                // errors into the final summary too.
                let level = match l.level {
                    Level::Error => "error",
                    _ => "warning",
                };
                let line = format!("gaccwb: {level} at step {}: {}", l.step, strip(&l.message));
                bar.suspend(|| crate::out::note(&line));
            }
            Event::Log(l) => bar.println(format!("{:?}: {}", l.level, strip(&l.message))),
            _ => {}
        }
        summary.absorb(&event);
        if matches!(event, Event::End(_)) {
            break;
        }
    }
    bar.finish_and_clear();
    if let Some(r) = recorder.take() {
        r.finish()?;
    }
    if crate::dist::watchdog::abandoned() {
        // Joining would wait forever; the watchdog ends the process shortly.
        std::mem::forget(handle);
    } else {
        handle.stop();
    }
    Ok(summary)
}

/// How long a rank asked to stop may sit in one collective before it ends without its peers:
/// a peer that died leaves it there, and Open MPI's launcher kills what is left of the job one
/// second after its SIGTERM (`odls_base_sigkill_timeout`), before the trainer could write `end`.
const STUCK_AFTER_SIGNAL: std::time::Duration = std::time::Duration::from_millis(400);

/// After a stopping signal: if the trainer sits in one collective (the other ranks do not
/// answer) for [`STUCK_AFTER_SIGNAL`], the run ends here, with its `end`, without it. Alone, a
/// run enters no collective and this never fires.
fn end_if_stuck(sink: &crate::telemetry::EventSink, signo: i32) {
    let signalled = std::time::Instant::now();
    loop {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let Some(entered) = crate::dist::watchdog::collective_entered() else {
            continue;
        };
        if entered.max(signalled).elapsed() >= STUCK_AFTER_SIGNAL {
            crate::dist::watchdog::abandon();
            send_end(sink, EndReason::Signalled(signo));
            return;
        }
    }
}

/// An `end` sent from outside the trainer (which is stuck in a collective).
fn send_end(sink: &crate::telemetry::EventSink, reason: EndReason) {
    sink.send(Event::End(crate::telemetry::EndEvent {
        step: sink.last_step(),
        reason,
    }));
}

fn progress_bar(total: u64, progress: Progress) -> ProgressBar {
    if progress == Progress::Hidden || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = if total > 0 {
        ProgressBar::new(total)
    } else {
        ProgressBar::new_spinner()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} step {pos}/{len} [{elapsed_precise}] {wide_bar} {msg}",
        )
        .expect("valid template"),
    );
    bar
}

impl Summary {
    /// Fold in one event: the same for a live run and for a recording.
    pub fn absorb(&mut self, event: &Event) {
        match event {
            Event::Header(h) => self.header = Some(h.clone()),
            Event::Step(s) => self.steps.push(s.clone()),
            Event::Eval(e) => self.last_val_loss = Some(e.val_loss),
            Event::Memory(m) => {
                match self.figure.as_mut() {
                    Some(f) if f.step == m.step => f.absorb(m),
                    _ => self.figure = Some(StepFigure::new(m)),
                }
                let peak = self.figure.as_ref().map_or(0, |f| f.peak);
                if self.peak_memory.is_none_or(|(best, _)| peak >= best) {
                    self.peak_memory = Some((peak, m.source));
                }
            }
            Event::Log(l) if l.level == Level::Error => self.errors.push(l.message.clone()),
            Event::Log(l) if l.message == RECORDING_STOPPED => self.stopped_by_key = true,
            Event::End(e) => self.end_reason = Some(e.reason.clone()),
            _ => {}
        }
    }

    /// The end reason as text, or why a recording has none: stopped with `r` while the run
    /// went on, or cut off (a run still going, or one killed before it could say).
    fn why(&self) -> String {
        match &self.end_reason {
            Some(reason) => reason.to_string(),
            None if self.stopped_by_key => RECORDING_STOPPED.into(),
            None => "the recording ends here: no end of the run in it (still running, or \
                     killed)"
                .into(),
        }
    }

    /// The error a run that did not succeed ends the program with (its exit code follows the
    /// reason); `None` for a completed or stopped run.
    pub fn outcome(&self) -> Option<RunEnded> {
        self.end_reason
            .clone()
            .filter(|r| r.exit_code() != 0)
            .map(RunEnded)
    }

    /// One paragraph for the end of a headless run.
    pub fn render(&self) -> String {
        let why = self.why();
        let Some(last) = self.steps.last() else {
            return strip(&format!("no steps ran ({why})"));
        };
        let n = self.steps.len();
        let tail = &self.steps[n.saturating_sub(10)..];
        let tok_s = tail.iter().map(|s| s.tokens_per_s).sum::<f64>() / tail.len() as f64;
        let step_ms = tail.iter().map(|s| s.step_ms).sum::<f64>() / tail.len() as f64;
        let mut out = format!(
            "{} steps ({}) on {}: loss {:.4}",
            last.step,
            why,
            self.header
                .as_ref()
                .map(|h| h.device.as_str())
                .unwrap_or("?"),
            last.loss
        );
        if let Some(v) = self.last_val_loss {
            out += &format!(", val {v:.4}");
        }
        if let Some(floor) = self.header.as_ref().and_then(|h| h.entropy_floor) {
            out += &format!(" (floor {floor:.4})");
        }
        out += &format!(
            "; {tok_s:.0} tokens/s, {step_ms:.0} ms/step over the last {}; K={} B={} skipped {}",
            tail.len(),
            last.accum_steps,
            last.micro_batch,
            last.overflow_count
        );
        if let Some(comm) = communication(tail) {
            out += &comm;
        }
        if let Some((peak, source)) = self.peak_memory {
            let source = serde_json::to_value(source).unwrap_or_default();
            let source = source.as_str().unwrap_or("?").to_string();
            out += &format!(
                "; peak {:.1} MiB ({source})",
                peak as f64 / (1 << 20) as f64
            );
        }
        for e in &self.errors {
            out += &format!("\n{e}");
        }
        // Reasons, errors and the device name may come from a recording someone else wrote.
        strip(&out)
    }
}

/// Data parallel's line: ranks, bytes each rank sent per step and the share of the step spent
/// in collectives, averaged over `tail`; `None` for a run of one process.
fn communication(tail: &[StepEvent]) -> Option<String> {
    let comms: Vec<(&crate::dist::CommEvent, f64)> = tail
        .iter()
        .filter_map(|s| s.comm.as_ref().map(|c| (c, s.step_ms)))
        .collect();
    let (last, _) = comms.last()?;
    let n = comms.len() as f64;
    let sent = comms
        .iter()
        .map(|(c, _)| c.sent_bytes() as f64 / c.ranks.max(1) as f64)
        .sum::<f64>()
        / n;
    let share = comms
        .iter()
        .map(|(c, ms)| c.share_of_step(*ms))
        .sum::<f64>()
        / n;
    Some(format!(
        "; {} ranks (sync per {}): {:.2} MiB sent per rank per step, {:.0}% of rank 0's step \
         in collectives",
        last.ranks,
        last.sync.noun(),
        sent / f64::from(1 << 20),
        share * 100.0
    ))
}

/// `text` without terminal escape sequences or other control characters (newlines and tabs
/// stay), so text read from a recording cannot move the cursor, retitle or clear the terminal.
pub fn strip(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' | '\u{9b}' => skip_escape(c, &mut chars),
            '\n' | '\t' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// Consume the rest of an escape sequence: CSI (`ESC [` … final byte), OSC/DCS/APC/PM/SOS
/// (… BEL or `ESC \\`), or a two-character escape.
fn skip_escape(first: char, chars: &mut std::iter::Peekable<std::str::Chars>) {
    let kind = if first == '\u{9b}' {
        '['
    } else {
        match chars.next() {
            Some(k) => k,
            None => return,
        }
    };
    match kind {
        '[' => {
            for c in chars.by_ref() {
                if ('\x40'..='\x7e').contains(&c) {
                    break;
                }
            }
        }
        ']' | 'P' | '_' | '^' | 'X' => {
            while let Some(c) = chars.next() {
                if c == '\x07' || (c == '\x1b' && chars.next_if_eq(&'\\').is_some()) {
                    break;
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::strip;

    #[test]
    fn escape_sequences_and_controls_are_removed() {
        assert_eq!(strip("a\x1b[2J\x1b[31mred\x1b[0m b"), "ared b");
        assert_eq!(strip("t\x1b]0;pwned\x07itle\x1b]2;x\x1b\\!"), "title!");
        assert_eq!(strip("bell\x07\r\nnext\tcol"), "bell\nnext\tcol");
        assert_eq!(strip("plain ünïcode"), "plain ünïcode");
    }
}
