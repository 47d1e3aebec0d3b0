//! `gaccwb export FILE --to cast`: an asciinema v2 recording of the workbench replaying a
//! session. Every frame comes from the same `ui::render` the live screen uses, drawn through a
//! crossterm backend into memory, so the cast holds exactly the bytes a terminal would get.
//! A marker (`"m"` event) sits at each applied control.

use std::cell::RefCell;
use std::io::Write;
use std::rc::Rc;

use ratatui::backend::CrosstermBackend;
use ratatui::layout::Rect;
use ratatui::{Terminal, TerminalOptions, Viewport};
use serde_json::json;

use crate::telemetry::Event;
use crate::tui::app::App;
use crate::tui::event_loop::draw;
use crate::tui::keymap::KeyMap;

pub struct CastOptions {
    pub width: u16,
    pub height: u16,
    /// Frames per second of cast time, at most.
    pub fps: f64,
    /// Cast time runs this many times faster than the recorded step times.
    pub speed: f64,
}

impl Default for CastOptions {
    fn default() -> Self {
        CastOptions {
            width: 120,
            height: 40,
            fps: 10.0,
            speed: 1.0,
        }
    }
}

/// What was written.
#[derive(Debug, Default, PartialEq)]
pub struct CastStats {
    pub frames: usize,
    pub markers: usize,
    pub duration_s: f64,
}

pub fn write_cast(
    events: &[Event],
    out: &mut impl Write,
    opts: &CastOptions,
) -> anyhow::Result<CastStats> {
    let area = Rect::new(0, 0, opts.width, opts.height);
    let screen = Screen::default();
    let mut terminal = Terminal::with_options(
        CrosstermBackend::new(screen.clone()),
        TerminalOptions {
            viewport: Viewport::Fixed(area),
        },
    )?;
    let keys = KeyMap::default();
    let mut app = App::default();
    let title = events.iter().find_map(|e| match e {
        Event::Header(h) => Some((h.config.name.clone(), h.started_unix)),
        _ => None,
    });
    let (name, started) = title.unwrap_or_default();
    let header = json!({
        "version": 2,
        "width": opts.width,
        "height": opts.height,
        "timestamp": started,
        "title": crate::headless::strip(&format!("gaccwb replay: {name}")),
        "env": {"TERM": "xterm-256color"},
    });
    writeln!(out, "{header}")?;
    // Start from a blank screen with the cursor hidden, as the live UI does.
    emit(out, 0.0, "o", "\x1b[?25l\x1b[2J\x1b[H")?;

    let frame_gap = 1.0 / opts.fps.max(0.1);
    let speed = opts.speed.max(1e-3);
    let mut stats = CastStats::default();
    let mut t = 0.0;
    let mut last_frame = f64::NEG_INFINITY;
    for event in events {
        app.update(event);
        match event {
            Event::Step(s) => t += s.step_ms.max(0.0) / 1e3 / speed,
            Event::Control(c) => {
                emit(
                    out,
                    t,
                    "m",
                    &format!("step {}: {}", c.step, c.control.describe()),
                )?;
                stats.markers += 1;
            }
            _ => {}
        }
        if t - last_frame >= frame_gap {
            frame(&mut terminal, &screen, &mut app, &keys, out, t)?;
            stats.frames += 1;
            last_frame = t;
        }
    }
    if app.view.dirty {
        frame(&mut terminal, &screen, &mut app, &keys, out, t)?;
        stats.frames += 1;
    }
    stats.duration_s = t;
    Ok(stats)
}

fn frame(
    terminal: &mut Terminal<CrosstermBackend<Screen>>,
    screen: &Screen,
    app: &mut App,
    keys: &KeyMap,
    out: &mut impl Write,
    t: f64,
) -> anyhow::Result<()> {
    draw(terminal, app, keys)?;
    let bytes = screen.take();
    emit(out, t, "o", &String::from_utf8_lossy(&bytes))
}

/// What the backend wrote since the last frame.
#[derive(Clone, Default)]
struct Screen(Rc<RefCell<Vec<u8>>>);

impl Screen {
    fn take(&self) -> Vec<u8> {
        std::mem::take(&mut *self.0.borrow_mut())
    }
}

impl Write for Screen {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn emit(out: &mut impl Write, t: f64, kind: &str, data: &str) -> anyhow::Result<()> {
    let t = (t * 1e6).round() / 1e6;
    writeln!(out, "{}", json!([t, kind, data]))?;
    Ok(())
}
