//! The real terminal: raw mode and the alternate screen on the way in, and the way back out on
//! quit, on error (drop guard), on panic (hook) and on SIGTERM/SIGHUP/SIGINT (the loop's shutdown).

use std::io::{self, Stdout, Write};

use crossterm::terminal::{
    self, BeginSynchronizedUpdate, EndSynchronizedUpdate, EnterAlternateScreen,
    LeaveAlternateScreen,
};
use crossterm::{cursor, execute, queue};
use ratatui::backend::{CrosstermBackend, TestBackend};
use ratatui::Terminal;

/// Frames are wrapped in a synchronized update so a slow link never shows half a frame.
pub trait FrameSync {
    fn begin_frame(&mut self) -> io::Result<()>;
    fn end_frame(&mut self) -> io::Result<()>;
}

impl<W: Write> FrameSync for CrosstermBackend<W> {
    fn begin_frame(&mut self) -> io::Result<()> {
        queue!(self, BeginSynchronizedUpdate)
    }

    fn end_frame(&mut self) -> io::Result<()> {
        queue!(self, EndSynchronizedUpdate)?;
        self.flush()
    }
}

impl FrameSync for TestBackend {
    fn begin_frame(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn end_frame(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Puts the terminal back when dropped, whatever path left the UI.
pub struct TerminalGuard {
    pub terminal: Terminal<CrosstermBackend<Stdout>>,
}

impl TerminalGuard {
    pub fn enter() -> anyhow::Result<TerminalGuard> {
        install_panic_hook();
        terminal::enable_raw_mode()?;
        let mut out = io::stdout();
        if let Err(e) = execute!(out, EnterAlternateScreen, cursor::Hide) {
            restore();
            return Err(e.into());
        }
        let terminal = match Terminal::new(CrosstermBackend::new(out)) {
            Ok(t) => t,
            Err(e) => {
                restore();
                return Err(e.into());
            }
        };
        Ok(TerminalGuard { terminal })
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore();
    }
}

/// Leave raw mode and the alternate screen; safe to call more than once.
pub fn restore() {
    let _ = terminal::disable_raw_mode();
    let _ = execute!(
        io::stdout(),
        EndSynchronizedUpdate,
        LeaveAlternateScreen,
        cursor::Show
    );
}

fn install_panic_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore();
        previous(info);
    }));
}

/// Resolves on SIGTERM, SIGHUP (an SSH session that goes away) or SIGINT from outside (in raw
/// mode ctrl-c is a key, not a signal); `signals::caught` then says which.
pub async fn termination() {
    match crate::signals::Stoppers::register() {
        Ok(mut stoppers) => {
            stoppers.next().await;
        }
        Err(_) => std::future::pending().await,
    }
}

/// `NO_COLOR` set to anything non-empty turns colour off (<https://no-color.org>).
pub fn color_enabled() -> bool {
    std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
