//! Per-category memory: the measured ledger beside the analytic estimate, one bar per category.
//! `█` is measured, `|` marks the estimate on the same scale.

use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use super::{block, fmt_bytes, placeholder, Theme};
use crate::telemetry::{Categories, MemoryEvent, MemorySource, Phase};
use crate::tui::app::{App, PaneId};

/// Category labels, short enough for the compact layout, in `Categories::NAMES` order.
const LABELS: [&str; 8] = [
    "params",
    "compute w",
    "grads",
    "grads tmp",
    "opt state",
    "offloaded",
    "activation",
    "other",
];

fn source_name(m: &MemoryEvent) -> &'static str {
    match m.source {
        MemorySource::Allocator => "allocator",
        MemorySource::Nvml => "NVML",
        MemorySource::CudaPool => "CUDA pool",
    }
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::Optimizer => "optimizer",
        Phase::Step => "end of step",
    }
}

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    let title = match &app.run.measured {
        Some(m) => format!(
            " Memory ledger · {} at {} of step {} ",
            source_name(m),
            phase_name(m.phase),
            m.step
        ),
        None => " Memory ledger ".into(),
    };
    let block = block(title, app, PaneId::Ledger, theme);
    if app.run.measured.is_none() && app.estimate().is_none() {
        return placeholder(frame, area, block, "no memory data yet", theme);
    }
    let inner = block.inner(area);
    let measured = app.run.measured.as_ref().map(|m| m.categories);
    let estimate = app.estimate().map(|m| m.categories);
    let lines = rows(measured, estimate, inner.width as usize, theme);
    // Every category always shows; the column heads and the total only when there is room.
    let lines = fit(lines, inner.height as usize);
    frame.render_widget(Paragraph::new(lines).block(block), area);
}

/// `lines` is heads, 8 categories, total: drop the total, then the heads, to fit `height`.
fn fit(mut lines: Vec<Line<'static>>, height: usize) -> Vec<Line<'static>> {
    if lines.len() > height {
        lines.pop();
    }
    if lines.len() > height {
        lines.remove(0);
    }
    lines
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
