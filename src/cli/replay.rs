//! `gaccwb replay`: play a recording on the workbench screen, or print its summary.

use std::path::PathBuf;

use clap::Args;

use gaccwb::headless;
use gaccwb::record::read_recording;
use gaccwb::tui::{self, keymap::KeyMap};

use super::usage;

#[derive(Args)]
pub struct ReplayArgs {
    /// A recording written by --record (JSON Lines).
    file: PathBuf,
    /// Playback speed against the recorded step times (2 = twice as fast).
    #[arg(long, default_value_t = 1.0, value_parser = super::speed)]
    speed: f64,
    /// No screen: print the run's summary.
    #[arg(long)]
    headless: bool,
    /// Key bindings (TOML); default: $XDG_CONFIG_HOME/gaccwb/keys.toml when it exists.
    #[arg(long, value_name = "FILE")]
    keys: Option<PathBuf>,
    /// Follow a recording that is still being written (a run under mpirun, nohup or a
    /// scheduler): show what is there, then each event as it arrives, until the run ends.
    /// With --headless, wait for the end, print the summary and exit as the run did.
    #[arg(long, conflicts_with = "speed")]
    follow: bool,
}

impl ReplayArgs {
    /// The files replay reads.
    pub(super) fn inputs(&self) -> gaccwb::safe_write::Inputs {
        super::inputs::recording(&self.file, self.keys.as_deref())
    }
}

pub fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    if !args.headless {
        let keys = KeyMap::load(args.keys.as_deref()).map_err(usage)?;
        tui::require_terminal().map_err(usage)?;
        if args.follow {
            return tui::run_follow(&args.file, &keys);
        }
        return tui::run_replay(&args.file, args.speed, &keys);
    }
    if args.follow {
        return follow_headless(&args.file);
    }
    let recording = read_recording(&args.file)?;
    for w in &recording.warnings {
        gaccwb::out::note(&format!("warning: {}", headless::strip(w)));
    }
    gaccwb::out::println(&tui::summarize(&recording.events).render())?;
    Ok(())
}

/// `replay --follow --headless`: read the recording as it grows until its end event, then print
/// the summary the run prints (and exit as the run did not, when it failed).
fn follow_headless(path: &std::path::Path) -> anyhow::Result<()> {
    let mut tail = gaccwb::record::Tail::open(path)?;
    let mut summary = headless::Summary::default();
    loop {
        let events = tail.poll()?;
        let ended = events
            .iter()
            .any(|e| matches!(e, gaccwb::telemetry::Event::End(_)));
        for e in &events {
            summary.absorb(e);
        }
        if ended {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    gaccwb::out::println(&summary.render())?;
    match summary.outcome() {
        Some(ended) => Err(ended.into()),
        None => Ok(()),
    }
}
