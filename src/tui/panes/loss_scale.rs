//! The fp16 loss scale in log2, with a mark at every overflow (skipped step).

use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::Frame;

use super::{block, draw_chart, placeholder, steps_in_view, ChartSpec, Series, Theme};
use crate::tui::app::{App, PaneId};

fn fmt_log2(v: f64) -> String {
    format!("2^{v:.0}")
}

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    let title = match app.last() {
        Some(s) if s.dtype.needs_loss_scaling() => format!(
            " Loss scale 2^{:.0} · {} skipped ",
            s.loss_scale.log2(),
            s.overflow_count
        ),
        Some(s) => format!(
            " Loss scale: off ({}) · {} skipped ",
            s.dtype.name(),
            s.overflow_count
        ),
        None => " Loss scale ".into(),
    };
    let block = block(title, app, PaneId::LossScale, theme);
    if app.run.steps.is_empty() {
        return placeholder(frame, area, block, "waiting for the first step…", theme);
    }
    let scale: Vec<(f64, f64)> = steps_in_view(app)
        .map(|s| (s.step as f64, s.loss_scale.max(1.0).log2()))
        .collect();
    let overflows: Vec<(f64, f64)> = steps_in_view(app)
        .filter(|s| s.skipped)
        .map(|s| (s.step as f64, s.loss_scale.max(1.0).log2()))
        .collect();
    let top = scale.iter().map(|p| p.1).fold(0.0, f64::max);
    let y = (0.0, (top + 2.0).max(4.0).ceil());
    let series = [
        Series {
            name: "log2 scale".into(),
            points: scale,
            style: theme.fg(Color::Blue),
            scatter: false,
        },
        Series {
            name: "overflow".into(),
            points: overflows,
            style: theme.fg(Color::Red),
            scatter: true,
        },
    ];
    let spec = ChartSpec {
        series: &series,
        y_fixed: Some(y),
        y_fmt: fmt_log2,
    };
    draw_chart(frame, area, block, app, spec, theme);
}
