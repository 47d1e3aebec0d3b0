//! Training loss per step, validation loss at each evaluation, and the data's entropy floor.

use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::Frame;

use super::{block, draw_chart, placeholder, steps_in_view, ChartSpec, Series, Theme, Units};
use crate::tui::app::{App, PaneId};

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    let floor = app.run.header.as_ref().and_then(|h| h.entropy_floor);
    let mut title = match app.last() {
        Some(s) => format!(" Loss {:.4}", s.loss),
        None => " Loss".to_string(),
    };
    if let Some((_, v)) = app.run.evals.back() {
        title += &format!(" · val {v:.4}");
    }
    match floor {
        Some(f) => title += &format!(" · floor {f:.4}"),
        // Real text: no closed-form floor, so no line is drawn; say why it is missing.
        None if app.run.header.is_some() => title += " · no known floor",
        None => {}
    }
    title.push(' ');
    let block = block(title, app, PaneId::Loss, theme);
    if app.run.steps.is_empty() {
        return placeholder(frame, area, block, "waiting for the first step…", theme);
    }
    let train: Vec<(f64, f64)> = steps_in_view(app)
        .map(|s| (s.step as f64, s.loss))
        .collect();
    let end = app.view_end();
    let val: Vec<(f64, f64)> = app
        .run
        .evals
        .iter()
        .filter(|(s, _)| *s <= end)
        .map(|(s, v)| (*s as f64, *v))
        .collect();
    let mut series = vec![
        Series {
            name: "train".into(),
            points: train,
            style: theme.fg(Color::Cyan),
            scatter: false,
        },
        Series {
            name: "val".into(),
            points: val,
            style: theme.fg(Color::Magenta),
            scatter: true,
        },
    ];
    if let Some(f) = floor {
        let (x0, x1) = super::x_window(app);
        // Dashed: a dot every 1/24 of the window.
        let dashes = (0..=24).map(|i| (x0 + (x1 - x0) * f64::from(i) / 24.0, f));
        series.push(Series {
            name: "floor".into(),
            points: dashes.collect(),
            style: theme.dim(),
            scatter: true,
        });
    }
    let spec = ChartSpec {
        series: &series,
        from_zero: false,
        units: Units::Number,
        scalable: true,
    };
    draw_chart(frame, area, block, app, spec, theme);
}
