//! The fp16 loss scale in log2, with a mark at every overflow (skipped step).

use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::Frame;

use super::{block, draw_chart, placeholder, steps_in_view, ChartSpec, Series, Theme, Units};
use crate::tui::app::{App, PaneId};

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
    // Only the steps that scaled their loss: an f32 or bf16 step has no scale to draw.
    let scaled = || steps_in_view(app).filter(|s| s.dtype.needs_loss_scaling());
    let scale: Vec<(f64, f64)> = scaled()
        .map(|s| (s.step as f64, s.loss_scale.max(1.0).log2()))
        .collect();
    if scale.is_empty() {
        let text = "not used: only f16 scales the loss";
        return placeholder(frame, area, block, text, theme);
    }
    let overflows: Vec<(f64, f64)> = scaled()
        .filter(|s| s.skipped)
        .map(|s| (s.step as f64, s.loss_scale.max(1.0).log2()))
        .collect();
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
        from_zero: true,
        units: Units::Log2,
        scalable: false,
    };
    draw_chart(frame, area, block, app, spec, theme);
}
