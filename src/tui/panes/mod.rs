//! One pane per file. Each is a pure function of the `App`: `render(frame, area, app, theme)`.
//! Charts share one drawing (`chart`) and the helpers here, so their axes move in steps
//! (page-wise in x, on a 1-2-5 grid in y): a new point then changes a few cells, not the whole
//! chart, which keeps SSH traffic low.

pub mod chart;
pub mod communication;
pub mod device_memory;
pub mod event_log;
pub mod grad_norm;
pub mod ledger;
pub mod loss;
pub mod loss_scale;
pub mod noise;
pub mod status;

use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, BorderType, Paragraph};
use ratatui::Frame;

pub use chart::{draw_chart, ChartSpec, Units};

use super::app::{App, PaneId};

/// Colours, or none at all under `NO_COLOR`.
#[derive(Clone, Copy, Debug)]
pub struct Theme {
    pub color: bool,
}

impl Theme {
    pub fn fg(self, c: Color) -> Style {
        if self.color {
            Style::default().fg(c)
        } else {
            Style::default()
        }
    }

    pub fn dim(self) -> Style {
        if self.color {
            Style::default().fg(Color::DarkGray)
        } else {
            Style::default()
        }
    }

    pub fn bold(self) -> Style {
        Style::default().add_modifier(Modifier::BOLD)
    }

    pub fn warn(self) -> Style {
        self.fg(Color::Yellow)
    }

    pub fn error(self) -> Style {
        self.fg(Color::Red)
    }
}

/// A pane's frame; the focused pane's border is doubled (visible without colour too).
pub fn block<'a>(title: impl Into<Line<'a>>, app: &App, pane: PaneId, theme: Theme) -> Block<'a> {
    let focused = app.view.focus == pane;
    let block = Block::bordered().title(title);
    if focused {
        block
            .border_type(BorderType::Double)
            .border_style(theme.fg(Color::Cyan))
    } else {
        block.border_style(theme.dim())
    }
}

/// Steps shown: a window of `app.zoom` steps that advances a quarter window at a time.
pub fn x_window(app: &App) -> (f64, f64) {
    let w = app.view.zoom.max(4);
    let end = app.view_end();
    let q = w / 4;
    let lo = if end <= w {
        0
    } else {
        (end - w).div_ceil(q) * q
    };
    (lo as f64, (lo + w) as f64)
}

/// Largest magnitude a chart axis reaches; larger values are drawn at the edge.
pub const CHART_LIMIT: f64 = 1e300;

/// Round `[min, max]` outwards to a 1-2-5 grid of about four intervals.
pub fn nice_bounds(min: f64, max: f64) -> (f64, f64) {
    let (lo, hi, _) = nice_axis(min, max);
    (lo, hi)
}

/// [`nice_bounds`] and the grid's step.
pub fn nice_axis(min: f64, max: f64) -> (f64, f64, f64) {
    if !min.is_finite() || !max.is_finite() {
        return (0.0, 1.0, 0.25);
    }
    // Near f64::MAX the span and the rounding overflow; no chart needs more than this.
    let limit = |v: f64| v.clamp(-CHART_LIMIT, CHART_LIMIT);
    let (min, max) = (limit(min), limit(max));
    let span = if max > min {
        max - min
    } else {
        max.abs().max(1e-12) * 0.2
    };
    let raw = span / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let lo = (min / step).floor() * step;
    let mut hi = (max / step).ceil() * step;
    if hi <= lo {
        hi = lo + step;
    }
    (lo, hi, step)
}

/// Min and max of the y values in `points`, ignoring non-finite ones.
pub fn y_range<'a>(points: impl IntoIterator<Item = &'a (f64, f64)>) -> Option<(f64, f64)> {
    points
        .into_iter()
        .map(|p| p.1)
        .filter(|y| y.is_finite())
        .fold(None, |acc, y| match acc {
            None => Some((y, y)),
            Some((lo, hi)) => Some((lo.min(y), hi.max(y))),
        })
}

/// Short axis label: 3 significant figures, SI-ish suffixes for big numbers.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 1e-3 {
        format!("{v:.3}")
    } else {
        format!("{v:.1e}")
    }
}

pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut unit = 0;
    // From 1000 up the next unit: "1009.8 KiB" would overflow the ledger's columns.
    while v >= 1000.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// A line series for a chart.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub style: Style,
    pub scatter: bool,
}

/// A pane that has nothing to draw yet says so, in its frame.
pub fn placeholder(frame: &mut Frame, area: Rect, block: Block, text: &str, theme: Theme) {
    frame.render_widget(
        Paragraph::new(Line::styled(text.to_string(), theme.dim())).block(block),
        area,
    );
}

/// Steps (x) of the chart window, for series builders.
pub fn steps_in_view(app: &App) -> impl Iterator<Item = &crate::telemetry::StepEvent> {
    let end = app.view_end();
    let (x0, _) = x_window(app);
    app.run
        .steps
        .iter()
        .filter(move |s| s.step <= end && s.step as f64 >= x0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_bounds_stay_finite_at_the_edge_of_f64() {
        let (lo, hi) = nice_bounds(-f64::MAX, f64::MAX);
        assert!(lo.is_finite() && hi.is_finite() && lo < hi, "{lo} {hi}");
        let (lo, hi) = nice_bounds(f64::MAX, f64::MAX);
        assert!(lo.is_finite() && hi.is_finite() && lo < hi, "{lo} {hi}");
    }

    #[test]
    fn nice_bounds_round_outwards() {
        assert_eq!(nice_bounds(0.13, 0.87), (0.0, 1.0));
        let (lo, hi) = nice_bounds(2.31, 2.47);
        assert!(
            (lo - 2.3).abs() < 1e-9 && (hi - 2.5).abs() < 1e-9,
            "{lo} {hi}"
        );
        let (lo, hi) = nice_bounds(5.0, 5.0);
        assert!(lo <= 5.0 && hi > 5.0);
    }

    #[test]
    fn the_x_window_pages_by_a_quarter() {
        let mut app = App::default();
        app.view.zoom = 64;
        for i in 1..=70 {
            app.run.steps.push_back(crate::tui::testing::step(i, 1.0));
        }
        assert_eq!(x_window(&app), (16.0, 80.0));
        app.run.steps.push_back(crate::tui::testing::step(80, 1.0));
        assert_eq!(x_window(&app), (16.0, 80.0));
        app.run.steps.push_back(crate::tui::testing::step(81, 1.0));
        assert_eq!(x_window(&app), (32.0, 96.0));
    }

    #[test]
    fn bytes_read_as_binary_units() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(3 * 1024 * 1024), "3.0 MiB");
    }
}
