use super::*;
use crate::telemetry::{Categories, EstimateEvent, Phase};
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
fn each_step_holds_its_bytes_over_its_span() {
    let points = held([(1, 3.0), (2, 5.0), (4, 2.0)]);
    assert_eq!(
        points,
        [(0, 3.0), (1, 3.0), (1, 5.0), (2, 5.0), (2, 2.0), (4, 2.0)]
    );
}

#[test]
fn a_recording_started_mid_run_spans_its_own_steps_under_its_own_knobs() {
    let mut events = sample_run(200);
    events.retain(|e| !matches!(e, Event::Step(s) if s.step <= 140));
    let mut rec = recording(events);
    rec.header.config.train.accum_steps = 4;
    let steps: Vec<&StepEvent> = rec
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(step_range(&steps, &[]), 140..200);
    let line = knobs_line(&rec, &steps);
    assert!(line.starts_with("at the start: steps 141–200"), "{line}");
    assert!(line.contains("K 4"), "{line}");
}
