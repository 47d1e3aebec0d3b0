//! The lean ops (the code every CUDA step runs) on the CPU in f32, against the fused CPU
//! kernels: training, the Candle-ops AdamW branch, and the offload branch that keeps host master
//! copies (the path taken when the weights live on a separate device).

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::accumulating;
use gaccwb::model::Gpt;
use gaccwb::ops;
use gaccwb::train::{AdamW, Hyper, Trainer};
use gaccwb_engine::tensors::{activation_bytes, StorageSet};

fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn training_on_the_lean_ops_follows_the_fused_run() {
    let mut fused = Trainer::new(accumulating(), Device::Cpu).unwrap();
    let mut lean = Trainer::new(accumulating(), Device::Cpu).unwrap();
    lean.force_lean_ops(true);
    let mut first_and_last = Vec::new();
    for i in 0..8 {
        let (Ok(a), Ok(b)) = (fused.train_step(|| true), lean.train_step(|| true)) else {
            panic!("step {i} failed");
        };
        let e = (a.loss - b.loss).abs() / a.loss;
        assert!(e < 1e-5, "step {i}: loss {} vs {} ({e:e})", a.loss, b.loss);
        let e = (a.grad_norm - b.grad_norm).abs() / a.grad_norm;
        assert!(
            e < 1e-4,
            "step {i}: grad norm {} vs {}",
            a.grad_norm,
            b.grad_norm
        );
        if i == 0 || i == 7 {
            first_and_last.push(b.loss);
        }
    }
    assert!(
        first_and_last[1] < first_and_last[0],
        "the lean run trains: {first_and_last:?}"
    );
    for (p, q) in fused.model().params.iter().zip(&lean.model().params) {
        let e = rel_diff(&flat(q.var.as_tensor()), &flat(p.var.as_tensor()));
        assert!(e < 1e-4, "{}: weights differ by {e:e}", p.name);
    }
    let (a, b) = (fused.evaluate().unwrap(), lean.evaluate().unwrap());
    assert!((a - b).abs() / a < 1e-5, "evaluation {a} vs {b}");
}

#[test]
fn the_lean_path_is_what_runs_when_forced() {
    // The lean residual steps keep what the fused ones keep, plus f32 row
    // figures beside their nodes (each layer norm's mean and reciprocal std, attention's
    // log-sum-exp), which the fused steps recompute; and the lean embedding keeps the token
    // rows beside their sum with the positions, where the fused one adds them in one op.
    let s = accumulating();
    let model = Gpt::new(&s.model, 1, &Device::Cpu).unwrap();
    let (b, t) = (2, 8);
    let ids = Tensor::zeros((b, t), DType::U32, &Device::Cpu).unwrap();
    let kept = |lean: bool| {
        let _kernels = ops::force_lean(lean);
        let logits = model
            .forward(&ids, DType::F32, true)
            .unwrap()
            .logits()
            .unwrap();
        let mut seen = StorageSet::default();
        seen.add_all(model.vars().map(|v| v.as_tensor()));
        activation_bytes(&logits.sum_all().unwrap(), &mut seen)
    };
    let (fused, lean) = (kept(false), kept(true));
    let (n, layers, heads) = (b * t, s.model.layers, s.model.heads);
    let statistics = layers * (2 * 2 * n + heads * n) * 4 + 2 * n * 4;
    let token_rows = n * s.model.d_model * 4;
    assert_eq!(lean, fused + (statistics + token_rows) as u64);
}

/// One vector of values per parameter.
type PerParam = Vec<Vec<f32>>;

/// Weights, first and second moments after two AdamW steps on the same weights and gradients,
/// one way and the other.
fn adamw_after_two_steps(lean: bool, with_master: bool) -> (PerParam, PerParam, PerParam) {
    let model = Gpt::new(&accumulating().model, 3, &Device::Cpu).unwrap();
    let hyper = Hyper {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(&model.params, hyper).unwrap();
    if with_master {
        // What `set_offload` builds when the weights live on a GPU: state on the host beside
        // host copies of the master weights, updated there and copied back to the weights.
        opt.offloaded = true;
        opt.master = Some(
            model
                .params
                .iter()
                .map(|p| p.var.as_tensor().copy().unwrap())
                .collect(),
        );
    }
    let _kernels = ops::force_lean(lean);
    for seed in 0..2u64 {
        let grads: Vec<Tensor> = model
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let n = p.var.elem_count();
                let g: Vec<f32> = (0..n)
                    .map(|j| ((j * 31 + i * 7 + seed as usize * 13) % 17) as f32 / 17.0 - 0.5)
                    .collect();
                Tensor::from_vec(g, p.var.shape(), &Device::Cpu).unwrap()
            })
            .collect();
        opt.step(&model.params, &grads, 1e-2).unwrap();
    }
    let weights = model.params.iter().map(|p| flat(p.var.as_tensor()));
    (
        weights.collect(),
        opt.m.iter().map(flat).collect(),
        opt.v.iter().map(flat).collect(),
    )
}

#[test]
fn lean_adamw_matches_the_fused_kernel() {
    let fused = adamw_after_two_steps(false, false);
    for (name, other) in [
        ("lean", adamw_after_two_steps(true, false)),
        (
            "offload with host master copies",
            adamw_after_two_steps(false, true),
        ),
    ] {
        let parts = [("weights", &fused.0, &other.0), ("m", &fused.1, &other.1)];
        for (what, a, b) in parts.into_iter().chain([("v", &fused.2, &other.2)]) {
            for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
                let e = rel_diff(y, x);
                assert!(e < 1e-6, "{name}: {what} of parameter {i} differs by {e:e}");
            }
        }
    }
    // The weights moved: the comparison is not between two untouched copies.
    let start = Gpt::new(&accumulating().model, 3, &Device::Cpu).unwrap();
    let moved = rel_diff(&fused.0[2], &flat(start.params[2].var.as_tensor()));
    assert!(moved > 1e-3, "AdamW changed the weights by only {moved:e}");
}
