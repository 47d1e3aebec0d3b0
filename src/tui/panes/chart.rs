//! The charts' one drawing: lines in braille, points as dots, y labels at round values in one
//! format, the step axis with a tick (`┴`) at every applied control, and the legend in the
//! frame's bottom edge, where nothing is drawn over it. The y scale (`s`) is linear, robust (a
//! spike is drawn at the edge instead of flattening the rest) or logarithmic.

use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::style::{Color, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::canvas::{Canvas, Line as Segment};
use ratatui::widgets::{Block, Widget};
use ratatui::Frame;

use super::{x_window, Series, Theme};
use crate::tui::app::{App, YScale};

/// How a chart's y values read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Units {
    /// Plain numbers (`k`/`M` from ten thousand up).
    Number,
    /// Bytes, in the one binary unit the axis's top needs.
    Bytes,
    /// Exponents of two, read as `2^k`.
    Log2,
}

/// What a chart plots: its series, whether a linear axis starts at zero (else at the data),
/// how its values read, and whether the y scale key applies to it (a log2 axis, say, takes no
/// other scale).
pub struct ChartSpec<'s> {
    pub series: &'s [Series],
    pub from_zero: bool,
    pub units: Units,
    pub scalable: bool,
}

/// The y axis: its bounds in plot coordinates (log10 of the value on a log scale), the labelled
/// values, and how many points lie beyond each bound (a robust scale draws them at the edge).
#[derive(Clone, Debug, PartialEq)]
pub struct YAxis {
    pub log: bool,
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<f64>,
    pub below: usize,
    pub above: usize,
}

impl YAxis {
    /// Where a value lies in plot coordinates: clamped to the bounds, `None` when it cannot be
    /// drawn at all (not finite; zero or less on a log scale).
    pub fn place(&self, v: f64) -> Option<f64> {
        let v = match self.log {
            true if v > 0.0 => v.log10(),
            true => return None,
            false => v,
        };
        v.is_finite().then(|| v.clamp(self.lo, self.hi))
    }
}

/// The y axis for `ys` under `scale`, with at most `labels` labelled values; a linear one from
/// zero when `from_zero`.
pub fn y_axis(ys: &[f64], from_zero: bool, scale: YScale, labels: usize) -> YAxis {
    let mut finite: Vec<f64> = ys.iter().copied().filter(|y| y.is_finite()).collect();
    finite.sort_by(f64::total_cmp);
    let labels = labels.max(2);
    match scale {
        YScale::Log => {
            let positive: Vec<f64> = finite.iter().copied().filter(|y| *y > 0.0).collect();
            let (lo, hi) = match (positive.first(), positive.last()) {
                (Some(lo), Some(hi)) => (nice_below(*lo), nice_above(*hi)),
                _ => (0.1, 10.0),
            };
            let hi = if hi <= lo { lo * 10.0 } else { hi };
            let ticks = log_ticks(lo, hi, labels);
            YAxis {
                log: true,
                lo: lo.log10(),
                hi: hi.log10(),
                ticks,
                below: finite.len() - positive.len(),
                above: 0,
            }
        }
        YScale::Robust if finite.len() >= 4 => {
            let (lo, hi) = fences(&finite);
            let mut axis = linear(lo, hi, labels);
            axis.below = finite.iter().filter(|y| **y < axis.lo).count();
            axis.above = finite.iter().filter(|y| **y > axis.hi).count();
            axis
        }
        _ => {
            let (lo, hi) = match (finite.first(), finite.last()) {
                (Some(lo), Some(hi)) => (*lo, *hi),
                _ => (0.0, 1.0),
            };
            match from_zero {
                true => linear(lo.min(0.0), hi.max(0.0), labels),
                false => linear(lo, hi, labels),
            }
        }
    }
}

/// Tukey's far-out fences (3 interquartile ranges beyond the quartiles), within the data.
fn fences(sorted: &[f64]) -> (f64, f64) {
    let q = |p: f64| sorted[((sorted.len() - 1) as f64 * p).round() as usize];
    let (q1, q3) = (q(0.25), q(0.75));
    let iqr = q3 - q1;
    let (min, max) = (sorted[0], sorted[sorted.len() - 1]);
    ((q1 - 3.0 * iqr).max(min), (q3 + 3.0 * iqr).min(max))
}

fn linear(min: f64, max: f64, labels: usize) -> YAxis {
    let (lo, hi, step) = super::nice_axis(min, max);
    // About four steps span the axis; the bound keeps rounding at the edge of f64 finite.
    let ticks = (0..64)
        .map(|i| lo + step * f64::from(i))
        .take_while(|v| *v <= hi + step * 1e-9)
        .collect();
    YAxis {
        log: false,
        lo,
        hi,
        ticks: thin(ticks, labels),
        below: 0,
        above: 0,
    }
}

/// At most `most` of `ticks`, every m-th from the first: as many as fit, and of those a stride
/// that also reaches the last (0, 2, 4 rather than 0, 3).
fn thin(ticks: Vec<f64>, most: usize) -> Vec<f64> {
    let n = ticks.len();
    if n <= most {
        return ticks;
    }
    let count = |m: usize| (n - 1) / m + 1;
    let m = (1..n)
        .filter(|m| count(*m) <= most.max(1))
        .max_by_key(|m| (count(*m), (n - 1).is_multiple_of(*m), std::cmp::Reverse(*m)))
        .unwrap_or(n - 1);
    ticks.into_iter().step_by(m).collect()
}

/// The largest 1, 2 or 5 × 10^k at or below `v` (> 0).
fn nice_below(v: f64) -> f64 {
    let mag = 10f64.powf(v.log10().floor());
    [5.0, 2.0, 1.0]
        .iter()
        .map(|m| m * mag)
        .find(|c| *c <= v * (1.0 + 1e-12))
        .unwrap_or(mag)
}

/// The smallest 1, 2 or 5 × 10^k at or above `v` (> 0).
fn nice_above(v: f64) -> f64 {
    let mag = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|c| *c >= v * (1.0 - 1e-12))
        .unwrap_or(10.0 * mag)
}

/// Round values from `lo` to `hi`, at most `most` of them: 1, 2 and 5 × 10^k; else 1 and 5;
/// else the powers of ten (every m-th when even those are too many).
fn log_ticks(lo: f64, hi: f64, most: usize) -> Vec<f64> {
    let (first, last) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let at = |mantissas: &[f64]| -> Vec<f64> {
        (first..=last)
            .flat_map(|k| mantissas.iter().map(move |m| m * 10f64.powi(k)))
            .filter(|v| *v >= lo * (1.0 - 1e-12) && *v <= hi * (1.0 + 1e-12))
            .collect()
    };
    for mantissas in [&[1.0, 2.0, 5.0][..], &[1.0, 5.0]] {
        let ticks = at(mantissas);
        if ticks.len() <= most && ticks.len() >= 2 {
            return ticks;
        }
    }
    thin(at(&[1.0]), most)
}

/// The binary unit a byte axis reaching `top` is drawn in, and its size: the axis is laid out
/// in that unit, so its round values are round in it (8 MiB, not 8.4 million bytes).
pub fn byte_unit(top: f64) -> (&'static str, f64) {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let unit = (0..UNITS.len())
        .rev()
        .find(|u| top.abs() >= 1024f64.powi(*u as i32))
        .unwrap_or(0);
    (UNITS[unit], 1024f64.powi(unit as i32))
}

/// The labels of `ticks`, in one format: the decimals the spacing between labels needs, one
/// unit (or suffix) for the axis. A log axis's values are shown with the decimals each needs.
/// Byte ticks are already in the unit `byte_unit` chose; `unit` names it.
pub fn tick_labels(ticks: &[f64], units: Units, log: bool) -> Vec<String> {
    tick_labels_in(ticks, units, log, "")
}

fn tick_labels_in(ticks: &[f64], units: Units, log: bool, unit: &str) -> Vec<String> {
    let top = ticks.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let spacing = ticks
        .windows(2)
        .map(|w| (w[1] - w[0]).abs())
        .fold(f64::INFINITY, f64::min);
    let decimals = |spacing: f64| -> usize {
        if !spacing.is_finite() || spacing >= 1.0 {
            0
        } else {
            ((-spacing.log10()).ceil().max(0.0) as usize).min(6)
        }
    };
    let plain = |v: f64, d: usize| format!("{v:.d$}");
    match units {
        Units::Log2 => ticks.iter().map(|v| format!("2^{v:.0}")).collect(),
        Units::Number => {
            let (div, suffix) = match top {
                t if t >= 1e6 => (1e6, "M"),
                t if t >= 1e4 => (1e3, "k"),
                _ => (1.0, ""),
            };
            ticks
                .iter()
                .map(|v| {
                    let d = if log {
                        decimals(v.abs() / div)
                    } else {
                        decimals(spacing / div)
                    };
                    format!("{}{suffix}", plain(v / div, d))
                })
                .collect()
        }
        Units::Bytes => ticks
            .iter()
            .map(|v| {
                let d = if log {
                    decimals(v.abs())
                } else {
                    decimals(spacing)
                };
                format!("{} {unit}", plain(*v, d))
            })
            .collect(),
    }
}

/// Draw `spec` in `block` over the chart window; the legend goes into the block's bottom edge.
pub fn draw_chart(
    frame: &mut Frame,
    area: Rect,
    block: Block,
    app: &App,
    spec: ChartSpec,
    theme: Theme,
) {
    let (x0, x1) = x_window(app);
    let visible: Vec<Vec<(f64, f64)>> = spec
        .series
        .iter()
        .map(|s| {
            s.points
                .iter()
                .copied()
                .filter(|p| p.0 >= x0 && p.0 <= x1 && p.1.is_finite())
                .collect()
        })
        .collect();
    let scale = match spec.scalable {
        true => app.view.y_scale,
        false => YScale::Linear,
    };
    // Bytes are laid out in the one unit the axis needs, so their round values are round.
    let top = visible
        .iter()
        .flatten()
        .fold(0.0f64, |m, p| m.max(p.1.abs()));
    let (unit, div) = match spec.units {
        Units::Bytes => byte_unit(top),
        _ => ("", 1.0),
    };
    let visible: Vec<Vec<(f64, f64)>> = visible
        .into_iter()
        .map(|pts| pts.into_iter().map(|(x, y)| (x, y / div)).collect())
        .collect();
    // The legend takes the bottom edge: a frame's border, else a row of its own.
    let inner = block.clone().title_bottom(Line::raw("")).inner(area);
    let plot_rows = inner.height.saturating_sub(2) as usize;
    let ys: Vec<f64> = visible.iter().flatten().map(|p| p.1).collect();
    let axis = y_axis(&ys, spec.from_zero, scale, plot_rows.div_ceil(2).max(2));
    let block = block.title_bottom(legend(spec.series, &axis, scale, theme));
    frame.render_widget(block, area);
    if inner.height < 3 || inner.width < 12 {
        return;
    }
    let labels = tick_labels_in(&axis.ticks, spec.units, axis.log, unit);
    let label_w = labels.iter().map(|l| l.chars().count()).max().unwrap_or(1) as u16;
    let plot = Rect {
        x: inner.x + label_w + 1,
        y: inner.y,
        width: inner.width.saturating_sub(label_w + 1),
        height: plot_rows as u16,
    };
    if plot.width < 4 || plot.height == 0 {
        return;
    }
    let buf = frame.buffer_mut();
    draw_y_axis(buf, &axis, &labels, plot, label_w, theme);
    draw_x_axis(buf, app, plot, (x0, x1), theme);
    draw_lines(buf, plot, (x0, x1), &axis, spec.series, &visible);
    draw_points(buf, plot, (x0, x1), &axis, spec.series, &visible);
}

/// What a robust or log scale left out, then the series' names in their colours: the note
/// first, since a narrow frame cuts the end.
fn legend<'a>(series: &[Series], axis: &YAxis, scale: YScale, theme: Theme) -> Line<'a> {
    let counted = |n: usize, mark: &str| (n > 0).then(|| format!(" {n}{mark}"));
    let note = match scale {
        YScale::Robust => Some(format!(
            "robust{}{}",
            counted(axis.above, "↑").unwrap_or_default(),
            counted(axis.below, "↓").unwrap_or_default()
        )),
        YScale::Log => Some(format!(
            "log{}",
            counted(axis.below, " ≤0 hidden").unwrap_or_default()
        )),
        YScale::Linear => None,
    };
    let mut spans = vec![Span::raw(" ")];
    if let Some(note) = note {
        spans.push(Span::styled(format!("[{note}] "), theme.warn()));
    }
    for s in series.iter().filter(|s| !s.name.is_empty()) {
        let mark = if s.scatter { "• " } else { "─ " };
        spans.push(Span::styled(format!("{mark}{}", s.name), s.style));
        spans.push(Span::raw(" "));
    }
    Line::from(spans)
}

fn draw_y_axis(buf: &mut Buffer, axis: &YAxis, labels: &[String], plot: Rect, w: u16, t: Theme) {
    let bottom = plot.y + plot.height - 1;
    for row in plot.y..=bottom {
        buf.set_string(plot.x - 1, row, "│", t.dim());
    }
    let span = (axis.hi - axis.lo).max(f64::MIN_POSITIVE);
    for (v, label) in axis.ticks.iter().zip(labels) {
        let Some(p) = axis.place(*v) else { continue };
        let from_top = ((axis.hi - p) / span * f64::from(plot.height - 1)).round() as u16;
        let x = plot.x - 1 - label.chars().count() as u16;
        buf.set_string(x.max(plot.x - 1 - w), plot.y + from_top, label, t.dim());
    }
}

/// The axis row under the plot, `┴` where a control was applied, and the step labels under it.
fn draw_x_axis(buf: &mut Buffer, app: &App, plot: Rect, (x0, x1): (f64, f64), t: Theme) {
    let row = plot.y + plot.height;
    buf.set_string(plot.x - 1, row, "└", t.dim());
    buf.set_string(plot.x, row, "─".repeat(plot.width as usize), t.dim());
    let col = |x: f64| column(x, (x0, x1), plot.width);
    for (step, _) in app.run.markers.iter().filter(|(s, _)| *s <= app.view_end()) {
        let x = *step as f64;
        if x >= x0 && x <= x1 {
            buf.set_string(plot.x + col(x), row, "┴", t.warn());
        }
    }
    let fmt = |x: f64| format!("{x:.0}");
    let (left, mid, right) = (fmt(x0), fmt((x0 + x1) / 2.0), fmt(x1));
    let label_row = row + 1;
    let width = plot.width as usize;
    buf.set_string(plot.x, label_row, &left, t.dim());
    buf.set_string(
        plot.x + (width - right.len().min(width)) as u16,
        label_row,
        &right,
        t.dim(),
    );
    let at = col((x0 + x1) / 2.0) as usize;
    let start = at.saturating_sub(mid.len() / 2);
    if start > left.len() + 1 && start + mid.len() + 1 < width - right.len() {
        buf.set_string(plot.x + start as u16, label_row, &mid, t.dim());
    }
}

/// The cell column of step `x` in a plot `width` cells wide.
fn column(x: f64, (x0, x1): (f64, f64), width: u16) -> u16 {
    let f = ((x - x0) / (x1 - x0).max(f64::MIN_POSITIVE)).clamp(0.0, 1.0);
    (f * f64::from(width.saturating_sub(1))).round() as u16
}

fn color_of(style: Style) -> Color {
    style.fg.unwrap_or(Color::Reset)
}

fn draw_lines(
    buf: &mut Buffer,
    plot: Rect,
    x: (f64, f64),
    axis: &YAxis,
    series: &[Series],
    visible: &[Vec<(f64, f64)>],
) {
    let canvas = Canvas::default()
        .marker(Marker::Braille)
        .x_bounds([x.0, x.1])
        .y_bounds([axis.lo, axis.hi])
        .paint(|ctx| {
            for (s, pts) in series.iter().zip(visible).filter(|(s, _)| !s.scatter) {
                let placed: Vec<Option<(f64, f64)>> = pts
                    .iter()
                    .map(|p| axis.place(p.1).map(|y| (p.0, y)))
                    .collect();
                for w in placed.windows(2) {
                    if let [Some(a), Some(b)] = w {
                        ctx.draw(&Segment::new(a.0, a.1, b.0, b.1, color_of(s.style)));
                    }
                }
                if let [Some(only)] = placed[..] {
                    ctx.draw(&Segment::new(
                        only.0,
                        only.1,
                        only.0,
                        only.1,
                        color_of(s.style),
                    ));
                }
                ctx.layer();
            }
        });
    canvas.render(plot, buf);
}

/// Scatter series as one `•` per cell, over the lines.
fn draw_points(
    buf: &mut Buffer,
    plot: Rect,
    x: (f64, f64),
    axis: &YAxis,
    series: &[Series],
    visible: &[Vec<(f64, f64)>],
) {
    let span = (axis.hi - axis.lo).max(f64::MIN_POSITIVE);
    for (s, pts) in series.iter().zip(visible).filter(|(s, _)| s.scatter) {
        for p in pts {
            let Some(y) = axis.place(p.1) else { continue };
            let from_top = ((axis.hi - y) / span * f64::from(plot.height - 1)).round() as u16;
            let col = column(p.0, x, plot.width);
            buf.set_string(plot.x + col, plot.y + from_top, "•", s.style);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_labels_sit_at_round_values_in_one_format() {
        let axis = y_axis(&[0.13, 3.87], false, YScale::Linear, 3);
        assert_eq!(axis.ticks, [0.0, 2.0, 4.0]);
        assert_eq!(
            tick_labels(&axis.ticks, Units::Number, false),
            ["0", "2", "4"]
        );
        let axis = y_axis(&[0.21, 0.39], false, YScale::Linear, 3);
        assert_eq!(
            tick_labels(&axis.ticks, Units::Number, false),
            ["0.2", "0.3", "0.4"]
        );
        let axis = y_axis(&[64.0, 320.0], false, YScale::Linear, 3);
        let labels = tick_labels(&axis.ticks, Units::Number, false);
        assert!(labels.iter().all(|l| !l.contains('.')), "{labels:?}");
    }

    #[test]
    fn bytes_share_one_unit_and_round_values_in_it() {
        let (unit, div) = byte_unit(33.0 * 1048576.0);
        assert_eq!((unit, div), ("MiB", 1048576.0));
        let axis = y_axis(&[19.0, 33.0], true, YScale::Linear, 3);
        let labels = tick_labels_in(&axis.ticks, Units::Bytes, false, unit);
        assert_eq!(labels, ["0 MiB", "20 MiB", "40 MiB"]);
    }

    #[test]
    fn a_robust_scale_leaves_a_spike_at_the_edge() {
        let mut ys: Vec<f64> = (0..40).map(|i| 1.0 + f64::from(i % 5) * 0.1).collect();
        ys[3] = 32.0;
        let linear = y_axis(&ys, false, YScale::Linear, 3);
        assert!(linear.hi >= 32.0);
        let robust = y_axis(&ys, false, YScale::Robust, 3);
        assert!(robust.hi < 5.0, "{robust:?}");
        assert_eq!((robust.above, robust.below), (1, 0));
        assert_eq!(robust.place(32.0), Some(robust.hi));
    }

    #[test]
    fn a_log_scale_spans_round_decades_and_skips_what_it_cannot_draw() {
        let axis = y_axis(&[0.02, 0.5, 30.0, 0.0], false, YScale::Log, 4);
        assert_eq!((axis.lo, axis.hi), (0.02f64.log10(), 50f64.log10()));
        assert_eq!(axis.below, 1);
        assert_eq!(axis.place(0.0), None);
        assert!(axis.ticks.iter().all(|t| [1.0, 2.0, 5.0]
            .iter()
            .any(|m| ((t / m).log10() - (t / m).log10().round()).abs() < 1e-9)));
    }
}
