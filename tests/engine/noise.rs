//! The gradient noise scale: checked against per-sample gradients computed independently, and
//! shown not to change training.

use crate::common;

use candle_core::{Device, Tensor};
use common::TINY;
use gaccwb::control::Knobs;
use gaccwb::data::{Sample, Split};
use gaccwb::scenario::Scenario;
use gaccwb::train::{window_gradients, NoiseTracker, Trainer};

/// Every sample counts all `seq_len` targets, so a micro-batch's token-mean gradient is the plain
/// mean of its samples' gradients and sequences and tokens give the same estimate.
fn full_length() -> Scenario {
    let mut s = TINY.scenario();
    s.data.min_doc_len = s.model.seq_len;
    s.data.max_doc_len = s.model.seq_len;
    s
}

fn flat(grads: &[Tensor]) -> Vec<f64> {
    grads
        .iter()
        .flat_map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .map(f64::from)
        .collect()
}

/// At fixed weights: the exact |G|² and tr(Σ) of the distribution "one of these 64 samples,
/// uniformly", from each sample's own gradient; then windows of K micro-batches of B samples
/// drawn from it with replacement, fed to the estimator as the trainer does.
#[test]
fn the_estimator_agrees_with_exact_per_sample_statistics() {
    let s = full_length();
    let t = Trainer::new(s.clone(), Device::Cpu).unwrap();
    let n = 64;
    let population: Vec<Sample> = (0..n).map(|i| t.corpus().sample(Split::Train, i)).collect();
    assert!(population.iter().all(|x| x.len == s.model.seq_len));
    let one = Knobs {
        accum_steps: 1,
        micro_batch: 1,
        ..Knobs::from_scenario(&s)
    };
    let per_sample: Vec<Vec<f64>> = population
        .iter()
        .map(|x| {
            let w = window_gradients(
                t.model(),
                std::slice::from_ref(x),
                &one,
                1.0,
                &Device::Cpu,
                || true,
            );
            flat(&w.ok().expect("window ran").grads)
        })
        .collect();
    let dim = per_sample[0].len();
    let mean: Vec<f64> = (0..dim)
        .map(|d| per_sample.iter().map(|g| g[d]).sum::<f64>() / n as f64)
        .collect();
    let g2: f64 = mean.iter().map(|x| x * x).sum();
    let trace: f64 = per_sample
        .iter()
        .map(|g| {
            g.iter()
                .zip(&mean)
                .map(|(a, m)| (a - m) * (a - m))
                .sum::<f64>()
        })
        .sum::<f64>()
        / n as f64;
    let exact = trace / g2;

    let (k, b, windows) = (8usize, 2usize, 24);
    let knobs = Knobs {
        accum_steps: k,
        micro_batch: b,
        ..Knobs::from_scenario(&s)
    };
    // A fixed xorshift stream: which samples each window draws, with replacement.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut draw = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n) as usize
    };
    // Every window counts equally (a plain mean), so the figure is the estimator's, not the EMA's.
    let mut tracker = NoiseTracker::new(1.0 - 1.0 / windows as f64);
    let (mut sum_g2, mut sum_trace) = (0.0, 0.0);
    let mut last = None;
    for _ in 0..windows {
        let window: Vec<Sample> = (0..k * b).map(|_| population[draw()].clone()).collect();
        let w = window_gradients(t.model(), &window, &knobs, 1.0, &Device::Cpu, || true)
            .ok()
            .expect("window ran");
        let norms = w.noise.expect("K ≥ 2 is measured");
        let raw = norms.estimate_seqs().unwrap();
        sum_g2 += raw.g2;
        sum_trace += raw.trace;
        last = tracker
            .observe(Some(&norms), false)
            .and_then(|e| e.b_simple_seqs);
    }
    let (est_g2, est_trace) = (sum_g2 / windows as f64, sum_trace / windows as f64);
    let estimate = est_trace / est_g2;
    let smoothed: f64 = last.expect("the last window gave an estimate");
    let rel = (estimate - exact).abs() / exact;
    println!(
        "exact |G|² {g2:.4e} tr(Σ) {trace:.4e} B_simple {exact:.3}; \
         estimate over {windows} windows |G|² {est_g2:.4e} tr(Σ) {est_trace:.4e} \
         B_simple {estimate:.3} ({:.1}% off)",
        rel * 100.0
    );
    let smoothed_rel = (smoothed - exact).abs() / exact;
    println!(
        "smoothed (EMA {:.3}) B_simple {smoothed:.3} ({:.1}% off)",
        1.0 - 1.0 / windows as f64,
        smoothed_rel * 100.0
    );
    assert!(rel < 0.15, "estimate {estimate} vs exact {exact}");
    assert!(smoothed_rel < 0.15, "smoothed {smoothed} vs exact {exact}");
}

fn weights(t: &Trainer) -> Vec<Vec<u32>> {
    t.model()
        .params
        .iter()
        .map(|p| {
            let v = p
                .var
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            v.into_iter().map(f32::to_bits).collect()
        })
        .collect()
}

#[test]
fn measuring_the_noise_scale_does_not_change_training() {
    let run = |measure: bool| {
        let mut s = TINY.scenario();
        s.train.accum_steps = 4;
        s.train.micro_batch = 2;
        s.train.noise = measure;
        let mut t = Trainer::new(s, Device::Cpu).unwrap();
        let mut noise = Vec::new();
        for _ in 0..3 {
            let step = t.train_step(|| true).ok().expect("step ran");
            noise.push(step.noise.is_some());
        }
        (weights(&t), noise)
    };
    let (with, measured) = run(true);
    let (without, unmeasured) = run(false);
    assert_eq!(measured, vec![true; 3]);
    assert_eq!(unmeasured, vec![false; 3]);
    assert!(with == without, "weights differ bit for bit");
}

#[test]
fn pitfalls_are_measured_from_the_correct_gradients() {
    use gaccwb::control::{LossNorm, ZeroGrad};
    let s = TINY.scenario();
    let t = Trainer::new(s.clone(), Device::Cpu).unwrap();
    let window: Vec<Sample> = (0..8).map(|i| t.corpus().sample(Split::Train, i)).collect();
    let norms = |loss_norm, zero_grad| {
        let knobs = Knobs {
            accum_steps: 4,
            micro_batch: 2,
            loss_norm,
            zero_grad,
            ..Knobs::from_scenario(&s)
        };
        window_gradients(t.model(), &window, &knobs, 1.0, &Device::Cpu, || true)
            .ok()
            .expect("window ran")
            .noise
            .expect("measured")
    };
    let correct = norms(LossNorm::Tokens, ZeroGrad::PerWindow);
    for (loss_norm, zero_grad) in [
        (LossNorm::MeanOfMeans, ZeroGrad::PerWindow),
        (LossNorm::Tokens, ZeroGrad::PerMicroBatch),
    ] {
        let n = norms(loss_norm, zero_grad);
        let rel = |a: f64, b: f64| (a - b).abs() / b;
        assert!(rel(n.window_sq_norm, correct.window_sq_norm) < 1e-5);
        for (a, b) in n.micro.iter().zip(&correct.micro) {
            assert!(
                rel(a.sq_norm, b.sq_norm) < 1e-5,
                "{loss_norm:?} {zero_grad:?}"
            );
        }
    }
}

/// The `adaptive-k` preset, headless: K changes come from the policy, one step at a time and at
/// most one per patience window, while the measured critical batch rises as the loss falls.
#[test]
fn the_adaptive_k_preset_lets_the_noise_scale_choose_k() {
    use gaccwb::control::{Control, Origin};
    use gaccwb::headless::{self, HeadlessOptions};
    use gaccwb::telemetry::Event;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.jsonl");
    let mut s = gaccwb::presets::resolve("adaptive-k").unwrap();
    // The first 100 of its 150 steps hold the story (K 2 → 4 → 8 → 16) and keep the test short.
    s.train.steps = 100;
    let patience = s.train.accum_patience;
    let summary = headless::run(
        s,
        Device::Cpu,
        HeadlessOptions {
            record: Some(path.clone()),
            quiet: true,
        },
    )
    .unwrap();
    assert_eq!(summary.end_reason, Some(gaccwb::end::EndReason::Completed));
    let recording = gaccwb::record::read_recording(&path).unwrap();
    let changes: Vec<(u64, usize)> = recording
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Control(c) => match c.control {
                Control::SetAccumSteps { value } => {
                    assert_eq!(c.origin, Origin::Policy, "only the policy changes K");
                    Some((c.step, value))
                }
                _ => None,
            },
            _ => None,
        })
        .collect();
    let b_simple: Vec<(u64, f64)> = summary
        .steps
        .iter()
        .filter_map(|s| Some((s.step, s.noise.as_ref()?.b_simple_seqs?)))
        .collect();
    for s in summary.steps.iter().filter(|s| s.step % 10 == 0) {
        let b = s.noise.as_ref().and_then(|n| n.b_simple_seqs);
        println!(
            "step {:>3} loss {:.3} K {:>2} B_simple {b:?}",
            s.step, s.loss, s.accum_steps
        );
    }
    println!("K changes (step, K): {changes:?}");
    assert!(!changes.is_empty(), "the policy changed K");
    let mut k = summary.steps[0].accum_steps;
    for w in changes.windows(2) {
        assert!(
            w[1].0 - w[0].0 >= patience,
            "changes {w:?} closer than {patience} windows"
        );
    }
    for (_, value) in &changes {
        assert!(
            *value == k * 2 || *value * 2 == k,
            "K {k} → {value}: one step at a time"
        );
        k = *value;
    }
    let third = b_simple.len() / 3;
    let mean = |v: &[(u64, f64)]| v.iter().map(|p| p.1).sum::<f64>() / v.len() as f64;
    let (early, late) = (mean(&b_simple[..third]), mean(&b_simple[2 * third..]));
    println!("B_simple (sequences): first third {early:.2}, last third {late:.2}");
    assert!(late > early, "the critical batch rises as the loss falls");
}
