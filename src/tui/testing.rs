//! Small event builders for tests and benchmarks (not part of the workbench's behaviour).

use crate::control::{Control, Dtype, Origin};
use crate::scenario::Scenario;
use crate::telemetry::{
    BuildInfo, Categories, ControlEvent, EndEvent, EstimateEvent, EvalEvent, Event, Header,
    MemoryEvent, MemorySource, Phase, PhaseMs, StepEvent, FORMAT_VERSION,
};

pub fn header() -> Header {
    let mut config = Scenario {
        name: "baseline".into(),
        explanation: "A small GPT learns a seeded Markov source.".into(),
        ..Scenario::default()
    };
    config.train.steps = 100;
    Header {
        version: FORMAT_VERSION,
        config,
        device: "cpu".into(),
        build: BuildInfo {
            version: "test".into(),
            features: Vec::new(),
            threads: 1,
        },
        params: 1000,
        family: None,
        entropy_floor: Some(1.25),
        tokenizer: None,
        started_unix: 0,
        ranks: None,
        collectives: None,
        memory_budget_bytes: None,
        unified_memory: Some(true),
        writer: None,
    }
}

/// A plausible step: the loss decays towards the floor, the norm towards 0.5.
pub fn step(step: u64, loss: f64) -> StepEvent {
    StepEvent {
        step,
        loss,
        grad_norm: 0.5 + 1.0 / step as f64,
        grad_norm_clipped: (0.5 + 1.0 / step as f64).min(1.0),
        lr: 3e-3,
        accum_steps: 1,
        micro_batch: 8,
        tokens: 1024,
        tokens_per_s: 20_000.0,
        step_ms: 50.0,
        cpu_threads: None,
        skipped: false,
        loss_scale: 1.0,
        overflow_count: 0,
        dtype: Dtype::F32,
        offload: false,
        host_device_bytes: 0,
        clip: Some(1.0),
        phase_ms: PhaseMs {
            forward: 20.0,
            backward: 25.0,
            optimizer: 5.0,
        },
        grad_error: None,
        noise: None,
        comm: None,
    }
}

fn categories(activation_mib: u64) -> Categories {
    Categories {
        parameters: 4 << 20,
        compute_weights: 0,
        gradients: 4 << 20,
        gradients_transient: 2 << 20,
        optimizer_state: 8 << 20,
        offloaded: 0,
        activations: activation_mib << 20,
        frozen: 0,
        other: 1 << 20,
    }
}

/// A run of `steps` steps: K raised to 4 by key after step 20 (when there is one), a measured
/// ledger each step, an evaluation every 10 steps, the estimate and a warning at the end.
pub fn sample_run(steps: u64) -> Vec<Event> {
    let mut out = vec![Event::Header(header())];
    for i in 1..=steps {
        let mut s = step(i, 1.25 + 3.0 / i as f64);
        if i > 20 {
            s.accum_steps = 4;
        }
        // As the trainer's ledger reports a step: each phase, the end of the step last.
        for (phase, activations, total) in [
            (Phase::Forward, 12, 27u64 << 20),
            (Phase::Backward, 12, 31 << 20),
            (Phase::Step, 0, 19 << 20),
        ] {
            out.push(Event::Memory(MemoryEvent {
                step: i,
                phase,
                source: MemorySource::Allocator,
                categories: categories(activations),
                total,
                peak: 33 << 20,
                unified: true,
            }));
        }
        out.push(Event::Step(s));
        if i == 20 {
            out.push(Event::Control(ControlEvent {
                step: 20,
                origin: Origin::Key,
                control: Control::SetAccumSteps { value: 4 },
            }));
        }
        if i % 10 == 0 {
            out.push(Event::Eval(EvalEvent {
                step: i,
                val_loss: 1.3 + 3.0 / i as f64,
            }));
        }
    }
    for (phase, activations) in [(Phase::Backward, 11), (Phase::Step, 0)] {
        out.push(Event::Estimate(EstimateEvent {
            step: steps,
            phase,
            categories: categories(activations),
            total: 30 << 20,
            unified: true,
        }));
    }
    out.push(Event::warn(steps, "something to see in the log"));
    out
}

/// `sample_run` with the trainer's closing event.
pub fn sample_run_ended(steps: u64) -> Vec<Event> {
    let mut out = sample_run(steps);
    out.push(Event::End(EndEvent {
        step: steps,
        reason: crate::end::EndReason::Completed,
    }));
    out
}
