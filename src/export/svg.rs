//! `gaccwb export FILE --to svg -o OUT.svg`: one SVG drawn by `plotters`, panels sharing one step
//! axis: loss (train, and validation when recorded), gradient norm before and after clipping, the
//! loss scale (log2; one line of text when the run never scaled), and memory: each step's ledger
//! stacked by category, the measured peak as a line and the estimate dashed. A dashed line
//! crosses every panel at each applied control, labelled once at the top with what changed.

use std::ops::Range;
use std::path::Path;

use plotters::coord::types::{RangedCoordf64, RangedCoordu64};
use plotters::prelude::*;

use super::chart::{
    axis_number, category_color, category_label, draw_legend, legend_top, text, text_width,
    well_formed, Area, DrawResult, LegendEntry, Swatch, FONT, LEGEND_WIDTH, MIB, PALETTE,
    STACK_ORDER,
};
use crate::memory::{step_figures, StepFigure};
use crate::record::Recording;
use crate::telemetry::Knobs;
use crate::telemetry::{Event, StepEvent};

const WIDTH: u32 = 1100;
const TITLE_HEIGHT: u32 = 58;
const LOSS_HEIGHT: u32 = 280;
const GRAD_HEIGHT: u32 = 240;
const SCALE_HEIGHT: u32 = 220;
const SCALE_NOTE_HEIGHT: u32 = 34;
const MEMORY_HEIGHT: u32 = 400;
const MARGIN: u32 = 12;
const Y_LABELS: u32 = 70;
/// Left and right pixel of every panel's plot: all panels share one step axis.
const PLOT_LEFT: i32 = (MARGIN + Y_LABELS) as i32;
const PLOT_RIGHT: i32 = (WIDTH - LEGEND_WIDTH - MARGIN) as i32;
/// One row of control labels; labels that would overlap go to the next row.
const CONTROL_ROW: u32 = 22;
const MAX_CONTROL_ROWS: usize = 4;
const LABEL_FONT: u32 = 15;
/// The colour of control markers (the test finds markers by it).
pub const MARKER: RGBColor = RGBColor(80, 80, 80);
const ESTIMATE: RGBColor = RGBColor(230, 0, 126);

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordu64, RangedCoordf64>>;

/// A named line of (step, value) points.
#[derive(Debug)]
struct Series {
    label: String,
    points: Vec<(u64, f64)>,
}

/// The controls applied at one step, in one label ("B 32→4, K 1→8").
#[derive(Debug, PartialEq)]
pub struct Mark {
    pub step: u64,
    pub label: String,
}

/// Draw the charts into `out`; an existing file is refused unless `rules` allow it.
pub fn write_svg(
    recording: &Recording,
    out: &Path,
    rules: &crate::safe_write::Overwrite,
) -> anyhow::Result<()> {
    crate::safe_write::check(out, "chart", rules)?;
    let svg = render_svg(recording).map_err(|e| anyhow::anyhow!("drawing the charts: {e}"))?;
    Ok(crate::safe_write::write_file(
        out,
        svg.as_bytes(),
        "chart",
        rules,
    )?)
}

/// The charts as SVG text.
pub fn render_svg(recording: &Recording) -> Result<String, Box<dyn std::error::Error>> {
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
    let scaled = steps.iter().any(|s| s.loss_scale != 1.0);
    let scale_height = if scaled {
        SCALE_HEIGHT
    } else {
        SCALE_NOTE_HEIGHT
    };
    let height = TITLE_HEIGHT + strip_height + LOSS_HEIGHT + GRAD_HEIGHT + scale_height;
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (WIDTH, height + MEMORY_HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (title, rest) = root.split_vertically(TITLE_HEIGHT);
        draw_title(&title, recording)?;
        let (strip, rest) = rest.split_vertically(strip_height);
        let (loss, rest) = rest.split_vertically(LOSS_HEIGHT);
        let (grad, rest) = rest.split_vertically(GRAD_HEIGHT);
        let (scale, memory) = rest.split_vertically(scale_height);
        let steps_at: Vec<u64> = marks.iter().map(|m| m.step).collect();
        let pixels = draw_lines_panel(
            &loss,
            "loss (nats/token)",
            x.clone(),
            &loss_series(recording, &steps),
            &steps_at,
        )?;
        draw_lines_panel(
            &grad,
            "gradient norm",
            x.clone(),
            &grad_series(&steps),
            &steps_at,
        )?;
        if scaled {
            draw_lines_panel(
                &scale,
                "loss scale (log2)",
                x.clone(),
                &scale_series(&steps),
                &steps_at,
            )?;
        } else {
            // A flat line at 0 with an axis of "0.0 … -0.0" says nothing: say it in words.
            scale.draw(&Text::new(
                "loss scale: not used (only f16 scales the loss; this run never did)",
                (PLOT_LEFT, 8),
                (FONT, 16).into_font().color(&RGBColor(90, 90, 90)),
            ))?;
        }
        draw_memory_panel(&memory, x, recording, &steps_at)?;
        draw_control_strip(&strip, &placed, &pixels, unlabelled)?;
        root.present()?;
    }
    Ok(well_formed(svg))
}

fn draw_title(area: &Area, recording: &Recording) -> DrawResult {
    let config = &recording.header.config;
    let title = format!("{} on {}", config.name, recording.header.device);
    area.draw(&Text::new(text(&title), (PLOT_LEFT, 8), (FONT, 26)))?;
    if !config.description.is_empty() {
        area.draw(&Text::new(
            text(&config.description),
            (PLOT_LEFT, 36),
            (FONT, 15).into_font().color(&RGBColor(90, 90, 90)),
        ))?;
    }
    Ok(())
}

/// From 0 to the last step, or to the last control when one came later (a run stopped just
/// after it): every marker lies on the axis.
fn step_range(steps: &[&StepEvent], marks: &[Mark]) -> Range<u64> {
    let last_step = steps.last().map_or(1, |s| s.step);
    let last_mark = marks.last().map_or(0, |m| m.step);
    0..last_step.max(last_mark).max(1)
}

/// The applied knob changes (flow controls change no curve), those of one step in one label,
/// each saying the value before and after: knobs start from the recording's configuration.
pub fn control_marks(recording: &Recording) -> Vec<Mark> {
    let mut knobs = Knobs::from_scenario(&recording.header.config);
    let mut marks: Vec<Mark> = Vec::new();
    for event in &recording.events {
        let Event::Control(c) = event else { continue };
        if c.control.is_flow() {
            continue;
        }
        let change = c.control.describe_change(&knobs);
        knobs.apply(&c.control);
        match marks.last_mut() {
            Some(m) if m.step == c.step => {
                m.label.push_str(", ");
                m.label.push_str(&change);
            }
            _ => marks.push(Mark {
                step: c.step,
                label: change,
            }),
        }
    }
    marks
}

/// A control label's place in the strip above the panels.
#[derive(Debug)]
struct Placed {
    /// Index into the marks.
    mark: usize,
    text: String,
    row: usize,
    /// The label ends left of its marker (it would run past the right edge otherwise).
    leftward: bool,
}

/// Rows for the labels so that none overlaps another (the first row that has room); a label
/// that finds no room in `MAX_CONTROL_ROWS` rows is left out and counted.
fn place_labels(marks: &[Mark], x: &Range<u64>) -> (Vec<Placed>, usize) {
    const GAP: i32 = 14;
    let mut rows: Vec<Vec<Range<i32>>> = vec![Vec::new(); MAX_CONTROL_ROWS];
    let mut placed = Vec::new();
    let mut unlabelled = 0;
    for (i, m) in marks.iter().enumerate() {
        let text = format!("step {}: {}", m.step, m.label);
        let px = approx_pixel(m.step, x);
        let width = text_width(&text, LABEL_FONT);
        let leftward = px + 5 + width > WIDTH as i32 - 8;
        let span = if leftward {
            (px - 5 - width)..px
        } else {
            px..(px + 5 + width)
        };
        let free = |row: &Vec<Range<i32>>| {
            row.iter()
                .all(|r| span.end + GAP <= r.start || r.end + GAP <= span.start)
        };
        match rows.iter().position(free) {
            Some(row) => {
                rows[row].push(span);
                placed.push(Placed {
                    mark: i,
                    text,
                    row,
                    leftward,
                });
            }
            None => unlabelled += 1,
        }
    }
    (placed, unlabelled)
}

/// Where plotters will put `step` (its exact mapping is read back from the chart when drawing).
fn approx_pixel(step: u64, x: &Range<u64>) -> i32 {
    let fraction = (step.saturating_sub(x.start)) as f64 / (x.end - x.start).max(1) as f64;
    PLOT_LEFT + (fraction * (PLOT_RIGHT - PLOT_LEFT) as f64) as i32
}

/// The labels above the panels, each with a dashed stub down to where its marker line starts.
/// `pixels` are the markers' exact x in the panels. Stubs go first: a label's white box keeps a
/// stub that passes under it from striking through its text.
fn draw_control_strip(
    area: &Area,
    placed: &[Placed],
    pixels: &[i32],
    unlabelled: usize,
) -> DrawResult {
    let bottom = area.dim_in_pixel().1 as i32;
    let base_x = area.get_base_pixel().0;
    let row_top = |row: usize| 4 + (row as u32 * CONTROL_ROW) as i32;
    for p in placed {
        let px = pixels[p.mark] - base_x;
        let mut top = row_top(p.row);
        while top < bottom {
            let end = (top + 4).min(bottom);
            area.draw(&PathElement::new(vec![(px, top), (px, end)], MARKER))?;
            top += 8;
        }
    }
    for p in placed {
        let px = pixels[p.mark] - base_x;
        let width = text_width(&p.text, LABEL_FONT);
        let left = if p.leftward { px - 5 - width } else { px + 5 };
        boxed_label(area, &p.text, (left, row_top(p.row)), BLACK)?;
    }
    if unlabelled > 0 {
        let rows = placed.iter().map(|p| p.row + 1).max().unwrap_or(0);
        let note = format!("{unlabelled} more control(s): marked, not labelled");
        boxed_label(
            area,
            &note,
            (PLOT_LEFT, row_top(rows)),
            RGBColor(90, 90, 90),
        )?;
    }
    Ok(())
}

/// `text` from `(left, top)` on a white box.
fn boxed_label(area: &Area, text: &str, (left, top): (i32, i32), color: RGBColor) -> DrawResult {
    let width = text_width(text, LABEL_FONT);
    let corners = [
        (left - 2, top - 1),
        (left + width + 2, top + CONTROL_ROW as i32 - 5),
    ];
    area.draw(&Rectangle::new(corners, WHITE.filled()))?;
    let style = (FONT, LABEL_FONT).into_font().color(&color);
    area.draw(&Text::new(text.to_string(), (left, top), style))?;
    Ok(())
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

fn scale_series(steps: &[&StepEvent]) -> Vec<Series> {
    vec![Series {
        label: "log2 loss scale".into(),
        points: finite(steps.iter().map(|s| (s.step, s.loss_scale.log2()))),
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

/// The stacked layers: per category present, the running sum up to it (MiB) at each step, bottom
/// layer first, with the category's index.
fn memory_stack(figures: &[StepFigure]) -> Vec<(usize, Vec<(u64, f64)>)> {
    let values: Vec<[u64; 8]> = figures
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
        let points = figures
            .iter()
            .zip(&values)
            .zip(below.iter_mut())
            .map(|((f, v), sum)| {
                *sum += v[category];
                (f.step, *sum as f64 / MIB)
            })
            .collect();
        layers.push((category, points));
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

fn y_range(series: &[Series]) -> Range<f64> {
    let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let (lo, hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), y| {
        (lo.min(y), hi.max(y))
    });
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    let pad = ((hi - lo) * 0.05).max(1e-9);
    (lo - pad)..(hi + pad)
}

/// The chart of a panel, on `plot` (the panel less its legend column).
fn build_chart<'a, 'b>(
    plot: &'a Area<'b>,
    caption: &str,
    x: Range<u64>,
    y: Range<f64>,
    x_desc: Option<&str>,
) -> Result<Chart<'a, 'b>, Box<dyn std::error::Error>> {
    let mut chart = ChartBuilder::on(plot)
        .caption(caption, (FONT, 18))
        .margin(MARGIN)
        .x_label_area_size(if x_desc.is_some() { 44 } else { 28 })
        .y_label_area_size(Y_LABELS)
        .build_cartesian_2d(x, y.clone())?;
    let y_label = move |v: &f64| axis_number(*v, &y);
    let mut mesh = chart.configure_mesh();
    mesh.x_labels(12)
        .y_label_formatter(&y_label)
        .y_labels(6)
        .light_line_style(RGBColor(238, 238, 238))
        .label_style((FONT, 14));
    if let Some(desc) = x_desc {
        mesh.x_desc(desc);
    }
    mesh.draw()?;
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

fn draw_lines_panel(
    area: &Area,
    caption: &str,
    x: Range<u64>,
    series: &[Series],
    marks: &[u64],
) -> Result<Vec<i32>, Box<dyn std::error::Error>> {
    let (plot, legend) = split_panel(area);
    let mut chart = build_chart(&plot, caption, x, y_range(series), None)?;
    let pixels = draw_markers(&mut chart, marks)?;
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
        chart.draw_series(LineSeries::new(
            s.points.iter().copied(),
            color.stroke_width(2),
        ))?;
        entries.push(LegendEntry::new(s.label.clone(), Swatch::Line(color)));
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
    let peak: Vec<(u64, f64)> = figures
        .iter()
        .map(|f| (f.step, f.peak as f64 / MIB))
        .collect();
    let estimate = estimate_line(recording, x.end);
    let top = peak
        .iter()
        .chain(&estimate)
        .chain(stack.iter().flat_map(|(_, p)| p))
        .map(|p| p.1)
        .fold(0.0, f64::max);
    let y = 0.0..(top * 1.1).max(1.0);
    let caption = "memory (MiB): each step's fullest phase, by ledger category";
    let (plot, legend) = split_panel(area);
    let mut chart = build_chart(&plot, caption, x, y, Some("optimizer step"))?;
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
mod tests {
    use super::*;
    use crate::telemetry::{Categories, Control, ControlEvent, EstimateEvent, Origin, Phase};
    use crate::tui::testing::{header, sample_run};

    fn recording(events: Vec<Event>) -> Recording {
        Recording {
            header: header(),
            events,
            warnings: Vec::new(),
        }
    }

    #[test]
    fn the_memory_stack_holds_measurements_only() {
        let mut events = sample_run(5);
        // The trainer sends its estimate before the first measurement, at step 0.
        let estimate = EstimateEvent {
            step: 0,
            phase: Phase::Backward,
            categories: Categories {
                activations: 99 << 20,
                ..Categories::default()
            },
            total: 99 << 20,
            unified: true,
        };
        events.insert(1, Event::Estimate(estimate));
        let recording = recording(events);
        let figures = figures(&recording);
        let steps: Vec<u64> = figures.iter().map(|f| f.step).collect();
        assert_eq!(steps, [1, 2, 3, 4, 5]);
        let stack = memory_stack(&figures);
        let top = &stack.last().unwrap().1;
        assert!(top.iter().all(|p| p.1 < 99.0), "{top:?}");
        // The estimate is its own dashed line, from step 0 to the last step's estimate.
        assert_eq!(estimate_line(&recording, 5)[..2], [(0, 99.0), (5, 99.0)]);
    }

    #[test]
    fn controls_of_one_step_share_a_label_that_says_what_changed() {
        let mut events = sample_run(30);
        let at = |step, control| {
            Event::Control(ControlEvent {
                step,
                origin: Origin::Scenario,
                control,
            })
        };
        events.push(at(25, Control::SetMicroBatch { value: 2 }));
        events.push(at(25, Control::SetAccumSteps { value: 16 }));
        events.push(at(26, Control::Pause));
        let marks = control_marks(&recording(events));
        let b = header().config.train.micro_batch;
        assert_eq!(
            marks,
            [
                Mark {
                    step: 20,
                    label: format!("K {}→4", header().config.train.accum_steps),
                },
                Mark {
                    step: 25,
                    label: format!("B {b}→2, K 4→16"),
                },
            ]
        );
    }

    #[test]
    fn labels_that_would_overlap_take_another_row() {
        let mark = |step| Mark {
            step,
            label: "B 32→4, K 1→8".into(),
        };
        let long = Mark {
            step: 99,
            label: "B 32→4, K 1→8, dtype f32→bf16, offload off→on".into(),
        };
        let (placed, unlabelled) = place_labels(&[mark(10), mark(11), long], &(0..100));
        let rows: Vec<usize> = placed.iter().map(|p| p.row).collect();
        assert_eq!((rows, unlabelled), (vec![0, 1, 0], 0));
        assert!(
            placed[2].leftward,
            "a label at the right edge ends left of its marker"
        );
    }
}
