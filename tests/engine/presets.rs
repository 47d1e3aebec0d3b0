//! Every preset file loads and runs; bad presets fail with file:line:col and a fix; the pitfall
//! presets measure a real gradient error while the correct path matches full-batch gradients.

use std::path::{Path, PathBuf};

use candle_core::Device;
use gaccwb::control::{Control, Knobs, LossNorm, Origin, ZeroGrad};
use gaccwb::data::{Corpus, Sample, Split};
use gaccwb::model::Gpt;
use gaccwb::presets;
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::Event;
use gaccwb::train::{self, relative_error, window_gradients};

use crate::common;

use common::{steps, TINY};

const RUN_STEPS: u64 = 3;

fn preset_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("presets");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files
}

/// [`TINY`] and the timeline squeezed into `RUN_STEPS` steps, so every control fires.
fn shrink(s: Scenario) -> Scenario {
    let total = s.train.steps.max(1);
    // A preset that fine-tunes a model runs here on a tiny checkpoint of the same kind.
    let mut s = match s.model.path {
        Some(_) => {
            let mut s = s;
            s.model.path = Some(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/models/llama-tied"),
            );
            s.model.seq_len = 16;
            s.train.eval_every = 0;
            s
        }
        None => TINY.onto(s),
    };
    s.train.steps = RUN_STEPS;
    s.train.decay_steps = RUN_STEPS;
    s.train.micro_batch = s.train.micro_batch.min(4);
    for e in &mut s.timeline {
        e.step = (e.step * RUN_STEPS / total).min(RUN_STEPS - 1);
        if let Control::SetMicroBatch { value } = &mut e.control {
            *value = (*value).min(4);
        }
    }
    s.validate().unwrap();
    s
}

/// Run on the trainer thread; every event in order.
fn run_events(s: Scenario) -> Vec<Event> {
    let (mut handle, sink) = train::spawn(s, Device::Cpu).unwrap();
    drop(sink);
    let mut events = Vec::new();
    while let Some(e) = handle.events.blocking_recv() {
        let end = matches!(e, Event::End(_));
        events.push(e);
        if end {
            break;
        }
    }
    handle.stop();
    events
}

#[test]
fn every_preset_file_is_built_in_and_described() {
    let files = preset_files();
    assert!(files.len() >= 9, "{} presets", files.len());
    for f in &files {
        let stem = f.file_stem().unwrap().to_str().unwrap();
        let s = Scenario::from_file(f).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.name, stem, "{}: name must match the file", f.display());
        assert!(!s.description.is_empty() && !s.description.contains('\n'));
        assert!(s.explanation.len() > 80, "{stem}: explanation too short");
        // The baseline is the open-ended playground; every story preset ends.
        assert!(
            s.train.steps > 0 || stem == "baseline",
            "{stem}: a story needs an end"
        );
        let built_in = presets::resolve(stem).unwrap();
        assert_eq!(built_in, s, "{stem}: built-in copy differs from the file");
    }
    assert_eq!(presets::BUILTIN.len(), files.len());
}

#[test]
fn every_preset_runs_three_steps_and_applies_its_timeline() {
    for f in preset_files() {
        let s = shrink(Scenario::from_file(&f).unwrap());
        let expected: Vec<Control> = s.timeline.iter().map(|e| e.control.clone()).collect();
        let events = run_events(s);
        let name = f.display();
        assert_eq!(steps(&events).count() as u64, RUN_STEPS, "{name}");
        assert!(
            matches!(events.last(), Some(Event::End(e)) if e.reason == gaccwb::end::EndReason::Completed),
            "{name}: {:?}",
            events.last()
        );
        let applied: Vec<Control> = events
            .iter()
            .filter_map(|e| match e {
                Event::Control(c) if c.origin == Origin::Scenario => Some(c.control.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(applied, expected, "{name}: timeline controls applied");
    }
}

fn parse_err(text: &str) -> String {
    Scenario::from_toml(text, "p.toml").unwrap_err().to_string()
}

#[test]
fn misspelt_keys_name_the_place_and_the_nearest_key() {
    let err = parse_err("[train]\nsteps = 3\nacum_steps = 4\n");
    assert!(err.starts_with("p.toml:3:1"), "{err}");
    assert!(err.contains("did you mean `accum_steps`?"), "{err}");

    let err = parse_err("[modle]\nd_model = 64\n");
    assert!(err.starts_with("p.toml:1:"), "{err}");
    assert!(err.contains("did you mean `model`?"), "{err}");

    let err = parse_err("[train]\ndtype = \"f61\"\n");
    assert!(err.starts_with("p.toml:2:9"), "{err}");
    assert!(err.contains("did you mean `f16`?"), "{err}");

    let err =
        parse_err("[[timeline]]\nstep = 5\ncontrol = { kind = \"set_acum_steps\", value = 8 }\n");
    assert!(err.starts_with("p.toml:3:"), "{err}");
    assert!(err.contains("did you mean `set_accum_steps`?"), "{err}");

    // Nothing close: no guess, but the list of what is accepted.
    let err = parse_err("[train]\nzzzzzz = 1\n");
    assert!(!err.contains("did you mean"), "{err}");
    assert!(err.contains("expected one of"), "{err}");
}

#[test]
fn bad_values_point_at_the_value_and_say_what_is_expected() {
    let err = parse_err("[train]\nsteps = 3\naccum_steps = 0\n");
    assert!(err.starts_with("p.toml:3:15"), "{err}");
    assert!(
        err.contains("train.accum_steps must be at least 1"),
        "{err}"
    );

    let err = parse_err("[model]\nd_model = 30\nheads = 4\n");
    assert!(err.starts_with("p.toml:3:"), "{err}");
    assert!(err.contains("divisible"), "{err}");

    let err = parse_err("[train]\nmicro_batch = \"eight\"\n");
    assert!(err.starts_with("p.toml:2:"), "{err}");
    assert!(err.contains("expected"), "{err}");

    let err = parse_err(
        "[[timeline]]\nstep = 1\ncontrol = { kind = \"set_lr\", value = 1e-3 }\n\
         [[timeline]]\nstep = 2\ncontrol = { kind = \"set_accum_steps\", value = 0 }\n",
    );
    assert!(err.starts_with("p.toml:6:"), "{err}");
    assert!(err.contains("timeline[1] (step 2)"), "{err}");
}

#[test]
fn unknown_preset_names_list_the_built_ins() {
    let err = presets::resolve("basline").unwrap_err().to_string();
    assert!(
        err.contains("baseline") && err.contains("pitfall-zero-grad"),
        "{err}"
    );
}

#[test]
fn pitfalls_report_a_real_gradient_error_only_while_on() {
    for (name, floor) in [("pitfall-zero-grad", 0.3), ("pitfall-mean-of-means", 1e-3)] {
        let s = shrink(presets::resolve(name).unwrap());
        // Entry 0 turns the pitfall on at its boundary, entry 1 turns it off.
        let (on_from, off_from) = (s.timeline[0].step, s.timeline[1].step);
        let events = run_events(s);
        let mut seen = 0;
        for st in steps(&events) {
            let on = st.step > on_from && st.step <= off_from;
            match (on, st.grad_error) {
                (true, Some(err)) => {
                    assert!(err > floor, "{name} step {}: grad_error {err}", st.step);
                    seen += 1;
                }
                (false, None) => {}
                other => panic!("{name} step {}: (on, grad_error) = {other:?}", st.step),
            }
        }
        assert!(seen > 0, "{name}: the pitfall never ran");
    }
}

/// K×B accumulated gradients against one K·B batch, on documents of varied length so the
/// token normalisation matters; the pitfalls differ from it, and the reference they are
/// measured against is the full-batch gradient.
#[test]
fn correct_path_matches_full_batch_gradients_and_pitfalls_do_not() {
    let s = shrink(presets::resolve("pitfall-mean-of-means").unwrap());
    let device = Device::Cpu;
    let model = Gpt::new(&s.model, 0, &device).unwrap();
    let corpus = Corpus::open(&s.data, &s.model).unwrap();
    let (k, b) = (4usize, 2usize);
    let samples: Vec<Sample> = (0..(k * b) as u64)
        .map(|i| corpus.sample(Split::Train, i))
        .collect();
    let lens: Vec<usize> = samples.iter().map(|x| x.len).collect();
    assert!(lens.iter().min() != lens.iter().max(), "{lens:?}");

    let knobs = |accum_steps, micro_batch, loss_norm, zero_grad| Knobs {
        accum_steps,
        micro_batch,
        loss_norm,
        zero_grad,
        ..Knobs::from_scenario(&s)
    };
    let grads = |kn: &Knobs| {
        window_gradients(&model, &samples, kn, 1.0, &device, || true)
            .ok()
            .expect("window ran")
    };
    let full = grads(&knobs(1, k * b, LossNorm::Tokens, ZeroGrad::PerWindow)).grads;
    let accumulated = grads(&knobs(k, b, LossNorm::Tokens, ZeroGrad::PerWindow));
    let err = relative_error(&accumulated.grads, &full).unwrap();
    assert!(err <= 1e-5, "accumulated vs full batch: {err}");
    assert!(accumulated.reference.is_none());

    for (loss_norm, zero_grad) in [
        (LossNorm::MeanOfMeans, ZeroGrad::PerWindow),
        (LossNorm::Tokens, ZeroGrad::PerMicroBatch),
    ] {
        let w = grads(&knobs(k, b, loss_norm, zero_grad));
        let wrong = relative_error(&w.grads, &full).unwrap();
        assert!(wrong > 1e-3, "{loss_norm:?}/{zero_grad:?}: {wrong}");
        let reference = w.reference.expect("kept while a pitfall is on");
        let ref_err = relative_error(&reference, &full).unwrap();
        assert!(ref_err <= 1e-5, "reference vs full batch: {ref_err}");
    }
}
