//! The workbench screen. `App` holds what the panes show and folds in `Event`s; `ui::render`
//! draws it (a pure function); `event_loop::run` ties keys, the event feed and frames together.
//! A live run and a replay differ only in their `Feed`.

pub mod app;
pub mod event_loop;
pub mod feed;
pub mod fit;
pub mod input;
pub mod keymap;
pub mod panes;
pub mod terminal;
#[doc(hidden)]
pub mod testing;
pub mod ui;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::headless::Summary;
use crate::telemetry::Event;
use crate::train::Trainer;
use app::App;
use feed::{Feed, Live, Replay};
use keymap::KeyMap;
use terminal::TerminalGuard;

pub struct LiveOptions {
    /// Record from the first event to this file.
    pub record: Option<PathBuf>,
    pub keys: KeyMap,
    /// What `record` may replace (with `--force`: a regular file that is not an input, written
    /// beside it and renamed when complete).
    pub overwrite: crate::safe_write::Overwrite,
}

/// The UI needs a terminal on stdout; say what to do instead when there is none.
pub fn require_terminal() -> anyhow::Result<()> {
    if !std::io::stdout().is_terminal() {
        anyhow::bail!(
            "stdout is not a terminal, so the workbench screen cannot start; \
             add --headless for a progress bar and a summary"
        );
    }
    // A terminal that says it cannot move the cursor would show escape sequences as text.
    if std::env::var_os("TERM").is_some_and(|t| t == "dumb") {
        anyhow::bail!(
            "TERM=dumb: this terminal cannot draw the workbench screen; add --headless for a \
             progress bar and a summary, or run in a terminal that can (TERM=xterm-256color)"
        );
    }
    Ok(())
}

/// Run `trainer` with the workbench screen until the user quits.
pub fn run_live(trainer: Trainer, opts: LiveOptions) -> anyhow::Result<()> {
    require_terminal()?;
    let session = crate::session::Session::start(trainer, opts.record.as_deref(), &opts.overwrite)?;
    let live = Live::from_session(session, opts.record.as_deref());
    let mut app = App::default();
    app.view.color = terminal::color_enabled();
    app.view.recording = live.recording_path();
    let mut feed = Feed::Live(live);
    on_screen(&mut app, &opts.keys, &mut feed)?;
    if let Some(path) = &opts.record {
        crate::out::note(&format!("recording saved to {}", path.display()));
    }
    Ok(())
}

/// Play a recording on the workbench screen.
pub fn run_replay(path: &Path, speed: f64, keys: &KeyMap) -> anyhow::Result<()> {
    require_terminal()?;
    let recording = crate::record::read_recording(path)?;
    for w in &recording.warnings {
        crate::out::note(&format!("warning: {}", crate::headless::strip(w)));
    }
    let mut app = App::default();
    app.view.color = terminal::color_enabled();
    let replay = Replay::new(recording.events, speed, &mut app);
    let mut feed = Feed::Replay(replay);
    on_screen(&mut app, keys, &mut feed)
}

/// Show a recording that is still being written (a headless run's, a rank's) as it grows; with
/// `steer`, knob keys are written there for the run to read (`run --controls-from`).
pub fn run_follow(
    path: &Path,
    keys: &KeyMap,
    steer: Option<crate::steer::ControlWriter>,
) -> anyhow::Result<()> {
    require_terminal()?;
    follow_tail(crate::record::Tail::open(path)?, keys, steer)
}

/// [`run_follow`] of a recording already opened (the launcher of `--ranks` removes its scratch
/// files once it holds them).
pub fn follow_tail(
    tail: crate::record::Tail,
    keys: &KeyMap,
    steer: Option<crate::steer::ControlWriter>,
) -> anyhow::Result<()> {
    require_terminal()?;
    let mut app = App::default();
    app.view.color = terminal::color_enabled();
    let replay = match steer {
        Some(steer) => Replay::steer(tail, steer, &mut app),
        None => Replay::follow(tail, &mut app),
    };
    on_screen(&mut app, keys, &mut Feed::Replay(replay))
}

/// Enter the terminal, run the loop, and restore the terminal whatever happened.
fn on_screen(app: &mut App, keys: &KeyMap, feed: &mut Feed) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the event loop")?;
    let mut guard = TerminalGuard::enter().context("preparing the terminal")?;
    let input = input::start().context("reading the terminal's keys")?;
    let result = runtime.block_on(event_loop::run(
        &mut guard.terminal,
        app,
        keys,
        feed,
        input,
        terminal::termination(),
    ));
    drop(guard);
    // Stopped from outside: the conventional exit code once the terminal is back.
    match crate::signals::caught() {
        Some(signal) => result.and(Err(signal.into())),
        None => result,
    }
}

/// What a headless run would have printed, from a recording's events.
pub fn summarize(events: &[Event]) -> Summary {
    let mut summary = Summary::default();
    for event in events {
        summary.absorb(event);
    }
    summary
}
