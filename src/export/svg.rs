//! `gaccwb export FILE --to svg -o OUT.svg`: one SVG with four charts drawn by `plotters`:
//! loss (train, and validation when recorded), gradient norm before and after clipping, the
//! loss scale (log2), and memory by ledger category. Dashed grey lines mark applied controls.

use std::ops::Range;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::memory::step_figures;
use crate::record::Recording;
use crate::telemetry::{Categories, Event, StepEvent};

const WIDTH: u32 = 1000;
const PANEL_HEIGHT: u32 = 320;
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// A named line of (step, value) points.
#[derive(Debug)]
struct Series {
    label: String,
    points: Vec<(f64, f64)>,
}

/// Draw the charts into `out`; an existing file is refused unless `force`.
pub fn write_svg(recording: &Recording, out: &Path, force: bool) -> anyhow::Result<()> {
    crate::safe_write::check_free(out, "chart", force)?;
    let svg = render_svg(recording).map_err(|e| anyhow::anyhow!("drawing the charts: {e}"))?;
    crate::safe_write::write_file(out, svg.as_bytes(), "chart", force)
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
    let markers: Vec<f64> = recording
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Control(c) if !c.control.is_flow() => Some(c.step as f64),
            _ => None,
        })
        .collect();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, PANEL_HEIGHT * 4)).into_drawing_area();
        root.fill(&WHITE)?;
        let title = format!(
            "{} on {}",
            recording.header.config.name, recording.header.device
        );
        let root = root.titled(&title, ("sans-serif", 22))?;
        let panels = root.split_evenly((4, 1));
        let x = step_range(&steps);
        draw_panel(
            &panels[0],
            "loss (nats/token)",
            x.clone(),
            &loss_series(recording, &steps),
            &markers,
        )?;
        draw_panel(
            &panels[1],
            "gradient norm",
            x.clone(),
            &grad_series(&steps),
            &markers,
        )?;
        if steps.iter().any(|s| s.loss_scale != 1.0) {
            draw_panel(
                &panels[2],
                "loss scale (log2)",
                x.clone(),
                &scale_series(&steps),
                &markers,
            )?;
        } else {
            // A flat line at 0 with an axis of "0.0 … -0.0" says nothing: say it in words.
            panels[2].draw(&Text::new(
                "loss scale: not used (only f16 scales the loss; this run never did)",
                (40, PANEL_HEIGHT as i32 / 2),
                ("sans-serif", 16),
            ))?;
        }
        draw_panel(
            &panels[3],
            "memory (MiB, largest phase of each step)",
            x,
            &memory_series(recording),
            &markers,
        )?;
        root.present()?;
    }
    Ok(svg)
}

fn step_range(steps: &[&StepEvent]) -> Range<f64> {
    let last = steps.last().map(|s| s.step).unwrap_or(1).max(1);
    0.0..last as f64
}

fn loss_series(recording: &Recording, steps: &[&StepEvent]) -> Vec<Series> {
    let train = finite(steps.iter().map(|s| (s.step as f64, s.loss)));
    let val = finite(recording.events.iter().filter_map(|e| match e {
        Event::Eval(v) => Some((v.step as f64, v.val_loss)),
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
            points: finite(steps.iter().map(|s| (s.step as f64, s.grad_norm))),
        },
        Series {
            label: "after clip".into(),
            points: finite(steps.iter().map(|s| (s.step as f64, s.grad_norm_clipped))),
        },
    ]
}

fn scale_series(steps: &[&StepEvent]) -> Vec<Series> {
    vec![Series {
        label: "log2 loss scale (0 = off)".into(),
        points: finite(steps.iter().map(|s| (s.step as f64, s.loss_scale.log2()))),
    }]
}

/// Per category, each step's fullest measured ledger (`memory::figure`). Estimates are their own
/// event type and never enter this series.
fn memory_series(recording: &Recording) -> Vec<Series> {
    let figures = step_figures(recording.events.iter().filter_map(|e| match e {
        Event::Memory(m) => Some(m),
        _ => None,
    }));
    Categories::NAMES
        .iter()
        .enumerate()
        .map(|(i, name)| Series {
            label: name.replace('_', " "),
            points: figures
                .iter()
                .map(|f| {
                    let bytes = f.fullest.categories.values()[i];
                    (f.step as f64, bytes as f64 / 1048576.0)
                })
                .collect(),
        })
        .filter(|s| s.points.iter().any(|p| p.1 > 0.0))
        .collect()
}

/// The finite points, clamped to what an axis can span: near f64::MAX the range's width
/// overflows to infinity and drawing the axis never ends.
fn finite(points: impl Iterator<Item = (f64, f64)>) -> Vec<(f64, f64)> {
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

/// Steps are whole numbers: a tick between two steps gets no label rather than "20.5".
fn step_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-9 {
        format!("{}", x.round() as i64)
    } else {
        String::new()
    }
}

fn draw_panel(
    area: &Area,
    caption: &str,
    x: Range<f64>,
    series: &[Series],
    markers: &[f64],
) -> DrawResult {
    let y = y_range(series);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y.clone())?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .x_label_formatter(&step_label)
        .draw()?;
    if series.iter().all(|s| s.points.is_empty()) {
        area.draw(&Text::new(
            "no data in this recording",
            (WIDTH as i32 / 2 - 80, PANEL_HEIGHT as i32 / 2),
            ("sans-serif", 14),
        ))?;
        return Ok(());
    }
    let marker_style = ShapeStyle::from(&RGBColor(170, 170, 170)).stroke_width(1);
    for &m in markers {
        chart.draw_series(DashedLineSeries::new(
            vec![(m, y.start), (m, y.end)],
            4,
            4,
            marker_style,
        ))?;
    }
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::{EstimateEvent, Phase};
    use crate::tui::testing::{header, sample_run};

    #[test]
    fn the_memory_series_holds_measurements_only() {
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
        let recording = Recording {
            header: header(),
            events,
            warnings: Vec::new(),
        };
        let series = memory_series(&recording);
        let activations = series.iter().find(|s| s.label == "activations").unwrap();
        let steps: Vec<f64> = activations.points.iter().map(|p| p.0).collect();
        assert_eq!(steps, [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(
            activations.points.iter().all(|p| p.1 == 12.0),
            "{activations:?}"
        );
    }

    #[test]
    fn step_axis_labels_are_whole_numbers() {
        assert_eq!(step_label(&20.0), "20");
        assert_eq!(step_label(&0.0), "0");
        assert_eq!(step_label(&2.5), "");
    }
}
