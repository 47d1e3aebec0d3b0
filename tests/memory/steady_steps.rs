//! What a step leaves for the next. From the third step on (the first two take the one-time
//! allocations: AdamW's moments, the gradient buffer, `gemm`'s slab), every step of every family
//! closes each phase holding the same bytes at the same peak, to the byte, on the lean ops (what
//! a CUDA step runs) and on the fused ones run on the trainer's thread, and ends holding what the
//! step before it ended with. On the fused ops' pool it ends holding the same bytes too; its
//! peaks are not compared there, as a worker packs beside the trainer's thread only when the
//! scheduler runs it in time (`common::ledger::serial_trainer`).
//! A caching allocator, such as the stream-ordered pool Candle's CUDA tensors come from, then
//! serves each step from the blocks the step before it freed. A step that kept anything (a graph
//! held past its step, a cache keyed by the step) grows the live bytes every step and fails here.

use candle_core::Device;
use gaccwb::memory::alloc;
use gaccwb::telemetry::Phase;
use gaccwb::train::Trainer;

use crate::common;

use common::ledger::{on_measuring_thread, with_one_rayon_thread, FamilyPoint, FIXTURES};

/// Steps run per point; the first two are not compared.
const STEPS: usize = 6;

/// A phase's peak and the bytes held when it closed.
#[derive(Debug)]
struct Held {
    phase: Phase,
    peak: u64,
    closing: u64,
}

/// One step's figures: each phase's (forward, backward, optimizer, the step's end), then the
/// bytes the process holds once the step has returned. Held in place, not on the heap: the
/// figures of earlier steps are part of what a later step's count sees.
type Figures = ([Held; 4], u64);

/// Every family × f32 and bf16 × the lean and the fused ops at B = 2, K = 2; then a Llama with
/// grouped-query attention under block checkpointing and under LoRA with dropout (its masks are
/// drawn again in every pass).
fn points() -> Vec<FamilyPoint> {
    let families = std::iter::once(None).chain(FIXTURES.iter().copied().map(Some));
    let mut points = Vec::new();
    for family in families {
        for dtype in ["f32", "bf16"] {
            for lean in [true, false] {
                points.push(point(family, dtype, lean));
            }
        }
    }
    for lean in [true, false] {
        let mut blocks = point(Some("llama-gqa-llama3"), "bf16", lean);
        blocks.checkpointing = "blocks";
        let mut lora = point(Some("llama-gqa-llama3"), "f32", lean);
        lora.lora = Some(&[]);
        lora.dropout = 0.1;
        points.extend([blocks, lora]);
    }
    points
}

fn point(family: Option<&'static str>, dtype: &'static str, lean: bool) -> FamilyPoint {
    FamilyPoint {
        family,
        dtype,
        checkpointing: "none",
        lean,
        micro_batch: 2,
        accum_steps: 2,
        lora: None,
        dropout: 0.0,
    }
}

/// The figures of `STEPS` steps of `point`; its fused ops on the CPU pool when `pool`, else on
/// the trainer's thread.
fn figures(point: &FamilyPoint, pool: bool) -> Vec<Figures> {
    let mut t = Trainer::new(point.scenario(), Device::Cpu).unwrap();
    t.force_lean_ops(point.lean);
    t.force_serial_ops(!pool);
    let mut steps = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        t.train_step(|| true).ok().unwrap();
        let events = t.take_memory_events();
        let live = alloc::live();
        let phases: Vec<_> = events
            .iter()
            .map(|e| Held {
                phase: e.phase,
                peak: e.peak,
                closing: e.total,
            })
            .collect();
        let phases = phases.try_into().expect("one memory event per phase");
        steps.push((phases, live));
    }
    steps
}

/// Why `step` differs from the step the comparison settled on, if it does: in the bytes held
/// after it, and unless `pool`, in any phase's peak or closing bytes.
fn moved(settled: &Figures, step: &Figures, pool: bool) -> Option<String> {
    let phases = settled.0.iter().zip(&step.0).all(|(was, now)| {
        was.phase == now.phase && (pool || (was.closing == now.closing && was.peak == now.peak))
    });
    let same = settled.1 == step.1 && phases;
    (!same).then(|| format!("{step:?} against {settled:?}"))
}

#[test]
fn every_step_from_the_third_asks_for_and_keeps_the_bytes_of_the_one_before() {
    let _serial = crate::serial();
    let failures = with_one_rayon_thread(|| {
        on_measuring_thread(|| {
            let mut failures = Vec::new();
            for point in points() {
                // The lean ops do not use the pool.
                let ways: &[bool] = if point.lean { &[false] } else { &[false, true] };
                for &pool in ways {
                    let steps = figures(&point, pool);
                    let (settled, later) = steps[2..].split_first().unwrap();
                    for (i, step) in later.iter().enumerate() {
                        if let Some(why) = moved(settled, step, pool) {
                            let on = if pool { " on the pool" } else { "" };
                            failures.push(format!("{}{on}: step {}: {why}", point.label(), i + 4));
                        }
                    }
                }
            }
            failures
        })
    });
    for f in &failures {
        println!("{f}");
    }
    assert!(failures.is_empty(), "{} steps moved", failures.len());
}
