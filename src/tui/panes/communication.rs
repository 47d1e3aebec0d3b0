//! Data parallel's communication: bytes each rank sent per step (the line that falls K× when the
//! ranks stop summing every micro-batch), the share of the step spent in collectives, and the
//! spread of the ranks' peak memory. Shown in the loss-scale slot for a run of several ranks.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Color;
use ratatui::text::Line;
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use super::{
    block, draw_chart, fmt_bytes, placeholder, steps_in_view, ChartSpec, Series, Theme, Units,
};
use crate::dist::CommEvent;
use crate::telemetry::StepEvent;
use crate::tui::app::{App, PaneId};

/// Whether the run has communication to show.
pub fn applies(app: &App) -> bool {
    app.run.header.as_ref().is_some_and(|h| h.ranks.is_some())
}

/// Bytes one rank sent in the step, on average over the ranks.
fn sent_per_rank(c: &CommEvent) -> f64 {
    c.sent_bytes() as f64 / c.ranks.max(1) as f64
}

/// The pane's figures for the latest step, as text.
pub fn lines(step: &StepEvent, c: &CommEvent) -> Vec<Line<'static>> {
    let reduces = c.per_rank.first().map_or(0, |r| r.gradient_reduces);
    let share = c.share_of_step(step.step_ms) * 100.0;
    let mine = c.per_rank.first().map_or(0.0, |r| r.comm_ms);
    let (lo, hi) = (
        c.peak_bytes.iter().copied().min().unwrap_or(0),
        c.peak_bytes.iter().copied().max().unwrap_or(0),
    );
    vec![
        Line::from(format!(
            "sent/rank {}/step · {reduces} grad all-reduce{}",
            fmt_bytes(sent_per_rank(c) as u64),
            if reduces == 1 { "" } else { "s" }
        )),
        Line::from(format!(
            "in comm   {share:.0}% of rank 0's step ({mine:.0} of {:.0} ms)",
            step.step_ms
        )),
        Line::from(format!(
            "peak      {} min · {} max",
            fmt_bytes(lo),
            fmt_bytes(hi)
        )),
    ]
}

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    let latest = app.last().and_then(|s| s.comm.as_ref().map(|c| (s, c)));
    let title = match latest {
        Some((_, c)) => {
            let over = app.run.header.as_ref().and_then(|h| h.collectives);
            let kind = over.map(|c| format!("{c} ")).unwrap_or_default();
            format!(" Comm · {} {kind}ranks · per {} ", c.ranks, c.sync.noun())
        }
        None => " Communication ".into(),
    };
    let block = block(title, app, PaneId::LossScale, theme);
    let Some((step, comm)) = latest else {
        return placeholder(frame, area, block, "waiting for the first step…", theme);
    };
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let [text, chart] = Layout::vertical([Constraint::Length(3), Constraint::Min(0)]).areas(inner);
    frame.render_widget(Paragraph::new(lines(step, comm)), text);
    let sent: Vec<(f64, f64)> = steps_in_view(app)
        .filter_map(|s| s.comm.as_ref().map(|c| (s.step as f64, sent_per_rank(c))))
        .collect();
    let series = [Series {
        name: "sent/rank".into(),
        points: sent,
        style: theme.fg(Color::Magenta),
        scatter: false,
    }];
    let spec = ChartSpec {
        series: &series,
        from_zero: true,
        units: Units::Bytes,
        scalable: true,
    };
    draw_chart(
        frame,
        chart,
        ratatui::widgets::Block::new(),
        app,
        spec,
        theme,
    );
}
