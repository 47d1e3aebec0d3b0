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
        return tui::run_replay(&args.file, args.speed, &keys);
    }
    let recording = read_recording(&args.file)?;
    for w in &recording.warnings {
        gaccwb::out::note(&format!("warning: {}", headless::strip(w)));
    }
    gaccwb::out::println(&tui::summarize(&recording.events).render())?;
    Ok(())
}
