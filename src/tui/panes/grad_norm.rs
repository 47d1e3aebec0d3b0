//! Global gradient norm before and after clipping, with the clip threshold.

use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::Frame;

use super::{
    block, draw_chart, fmt_num, placeholder, steps_in_view, ChartSpec, Series, Theme, Units,
};
use crate::tui::app::{App, PaneId};

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    if app.view.noise_view {
        return super::noise::render(frame, area, app, theme);
    }
    let title = match app.last() {
        Some(s) => {
            let clip = match s.clip {
                Some(c) => format!("clip {}", fmt_num(c)),
                None => "clip off".into(),
            };
            format!(
                " Grad norm {} → {} · {clip} ",
                fmt_num(s.grad_norm),
                fmt_num(s.grad_norm_clipped)
            )
        }
        None => " Grad norm ".into(),
    };
    let block = block(title, app, PaneId::GradNorm, theme);
    if app.run.steps.is_empty() {
        return placeholder(frame, area, block, "waiting for the first step…", theme);
    }
    let pre: Vec<(f64, f64)> = steps_in_view(app)
        .map(|s| (s.step as f64, s.grad_norm))
        .collect();
    let post: Vec<(f64, f64)> = steps_in_view(app)
        .map(|s| (s.step as f64, s.grad_norm_clipped))
        .collect();
    // The threshold as it was at each step (it can change mid-run); gaps where clipping was off.
    let clip: Vec<(f64, f64)> = steps_in_view(app)
        .filter_map(|s| s.clip.map(|c| (s.step as f64, c)))
        .collect();
    let series = [
        Series {
            name: "before".into(),
            points: pre,
            style: theme.fg(Color::Yellow),
            scatter: false,
        },
        Series {
            name: "after".into(),
            points: post,
            style: theme.fg(Color::Green),
            scatter: false,
        },
        Series {
            name: "clip".into(),
            points: clip,
            style: theme.fg(Color::Red),
            scatter: true,
        },
    ];
    let spec = ChartSpec {
        series: &series,
        from_zero: false,
        units: Units::Number,
        scalable: true,
    };
    draw_chart(frame, area, block, app, spec, theme);
}
