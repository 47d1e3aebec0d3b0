//! `gaccwb export FILE --to svg -o OUT.svg`: one SVG drawn by `plotters`, panels sharing one step
//! axis over the recording's own steps: loss (train, and validation when recorded), gradient norm
//! before and after clipping (both on a linear, robust or log y scale, `--scale`), the loss scale
//! (log2, the steps that scaled; one line of text when none did), and memory: each step's ledger
//! stacked by category as steps (a step's bytes held over its span), the measured peak, the
//! estimate dashed. A dashed line crosses every panel at each applied control, labelled once at
//! the top with what changed; a red cross marks each skipped (overflowed) step.

use std::ops::Range;
use std::path::Path;

use plotters::coord::types::{RangedCoordf64, RangedCoordu64};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::chart::{
    category_color, category_label, draw_legend, legend_top, text, well_formed, Area, DrawResult,
    LegendEntry, Swatch, FONT, LEGEND_WIDTH, MIB, PALETTE, STACK_ORDER,
};
use super::svg_controls::{control_marks, draw_control_strip, place_labels, Mark, CONTROL_ROW};
use crate::control::{Knobs, KNOBS};
use crate::memory::{step_figures, StepFigure};
use crate::record::Recording;
use crate::telemetry::{Event, StepEvent};
use crate::tui::app::YScale;
use crate::tui::panes::chart::{tick_labels, y_axis, Units, YAxis};

pub const WIDTH: u32 = 1100;
const TITLE_HEIGHT: u32 = 84;
const LOSS_HEIGHT: u32 = 280;
const GRAD_HEIGHT: u32 = 240;
const SCALE_HEIGHT: u32 = 220;
const SCALE_NOTE_HEIGHT: u32 = 34;
const MEMORY_HEIGHT: u32 = 400;
const MARGIN: u32 = 12;
const Y_LABELS: u32 = 70;
/// Left and right pixel of every panel's plot: all panels share one step axis.
pub const PLOT_LEFT: i32 = (MARGIN + Y_LABELS) as i32;
pub const PLOT_RIGHT: i32 = (WIDTH - LEGEND_WIDTH - MARGIN) as i32;
/// The colour of control markers (the test finds markers by it).
pub const MARKER: RGBColor = RGBColor(80, 80, 80);
/// The colour of skipped-step crosses.
pub const SKIPPED: RGBColor = RGBColor(220, 20, 60);
const ESTIMATE: RGBColor = RGBColor(230, 0, 126);
const GRID: RGBColor = RGBColor(238, 238, 238);
const SUBTLE: RGBColor = RGBColor(90, 90, 90);

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordu64, RangedCoordf64>>;

/// A named line of (step, value) points.
#[derive(Debug)]
struct Series {
    label: String,
    points: Vec<(u64, f64)>,
}

/// What one panel of lines shows besides its series.
struct Panel<'r> {
    caption: &'r str,
    x: Range<u64>,
    /// Steps with applied controls (marker lines).
    marks: &'r [u64],
    /// Skipped steps (red crosses along the bottom).
    skipped: &'r [u64],
    scale: YScale,
    units: Units,
}

/// Draw the charts into `out`; an existing file is refused unless `rules` allow it.
pub fn write_svg(
    recording: &Recording,
    scale: YScale,
    out: &Path,
    rules: &crate::safe_write::Overwrite,
) -> anyhow::Result<()> {
    crate::safe_write::check(out, "chart", rules)?;
    let svg =
        render_svg(recording, scale).map_err(|e| anyhow::anyhow!("drawing the charts: {e}"))?;
    Ok(crate::safe_write::write_file(
        out,
        svg.as_bytes(),
        "chart",
        rules,
    )?)
}

/// The charts as SVG text; `scale` is the y scale of the loss and gradient-norm panels.
pub fn render_svg(
    recording: &Recording,
    scale: YScale,
) -> Result<String, Box<dyn std::error::Error>> {
    let steps: Vec<&StepEvent> = recording
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) => Some(s),
            _ => None,
        })
        .collect();
    let marks = control_marks(recording);
    let x = step_range(&steps, &marks);
    let (placed, unlabelled) = place_labels(&marks, &x);
    let rows = placed.iter().map(|p| p.row + 1).max().unwrap_or(0) as u32;
    let note_row = u32::from(unlabelled > 0);
    let strip_height = if marks.is_empty() {
        0
    } else {
        (rows + note_row) * CONTROL_ROW + 10
    };
    let scaled = steps.iter().any(|s| s.dtype.needs_loss_scaling());
    let scale_height = if scaled {
        SCALE_HEIGHT
    } else {
        SCALE_NOTE_HEIGHT
    };
    let height = TITLE_HEIGHT + strip_height + LOSS_HEIGHT + GRAD_HEIGHT + scale_height;
    let steps_at: Vec<u64> = marks.iter().map(|m| m.step).collect();
    let skipped: Vec<u64> = steps.iter().filter(|s| s.skipped).map(|s| s.step).collect();
    let panel = |caption, scale, units| Panel {
        caption,
        x: x.clone(),
        marks: &steps_at,
        skipped: &skipped,
        scale,
        units,
    };
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (WIDTH, height + MEMORY_HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (title, rest) = root.split_vertically(TITLE_HEIGHT);
        draw_title(&title, recording, &steps)?;
        let (strip, rest) = rest.split_vertically(strip_height);
        let (loss, rest) = rest.split_vertically(LOSS_HEIGHT);
        let (grad, rest) = rest.split_vertically(GRAD_HEIGHT);
        let (scale_area, memory) = rest.split_vertically(scale_height);
        let loss_panel = panel("loss (nats/token)", scale, Units::Number);
        let pixels = draw_lines_panel(&loss, &loss_panel, &loss_series(recording, &steps))?;
        let grad_panel = panel("gradient norm", scale, Units::Number);
        draw_lines_panel(&grad, &grad_panel, &grad_series(&steps))?;
        if scaled {
            let scale_panel = panel("loss scale (f16 steps)", YScale::Linear, Units::Log2);
            draw_lines_panel(&scale_area, &scale_panel, &scale_series(&steps))?;
        } else {
            // A flat line at 0 with an axis of "0.0 … -0.0" says nothing: say it in words.
            scale_area.draw(&Text::new(
                "loss scale: not used (only f16 scales the loss; this run never did)",
                (PLOT_LEFT, 8),
                (FONT, 16).into_font().color(&SUBTLE),
            ))?;
        }
        draw_memory_panel(&memory, x, recording, &steps_at)?;
        draw_control_strip(&strip, &placed, &pixels, unlabelled)?;
        root.present()?;
    }
    Ok(well_formed(svg))
}

/// The title, the knobs in force at the recording's first step, and (for a recording of a
/// whole run) the preset's description, which tells the run's story from its start.
fn draw_title(area: &Area, recording: &Recording, steps: &[&StepEvent]) -> DrawResult {
    let config = &recording.header.config;
    let title = format!("{} on {}", config.name, recording.header.device);
    area.draw(&Text::new(text(&title), (PLOT_LEFT, 8), (FONT, 26)))?;
    let subtle = (FONT, 15).into_font().color(&SUBTLE);
    area.draw(&Text::new(
        text(&knobs_line(recording, steps)),
        (PLOT_LEFT, 38),
        subtle.clone(),
    ))?;
    let whole_run = steps.first().is_none_or(|s| s.step <= 1);
    if whole_run && !config.description.is_empty() {
        area.draw(&Text::new(
            text(&config.description),
            (PLOT_LEFT, 58),
            subtle,
        ))?;
    }
    Ok(())
}

/// "steps 141–200 of 200 · K 4 · B 8 · … · B·K 32": the steps the recording holds and the
/// knobs its header says were in force at its start (a recording started with `r` mid-run has
/// the knobs of that moment), read through the knob table.
pub fn knobs_line(recording: &Recording, steps: &[&StepEvent]) -> String {
    let knobs = Knobs::from_scenario(&recording.header.config);
    let total = recording.header.config.train.steps;
    let mut parts = Vec::new();
    if let (Some(first), Some(last)) = (steps.first(), steps.last()) {
        let of = match total {
            0 => String::new(),
            n => format!(" of {n}"),
        };
        parts.push(format!("steps {}–{}{of}", first.step, last.step));
    }
    parts.extend(
        KNOBS
            .iter()
            .filter(|k| k.pane.is_some())
            .map(|k| format!("{} {}", k.label, k.show(&knobs))),
    );
    parts.push(format!("B·K {}", knobs.effective_batch()));
    format!("at the start: {}", parts.join(" · "))
}

/// The recording's own steps: from where its first step began (step s spans s−1 to s) to its
/// last step, or to the last control when one came later (a run stopped just after it).
fn step_range(steps: &[&StepEvent], marks: &[Mark]) -> Range<u64> {
    let first = steps.first().map_or(0, |s| s.step.saturating_sub(1));
    let last_step = steps.last().map_or(1, |s| s.step);
    let last_mark = marks.last().map_or(0, |m| m.step);
    let end = last_step.max(last_mark).max(first + 1);
    first..end
}

fn loss_series(recording: &Recording, steps: &[&StepEvent]) -> Vec<Series> {
    let train = finite(steps.iter().map(|s| (s.step, s.loss)));
    let val = finite(recording.events.iter().filter_map(|e| match e {
        Event::Eval(v) => Some((v.step, v.val_loss)),
        _ => None,
    }));
    let mut out = vec![Series {
        label: "train".into(),
        points: train,
    }];
    if !val.is_empty() {
        out.push(Series {
            label: "validation".into(),
            points: val,
        });
    }
    out
}

fn grad_series(steps: &[&StepEvent]) -> Vec<Series> {
    vec![
        Series {
            label: "before clip".into(),
            points: finite(steps.iter().map(|s| (s.step, s.grad_norm))),
        },
        Series {
            label: "after clip".into(),
            points: finite(steps.iter().map(|s| (s.step, s.grad_norm_clipped))),
        },
    ]
}

/// log2 of the loss scale, at the steps that scaled their loss (f16) only.
fn scale_series(steps: &[&StepEvent]) -> Vec<Series> {
    let scaled = steps.iter().filter(|s| s.dtype.needs_loss_scaling());
    vec![Series {
        label: "log2 loss scale".into(),
        points: finite(scaled.map(|s| (s.step, s.loss_scale.log2()))),
    }]
}

/// Each step's figure (`memory::figure`) from the measured events. Estimates are their own event
/// type and never enter it.
fn figures(recording: &Recording) -> Vec<StepFigure> {
    step_figures(recording.events.iter().filter_map(|e| match e {
        Event::Memory(m) => Some(m),
        _ => None,
    }))
}

/// `(step, value)` per step as a step function: each value held over its step's span, from
/// where the step began (the previous step, or s−1) to s.
fn held(points: impl IntoIterator<Item = (u64, f64)>) -> Vec<(u64, f64)> {
    let mut out = Vec::new();
    let mut previous: Option<u64> = None;
    for (step, v) in points {
        let from = previous
            .filter(|p| *p < step)
            .unwrap_or(step.saturating_sub(1));
        out.push((from, v));
        out.push((step, v));
        previous = Some(step);
    }
    out
}

/// The stacked layers: per category present, the running sum up to it (MiB) held over each
/// step's span, bottom layer first, with the category's index.
fn memory_stack(figures: &[StepFigure]) -> Vec<(usize, Vec<(u64, f64)>)> {
    let values: Vec<[u64; 9]> = figures
        .iter()
        .map(|f| f.measured_ledger().values())
        .collect();
    let present = STACK_ORDER
        .iter()
        .copied()
        .filter(|&c| values.iter().any(|v| v[c] > 0));
    let mut below = vec![0u64; figures.len()];
    let mut layers = Vec::new();
    for category in present {
        let sums = figures
            .iter()
            .zip(&values)
            .zip(below.iter_mut())
            .map(|((f, v), sum)| {
                *sum += v[category];
                (f.step, *sum as f64 / MIB)
            });
        layers.push((category, held(sums)));
    }
    layers
}

/// The predicted peak (the largest phase total of each `estimate` event group), held from the
/// step it was made at until the next one or the end: a step line.
fn estimate_line(recording: &Recording, end: u64) -> Vec<(u64, f64)> {
    let mut groups: Vec<(u64, u64)> = Vec::new();
    for event in &recording.events {
        let Event::Estimate(e) = event else { continue };
        match groups.last_mut() {
            Some((step, peak)) if *step == e.step => *peak = (*peak).max(e.total),
            _ => groups.push((e.step, e.total)),
        }
    }
    let mut points = Vec::new();
    for (i, &(step, peak)) in groups.iter().enumerate() {
        let until = groups.get(i + 1).map_or(end.max(step), |g| g.0);
        let mib = peak as f64 / MIB;
        points.push((step, mib));
        points.push((until, mib));
    }
    points
}

/// The finite points, clamped to what an axis can span: near f64::MAX the range's width
/// overflows to infinity and drawing the axis never ends.
fn finite(points: impl Iterator<Item = (u64, f64)>) -> Vec<(u64, f64)> {
    let limit = crate::tui::panes::CHART_LIMIT;
    points
        .filter(|p| p.1.is_finite())
        .map(|(x, y)| (x, y.clamp(-limit, limit)))
        .collect()
}

/// The chart of a panel, on `plot` (the panel less its legend column), its y axis in plot
/// coordinates (`axis`): grid lines and labels at the axis's round values, in one format.
fn build_chart<'a, 'b>(
    plot: &'a Area<'b>,
    caption: &str,
    x: Range<u64>,
    axis: &YAxis,
    units: Units,
    x_desc: Option<&str>,
) -> Result<Chart<'a, 'b>, Box<dyn std::error::Error>> {
    let mut chart = ChartBuilder::on(plot)
        .caption(caption, (FONT, 18))
        .margin(MARGIN)
        .x_label_area_size(if x_desc.is_some() { 44 } else { 28 })
        .y_label_area_size(Y_LABELS)
        .build_cartesian_2d(x.clone(), axis.lo..axis.hi)?;
    let mut mesh = chart.configure_mesh();
    mesh.x_labels(12)
        .y_labels(0)
        .disable_y_mesh()
        .light_line_style(GRID)
        .label_style((FONT, 14));
    if let Some(desc) = x_desc {
        mesh.x_desc(desc);
    }
    mesh.draw()?;
    let labels = tick_labels(&axis.ticks, units, axis.log);
    let base = plot.get_base_pixel();
    let style = (FONT, 14)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Right, VPos::Center));
    for (tick, label) in axis.ticks.iter().zip(labels) {
        let Some(y) = axis.place(*tick) else { continue };
        chart.draw_series(LineSeries::new(
            [(x.start, y), (x.end, y)],
            GRID.stroke_width(1),
        ))?;
        let (px, py) = chart.backend_coord(&(x.start, y));
        plot.draw(&Text::new(
            label,
            (px - base.0 - 8, py - base.1),
            style.clone(),
        ))?;
    }
    Ok(chart)
}

/// A panel split into its plot and, on the right, its legend column.
fn split_panel<'b>(area: &Area<'b>) -> (Area<'b>, Area<'b>) {
    area.split_horizontally(WIDTH - LEGEND_WIDTH)
}

/// Dashed vertical lines at the steps; their pixel x (absolute), left to right as given.
fn draw_markers(chart: &mut Chart, steps: &[u64]) -> Result<Vec<i32>, Box<dyn std::error::Error>> {
    let y = chart.y_range();
    let mut pixels = Vec::new();
    for &step in steps {
        chart.draw_series(DashedLineSeries::new(
            vec![(step, y.end), (step, y.start)],
            4,
            4,
            MARKER.stroke_width(1),
        ))?;
        pixels.push(chart.backend_coord(&(step, y.start)).0);
    }
    Ok(pixels)
}

/// A red cross at each skipped step, along the bottom of the plot.
fn draw_skipped(chart: &mut Chart, skipped: &[u64]) -> DrawResult {
    let y = chart.y_range();
    let at = y.start + (y.end - y.start) * 0.04;
    chart.draw_series(
        skipped
            .iter()
            .map(|&s| Cross::new((s, at), 5, SKIPPED.stroke_width(2))),
    )?;
    Ok(())
}

/// The points of a series in plot coordinates, split where a value cannot be drawn (zero or
/// less on a log scale): one line per stretch.
fn stretches(points: &[(u64, f64)], axis: &YAxis) -> Vec<Vec<(u64, f64)>> {
    let mut out: Vec<Vec<(u64, f64)>> = vec![Vec::new()];
    for &(x, v) in points {
        match axis.place(v) {
            Some(y) => out.last_mut().expect("one stretch at least").push((x, y)),
            None if out.last().is_some_and(|l| !l.is_empty()) => out.push(Vec::new()),
            None => {}
        }
    }
    out.retain(|l| !l.is_empty());
    out
}

fn draw_lines_panel(
    area: &Area,
    panel: &Panel,
    series: &[Series],
) -> Result<Vec<i32>, Box<dyn std::error::Error>> {
    let (plot, legend) = split_panel(area);
    let ys: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .collect();
    let axis = y_axis(&ys, false, panel.scale, 7);
    let mut chart = build_chart(
        &plot,
        panel.caption,
        panel.x.clone(),
        &axis,
        panel.units,
        None,
    )?;
    let pixels = draw_markers(&mut chart, panel.marks)?;
    if series.iter().all(|s| s.points.is_empty()) {
        legend.draw(&Text::new(
            "no data in this recording",
            (10, 40),
            (FONT, 14),
        ))?;
        return Ok(pixels);
    }
    let mut entries = Vec::new();
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        for stretch in stretches(&s.points, &axis) {
            chart.draw_series(LineSeries::new(stretch, color.stroke_width(2)))?;
        }
        entries.push(LegendEntry::new(s.label.clone(), Swatch::Line(color)));
    }
    if !panel.skipped.is_empty() {
        draw_skipped(&mut chart, panel.skipped)?;
        let label = format!("skipped step ({})", panel.skipped.len());
        entries.push(LegendEntry::new(label, Swatch::Cross(SKIPPED)));
    }
    let beyond = match panel.scale {
        YScale::Robust if axis.above + axis.below > 0 => {
            Some(format!("robust: {} at the edge", axis.above + axis.below))
        }
        YScale::Robust => Some("robust scale".into()),
        YScale::Log if axis.below > 0 => Some(format!("log: {} ≤ 0 not drawn", axis.below)),
        YScale::Log => Some("log scale".into()),
        YScale::Linear => None,
    };
    if let Some(note) = beyond {
        entries.push(LegendEntry::new(note, Swatch::None));
    }
    let top = chart.plotting_area().get_pixel_range().1.start;
    draw_legend(&legend, legend_top(&legend, top), &entries)?;
    Ok(pixels)
}

fn draw_memory_panel(
    area: &Area,
    x: Range<u64>,
    recording: &Recording,
    marks: &[u64],
) -> DrawResult {
    let figures = figures(recording);
    let stack = memory_stack(&figures);
    let peak = held(figures.iter().map(|f| (f.step, f.peak as f64 / MIB)));
    let estimate: Vec<(u64, f64)> = estimate_line(recording, x.end)
        .into_iter()
        .map(|(s, v)| (s.max(x.start), v))
        .collect();
    let top = peak
        .iter()
        .chain(&estimate)
        .chain(stack.iter().flat_map(|(_, p)| p))
        .map(|p| p.1)
        .fold(0.0, f64::max);
    let axis = y_axis(&[top.max(1.0)], true, YScale::Linear, 7);
    let caption = "memory (MiB): each step's fullest phase, by ledger category";
    let (plot, legend) = split_panel(area);
    let mut chart = build_chart(
        &plot,
        caption,
        x,
        &axis,
        Units::Number,
        Some("optimizer step"),
    )?;
    if figures.is_empty() && estimate.is_empty() {
        draw_markers(&mut chart, marks)?;
        legend.draw(&Text::new("no memory events", (10, 40), (FONT, 14)))?;
        return Ok(());
    }
    // Top layer first: each lower layer paints over the part of it that is not its own.
    for (category, points) in stack.iter().rev() {
        let color = category_color(*category);
        chart.draw_series(
            AreaSeries::new(points.iter().copied(), 0.0, color.mix(0.85).filled())
                .border_style(color.stroke_width(1)),
        )?;
    }
    draw_markers(&mut chart, marks)?;
    chart.draw_series(LineSeries::new(peak, BLACK.stroke_width(2)))?;
    chart.draw_series(DashedLineSeries::new(
        estimate.iter().copied(),
        7,
        5,
        ESTIMATE.stroke_width(2),
    ))?;
    let mut entries = vec![LegendEntry::new("measured peak", Swatch::Line(BLACK))];
    if !estimate.is_empty() {
        entries.push(LegendEntry::new(
            "estimate (peak)",
            Swatch::Dashed(ESTIMATE),
        ));
    }
    for (category, _) in stack.iter().rev() {
        let swatch = Swatch::Fill(category_color(*category));
        entries.push(LegendEntry::new(category_label(*category), swatch));
    }
    let top = chart.plotting_area().get_pixel_range().1.start;
    draw_legend(&legend, legend_top(&legend, top), &entries)
}

#[cfg(test)]
mod tests;
