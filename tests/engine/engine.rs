//! The engine's exact semantics: accumulation equals the full batch, normalisation, clipping,
//! controls at boundaries, learning to the entropy floor, and clear errors for bad input.

use crate::common;

use candle_core::{Device, Tensor};
use common::{TestModel, TINY};
use gaccwb::control::{Control, Knobs, LossNorm, Origin, ZeroGrad};
use gaccwb::data::{Sample, Split};
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::Event;
use gaccwb::train::{self, global_norm, relative_error, window_gradients, Trainer};

fn tiny() -> Scenario {
    let mut s = TINY.scenario();
    s.data.min_doc_len = 4;
    s.train.micro_batch = 2;
    s
}

fn trainer(s: Scenario) -> Trainer {
    Trainer::new(s, Device::Cpu).unwrap()
}

fn samples(t: &Trainer, n: u64) -> Vec<Sample> {
    (0..n).map(|i| t.corpus().sample(Split::Train, i)).collect()
}

fn grads(t: &Trainer, samples: &[Sample], micro_batch: usize, loss_norm: LossNorm) -> Vec<Tensor> {
    let knobs = Knobs {
        micro_batch,
        loss_norm,
        ..Knobs::from_scenario(t.scenario())
    };
    match window_gradients(t.model(), samples, &knobs, 1.0, &Device::Cpu, || true) {
        Ok(w) => w.grads,
        Err(_) => panic!("window failed"),
    }
}

/// Largest per-parameter relative L2 error.
fn max_relative_error(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| relative_error(std::slice::from_ref(x), std::slice::from_ref(y)).unwrap())
        .fold(0.0, f64::max)
}

#[test]
fn accumulated_gradients_equal_the_full_batch_under_token_normalisation() {
    let t = trainer(tiny());
    let b = 2;
    for k in [1usize, 2, 4, 8] {
        let window = samples(&t, (b * k) as u64);
        let lens: std::collections::BTreeSet<usize> = window.iter().map(|s| s.len).collect();
        assert!(k == 1 || lens.len() > 1, "documents must vary in length");
        let full = grads(&t, &window, b * k, LossNorm::Tokens);
        let accumulated = grads(&t, &window, b, LossNorm::Tokens);
        let err = max_relative_error(&accumulated, &full);
        println!("K={k}: max relative error {err:.2e}");
        assert!(err <= 1e-5, "K={k}: relative error {err:e} > 1e-5");
    }
}

#[test]
fn mean_of_means_differs_from_the_full_batch_on_variable_length_documents() {
    let t = trainer(tiny());
    let window = samples(&t, 8);
    let full = grads(&t, &window, 8, LossNorm::Tokens);
    let buggy = grads(&t, &window, 2, LossNorm::MeanOfMeans);
    let err = max_relative_error(&buggy, &full);
    println!("mean-of-means relative error {err:.3e}");
    assert!(
        err > 1e-3,
        "mean-of-means should be measurably wrong, got {err:e}"
    );
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    let t = trainer(tiny());
    let g = grads(&t, &samples(&t, 4), 2, LossNorm::Tokens);
    assert_eq!(g.len(), t.model().params.len());
    for (p, g) in t.model().params.iter().zip(&g) {
        let norm = global_norm(std::slice::from_ref(g)).unwrap();
        assert!(
            norm > 0.0 && norm.is_finite(),
            "{} has gradient norm {norm}",
            p.name
        );
    }
}

#[test]
fn zero_grad_per_micro_batch_keeps_only_the_last_micro_batch() {
    let t = trainer(tiny());
    let window = samples(&t, 8);
    let knobs = Knobs {
        micro_batch: 2,
        zero_grad: ZeroGrad::PerMicroBatch,
        ..Knobs::from_scenario(t.scenario())
    };
    let Ok(w) = window_gradients(t.model(), &window, &knobs, 1.0, &Device::Cpu, || true) else {
        panic!()
    };
    let correct = grads(&t, &window, 8, LossNorm::Tokens);
    let reference = w
        .reference
        .expect("a pitfall keeps the correct gradient for comparison");
    assert!(max_relative_error(&reference, &correct) <= 1e-5);
    assert!(relative_error(&w.grads, &correct).unwrap() > 0.1);
}

fn first_step(clip: Option<f64>) -> gaccwb::telemetry::StepEvent {
    let mut s = tiny();
    s.train.clip = clip;
    let mut t = trainer(s);
    match t.train_step(|| true) {
        Ok(step) => step,
        Err(_) => panic!("step failed"),
    }
}

#[test]
fn clipping_leaves_the_norm_at_the_threshold_and_leaves_small_norms_alone() {
    let unclipped = first_step(None);
    let norm = unclipped.grad_norm;
    assert_eq!(unclipped.grad_norm_clipped, norm);

    let max = norm / 3.0;
    let clipped = first_step(Some(max));
    assert_eq!(clipped.grad_norm, norm);
    let rel = (clipped.grad_norm_clipped - max).abs() / max;
    assert!(
        rel <= 1e-6,
        "clipped norm {} vs max {max}: rel {rel:e}",
        clipped.grad_norm_clipped
    );

    let loose = first_step(Some(norm * 3.0));
    assert_eq!(loose.grad_norm_clipped, norm);
}

#[test]
fn a_k_change_sent_mid_window_applies_at_the_next_boundary() {
    let mut s = tiny();
    s.train.accum_steps = 8;
    s.train.steps = 4;
    let corpus_trainer = trainer(s.clone());
    let (mut handle, _sink) = train::spawn(s, Device::Cpu).unwrap();
    let mut events = Vec::new();
    while let Some(e) = handle.events.blocking_recv() {
        // Step 1 has finished: the trainer is starting or running window 2.
        if matches!(&e, Event::Step(st) if st.step == 1) {
            handle.send(Control::SetAccumSteps { value: 2 }, Origin::Key);
        }
        let end = matches!(e, Event::End(_));
        events.push(e);
        if end {
            break;
        }
    }
    let applied = events
        .iter()
        .find_map(|e| match e {
            Event::Control(c) if c.control == Control::SetAccumSteps { value: 2 } => Some(c.step),
            _ => None,
        })
        .expect("the control is reported when applied");
    assert!(applied >= 1, "sent after step 1, applied at {applied}");
    // Every window ran with one K throughout: it reports the K in force at its start, and its
    // counted tokens are exactly those of the next K·B samples of the stream.
    let mut cursor = 0u64;
    for e in &events {
        if let Event::Step(st) = e {
            let expected = if st.step <= applied { 8 } else { 2 };
            assert_eq!(
                st.accum_steps, expected,
                "step {} ran with K={}",
                st.step, st.accum_steps
            );
            let n = (st.accum_steps * st.micro_batch) as u64;
            let tokens: u64 = (cursor..cursor + n)
                .map(|i| corpus_trainer.corpus().sample(Split::Train, i).len as u64)
                .sum();
            assert_eq!(
                st.tokens, tokens,
                "step {} consumed other samples than its K·B",
                st.step
            );
            cursor += n;
        }
    }
    println!("K change applied after step {applied}");
}

#[test]
fn loss_approaches_the_entropy_floor() {
    const STEPS: usize = 400;
    // Wide enough to reach the floor in 400 steps; short samples keep those steps quick.
    let model = TestModel {
        d_model: 64,
        heads: 4,
        seq_len: 16,
        ..TINY
    };
    let mut s = model.onto(tiny());
    s.data.min_doc_len = 8;
    s.train.micro_batch = 32;
    s.train.lr = 3e-3;
    s.train.warmup = 10;
    s.train.steps = STEPS as u64;
    let mut t = trainer(s);
    let floor = t.corpus().entropy_floor().unwrap();
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        match t.train_step(|| true) {
            Ok(step) => losses.push(step.loss),
            Err(_) => panic!("step failed"),
        }
    }
    let val = t.evaluate().unwrap();
    println!(
        "after {STEPS} steps: floor {floor:.4}, first loss {:.4}, last train {:.4}, val {val:.4} ({:+.1}% of floor)",
        losses[0],
        losses[STEPS - 1],
        (val / floor - 1.0) * 100.0
    );
    assert!(
        val <= floor * 1.10,
        "validation loss {val:.4} is not within 10% of the floor {floor:.4}"
    );
    assert!(
        val >= floor * 0.97,
        "validation loss {val:.4} is below the floor {floor:.4}: the floor is wrong"
    );
}
