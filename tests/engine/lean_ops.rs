//! The lean ops (`ops::lean`, what every CUDA step runs, and the CPU under
//! `GACCWB_KERNELS=lean`) in a whole model: their gradients against the plain composite
//! expressions they replace, and what their graph keeps against what the estimator books; and
//! what the fused CPU ops keep in half precision.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::{TestModel, TINY};
use gaccwb::control::{Checkpointing, Dtype, Knobs};
use gaccwb::data::Split;
use gaccwb::memory::estimate::{activation_bytes, Config};
use gaccwb::ops;
use gaccwb::scenario::Scenario;
use gaccwb::train::{relative_error, window_gradients, Trainer};
use gaccwb_engine::tensors::{activation_bytes as graph_bytes, StorageSet};

/// TINY with sequences shorter than the model is wide, so no weight or `[B, T, d]` tensor has
/// the `[T, T]` shape of attention scores.
const SHORT: TestModel = TestModel {
    seq_len: 16,
    ..TINY
};

fn scenario(micro_batch: usize) -> Scenario {
    let mut s = SHORT.scenario();
    s.train.micro_batch = micro_batch;
    s.train.accum_steps = 1;
    s
}

/// Every parameter's gradient of one micro-batch, off the fused path: lean or plain.
fn gradients(s: &Scenario, dtype: Dtype, plain: bool) -> Vec<Tensor> {
    let t = Trainer::new(s.clone(), Device::Cpu).unwrap();
    let samples: Vec<_> = (0..s.train.micro_batch)
        .map(|i| t.corpus().sample(Split::Train, i as u64))
        .collect();
    let mut knobs = Knobs::from_scenario(s);
    knobs.dtype = dtype;
    let _lean = ops::force_lean(true);
    let _plain = ops::force_plain(plain);
    let w = window_gradients(t.model(), &samples, &knobs, 1.0, &Device::Cpu, || true);
    let Ok(w) = w else { panic!("window failed") };
    w.grads
}

fn names() -> Vec<String> {
    let t = Trainer::new(scenario(1), Device::Cpu).unwrap();
    t.model().params.iter().map(|p| p.name.clone()).collect()
}

#[test]
fn lean_gradients_match_the_plain_composite_ops_per_parameter() {
    let s = scenario(4);
    let (lean, plain) = (
        gradients(&s, Dtype::F32, false),
        gradients(&s, Dtype::F32, true),
    );
    for ((name, g), r) in names().iter().zip(&lean).zip(&plain) {
        let e = relative_error(std::slice::from_ref(g), std::slice::from_ref(r)).unwrap();
        assert!(e <= 1e-5, "{name}: lean gradient {e:e} off the plain one");
        let norm = g
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(norm > 0.0, "{name}: no gradient");
    }
}

#[test]
fn every_parameter_gets_a_finite_non_zero_gradient_in_half_precision() {
    let s = scenario(2);
    let reference = gradients(&s, Dtype::F32, true);
    // The precision tests' bounds per parameter tensor: bf16 2%, f16 0.5% (f16 unscaled here:
    // at this size no gradient underflows).
    for (dtype, bound) in [(Dtype::Bf16, 0.02), (Dtype::F16, 0.005)] {
        let lean = gradients(&s, dtype, false);
        for ((name, g), r) in names().iter().zip(&lean).zip(&reference) {
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                norm.is_finite() && norm > 0.0,
                "{dtype:?} {name}: gradient norm² {norm}"
            );
            let e = relative_error(std::slice::from_ref(g), std::slice::from_ref(r)).unwrap();
            assert!(
                e <= bound,
                "{dtype:?} {name}: {e:.3e} off f32 (bound {bound})"
            );
        }
    }
}

/// The graph one training forward keeps in `dtype`: its loss (scaled, as the trainer's), and the
/// storages the ledger counts apart (parameters, compute weights).
fn training_graph(s: &Scenario, dtype: DType) -> (Tensor, StorageSet) {
    let t = Trainer::new(s.clone(), Device::Cpu).unwrap();
    let (b, len) = (s.train.micro_batch, s.model.seq_len);
    let ids: Vec<u32> = (0..b * len)
        .map(|i| (i * 7 % s.model.vocab) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (b, len), &Device::Cpu).unwrap();
    let targets = ids.flatten_all().unwrap();
    let mask = Tensor::ones(b * len, DType::F32, &Device::Cpu).unwrap();
    let fwd = t
        .model()
        .forward_checkpointed(&ids, dtype, true, Checkpointing::None)
        .unwrap();
    let loss = fwd
        .nll_sum(&targets, &mask)
        .unwrap()
        .affine(0.5, 0.0)
        .unwrap();
    let mut seen = StorageSet::default();
    seen.add_all(t.model().vars().map(|v| v.as_tensor()));
    seen.add_all(&fwd.compute_weights);
    (loss, seen)
}

#[test]
fn the_lean_graph_keeps_no_score_tensor_and_exactly_what_the_estimator_books() {
    let t = SHORT.seq_len;
    // On the CPU half precision takes the fused ops unless the lean ones are forced.
    let _lean = ops::force_lean(true);
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for b in [1, 3] {
            let mut s = scenario(b);
            s.train.dtype = dtype;
            let (loss, mut seen) = training_graph(&s, dtype.candle());
            let squares: Vec<_> = loss
                .sorted_nodes()
                .into_iter()
                .filter(|n| n.rank() >= 2 && n.dims()[n.rank() - 2..] == [t, t])
                .map(|n| n.dims().to_vec())
                .collect();
            assert!(squares.is_empty(), "{dtype:?}: T×T nodes kept: {squares:?}");
            let kept = graph_bytes(&loss, &mut seen);
            // A device apart from the host: the lean ops' booking.
            let booked = activation_bytes(&Config::from_scenario(&s, false).unwrap());
            assert_eq!(
                kept, booked,
                "{dtype:?} B={b}: graph keeps {kept}, estimate {booked}"
            );
        }
    }
}

#[test]
fn the_fused_half_graph_halves_all_but_the_f32_stream_and_keeps_what_the_estimator_books() {
    let mut s = scenario(3);
    // Elements of one [N, D] tensor (B = 3).
    let nd = (3 * SHORT.seq_len * SHORT.d_model) as u64;
    let steps = 2 * SHORT.layers as u64;
    let (f32_loss, mut seen) = training_graph(&s, DType::F32);
    // Less the f32 logits the head keeps for its backward where its products run on `gemm`
    // (f32, f16, bf16 without bf16 tiles); on bf16 tiles it makes them again.
    let logits =
        |on_tiles| ops::fused::head_kept(3 * SHORT.seq_len, SHORT.vocab, on_tiles) as u64 * 4;
    assert!(logits(false) > 0);
    let f32_kept = graph_bytes(&f32_loss, &mut seen) - logits(false);
    let tiles = ops::fused::bf16_kernel() != ops::fused::Bf16Kernel::Gemm;
    for (dtype, on_tiles) in [(Dtype::Bf16, tiles), (Dtype::F16, false)] {
        s.train.dtype = dtype;
        let (loss, mut seen) = training_graph(&s, dtype.candle());
        let all = graph_bytes(&loss, &mut seen);
        let kept = all - logits(on_tiles);
        let booked = activation_bytes(&Config::from_scenario(&s, true).unwrap());
        assert_eq!(
            all, booked,
            "{dtype:?}: graph keeps {all}, estimate {booked}"
        );
        // Every kept tensor in 2 bytes instead of 4 but the loss's two f32 scalars and the
        // residual stream: the embedding's output and each residual step's stay in f32, and the
        // stream adds one copy, the last step's narrowed (2 bytes).
        let stream = (steps + 1) * nd * 4;
        assert_eq!(
            kept - 8,
            (f32_kept - 8 - stream) / 2 + stream + nd * 2,
            "{dtype:?}: {kept} vs f32 {f32_kept}"
        );
    }
}
