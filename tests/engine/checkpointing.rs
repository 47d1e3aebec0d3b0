//! Activation checkpointing changes what the forward keeps, not the gradients.

use crate::common;

use candle_core::{Device, Tensor};
use common::{TestModel, TINY};
use gaccwb::control::{Checkpointing, Dtype, Knobs};
use gaccwb::data::{Sample, Split};
use gaccwb::ops;
use gaccwb::train::{relative_error, window_gradients, Trainer};

fn trainer() -> Trainer {
    // Four blocks: `every-2` makes two segments and `every-3` a full one and a short one.
    let mut s = TestModel { layers: 4, ..TINY }.scenario();
    s.data.min_doc_len = 4;
    Trainer::new(s, Device::Cpu).unwrap()
}

/// The gradients of one window of 4 samples in 2 micro-batches.
fn grads(t: &Trainer, dtype: Dtype, checkpointing: Checkpointing) -> Vec<Tensor> {
    let samples: Vec<Sample> = (0..4).map(|i| t.corpus().sample(Split::Train, i)).collect();
    let knobs = Knobs {
        micro_batch: 2,
        dtype,
        checkpointing,
        ..Knobs::from_scenario(t.scenario())
    };
    match window_gradients(t.model(), &samples, &knobs, 1.0, &Device::Cpu, || true) {
        Ok(w) => w.grads,
        Err(_) => panic!("window failed"),
    }
}

fn bits(g: &[Tensor]) -> Vec<Vec<u32>> {
    g.iter()
        .map(|t| {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.into_iter().map(f32::to_bits).collect()
        })
        .collect()
}

fn max_relative_error(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| relative_error(std::slice::from_ref(x), std::slice::from_ref(y)).unwrap())
        .fold(0.0, f64::max)
}

#[test]
fn fused_path_gradients_are_bit_identical() {
    let t = trainer();
    let plain = grads(&t, Dtype::F32, Checkpointing::None);
    for ckpt in [
        Checkpointing::Blocks,
        Checkpointing::Every(2),
        Checkpointing::Every(3),
    ] {
        let recomputed = grads(&t, Dtype::F32, ckpt);
        assert_eq!(recomputed.len(), plain.len());
        assert!(
            bits(&recomputed) == bits(&plain),
            "{}: max relative error {:e}",
            ckpt.name(),
            max_relative_error(&recomputed, &plain)
        );
    }
}

#[test]
fn half_precision_gradients_agree_on_the_fused_and_the_lean_path() {
    let t = trainer();
    for lean in [false, true] {
        let _kernels = ops::force_lean(lean);
        for dtype in [Dtype::Bf16, Dtype::F16] {
            let plain = grads(&t, dtype, Checkpointing::None);
            let recomputed = grads(&t, dtype, Checkpointing::Blocks);
            let err = max_relative_error(&recomputed, &plain);
            println!("{dtype:?}, lean {lean}: max relative error {err:e}");
            assert!(err <= 1e-5, "{dtype:?}, lean {lean}: {err:e} > 1e-5");
        }
    }
}

#[test]
fn checkpointing_parses_and_rejects_bad_values() {
    for (text, want) in [
        ("none", Checkpointing::None),
        ("blocks", Checkpointing::Blocks),
        ("every-2", Checkpointing::Every(2)),
    ] {
        assert_eq!(Checkpointing::try_from(text.to_string()), Ok(want));
        assert_eq!(want.name(), text);
    }
    for bad in ["every-0", "every-x", "block"] {
        let err = Checkpointing::try_from(bad.to_string()).unwrap_err();
        assert!(err.to_string().contains("every-N"), "{err}");
    }
}

#[test]
fn checkpointed_blocks_leave_the_loss_graph() {
    // The loss's own backward reaches only the embeddings, final norm and head; the blocks'
    // gradients come from the recompute.
    let t = trainer();
    let samples: Vec<Sample> = (0..2).map(|i| t.corpus().sample(Split::Train, i)).collect();
    let batch = gaccwb::data::Batch::new(&samples, &Device::Cpu).unwrap();
    let fwd = t
        .model()
        .forward_checkpointed(
            &batch.inputs,
            candle_core::DType::F32,
            true,
            Checkpointing::Blocks,
        )
        .unwrap();
    let loss = fwd.logits().unwrap().sqr().unwrap().sum_all().unwrap();
    let store = loss.backward().unwrap();
    let block_var = &t.model().blocks[1].attn_in[0].w;
    assert!(store.get(block_var.as_tensor()).is_none());
    // The embedding's gradient is added beside the graph on the fused CPU ops.
    assert!(fwd
        .recomputed
        .get(&store, &t.model().embed)
        .unwrap()
        .is_some());
    assert_eq!(fwd.recomputed.tensors().len(), 4 * 12);
    assert!(fwd.recomputed.get(&store, block_var).unwrap().is_some());
}
