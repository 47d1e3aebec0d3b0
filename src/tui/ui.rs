//! The whole screen as a pure function of `App` (and the key bindings the footer names).

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Color;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph, Wrap};
use ratatui::Frame;

use super::app::{App, PaneId};
use super::keymap::{Action, KeyMap};
use super::panes::{self, Theme};
use crate::control::KNOBS;

/// Smallest usable terminal.
pub const MIN_WIDTH: u16 = 80;
pub const MIN_HEIGHT: u16 = 24;
/// From this size up, every pane is on screen at once.
const FULL_WIDTH: u16 = 120;
const FULL_HEIGHT: u16 = 36;

pub fn render(frame: &mut Frame, app: &App, keys: &KeyMap) {
    let area = frame.area();
    let theme = Theme {
        color: app.view.color,
    };
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        return too_small(frame, area);
    }
    let [top, body, foot] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(area);
    frame.render_widget(Paragraph::new(header_line(app, theme)), top);
    frame.render_widget(Paragraph::new(footer_line(app, keys, theme)), foot);
    if app.view.expanded {
        render_pane(frame, body, app, app.view.focus, theme);
    } else if area.width >= FULL_WIDTH && area.height >= FULL_HEIGHT {
        full_layout(frame, body, app, theme);
    } else {
        compact_layout(frame, body, app, theme);
    }
    if app.view.help {
        help_overlay(frame, body, app, keys, theme);
    }
}

fn render_pane(frame: &mut Frame, area: Rect, app: &App, pane: PaneId, theme: Theme) {
    match pane {
        PaneId::DeviceMemory => panes::device_memory::render(frame, area, app, theme),
        PaneId::Ledger => panes::ledger::render(frame, area, app, theme),
        PaneId::Loss => panes::loss::render(frame, area, app, theme),
        PaneId::GradNorm => panes::grad_norm::render(frame, area, app, theme),
        // A run of several ranks shows its communication in the loss scale's place.
        PaneId::LossScale if panes::communication::applies(app) => {
            panes::communication::render(frame, area, app, theme)
        }
        PaneId::LossScale => panes::loss_scale::render(frame, area, app, theme),
        PaneId::Status => panes::status::render(frame, area, app, theme),
        PaneId::EventLog => panes::event_log::render(frame, area, app, theme),
    }
}

/// Three columns of two panes, the event log across the bottom.
fn full_layout(frame: &mut Frame, body: Rect, app: &App, theme: Theme) {
    let [grid, log] = Layout::vertical([Constraint::Min(0), Constraint::Length(8)]).areas(body);
    let [rows_top, rows_bottom] =
        Layout::vertical([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(grid);
    let cols = [Constraint::Ratio(1, 3); 3];
    let top: [Rect; 3] = Layout::horizontal(cols).areas(rows_top);
    let bottom: [Rect; 3] = Layout::horizontal(cols).areas(rows_bottom);
    render_pane(frame, top[0], app, PaneId::DeviceMemory, theme);
    render_pane(frame, top[1], app, PaneId::Loss, theme);
    render_pane(frame, top[2], app, PaneId::Status, theme);
    render_pane(frame, bottom[0], app, PaneId::Ledger, theme);
    render_pane(frame, bottom[1], app, PaneId::GradNorm, theme);
    render_pane(frame, bottom[2], app, PaneId::LossScale, theme);
    render_pane(frame, log, app, PaneId::EventLog, theme);
}

/// Four panes and the newest log lines. The bottom-left slot shows the focused pane when it is
/// one the grid has no room for, so Tab reaches every pane.
fn compact_layout(frame: &mut Frame, body: Rect, app: &App, theme: Theme) {
    let [grid, log] = Layout::vertical([Constraint::Min(0), Constraint::Length(2)]).areas(body);
    let [r1, r2] =
        Layout::vertical([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(grid);
    let halves = [Constraint::Percentage(50), Constraint::Percentage(50)];
    let [a, b]: [Rect; 2] = Layout::horizontal(halves).areas(r1);
    let [c, d]: [Rect; 2] = Layout::horizontal(halves).areas(r2);
    let swappable = matches!(
        app.view.focus,
        PaneId::DeviceMemory | PaneId::LossScale | PaneId::EventLog
    );
    let slot = if swappable {
        app.view.focus
    } else {
        PaneId::GradNorm
    };
    render_pane(frame, a, app, PaneId::Loss, theme);
    render_pane(frame, b, app, PaneId::Status, theme);
    render_pane(frame, c, app, slot, theme);
    render_pane(frame, d, app, PaneId::Ledger, theme);
    frame.render_widget(
        Paragraph::new(panes::event_log::lines(app, log.height as usize, theme)),
        log,
    );
}

fn header_line(app: &App, theme: Theme) -> Line<'static> {
    let mut spans = vec![Span::styled(" gaccwb ", theme.bold())];
    if let Some(h) = &app.run.header {
        spans.push(Span::raw(format!("· {} · {} ", h.config.name, h.device)));
        if let Some(family) = &h.family {
            spans.push(Span::styled(model_label(h, family), theme.bold()));
        }
    }
    let total = app
        .run
        .header
        .as_ref()
        .map(|h| h.config.train.steps)
        .unwrap_or(0);
    let step = app.last_step();
    spans.push(Span::raw(if total > 0 {
        format!("· step {step}/{total} ")
    } else {
        format!("· step {step} ")
    }));
    let state = match (&app.run.ended, app.run.paused) {
        (Some(reason), _) => Span::styled(format!("· ended: {reason} "), theme.warn()),
        (None, true) => Span::styled("· PAUSED ".to_string(), theme.warn()),
        (None, false) => Span::styled("· running ".to_string(), theme.fg(Color::Green)),
    };
    if app.view.replay.is_none() || app.run.ended.is_some() {
        spans.push(state);
    }
    if let Some(r) = &app.view.replay {
        let what = if r.paused { "paused" } else { "playing" };
        let text = match (r.following, r.finished) {
            (true, true) => format!("· FOLLOWED to its end ({} steps) ", r.last_step),
            (true, false) => format!("· FOLLOWING {what} ({} steps so far) ", r.last_step),
            (false, true) => format!("· REPLAY at its end ({} steps) ", r.last_step),
            (false, false) => format!("· REPLAY {what} ×{} ({} steps) ", r.speed, r.last_step),
        };
        spans.push(Span::styled(text, theme.fg(Color::Magenta)));
    }
    if let Some(path) = &app.view.recording {
        spans.push(Span::styled(format!("· ● REC {path} "), theme.error()));
    }
    if let Some(at) = app.view.frozen {
        spans.push(Span::styled(format!("· FROZEN at {at} "), theme.warn()));
    }
    spans.push(Span::styled(
        format!("· window {} steps", app.view.zoom),
        theme.dim(),
    ));
    Line::from(spans)
}

/// A fine-tuned model in the header: family, parameters, directory and sequence length.
fn model_label(h: &crate::telemetry::Header, family: &str) -> String {
    // A directory by its name; a config file alone (random weights) by its directory's.
    let path = h.config.model.path.as_deref();
    let random = path.is_some_and(|p| p.extension().is_some_and(|e| e == "json"));
    let named = path.and_then(|p| if random { p.parent() } else { Some(p) });
    let mut dir = named
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if random {
        dir.push_str(" (random weights)");
    }
    let params = h.params as f64;
    let size = if params >= 1e9 {
        format!("{:.1}B", params / 1e9)
    } else {
        format!("{:.1}M", params / 1e6)
    };
    format!("· {family} {size} {dir} T{} ", h.config.model.seq_len)
}

/// The most used keys, as many as fit: help, quit and pause, then replay's keys or each knob's
/// keys in the knob table's order.
fn footer_line(app: &App, keys: &KeyMap, theme: Theme) -> Line<'static> {
    let mut items: Vec<(String, &str)> = vec![
        (keys.label_for(Action::Help), "help"),
        (keys.label_for(Action::Quit), "quit"),
        (keys.label_for(Action::PauseResume), "pause"),
    ];
    if app.view.replay.is_some() {
        items.push((
            format!(
                "{}/{}",
                keys.label_for(Action::SeekBack),
                keys.label_for(Action::SeekForward)
            ),
            "seek",
        ));
        items.push((
            format!(
                "{}/{}",
                keys.label_for(Action::SpeedDown),
                keys.label_for(Action::SpeedUp)
            ),
            "speed",
        ));
    } else {
        for knob in KNOBS.iter().filter(|k| !k.actions.is_empty()) {
            let labels: Vec<String> = knob
                .actions
                .iter()
                .map(|a| keys.label_for(Action::Knob(a.name)))
                .collect();
            items.push((labels.join("/"), knob.name));
        }
    }
    let mut spans = Vec::new();
    for (key, what) in items {
        spans.push(Span::styled(format!(" {key}"), theme.fg(Color::Cyan)));
        spans.push(Span::raw(format!(" {what} ")));
    }
    Line::from(spans)
}

/// The keys in two columns, then the closing note, always whole; the preset's story above them
/// takes the rows left (at 80×24 a few, cut with `…`; the Controls pane shows the rest).
fn help_overlay(frame: &mut Frame, body: Rect, app: &App, keys: &KeyMap, theme: Theme) {
    let width = body.width.saturating_sub(4).min(100);
    let area = Rect {
        x: body.x + (body.width - width) / 2,
        y: body.y,
        width,
        height: body.height,
    };
    let inner_w = width.saturating_sub(2) as usize;
    let shown: Vec<Action> = Action::all()
        .filter(|a| match app.view.replay {
            Some(_) => !a.live_only(),
            None => !a.replay_only(),
        })
        .collect();
    let half = shown.len().div_ceil(2);
    let col_w = inner_w / 2;
    let key_w = shown
        .iter()
        .map(|a| keys.label_for(*a).chars().count())
        .max()
        .unwrap_or(1);
    let cell = |a: Option<&Action>| {
        a.map(|a| format!("{:>key_w$}  {}", keys.label_for(*a), a.describe()))
            .unwrap_or_default()
    };
    let mut rows: Vec<Line> = (0..half)
        .map(|i| {
            let (left, right) = (cell(shown.get(i)), cell(shown.get(i + half)));
            Line::raw(format!(
                "{:<col_w$}{}",
                truncate(&left, col_w),
                truncate(&right, col_w)
            ))
        })
        .collect();
    rows.push(Line::raw(""));
    rows.push(Line::styled(
        truncate(
            "Knob changes wait for the next window boundary. Any key closes this help.",
            inner_w,
        ),
        theme.dim(),
    ));
    let room = (area.height.saturating_sub(2) as usize).saturating_sub(rows.len() + 1);
    let mut lines: Vec<Line> = story_lines(app, inner_w, room)
        .into_iter()
        .map(|l| Line::styled(l, theme.fg(Color::Green)))
        .collect();
    if !lines.is_empty() {
        lines.push(Line::raw(""));
    }
    lines.extend(rows);
    let area = Rect {
        height: area.height.min(lines.len() as u16 + 2),
        ..area
    };
    frame.render_widget(Clear, area);
    frame.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(" Keys (? to close) ")),
        area,
    );
}

/// The preset's name and story wrapped at `width`, in at most `rows` lines (the last ends in
/// `…` when it is cut).
fn story_lines(app: &App, width: usize, rows: usize) -> Vec<String> {
    let Some(h) = &app.run.header else {
        return Vec::new();
    };
    let words: Vec<&str> = h.config.explanation.split_whitespace().collect();
    if words.is_empty() || rows == 0 || width < 8 {
        return Vec::new();
    }
    let name = format!("{}:", h.config.name);
    let mut lines: Vec<String> = vec![String::new()];
    for word in std::iter::once(name.as_str()).chain(words) {
        let line = lines.last_mut().expect("one line at least");
        if line.is_empty() {
            line.push_str(word);
        } else if line.chars().count() + 1 + word.chars().count() <= width {
            line.push(' ');
            line.push_str(word);
        } else {
            lines.push(word.to_string());
        }
    }
    if lines.len() > rows {
        lines.truncate(rows);
        let last = lines.last_mut().expect("rows > 0");
        let kept: String = last.chars().take(width.saturating_sub(2)).collect();
        *last = format!("{kept} …");
    }
    lines
}

fn truncate(s: &str, w: usize) -> String {
    s.chars().take(w).collect()
}

fn too_small(frame: &mut Frame, area: Rect) {
    let text = vec![
        Line::raw("terminal too small"),
        Line::raw(format!(
            "need {MIN_WIDTH}×{MIN_HEIGHT}, have {}×{}",
            area.width, area.height
        )),
        Line::raw("enlarge the window, or press q to quit"),
    ];
    frame.render_widget(Paragraph::new(text).wrap(Wrap { trim: true }), area);
}
