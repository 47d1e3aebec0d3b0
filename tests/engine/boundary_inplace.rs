//! The boundary scales gradients where they lie and measures the pitfall's error without a
//! gradient-sized copy (`train::inplace`).

use candle_core::{Device, Tensor};
use gaccwb::train::{relative_error, scale_in_place};

use crate::common;

use common::TINY;

fn tensors(values: &[&[f32]]) -> Vec<Tensor> {
    values
        .iter()
        .map(|v| Tensor::new(*v, &Device::Cpu).unwrap())
        .collect()
}

fn values(ts: &[Tensor]) -> Vec<Vec<f32>> {
    ts.iter().map(|t| t.to_vec1().unwrap()).collect()
}

#[test]
fn scaling_keeps_the_storage_and_multiplies_once() {
    let mut grads = tensors(&[&[1.0, -2.0], &[4.0]]);
    let shared = grads[0].clone();
    grads.push(shared.clone());
    let before: Vec<usize> = grads.iter().map(storage_key).collect();
    scale_in_place(&mut grads, 0.5).unwrap();
    assert_eq!(
        values(&grads),
        vec![vec![0.5, -1.0], vec![2.0], vec![0.5, -1.0]]
    );
    assert_eq!(storage_key(&grads[0]), before[0], "scaled where it lies");
    assert_eq!(storage_key(&grads[1]), before[1]);
    assert_ne!(
        storage_key(&grads[2]),
        before[2],
        "the duplicate got its own"
    );
}

#[test]
fn other_dtypes_are_scaled_by_copy() {
    let mut grads = vec![Tensor::new(&[2.0f64, 6.0], &Device::Cpu).unwrap()];
    scale_in_place(&mut grads, 0.5).unwrap();
    assert_eq!(grads[0].to_vec1::<f64>().unwrap(), vec![1.0, 3.0]);
}

#[test]
fn relative_error_matches_the_definition_on_both_paths() {
    let a = tensors(&[&[1.0, 2.0], &[3.0]]);
    let r = tensors(&[&[1.0, 1.0], &[1.0]]);
    let expected = (0f64 + 1.0 + 4.0).sqrt() / 3f64.sqrt();
    assert!((relative_error(&a, &r).unwrap() - expected).abs() < 1e-12);
    let wide = |ts: &[Tensor]| -> Vec<Tensor> {
        ts.iter()
            .map(|t| t.to_dtype(candle_core::DType::F64).unwrap())
            .collect()
    };
    let composite = relative_error(&wide(&a), &wide(&r)).unwrap();
    assert!((composite - expected).abs() < 1e-6);
}

fn storage_key(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    &*storage as *const candle_core::Storage as usize
}

#[test]
fn the_estimator_names_the_copies_only_where_the_boundary_makes_them() {
    use gaccwb::memory::estimate::{estimate, Config};
    let mut s = TINY.scenario();
    s.set("train.dtype=f16").unwrap();
    s.set("train.offload=true").unwrap();
    let (v, d) = (s.model.vocab as u64, s.model.d_model as u64);
    let largest = (v * d).max(4 * d * d) * 4;
    let cpu = estimate(&Config::from_scenario(&s, true).unwrap());
    assert_eq!(cpu.optimizer.gradients_transient, 0, "CPU: in place");
    assert_eq!(
        cpu.optimizer.offloaded, cpu.step.offloaded,
        "CPU: no host copy"
    );
    let gpu = estimate(&Config::from_scenario(&s, false).unwrap());
    assert_eq!(gpu.optimizer.gradients_transient, largest);
    // The gradient copied to the host, and the updated weight's f16 cast on its way back.
    assert_eq!(
        gpu.optimizer.offloaded,
        gpu.step.offloaded + largest + largest / 2
    );
    s.set("train.dtype=f32").unwrap();
    s.train.clip = None;
    let unscaled = estimate(&Config::from_scenario(&s, false).unwrap());
    assert_eq!(
        unscaled.optimizer.gradients_transient, 0,
        "nothing to scale"
    );
}
