//! The memory ledger measured on CPU with tiny models: the physics holds and the accounting
//! closes.

use std::sync::Mutex;

use candle_core::Device;
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::{MemoryEvent, Phase};
use gaccwb::train::Trainer;

/// The allocator is process-wide: measurements must not overlap.
static SERIAL: Mutex<()> = Mutex::new(());

fn scenario(b: usize, k: usize, sets: &[&str]) -> Scenario {
    let mut s = Scenario::default();
    for a in [
        "model.d_model=32",
        "model.layers=2",
        "model.heads=2",
        "model.seq_len=32",
        "train.eval_every=0",
    ] {
        s.set(a).unwrap();
    }
    s.set(&format!("train.micro_batch={b}")).unwrap();
    s.set(&format!("train.accum_steps={k}")).unwrap();
    for a in sets {
        s.set(a).unwrap();
    }
    s
}

/// Memory events of the `steps`-th step.
fn measure(s: Scenario, steps: u64) -> Vec<MemoryEvent> {
    let _guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut t = Trainer::new(s, Device::Cpu).unwrap();
    let mut events = Vec::new();
    for _ in 0..steps {
        t.train_step(|| true).ok().unwrap();
        events = t.memory.take_events();
    }
    events
}

fn phase(events: &[MemoryEvent], p: Phase) -> &MemoryEvent {
    events.iter().find(|e| e.phase == p).unwrap()
}

#[test]
fn explore() {
    for (b, k) in [(4, 1), (32, 1), (4, 8)] {
        let ev = measure(scenario(b, k, &[]), 2);
        for e in &ev {
            println!(
                "B={b} K={k} {:?} total={} peak={} {:?}",
                e.phase, e.total, e.peak, e.categories
            );
        }
    }
    let ev = measure(Scenario::default(), 2);
    for e in &ev {
        println!(
            "default {:?} total={} peak={} {:?}",
            e.phase, e.total, e.peak, e.categories
        );
    }
    let _ = phase(&ev, Phase::Backward);
}
