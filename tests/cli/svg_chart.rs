//! The exported SVG read back as text, as a viewer would see it: the step axis is labelled with
//! whole numbers over the recording's own steps, every panel with a step axis has a marker at the
//! step of each applied control, labelled once at the top with what changed, skipped steps are
//! crossed, and a log axis is labelled at round values.

use std::path::Path;

use gaccwb::control::{Control, Origin};
use gaccwb::export::svg::{render_svg, MARKER, SKIPPED};
use gaccwb::record::{read_recording, Recording};
use gaccwb::telemetry::{ControlEvent, Event};
use gaccwb::tui::app::YScale;
use gaccwb::tui::testing::{header, sample_run};

/// A `<text>` element: its position, anchor and content.
#[derive(Debug)]
struct Text {
    x: f64,
    y: f64,
    anchor: String,
    content: String,
}

fn attribute(tag: &str, name: &str) -> Option<String> {
    let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    let end = start + tag[start..].find('"')?;
    Some(tag[start..end].to_string())
}

fn texts(svg: &str) -> Vec<Text> {
    svg.split("<text")
        .skip(1)
        .map(|chunk| {
            let (tag, rest) = chunk.split_once('>').unwrap();
            let number = |n| attribute(tag, n).unwrap().parse().unwrap();
            Text {
                x: number("x"),
                y: number("y"),
                anchor: attribute(tag, "text-anchor").unwrap_or_default(),
                content: rest.split("</text>").next().unwrap().trim().to_string(),
            }
        })
        .collect()
}

/// Vertical segments drawn in the marker colour: (x, top, bottom).
fn marker_segments(svg: &str) -> Vec<(f64, f64, f64)> {
    let colour = format!("#{:02X}{:02X}{:02X}", MARKER.0, MARKER.1, MARKER.2);
    svg.split("<polyline")
        .skip(1)
        .filter_map(|chunk| {
            let tag = chunk.split('>').next().unwrap();
            if !attribute(tag, "stroke")?.eq_ignore_ascii_case(&colour) {
                return None;
            }
            let points: Vec<(f64, f64)> = attribute(tag, "points")?
                .split_whitespace()
                .map(|p| {
                    let (x, y) = p.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect();
            let x = points[0].0;
            let vertical = points.iter().all(|p| p.0 == x);
            let ys = points.iter().map(|p| p.1);
            let top = ys.clone().fold(f64::INFINITY, f64::min);
            vertical.then(|| (x, top, ys.fold(f64::NEG_INFINITY, f64::max)))
        })
        .collect()
}

/// The steps at which knob controls applied (flow controls move no curve and get no marker).
fn applied_steps(recording: &Recording) -> Vec<u64> {
    let mut steps: Vec<u64> = recording
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Control(c) if !c.control.is_flow() => Some(c.step),
            _ => None,
        })
        .collect();
    steps.dedup();
    steps
}

/// Checks the SVG of `recording`; returns the control labels' texts.
fn check(recording: &Recording) -> Vec<String> {
    let svg = render_svg(recording, YScale::Linear).unwrap();
    let texts = texts(&svg);
    // Tick labels of a step axis: centred numbers (captions and labels hold words).
    let ticks: Vec<&Text> = texts
        .iter()
        .filter(|t| t.anchor == "middle" && t.content.parse::<f64>().is_ok())
        .collect();
    assert!(ticks.len() >= 6, "too few step labels: {ticks:?}");
    for t in &ticks {
        assert!(
            t.content.parse::<u64>().is_ok(),
            "step label {:?} is not a whole number",
            t.content
        );
    }
    // Each panel has its own row of tick labels, just under its plot; all share one mapping.
    let mut rows: Vec<f64> = ticks.iter().map(|t| t.y).collect();
    rows.sort_by(f64::total_cmp);
    rows.dedup();
    assert!(rows.len() >= 3, "a step axis per panel: {rows:?}");
    let step = |t: &Text| t.content.parse::<f64>().unwrap();
    let first = ticks
        .iter()
        .min_by(|a, b| step(a).total_cmp(&step(b)))
        .unwrap();
    let last = ticks
        .iter()
        .max_by(|a, b| step(a).total_cmp(&step(b)))
        .unwrap();
    let pixel = |s: u64| {
        first.x + (s as f64 - step(first)) * (last.x - first.x) / (step(last) - step(first))
    };
    let markers = marker_segments(&svg);
    let steps = applied_steps(recording);
    assert!(!steps.is_empty());
    for &s in &steps {
        let x = pixel(s);
        for &row in &rows {
            let found = markers.iter().any(|&(mx, _, bottom)| {
                (mx - x).abs() <= 1.5 && bottom <= row && bottom > row - 40.0
            });
            assert!(
                found,
                "no marker at step {s} (x ≈ {x:.0}) in the panel above y = {row}"
            );
        }
    }
    let labels: Vec<String> = texts
        .iter()
        .filter(|t| t.content.starts_with("step "))
        .map(|t| t.content.clone())
        .collect();
    assert_eq!(
        labels.len(),
        steps.len(),
        "one label per step with controls: {labels:?}"
    );
    labels
}

#[test]
fn the_recorded_asset_marks_its_one_boundary_with_both_changes() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/accumulate-to-fit.jsonl");
    let recording = read_recording(&path).unwrap();
    assert_eq!(check(&recording), ["step 60: B 32→4, K 1→8"]);
}

#[test]
fn every_applied_control_has_a_marker_and_pauses_have_none() {
    let mut events = sample_run(120);
    for (step, control) in [
        (21, Control::SetMicroBatch { value: 2 }),
        (21, Control::SetAccumSteps { value: 16 }),
        (60, Control::Pause),
        (100, Control::SetOffload { value: true }),
    ] {
        events.push(Event::Control(ControlEvent {
            step,
            origin: Origin::Key,
            control,
        }));
    }
    let recording = Recording {
        header: header(),
        events,
        warnings: Vec::new(),
    };
    let labels = check(&recording);
    assert_eq!(labels.len(), 3, "{labels:?}");
    assert!(labels[2].ends_with("offload off→on"), "{labels:?}");
}

/// `<line>` elements stroked in `colour`.
fn lines_in(svg: &str, colour: plotters::style::RGBColor) -> usize {
    let hex = format!("#{:02X}{:02X}{:02X}", colour.0, colour.1, colour.2);
    svg.split("<line")
        .skip(1)
        .filter(|chunk| {
            let tag = chunk.split('>').next().unwrap();
            attribute(tag, "stroke").is_some_and(|s| s.eq_ignore_ascii_case(&hex))
        })
        .count()
}

#[test]
fn skipped_steps_are_crossed_in_every_line_panel_and_counted() {
    let mut events = sample_run(60);
    for e in &mut events {
        if let Event::Step(s) = e {
            s.dtype = gaccwb::control::Dtype::F16;
            s.loss_scale = 65536.0;
            s.skipped = [30, 31, 45].contains(&s.step);
        }
    }
    let recording = Recording {
        header: header(),
        events,
        warnings: Vec::new(),
    };
    let svg = render_svg(&recording, YScale::Linear).unwrap();
    let texts = texts(&svg);
    let counted = texts
        .iter()
        .filter(|t| t.content == "skipped step (3)")
        .count();
    assert_eq!(counted, 3, "loss, gradient norm and loss scale panels");
    // A cross is two strokes: three steps in three panels, and each legend's swatch.
    assert_eq!(lines_in(&svg, SKIPPED), 2 * (3 * 3 + 3));
}

#[test]
fn a_recording_started_mid_run_fills_its_axis_under_its_own_knobs() {
    let mut events = sample_run(200);
    events.retain(|e| match e {
        Event::Step(s) => s.step > 140,
        Event::Memory(m) => m.step > 140,
        Event::Eval(v) => v.step > 140,
        Event::Control(c) => c.step > 140,
        _ => true,
    });
    events.push(Event::Control(ControlEvent {
        step: 170,
        origin: Origin::Key,
        control: Control::SetMicroBatch { value: 2 },
    }));
    let mut h = header();
    h.config.train.accum_steps = 4;
    h.config.description = "f32, no accumulation".into();
    let recording = Recording {
        header: h,
        events,
        warnings: Vec::new(),
    };
    let svg = render_svg(&recording, YScale::Linear).unwrap();
    let texts = texts(&svg);
    let steps: Vec<u64> = texts
        .iter()
        .filter(|t| t.anchor == "middle")
        .filter_map(|t| t.content.parse().ok())
        .collect();
    assert!(
        steps.iter().all(|s| *s >= 140) && steps.iter().any(|s| *s >= 190),
        "the axis spans steps 140–200 only: {steps:?}"
    );
    let subtitle = texts
        .iter()
        .find(|t| t.content.starts_with("at the start:"))
        .expect("a subtitle of the knobs in force");
    assert!(
        subtitle.content.contains("steps 141–200") && subtitle.content.contains("K 4"),
        "{}",
        subtitle.content
    );
    assert!(
        !svg.contains("f32, no accumulation"),
        "the preset's story is the whole run's, not this part's"
    );
    check(&recording);
}

#[test]
fn a_log_scale_labels_round_decades() {
    let mut events = sample_run(60);
    for e in &mut events {
        if let Event::Step(s) = e {
            s.grad_norm = if s.step == 18 { 32.0 } else { 0.5 };
        }
    }
    let recording = Recording {
        header: header(),
        events,
        warnings: Vec::new(),
    };
    let svg = render_svg(&recording, YScale::Log).unwrap();
    let texts = texts(&svg);
    // The loss and gradient-norm panels: above the memory panel, which stays linear.
    let memory = texts
        .iter()
        .find(|t| t.content.starts_with("memory (MiB)"))
        .unwrap()
        .y;
    let labels: Vec<f64> = texts
        .iter()
        .filter(|t| t.anchor == "end" && t.y < memory)
        .filter_map(|t| t.content.parse().ok())
        .collect();
    assert!(labels.len() >= 4, "{labels:?}");
    for v in &labels {
        let mantissa = v / 10f64.powf(v.log10().floor());
        assert!(
            [1.0, 2.0, 5.0].iter().any(|m| (mantissa - m).abs() < 1e-9),
            "{v} is no 1-2-5 value"
        );
    }
    assert!(svg.contains("log scale"), "the legend says so");
}
