//! On a GPU with NCCL (`cargo test --features nccl --test gpu_nccl -- --include-ignored`): a world
//! of one runs its gradient sum through NCCL, what a one-GPU machine can check of the path that
//! CUDA ranks take (the communicator on Candle's stream, the all-reduce as a Candle op, the bucket
//! cut back into gradients). Ignored by default like `tests/gpu.rs`; run with
//! `--include-ignored`, a test fails when no CUDA device or no libnccl answers. CI compiles it;
//! `scripts/gpu-bundle.sh` packs it and `scripts/gpu-smoke.sh --prebuilt` runs it.
#![cfg(feature = "nccl")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::TINY;
use gaccwb::control::{Knobs, SyncEvery};
use gaccwb::data::Split;
use gaccwb::dist::{Collectives, Group};
use gaccwb::train::{window_gradients, Trainer};

/// `cuda:0` and a world of one on NCCL there; a test asked to run without them fails, naming why.
fn nccl_group(test: &str) -> (Device, Group) {
    let cuda =
        Device::new_cuda(0).unwrap_or_else(|e| panic!("{test}: no CUDA device answers: {e}"));
    let group = Group::solo_on_nccl(&cuda)
        .unwrap_or_else(|e| panic!("{test}: NCCL did not start on cuda:0: {e}"));
    assert_eq!(group.collectives(), Collectives::Nccl);
    (cuda, group)
}

fn bits(t: &Tensor) -> Vec<u32> {
    let flat = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
    flat.to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU and libnccl: cargo test --features nccl --test gpu_nccl -- --include-ignored"]
fn a_world_of_one_sums_tensors_through_nccl() {
    let (cuda, mut group) = nccl_group("a_world_of_one_sums_tensors_through_nccl");
    let f32s = Tensor::new(&[[1f32, -2.0, 3.5], [0.25, 8.0, -1.0]], &cuda).unwrap();
    let bf16s = Tensor::new(&[0.5f32, -4.0], &cuda)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let mut tensors = vec![f32s.clone(), bf16s.clone()];
    group.sum_tensors(&mut tensors, true).unwrap();
    // The sum over one rank is the tensor itself, in its shape, dtype and device.
    for (after, before) in tensors.iter().zip([&f32s, &bf16s]) {
        assert_eq!(after.dims(), before.dims());
        assert_eq!(after.dtype(), before.dtype());
        assert!(after.device().same_device(&cuda));
        assert_eq!(bits(after), bits(before));
    }
    let window = group.finish_window(SyncEvery::Window, 0);
    assert_eq!(window.per_rank[0].gradient_reduces, 1);
    // A tensor elsewhere than the communicator's device is refused, naming why.
    let mut on_cpu = vec![Tensor::new(&[1f32], &Device::Cpu).unwrap()];
    let err = group
        .sum_tensors(&mut on_cpu, true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("another device"), "{err}");
    println!("NCCL world of one on cuda:0: 8 values summed, f32 and bf16 kept bit for bit");
}

#[test]
#[ignore = "needs a CUDA GPU and libnccl: cargo test --features nccl --test gpu_nccl -- --include-ignored"]
fn a_window_of_gradients_crosses_nccl_unchanged() {
    let (cuda, mut group) = nccl_group("a_window_of_gradients_crosses_nccl_unchanged");
    let mut s = TINY.scenario();
    (s.train.micro_batch, s.train.accum_steps) = (2, 2);
    let trainer = Trainer::new(s.clone(), cuda.clone()).unwrap();
    let samples: Vec<_> = (0..4)
        .map(|i| trainer.corpus().sample(Split::Train, i))
        .collect();
    let knobs = Knobs::from_scenario(&s);
    let Ok(window) = window_gradients(trainer.model(), &samples, &knobs, 1.0, &cuda, || true)
    else {
        panic!("the window failed on cuda:0")
    };
    let mut summed = window.grads.clone();
    group.sum_tensors(&mut summed, true).unwrap();
    let values: usize = summed.iter().map(Tensor::elem_count).sum();
    for (after, before) in summed.iter().zip(&window.grads) {
        assert_eq!(bits(after), bits(before));
    }
    println!("NCCL world of one on cuda:0: a window's {values} gradient values, bit for bit");
}
