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
            return tui::run_follow(&args.file, &keys, None);
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
/// the summary the run prints (and exit as the run did not, when it failed). A writer that is
/// gone without writing its end ends the follow with what it recorded, and exit 1.
fn follow_headless(path: &std::path::Path) -> anyhow::Result<()> {
    use gaccwb::record::Liveness;
    let mut tail = gaccwb::record::Tail::open(path)?;
    if tail.reading() != path {
        gaccwb::out::note(&format!(
            "gaccwb: {} is being replaced by a run writing {}; following that run",
            path.display(),
            tail.reading().display()
        ));
    }
    let mut summary = headless::Summary::default();
    let mut gone = None;
    while summary.end_reason.is_none() {
        let mut events = tail.poll()?;
        if events.is_empty() {
            if let Liveness::Gone(why) = tail.liveness() {
                // A writer that ended wrote its last line first: read once more.
                events = tail.poll()?;
                gone = events.is_empty().then_some(why);
            }
        }
        for e in &events {
            summary.absorb(e);
        }
        if gone.is_some() {
            break;
        }
        if events.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(250));
        }
    }
    gaccwb::out::println(&summary.render())?;
    if let Some(why) = gone {
        anyhow::bail!(
            "{}: the recording stopped growing without an end event ({why}): the run was killed \
             or failed; the summary above is what it recorded",
            path.display()
        );
    }
    match summary.outcome() {
        Some(ended) => Err(ended.into()),
        None => Ok(()),
    }
}
