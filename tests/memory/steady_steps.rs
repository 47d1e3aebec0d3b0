//! What a step leaves for the next. From the third step on (the first two take the one-time
//! allocations: AdamW's moments, the gradient buffer, `gemm`'s slab), every step of every family
//! closes each phase holding the same bytes at the same peak (to the byte on the lean ops, what
//! a CUDA step runs; within `SCHEDULING` on the fused ones) and ends holding, to the byte, what
//! the step before it ended with.
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

fn figures(point: &FamilyPoint) -> Vec<Figures> {
    let mut t = Trainer::new(point.scenario(), Device::Cpu).unwrap();
    t.force_lean_ops(point.lean);
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

/// How far a phase's peak may move between steps on the fused ops: their pool's threads take and
/// free their blocks' scratch in an order the scheduler sets, so at two threads the moment the
/// largest ones overlap moves (by 12 KiB at most where this was measured). The lean ops' products
/// run on the calling thread here: their peaks are compared to the byte.
const SCHEDULING: u64 = 64 << 10;

/// Why `step` differs from the step the comparison settled on, if it does.
fn moved(point: &FamilyPoint, settled: &Figures, step: &Figures) -> Option<String> {
    let slack = if point.lean { 0 } else { SCHEDULING };
    let same = settled.1 == step.1
        && settled.0.iter().zip(&step.0).all(|(was, now)| {
            was.phase == now.phase
                && was.closing == now.closing
                && was.peak.abs_diff(now.peak) <= slack
        });
    (!same).then(|| format!("{step:?} against {settled:?}"))
}

#[test]
fn every_step_from_the_third_asks_for_and_keeps_the_bytes_of_the_one_before() {
    let _serial = crate::serial();
    let failures = with_one_rayon_thread(|| {
        on_measuring_thread(|| {
            let mut failures = Vec::new();
            for point in points() {
                let steps = figures(&point);
                let (settled, later) = steps[2..].split_first().unwrap();
                for (i, step) in later.iter().enumerate() {
                    if let Some(why) = moved(&point, settled, step) {
                        failures.push(format!("{}: step {}: {why}", point.label(), i + 4));
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
