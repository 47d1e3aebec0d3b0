//! Controls and status: the knobs in force, pending changes, throughput and the step's phases.

use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Wrap};
use ratatui::Frame;

use super::{block, Theme};
use crate::control::{Control, KNOBS};
use crate::tui::app::{App, PaneId};

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    let block = block(" Controls ", app, PaneId::Status, theme);
    let mut lines = lines(app, theme);
    // The preset's story fills whatever room is left.
    let room = block.inner(area).height as usize;
    if let Some(h) = &app.run.header {
        if lines.len() + 2 <= room && !h.config.explanation.trim().is_empty() {
            lines.push(Line::raw(""));
            let text = h.config.explanation.split_whitespace().collect::<Vec<_>>();
            lines.push(Line::styled(text.join(" "), theme.dim()));
        }
    }
    frame.render_widget(
        Paragraph::new(lines).block(block).wrap(Wrap { trim: true }),
        area,
    );
}

/// A knob's value, with `→ new` while a change waits for the window boundary.
fn knob(name: &str, now: String, pending: Option<String>, theme: Theme) -> Vec<Span<'static>> {
    let mut spans = vec![
        Span::styled(format!("{name} "), theme.dim()),
        Span::styled(now, theme.bold()),
    ];
    if let Some(p) = pending {
        spans.push(Span::styled(format!("→{p}"), theme.warn()));
    }
    spans.push(Span::raw("  "));
    spans
}

/// The knobs the knob table puts on pane line `line`, each with its pending value, then what
/// the line adds that is not a knob (`extra`).
fn knob_line(app: &App, line: u8, extra: Vec<Span<'static>>, theme: Theme) -> Line<'static> {
    let (now, target) = (&app.run.knobs, app.target_knobs());
    let mut spans = Vec::new();
    for k in KNOBS.iter().filter(|k| k.pane == Some(line)) {
        let (a, b) = (k.show(now), k.show(&target));
        let pending = (a != b).then_some(b);
        spans.extend(knob(k.label, a, pending, theme));
    }
    spans.extend(extra);
    Line::from(spans)
}

pub fn lines(app: &App, theme: Theme) -> Vec<Line<'static>> {
    let k = &app.run.knobs;
    let lr_now = app.last().map(|s| s.lr).unwrap_or(k.lr);
    // Data parallel: W ranks each train K·B samples of the window.
    let ranks = app.run.header.as_ref().and_then(|h| h.ranks).unwrap_or(1);
    let mut batch = Vec::new();
    if ranks > 1 {
        batch.extend(knob("W", ranks.to_string(), None, theme));
    }
    batch.extend(knob(
        "eff",
        (k.effective_batch() * ranks).to_string(),
        None,
        theme,
    ));
    let lr = knob("lr", format!("{lr_now:.2e}"), None, theme);
    // The device is in the header line.
    let mut out = vec![
        knob_line(app, 0, batch, theme),
        knob_line(app, 1, lr, theme),
        knob_line(app, 2, Vec::new(), theme),
    ];
    out.push(super::noise::status_line(app, theme));

    if let Some(s) = app.last() {
        out.push(Line::from(vec![
            Span::styled("step ", theme.dim()),
            Span::styled(s.step.to_string(), theme.bold()),
            Span::raw(format!(
                "  {:.0} tok/s  {:.0} ms/step",
                s.tokens_per_s, s.step_ms
            )),
        ]));
        let p = s.phase_ms;
        let mut phases = vec![
            Span::styled("fwd/bwd/opt ", theme.dim()),
            Span::raw(format!(
                "{:.0}/{:.0}/{:.0} ms",
                p.forward, p.backward, p.optimizer
            )),
        ];
        if let Some(threads) = s.cpu_threads {
            let plural = if threads == 1 { "" } else { "s" };
            phases.push(Span::styled(
                format!("  {threads} thread{plural}"),
                theme.dim(),
            ));
        }
        out.push(Line::from(phases));
        if let Some(err) = s.grad_error {
            out.push(Line::styled(
                format!("grad error vs correct path: {:.2}%", err * 100.0),
                theme.warn(),
            ));
        }
    }
    out.push(pending_line(&app.run.pending, theme));
    if let Some(budget) = crate::tui::fit::budget_line(app) {
        out.push(Line::styled(budget, theme.dim()));
    }
    if app.unified_memory() {
        out.push(Line::styled(
            "CPU: offload moves nothing physically",
            theme.dim(),
        ));
    }
    out
}

fn pending_line(pending: &[Control], theme: Theme) -> Line<'static> {
    if pending.is_empty() {
        return Line::styled("pending: none", theme.dim());
    }
    let text: Vec<String> = pending.iter().map(Control::describe).collect();
    Line::styled(
        format!("pending (next boundary): {}", text.join(", ")),
        theme.warn(),
    )
}
