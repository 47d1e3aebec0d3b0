//! ZeRO-Offload in half precision (`train::offload`): the device keeps only compute-dtype weights,
//! the f32 master weights and AdamW's moments live in host memory, and gradients accumulate on
//! the device or on the host (`train.offload_grads`). On the CPU host and device are one memory,
//! so these tests check the arithmetic, the bytes counted and the ledger's books, not a bus.

use crate::common;

use candle_core::{DType, Device};
use common::{step, TINY};
use gaccwb::control::Control;
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::{Categories, Phase, StepEvent};
use gaccwb::train::Trainer;

const K: usize = 3;

/// A tiny run at B=2, K=3 in `dtype`, offload off (`None`) or on with the gradients
/// accumulating on `Some("device" | "host")`.
fn scenario(dtype: &str, offload: Option<&str>) -> Scenario {
    let mut s = TINY.scenario();
    s.train.micro_batch = 2;
    s.train.accum_steps = K;
    s.train.warmup = 2;
    s.set(&format!("train.dtype={dtype}")).unwrap();
    s.set(&format!("train.offload={}", offload.is_some()))
        .unwrap();
    if let Some(grads) = offload {
        s.set(&format!("train.offload_grads={grads}")).unwrap();
    }
    s
}

/// The f32 master weights, flattened per parameter.
fn masters(t: &Trainer) -> Vec<Vec<f32>> {
    t.master_weights()
        .iter()
        .map(|w| w.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

fn run(s: Scenario, steps: usize) -> (Trainer, Vec<StepEvent>) {
    let mut t = Trainer::new(s, Device::Cpu).unwrap();
    let events = (0..steps).map(|_| step(&mut t)).collect();
    (t, events)
}

#[test]
fn offload_in_half_precision_keeps_half_weights_on_the_device_and_trains_the_same_bits() {
    for dtype in ["bf16", "f16", "f32"] {
        let (plain, plain_steps) = run(scenario(dtype, None), 4);
        for grads in ["device", "host"] {
            let (off, steps) = run(scenario(dtype, Some(grads)), 4);
            let device_weights = off.model().params[0].var.dtype();
            let expected = if dtype == "f32" {
                DType::F32
            } else {
                off.knobs().dtype.candle()
            };
            assert_eq!(device_weights, expected, "{dtype} {grads}");
            if dtype != "f32" {
                let master = off
                    .optimizer()
                    .master
                    .as_ref()
                    .expect("host master weights");
                assert!(master.iter().all(|w| w.dtype() == DType::F32));
            }
            // A half-precision gradient cast to f32 is exact and the host update is the same
            // fused AdamW: every placement accumulates and applies the same values.
            let same = masters(&plain) == masters(&off);
            assert!(same, "{dtype} grads on {grads}: master weights differ");
            for (a, b) in plain_steps.iter().zip(&steps) {
                assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{dtype} {grads}");
            }
        }
    }
}

#[test]
fn toggling_offload_in_bf16_moves_the_weights_and_changes_no_arithmetic() {
    let mut plain = Trainer::new(scenario("bf16", None), Device::Cpu).unwrap();
    let mut toggled = Trainer::new(scenario("bf16", None), Device::Cpu).unwrap();
    for i in 0..6 {
        if matches!(i, 1 | 3 | 4) {
            let on = !toggled.knobs().offload;
            toggled
                .apply_control(&Control::SetOffload { value: on })
                .unwrap();
            let want = if on { DType::BF16 } else { DType::F32 };
            assert_eq!(toggled.model().params[0].var.dtype(), want, "step {i}");
        }
        let (a, b) = (step(&mut plain), step(&mut toggled));
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {i}");
    }
    // Switching the dtype while offloaded recasts the device's weights from the master.
    toggled
        .apply_control(&Control::SetDtype {
            value: gaccwb::control::Dtype::F16,
        })
        .unwrap();
    assert_eq!(toggled.model().params[0].var.dtype(), DType::F16);
    assert!(
        masters(&plain) == masters(&toggled),
        "master weights differ"
    );
}

#[test]
fn bytes_crossing_per_step_follow_the_payload_rule() {
    for dtype in ["bf16", "f32"] {
        let (t, _) = run(scenario(dtype, None), 1);
        let p = t.model().param_count();
        let c = if dtype == "f32" { 4 } else { 2 };
        let plain = step_bytes(scenario(dtype, None));
        let device = step_bytes(scenario(dtype, Some("device")));
        let host = step_bytes(scenario(dtype, Some("host")));
        assert_eq!(plain, 0, "{dtype}: nothing crosses without offload");
        // Once per window: the f32 buffer to the host, the updated weights back.
        assert_eq!(device, 4 * p + c * p, "{dtype} device");
        // Once per micro-batch: each backward's gradients (in the weights' dtype) to the host.
        assert_eq!(host, K as u64 * c * p + c * p, "{dtype} host");
    }
}

fn step_bytes(s: Scenario) -> u64 {
    let (_, steps) = run(s, 2);
    assert_eq!(steps[0].host_device_bytes, steps[1].host_device_bytes);
    steps[1].host_device_bytes
}

/// The categories of the second step's `phase` event.
fn ledger(s: Scenario, phase: Phase) -> (u64, Categories) {
    let mut t = Trainer::new(s, Device::Cpu).unwrap();
    step(&mut t);
    t.take_memory_events();
    step(&mut t);
    let events = t.take_memory_events();
    let e = events.iter().find(|e| e.phase == phase).unwrap();
    (t.model().param_count(), e.categories)
}

/// The buffer a phase may hold: none after the step; at the optimizer step the whole window's;
/// the forward event is the micro-step with the highest peak, which other tests' threads can
/// move to the first micro-batch, before any buffer exists.
fn buffer_may_be(phase: Phase, p: u64, bytes: u64) -> bool {
    match phase {
        Phase::Step => bytes == 0,
        Phase::Optimizer => bytes == 4 * p,
        _ => bytes == 0 || bytes == 4 * p,
    }
}

#[test]
fn the_ledger_books_each_byte_where_it_lives() {
    for phase in [Phase::Forward, Phase::Optimizer, Phase::Step] {
        // Half precision offloaded, gradients on the device: bf16 weights there, the f32 buffer
        // there, the master weights and both moments in host memory.
        let (p, c) = ledger(scenario("bf16", Some("device")), phase);
        assert_eq!(c.parameters, 0, "{phase:?}");
        assert_eq!(c.compute_weights, 2 * p, "{phase:?}");
        assert!(buffer_may_be(phase, p, c.gradients), "{phase:?} {c:?}");
        assert_eq!(c.optimizer_state, 0, "{phase:?}");
        assert_eq!(c.offloaded, 12 * p, "{phase:?}");
        // Gradients on the host: no buffer on the device, its bytes with the offloaded ones.
        let (_, h) = ledger(scenario("bf16", Some("host")), phase);
        assert_eq!(
            (h.parameters, h.compute_weights, h.gradients),
            (0, 2 * p, 0),
            "{phase:?}"
        );
        assert!(h.offloaded >= 12 * p, "{phase:?} {h:?}");
        assert!(
            buffer_may_be(phase, p, h.offloaded - 12 * p),
            "{phase:?} {h:?}"
        );
        // Without offload: f32 weights and moments on the device.
        let (_, o) = ledger(scenario("bf16", None), phase);
        assert_eq!(
            (o.parameters, o.optimizer_state, o.offloaded),
            (4 * p, 8 * p, 0),
            "{phase:?}"
        );
        assert!(buffer_may_be(phase, p, o.gradients), "{phase:?} {o:?}");
    }
}
