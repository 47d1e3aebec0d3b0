//! Mixed precision, dynamic loss scaling and optimizer-state offload.

use crate::common;

use candle_core::Device;
use common::{accumulating, step, TestModel, TINY};
use gaccwb::control::{Control, Dtype};
use gaccwb::train::Trainer;

fn weights(t: &Trainer) -> Vec<Vec<f32>> {
    t.model()
        .params
        .iter()
        .map(|p| p.var.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

#[test]
/// On the CPU the host is the device, so offload moves no bytes across a bus: what this checks is
/// that toggling it mid-run changes no arithmetic and that the ledger's books move the moments
/// between `optimizer_state` and `offloaded`.
fn toggling_offload_on_cpu_changes_no_arithmetic_and_moves_the_books() {
    let mut plain = Trainer::new(accumulating(), Device::Cpu).unwrap();
    let mut toggled = Trainer::new(accumulating(), Device::Cpu).unwrap();
    for i in 0..8 {
        if matches!(i, 1 | 2 | 4 | 7) {
            let on = !toggled.knobs().offload;
            toggled
                .apply_control(&Control::SetOffload { value: on })
                .unwrap();
            assert_eq!(toggled.optimizer().offloaded, on);
            let books = toggled.persistent_memory();
            let moments = toggled.optimizer().moment_bytes();
            if on {
                assert_eq!(books.optimizer_state, 0);
                assert!(books.offloaded >= moments && moments > 0);
            } else {
                assert_eq!((books.optimizer_state, books.offloaded), (moments, 0));
            }
        }
        let a = step(&mut plain);
        let b = step(&mut toggled);
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {i}");
        assert_eq!(b.offload, toggled.knobs().offload);
    }
    assert_eq!(weights(&plain), weights(&toggled));
    assert_eq!(plain.optimizer().t, toggled.optimizer().t);
}

#[test]
fn a_forced_huge_f16_scale_overflows_skips_halves_and_recovers() {
    let mut t = Trainer::new(accumulating(), Device::Cpu).unwrap();
    t.apply_control(&Control::SetDtype { value: Dtype::F16 })
        .unwrap();
    step(&mut t);
    let huge = 2f64.powi(24);
    t.apply_control(&Control::SetLossScale { value: huge })
        .unwrap();
    let before = weights(&t);
    let lr_step = t.lr_step();

    let overflow = step(&mut t);
    assert!(
        overflow.skipped,
        "2^24 must overflow f16 gradients (norm {})",
        overflow.grad_norm
    );
    assert_eq!(overflow.loss_scale, huge);
    assert_eq!(overflow.overflow_count, 1);
    assert_eq!(
        weights(&t),
        before,
        "a skipped step leaves the weights untouched"
    );
    assert_eq!(
        t.lr_step(),
        lr_step,
        "the LR schedule does not advance on a skipped step"
    );
    assert_eq!(t.scaler().scale, huge / 2.0);

    let mut recovered = None;
    for _ in 0..12 {
        let s = step(&mut t);
        assert!(
            weights(&t).iter().flatten().all(|w| w.is_finite()),
            "a NaN reached the weights"
        );
        if !s.skipped {
            recovered = Some(s);
            break;
        }
    }
    let s = recovered.expect("training recovers once the scale has backed off");
    println!(
        "recovered at scale 2^{} after {} overflows",
        s.loss_scale.log2(),
        s.overflow_count
    );
    assert!(s.loss_scale < huge && s.grad_norm.is_finite());
}

fn losses(dtype: Dtype, steps: usize) -> Vec<f64> {
    let mut s = accumulating();
    s.train.dtype = dtype;
    s.train.lr = 3e-3;
    let mut t = Trainer::new(s, Device::Cpu).unwrap();
    (0..steps).map(|_| step(&mut t).loss).collect()
}

#[test]
fn bf16_and_f16_runs_train() {
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let l = losses(dtype, 30);
        let head: f64 = l[..3].iter().sum::<f64>() / 3.0;
        let tail: f64 = l[l.len() - 3..].iter().sum::<f64>() / 3.0;
        println!("{dtype:?}: loss {head:.3} → {tail:.3}");
        assert!(l.iter().all(|x| x.is_finite()));
        assert!(
            tail < head * 0.8,
            "{dtype:?} did not train: {head:.3} → {tail:.3}"
        );
    }
}

#[test]
fn half_precision_tracks_f32_early_on() {
    let f32_losses = losses(Dtype::F32, 5);
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let l = losses(dtype, 5);
        for (a, b) in l.iter().zip(&f32_losses) {
            assert!((a - b).abs() / b < 0.05, "{dtype:?} loss {a} vs f32 {b}");
        }
    }
}

/// Every parameter's gradient of one micro-batch of `tokens_per_micro` tokens in `dtype` against
/// f32, as relative L2 error per tensor.
fn gradient_errors(dtype: Dtype, tokens_per_micro: usize) -> Vec<(String, f64)> {
    use gaccwb::control::Knobs;
    use gaccwb::data::Split;
    use gaccwb::train::{relative_error, window_gradients};
    // The shape whose errors docs/GPU.md reports.
    let mut s = TestModel {
        vocab: 64,
        d_model: 64,
        seq_len: 64,
        ..TINY
    }
    .scenario();
    s.train.micro_batch = tokens_per_micro / s.model.seq_len;
    s.train.accum_steps = 1;
    let t = Trainer::new(s.clone(), Device::Cpu).unwrap();
    let samples: Vec<_> = (0..s.train.micro_batch)
        .map(|i| t.corpus().sample(Split::Train, i as u64))
        .collect();
    let grads = |dtype: Dtype, scale: f64| {
        let mut knobs = Knobs::from_scenario(&s);
        knobs.dtype = dtype;
        let w = window_gradients(t.model(), &samples, &knobs, scale, &Device::Cpu, || true);
        let Ok(w) = w else { panic!("window failed") };
        w.grads
            .iter()
            .map(|g| g.affine(1.0 / scale, 0.0).unwrap())
            .collect::<Vec<_>>()
    };
    let reference = grads(Dtype::F32, 1.0);
    // f16 runs under a loss scale, as in training; bf16 has f32's range and needs none.
    let scale = if dtype == Dtype::F16 { 1024.0 } else { 1.0 };
    let low = grads(dtype, scale);
    t.model()
        .params
        .iter()
        .zip(low.iter().zip(&reference))
        .map(|(p, (g, r))| {
            let e = relative_error(std::slice::from_ref(g), std::slice::from_ref(r)).unwrap();
            (p.name.clone(), e)
        })
        .collect()
}

#[test]
fn half_precision_gradients_match_f32_per_parameter() {
    // The bounds: bf16 within 2% of f32 per parameter tensor, f16 within 0.5%.
    for (dtype, bound) in [(Dtype::Bf16, 0.02), (Dtype::F16, 0.005)] {
        for tokens in [1024, 4096] {
            let errors = gradient_errors(dtype, tokens);
            let (worst, max) = errors
                .iter()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .expect("the model has parameters");
            println!(
                "{dtype:?} at {tokens} tokens per micro-batch: max rel. error {max:.4e} ({worst})"
            );
            for (name, e) in &errors {
                assert!(
                    *e <= bound,
                    "{dtype:?}, {tokens} tokens: {name} gradient {e:.3e} off f32 (bound {bound})"
                );
            }
        }
    }
}

#[test]
fn f16_gradients_that_overflow_at_the_scale_floor_end_the_run() {
    use gaccwb::telemetry::Event;
    let mut s = accumulating();
    s.train.dtype = Dtype::F16;
    s.train.steps = 100;
    s.train.warmup = 0;
    s.train.loss_scale = 8.0;
    // A learning rate this large sends the weights past f16's range after one step: every
    // window after it overflows whatever the scale.
    s.train.lr = 1e6;
    let (mut handle, _sink) = gaccwb::train::spawn(s, Device::Cpu).unwrap();
    let mut skipped = 0;
    let end = loop {
        match handle
            .events
            .blocking_recv()
            .expect("the trainer ends with an end event")
        {
            Event::Step(step) => {
                skipped += usize::from(step.skipped);
                assert!(
                    step.loss_scale >= 1.0,
                    "scale {} below the floor",
                    step.loss_scale
                );
            }
            Event::End(end) => break end,
            _ => {}
        }
    };
    println!(
        "ended at step {} after {skipped} skipped: {}",
        end.step, end.reason
    );
    assert!(
        matches!(&end.reason, gaccwb::end::EndReason::LossScaleExhausted(m) if m.contains("loss-scale floor")),
        "{}",
        end.reason
    );
    // 8 → 4 → 2 → 1, then FLOOR_PATIENCE overflows at 1.
    assert!(end.step < 20, "the run went on to step {}", end.step);
    assert!(skipped >= 6, "{skipped} skipped steps");
}
