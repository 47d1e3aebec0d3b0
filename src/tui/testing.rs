//! Small event builders for tests and benchmarks (not part of the workbench's behaviour).

use crate::scenario::Scenario;
use crate::telemetry::{BuildInfo, Dtype, Header, PhaseMs, StepEvent, FORMAT_VERSION};

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
        entropy_floor: Some(1.25),
        started_unix: 0,
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
        skipped: false,
        loss_scale: 1.0,
        overflow_count: 0,
        dtype: Dtype::F32,
        offload: false,
        clip: Some(1.0),
        phase_ms: PhaseMs {
            forward: 20.0,
            backward: 25.0,
            optimizer: 5.0,
        },
        grad_error: None,
    }
}
