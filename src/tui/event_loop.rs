//! One `tokio::select!` over keys, the event feed (live trainer or replay file) and a frame tick.
//! Generic over the ratatui `Backend`, so tests drive it with `TestBackend`.

use std::io;
use std::time::Duration;

use crossterm::event::Event as TermEvent;
use futures_util::{Stream, StreamExt};
use ratatui::backend::Backend;
use ratatui::Terminal;

use super::app::App;
use super::feed::Feed;
use super::keymap::KeyMap;
use super::terminal::FrameSync;
use super::ui;

/// At most this many frames a second; frames are drawn only when something changed.
pub const FRAME_INTERVAL: Duration = Duration::from_millis(100);

/// Draw the current state inside a synchronized update.
pub fn draw<B>(terminal: &mut Terminal<B>, app: &mut App, keys: &KeyMap) -> anyhow::Result<()>
where
    B: Backend + FrameSync,
    B::Error: Send + Sync + 'static,
{
    terminal.backend_mut().begin_frame()?;
    terminal.draw(|f| ui::render(f, app, keys))?;
    terminal.backend_mut().end_frame()?;
    app.view.dirty = false;
    Ok(())
}

/// Run until the user quits or `shutdown` resolves; then finish the feed (stop the trainer,
/// flush the recording), on error too. The caller restores the terminal.
pub async fn run<B, S>(
    terminal: &mut Terminal<B>,
    app: &mut App,
    keys: &KeyMap,
    feed: &mut Feed,
    mut input: S,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()>
where
    B: Backend + FrameSync,
    B::Error: Send + Sync + 'static,
    S: Stream<Item = io::Result<TermEvent>> + Unpin,
{
    let mut tick = tokio::time::interval(FRAME_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tokio::pin!(shutdown);
    let mut input_open = true;
    let first = draw(terminal, app, keys);
    let result = if first.is_err() {
        first
    } else {
        loop {
            tokio::select! {
                _ = &mut shutdown => app.view.quit = true,
                key = input.next(), if input_open => match key {
                    Some(Ok(TermEvent::Key(k))) => {
                        if let Some(action) = keys.action_for(&k) {
                            if let Err(e) = feed.act(app, action) {
                                break Err(e);
                            }
                        }
                    }
                    Some(Ok(TermEvent::Resize(..))) => {
                        if let Err(e) = terminal.autoresize() {
                            break Err(e.into());
                        }
                        app.view.dirty = true;
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => break Err(e.into()),
                    None => input_open = false,
                },
                got = feed.next(app) => if let Err(e) = got {
                    break Err(e);
                },
                _ = tick.tick() => {
                    if app.view.dirty {
                        if let Err(e) = draw(terminal, app, keys) {
                            break Err(e);
                        }
                    }
                }
            }
            if app.view.quit {
                break Ok(());
            }
        }
    };
    let finished = feed.finish(app);
    result.and(finished)
}
