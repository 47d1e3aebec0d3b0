//! The memory ledger measured on CPU with tiny models: the physics holds, the accounting closes,
//! and the analytic estimator agrees with what was measured.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use gaccwb::memory::estimate::{estimate, grad_store_bytes, head_bytes, Config};
use gaccwb::memory::TotalMeter;
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::{Categories, MemoryEvent, MemorySource, Phase};
use gaccwb::control::Control;
use gaccwb::train::Trainer;

use crate::common;

use common::{TestModel, TINY};

/// The allocator counts every thread of the process, so the checks run one after another in a
/// single test: another test thread allocating (a panic's backtrace is tens of MiB) would land in
/// the figures being checked.
#[test]
fn memory_ledger_physics_and_accounting() {
    let _serial = crate::serial();
    common::ledger::on_measuring_thread(|| {
        activations_scale_linearly_with_the_micro_batch();
        gradients_and_optimizer_state_do_not_depend_on_k_or_b();
        smaller_micro_batch_at_the_same_effective_batch_lowers_the_peak();
        parameters_are_the_parameter_count_times_four_bytes();
        other_is_the_matmul_workspace_within_five_percent_at_the_default_presets_backward_peak();
        the_estimator_is_within_ten_percent_of_measured_for_every_category();
        offload_moves_the_moments_out_of_optimizer_state();
        a_device_meter_keeps_offloaded_bytes_out_of_the_device_total();
        the_store_less_what_the_backward_freed_floors_the_transient_gradients();
    });
}

/// [`TINY`] at the byte vocabulary docs/MEMORY.md's figures were measured at.
const BYTES: TestModel = TestModel { vocab: 256, ..TINY };

fn tiny(b: usize, k: usize, sets: &[&str]) -> Scenario {
    let mut s = BYTES.scenario();
    s.set(&format!("train.micro_batch={b}")).unwrap();
    s.set(&format!("train.accum_steps={k}")).unwrap();
    for a in sets {
        s.set(a).unwrap();
    }
    s
}

/// A trainer that has taken one step (so one-time allocations are behind it), its fused ops on
/// its own thread (`common::ledger::serial_trainer`).
fn warm_trainer(s: Scenario) -> Trainer {
    let mut t = common::ledger::serial_trainer(s);
    t.train_step(|| true).ok().unwrap();
    t.take_memory_events();
    t
}

/// The memory events of one more step.
fn step(t: &mut Trainer) -> Vec<MemoryEvent> {
    t.train_step(|| true).ok().unwrap();
    t.take_memory_events()
}

/// Memory events of the second step of `s`.
fn measure(s: Scenario) -> Vec<MemoryEvent> {
    let mut t = warm_trainer(s);
    step(&mut t)
}

fn at(events: &[MemoryEvent], p: Phase) -> MemoryEvent {
    events.iter().find(|e| e.phase == p).cloned().unwrap()
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn activations_scale_linearly_with_the_micro_batch() {
    let small = at(&measure(tiny(4, 1, &[])), Phase::Backward).categories;
    let large = at(&measure(tiny(32, 1, &[])), Phase::Backward).categories;
    let ratio = large.activations as f64 / small.activations as f64;
    println!(
        "activations B=4 {} B, B=32 {} B, ratio {ratio:.3}",
        small.activations, large.activations
    );
    assert!((ratio - 8.0).abs() <= 0.2 * 8.0, "ratio {ratio}");
}

fn gradients_and_optimizer_state_do_not_depend_on_k_or_b() {
    let runs: Vec<Vec<MemoryEvent>> = [(4, 1), (32, 1), (4, 8)]
        .iter()
        .map(|&(b, k)| measure(tiny(b, k, &[])))
        .collect();
    let opt: Vec<Categories> = runs
        .iter()
        .map(|r| at(r, Phase::Optimizer).categories)
        .collect();
    for c in &opt {
        assert_eq!(c.gradients, opt[0].gradients);
        assert_eq!(c.gradients, c.parameters, "one f32 gradient per parameter");
    }
    for run in &runs {
        for e in run {
            assert_eq!(e.categories.optimizer_state, 2 * e.categories.parameters);
        }
    }
}

fn smaller_micro_batch_at_the_same_effective_batch_lowers_the_peak() {
    let big = measure(tiny(32, 1, &[]));
    let small = measure(tiny(4, 8, &[]));
    let (pb, ps) = (at(&big, Phase::Step).peak, at(&small, Phase::Step).peak);
    let (bb, bs) = (
        at(&big, Phase::Backward).categories,
        at(&small, Phase::Backward).categories,
    );
    let d_peak = pb as f64 - ps as f64;
    let d_act = bb.activations as f64 - bs.activations as f64;
    let d_transient = bb.gradients_transient as f64 - bs.gradients_transient as f64;
    let d_buffer = bb.gradients as f64 - bs.gradients as f64;
    let explained = d_act + d_transient + d_buffer;
    println!(
        "peak B=32,K=1 {:.2} MiB → B=4,K=8 {:.2} MiB: Δpeak {:.2} MiB = Δactivations {:.2} + \
         Δtransient gradients {:.2} + Δbuffer {:.2} (sum {:.2})",
        mib(pb),
        mib(ps),
        d_peak / 1048576.0,
        d_act / 1048576.0,
        d_transient / 1048576.0,
        d_buffer / 1048576.0,
        explained / 1048576.0
    );
    assert!(
        d_peak >= d_act,
        "the peak falls by at least the activations"
    );
    assert!(
        (d_peak - explained).abs() <= 0.05 * d_peak,
        "Δpeak {d_peak} vs categories {explained}"
    );
}

fn parameters_are_the_parameter_count_times_four_bytes() {
    let mut t = warm_trainer(tiny(4, 2, &[]));
    let expected = t.model().param_count() * 4;
    for e in step(&mut t) {
        assert_eq!(e.categories.parameters, expected, "{:?}", e.phase);
    }
}

/// Accounting closes: what no category explains is `gemm`'s per-thread packing workspace, which
/// the estimator predicts (cache size × threads), give or take 5% of the measured total.
fn other_is_the_matmul_workspace_within_five_percent_at_the_default_presets_backward_peak() {
    let s = default_preset();
    let workspace = Config::from_scenario(&s, true).unwrap().workspace;
    let e = at(&measure(s), Phase::Backward);
    let other = e.categories.other;
    let unexplained = (other as f64 - workspace as f64).abs() / e.peak as f64;
    println!(
        "default preset backward peak {:.2} MiB, other {:.2} MiB = {:.2}%, of which matmul \
         workspace {:.2} MiB; unexplained {:.2}%",
        mib(e.peak),
        mib(other),
        100.0 * other as f64 / e.peak as f64,
        mib(workspace),
        100.0 * unexplained
    );
    assert_eq!(e.source, MemorySource::Allocator);
    assert!(
        unexplained <= 0.05,
        "other {other} vs workspace {workspace}"
    );
}

fn the_estimator_is_within_ten_percent_of_measured_for_every_category() {
    let configs = [
        ("f32 B=4 K=1", tiny(4, 1, &[])),
        ("f32 B=8 K=4", tiny(8, 4, &[])),
        ("bf16 B=4 K=2", tiny(4, 2, &["train.dtype=bf16"])),
        ("f32 B=16 K=2 offload", tiny(16, 2, &["train.offload=true"])),
        ("default preset", default_preset()),
        // Real text at an 8k BPE vocabulary: the head, logits and their gradient dominate.
        (
            "f32 B=4 K=2 BPE 8192",
            tiny(
                4,
                2,
                &["data.source=docs", "data.tokenizer=bpe", "data.vocab=8192"],
            ),
        ),
        (
            "bf16 B=2 K=2 BPE 8192",
            tiny(
                2,
                2,
                &[
                    "data.source=docs",
                    "data.tokenizer=bpe",
                    "data.vocab=8192",
                    "train.dtype=bf16",
                ],
            ),
        ),
    ];
    println!(
        "{:<22}{:<10}{:<22}{:>12}{:>12}{:>8}",
        "config", "phase", "category", "measured", "estimate", "error"
    );
    for (name, s) in configs {
        let mut t = warm_trainer(s);
        // From the trainer's scenario: a tokenizer sets the vocabulary when the data opens.
        let cfg = common::ledger::serial_config(t.scenario());
        let predicted = estimate(&cfg);
        let head = head_bytes(&cfg);
        println!(
            "{name}: V={} head (logits, loss and their gradient at backward's start) {head} bytes = {:.1}% of the backward's predicted total",
            cfg.model.vocab,
            100.0 * head as f64 / predicted.resident(&predicted.backward) as f64
        );
        let measured = step(&mut t);
        assert_eq!(
            t.memory().last_store_bytes,
            grad_store_bytes(&cfg),
            "{name}: gradient store"
        );
        for (phase, estimated) in predicted.phases() {
            let got = at(&measured, phase).categories;
            let pairs = got.values().into_iter().zip(estimated.values());
            for (category, (m, e)) in Categories::NAMES.iter().zip(pairs).take(7) {
                let error = if m == 0 && e == 0 {
                    0.0
                } else {
                    (e as f64 - m as f64) / m.max(1) as f64
                };
                if m != 0 || e != 0 {
                    println!(
                        "{name:<22}{:<10}{category:<22}{m:>12}{e:>12}{:>7.2}%",
                        format!("{phase:?}"),
                        100.0 * error
                    );
                }
                assert!(
                    error.abs() <= 0.10,
                    "{name} {phase:?} {category}: {m} vs {e}"
                );
            }
        }
    }
}

/// The default preset, whose backward peaks in block 0's MLP rather than at the loss head.
fn default_preset() -> Scenario {
    let mut s = gaccwb::presets::resolve("baseline").unwrap();
    s.set("train.eval_every=0").unwrap();
    s
}

fn offload_moves_the_moments_out_of_optimizer_state() {
    let mut t = warm_trainer(tiny(4, 1, &[]));
    let off = at(&step(&mut t), Phase::Step).categories;
    assert!(off.optimizer_state > 0);
    assert_eq!(off.offloaded, 0);
    t.apply_control(&Control::SetOffload { value: true })
        .unwrap();
    let on = at(&step(&mut t), Phase::Step).categories;
    assert_eq!(on.optimizer_state, 0);
    assert_eq!(
        on.offloaded, off.optimizer_state,
        "CPU: moments only, no master copy"
    );
    t.apply_control(&Control::SetOffload { value: false })
        .unwrap();
    let back = at(&step(&mut t), Phase::Step).categories;
    assert_eq!(
        (back.optimizer_state, back.offloaded),
        (off.optimizer_state, 0)
    );
}

/// A device-style meter (separate memory, scripted figures) in place of the allocator.
struct FakeMeter {
    live: Arc<AtomicU64>,
    peak: Arc<AtomicU64>,
}

impl TotalMeter for FakeMeter {
    fn source(&self) -> MemorySource {
        MemorySource::CudaPool
    }
    fn unified(&self) -> bool {
        false
    }
    fn live(&self) -> u64 {
        self.live.load(Relaxed)
    }
    fn peak(&self) -> u64 {
        self.peak.load(Relaxed)
    }
    fn reset_peak(&self) {}
}

fn a_device_meter_keeps_offloaded_bytes_out_of_the_device_total() {
    let mut t = warm_trainer(tiny(4, 1, &["train.offload=true"]));
    let (live, peak) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    t.measure_with(Box::new(FakeMeter {
        live: live.clone(),
        peak: peak.clone(),
    }));
    let device_bytes = 50 << 20;
    live.store(device_bytes, Relaxed);
    peak.store(device_bytes, Relaxed);
    let events = step(&mut t);
    let s = at(&events, Phase::Step);
    assert_eq!(s.source, MemorySource::CudaPool);
    assert!(!s.unified);
    assert!(s.categories.offloaded > 0);
    let on_device = s.categories.sum() - s.categories.offloaded - s.categories.other;
    assert_eq!(s.categories.other, device_bytes - on_device);
}

/// Under a meter that reads no growth the store is all a backward is known to add, less what it
/// freed of the activations: the logits the f32 head kept, freed after the head's backward (the
/// categories would otherwise add up to more than the peak).
fn the_store_less_what_the_backward_freed_floors_the_transient_gradients() {
    let mut t = warm_trainer(tiny(4, 1, &[]));
    let cfg = Config::from_scenario(t.scenario(), true).unwrap();
    let rows = cfg.micro_batch * cfg.model.seq_len;
    let logits = gaccwb::ops::fused::head_kept(rows, cfg.model.vocab, false) as u64 * 4;
    assert!(logits > 0, "the f32 head keeps its logits");
    let (live, peak) = (Arc::new(AtomicU64::new(50 << 20)), Arc::new(AtomicU64::new(50 << 20)));
    t.measure_with(Box::new(FakeMeter { live, peak }));
    let b = at(&step(&mut t), Phase::Backward).categories;
    assert_eq!(b.gradients_transient, t.memory().last_store_bytes - logits);
}
