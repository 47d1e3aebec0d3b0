//! Per-category memory: the measured ledger beside the analytic estimate, one bar per category.
//! `█` is measured, `|` marks the estimate on the same scale.

use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use super::{block, fmt_bytes, placeholder, Theme};
use crate::telemetry::Categories;
use crate::tui::app::{App, PaneId};

/// Category labels, short enough for the compact layout, in `Categories::NAMES` order.
const LABELS: [&str; 9] = [
    "params",
    "compute w",
    "grads",
    "grads tmp",
    "opt state",
    "offloaded",
    "activation",
    "frozen",
    "other",
];

/// The `frozen` row's index in `Categories::NAMES`.
const FROZEN: usize = 7;

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    // Heads, 8 categories and the total need 10 rows; with fewer (80×24), the total moves into
    // the frame's bottom edge, measured then estimated (the columns' order), and every category
    // keeps its row.
    let compact = area.height < 12;
    let title = match (&app.run.measured, compact) {
        (Some(m), false) => format!(
            " Memory ledger · {} at {} of step {} ",
            m.source.label(),
            m.phase.label(),
            m.step
        ),
        (Some(m), true) => format!(" Ledger · {}, step {} ", m.phase.label(), m.step),
        (None, _) => " Memory ledger ".into(),
    };
    let mut block = block(title, app, PaneId::Ledger, theme);
    if app.run.measured.is_none() && app.estimate().is_none() {
        return placeholder(frame, area, block, "no memory data yet", theme);
    }
    let measured = app.run.measured.as_ref().map(|m| m.categories);
    let estimate = app.estimate().map(|m| m.categories);
    let total = |c: Option<Categories>| c.map_or_else(|| "—".into(), |c| fmt_bytes(c.sum()));
    let inner = block.inner(area);
    let mut lines = rows(measured, estimate, inner.width as usize, theme);
    if compact {
        lines.pop();
        lines.remove(0);
        block = block.title_bottom(Line::from(vec![
            Span::raw(format!(" total {}", total(measured))),
            Span::styled(format!(" · est {} ", total(estimate)), theme.dim()),
        ]));
    }
    frame.render_widget(Paragraph::new(lines).block(block), area);
}

fn rows(
    measured: Option<Categories>,
    estimate: Option<Categories>,
    width: usize,
    theme: Theme,
) -> Vec<Line<'static>> {
    let m = measured.map(|c| c.values());
    let e = estimate.map(|c| c.values());
    let scale = m
        .iter()
        .chain(e.iter())
        .flat_map(|v| v.iter())
        .copied()
        .max()
        .unwrap_or(0)
        .max(1);
    let bar_w = width.saturating_sub(10 + 1 + 1 + 9 + 1 + 9).max(3);
    let mut lines = vec![Line::styled(
        format!(
            "{:<10} {:<bar_w$} {:>9} {:>9}",
            "category", "", "measured", "estimate"
        ),
        theme.dim(),
    )];
    let cell = |v: Option<u64>| v.map(fmt_bytes).unwrap_or_else(|| "—".into());
    for (i, label) in LABELS.iter().enumerate() {
        let mv = m.map(|v| v[i]);
        let ev = e.map(|v| v[i]);
        // Frozen weights exist under LoRA only: other runs keep their rows (and layout).
        if i == FROZEN && mv.unwrap_or(0) == 0 && ev.unwrap_or(0) == 0 {
            continue;
        }
        let len = |v: u64| ((v as f64 / scale as f64) * bar_w as f64).round() as usize;
        let filled = mv.map(len).unwrap_or(0).min(bar_w);
        let mut bar: Vec<char> = (0..bar_w)
            .map(|j| if j < filled { '█' } else { '·' })
            .collect();
        if let Some(ev) = ev {
            let at = len(ev).min(bar_w.saturating_sub(1));
            bar[at] = '|';
        }
        let bar: String = bar.into_iter().collect();
        lines.push(Line::from(vec![
            Span::raw(format!("{label:<10} ")),
            Span::styled(bar, theme.fg(Color::Cyan)),
            Span::raw(format!(" {:>9}", cell(mv))),
            Span::styled(format!(" {:>9}", cell(ev)), theme.dim()),
        ]));
    }
    let total = |c: Option<Categories>| c.map(|c| fmt_bytes(c.sum()));
    lines.push(Line::from(format!(
        "{:<10} {:<bar_w$} {:>9} {:>9}",
        "total",
        "",
        total(measured).unwrap_or_else(|| "—".into()),
        total(estimate).unwrap_or_else(|| "—".into())
    )));
    lines
}
