//! The event log: controls applied (and where from), overflows, warnings and errors, newest last.

use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use super::{block, placeholder, Theme};
use crate::telemetry::Level;
use crate::tui::app::{App, PaneId};

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    let block = block(" Events ", app, PaneId::EventLog, theme);
    let rows = block.inner(area).height as usize;
    if app.run.log.is_empty() {
        return placeholder(frame, area, block, "no events yet", theme);
    }
    frame.render_widget(Paragraph::new(lines(app, rows, theme)).block(block), area);
}

/// The newest `rows` log lines, oldest first.
pub fn lines(app: &App, rows: usize, theme: Theme) -> Vec<Line<'static>> {
    let skip = app.run.log.len().saturating_sub(rows);
    app.run
        .log
        .iter()
        .skip(skip)
        .map(|l| {
            let style = match l.level {
                Level::Info => ratatui::style::Style::default(),
                Level::Warn => theme.warn(),
                Level::Error => theme.error(),
            };
            Line::from(vec![
                Span::styled(format!("{:>6} ", l.step), theme.dim()),
                Span::styled(l.text.clone(), style),
            ])
        })
        .collect()
}
