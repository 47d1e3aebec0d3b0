//! What activation checkpointing saves, measured by the ledger on CPU, and the estimator's
//! prediction of it. One test: the allocator counts every thread of the process.

use candle_core::Device;
use gaccwb::memory::estimate::{estimate, Config};
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::{Categories, MemoryEvent, Phase};
use gaccwb::train::Trainer;

fn four_layers(sets: &[&str]) -> Scenario {
    let mut s = Scenario::default();
    for a in [
        "model.d_model=64",
        "model.layers=4",
        "model.heads=2",
        "model.seq_len=64",
        "train.micro_batch=8",
        "train.eval_every=0",
    ]
    .iter()
    .chain(sets)
    {
        s.set(a).unwrap();
    }
    s
}

/// Memory events and step time of the second step (one-time allocations are behind it).
fn second_step(s: Scenario) -> (Vec<MemoryEvent>, f64, f64) {
    let mut t = Trainer::new(s, Device::Cpu).unwrap();
    t.train_step(|| true).ok().unwrap();
    t.memory.take_events();
    let step = t.train_step(|| true).ok().unwrap();
    (
        t.memory.take_events(),
        step.phase_ms.forward,
        step.phase_ms.backward,
    )
}

fn at(events: &[MemoryEvent], p: Phase) -> Categories {
    events.iter().find(|e| e.phase == p).unwrap().categories
}

#[test]
fn checkpointing_cuts_the_activations_and_the_estimator_follows() {
    let plain_s = four_layers(&[]);
    let ckpt_s = four_layers(&["train.checkpointing=\"blocks\""]);
    let (plain, pf, pb) = second_step(plain_s.clone());
    let (ckpt, cf, cb) = second_step(ckpt_s.clone());
    let (plain_bwd, ckpt_bwd) = (at(&plain, Phase::Backward), at(&ckpt, Phase::Backward));
    println!(
        "activations at the backward peak: none {} B, blocks {} B; forward+backward ms: none {pf:.1}+{pb:.1}, blocks {cf:.1}+{cb:.1}",
        plain_bwd.activations, ckpt_bwd.activations
    );

    // The per-block share of the plain graph, from the estimator's own split. Checkpointing
    // frees (L−1)/L of it, less what it keeps instead: the L segment outputs and, during the
    // recompute, the input's copy and the `y · grad` product (N·d·4 bytes each) and its sum.
    let cfg = Config::from_scenario(&plain_s, true);
    let no_blocks = Config {
        model: gaccwb::scenario::ModelConfig {
            layers: 0,
            ..cfg.model.clone()
        },
        ..cfg.clone()
    };
    let block_share = estimate(&cfg).forward.activations - estimate(&no_blocks).forward.activations;
    let (layers, nd4) = (4u64, 8 * 64 * 64 * 4u64);
    let floor = block_share * (layers - 1) / layers - (layers + 2) * nd4 - 4;
    let saved = plain_bwd.activations - ckpt_bwd.activations;
    println!("saved {saved} B of a {block_share} B block share (floor {floor} B)");
    assert!(saved >= floor, "saved {saved} B < {floor} B");

    let predicted = estimate(&Config::from_scenario(&ckpt_s, true));
    for (phase, want) in [
        (Phase::Forward, predicted.forward),
        (Phase::Backward, predicted.backward),
    ] {
        let got = at(&ckpt, phase);
        let error = (want.activations as f64 - got.activations as f64) / got.activations as f64;
        println!(
            "{phase:?} activations: measured {} estimate {} ({:+.2}%)",
            got.activations,
            want.activations,
            100.0 * error
        );
        assert!(error.abs() <= 0.05, "{phase:?}: {error:e}");
    }
}
