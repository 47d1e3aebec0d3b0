//! `gaccwb run --headless`: the trainer with a progress bar and a summary, no screen.

use std::io::IsTerminal;
use std::path::PathBuf;

use candle_core::Device;
use indicatif::{ProgressBar, ProgressStyle};

use crate::memory::StepFigure;
use crate::record::Recorder;
use crate::scenario::Scenario;
use crate::telemetry::{Event, Header, Level, MemorySource, StepEvent};
use crate::train;

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
    pub end_reason: String,
    pub errors: Vec<String>,
}

pub fn run(scenario: Scenario, device: Device, opts: HeadlessOptions) -> anyhow::Result<Summary> {
    run_trainer(train::Trainer::new(scenario, device)?, opts)
}

/// `run` for a trainer built by the caller (e.g. resumed from a checkpoint).
pub fn run_trainer(trainer: train::Trainer, opts: HeadlessOptions) -> anyhow::Result<Summary> {
    let total = trainer.scenario.train.steps;
    let mut recorder = opts.record.as_deref().map(Recorder::create).transpose()?;
    let device = trainer.device.clone();
    let (mut handle, sink) = train::spawn_trainer(trainer)?;
    let _sampler = crate::memory::gpu::start_sampler(sink, &device);
    let bar = progress_bar(total, opts.quiet);
    let mut summary = Summary::default();
    while let Some(event) = handle.events.blocking_recv() {
        if let Some(r) = recorder.as_mut() {
            r.write(&event)?;
        }
        match &event {
            Event::Step(s) => {
                bar.set_position(s.step);
                bar.set_message(format!("loss {:.3}  {:.0} tok/s", s.loss, s.tokens_per_s));
            }
            Event::Log(l) if l.level != Level::Error => {
                bar.println(format!("{:?}: {}", l.level, l.message));
            }
            _ => {}
        }
        summary.absorb(&event);
        if matches!(event, Event::End(_)) {
            break;
        }
    }
    bar.finish_and_clear();
    if let Some(r) = recorder.as_mut() {
        r.flush()?;
    }
    handle.stop();
    Ok(summary)
}

fn progress_bar(total: u64, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
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
            Event::End(e) => self.end_reason = e.reason.clone(),
            _ => {}
        }
    }

    /// One paragraph for the end of a headless run.
    pub fn render(&self) -> String {
        let Some(last) = self.steps.last() else {
            return format!("no steps ran ({})", self.end_reason);
        };
        let n = self.steps.len();
        let tail = &self.steps[n.saturating_sub(10)..];
        let tok_s = tail.iter().map(|s| s.tokens_per_s).sum::<f64>() / tail.len() as f64;
        let step_ms = tail.iter().map(|s| s.step_ms).sum::<f64>() / tail.len() as f64;
        let mut out = format!(
            "{} steps ({}) on {}: loss {:.4}",
            last.step,
            self.end_reason,
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
        out
    }
}
