//! The reference stack's answer for `gaccwb estimate`: device and host bytes of one
//! configuration (`model_states`, `activations`), the time of a step
//! (`step_time`), a verdict for a device budget, and the levers taken one on top of another at
//! the same effective batch, each with its bytes, time and bound.

use serde::Serialize;

use super::activations::{activations, Activations, Attention, Recompute};
use super::model_states::{model_states, ModelStates, Placement};
use super::step_time::{step_time, Rates, StepTime};
use crate::hf::{Arch, Mlp, Norm, Positions};

/// Why this engine cannot build `arch`, in one line.
pub fn engine_unavailable(arch: &Arch) -> String {
    let mut differs = Vec::new();
    if arch.mlp != Mlp::Gelu || arch.intermediate != 4 * arch.hidden {
        differs.push("its MLP is not 4×GELU");
    }
    if arch.norm != Norm::LayerNorm {
        differs.push("RMSNorm");
    }
    if arch.positions != Positions::Learned {
        differs.push("rotary positions");
    }
    if arch.kv_heads != arch.heads {
        differs.push("grouped-query attention");
    }
    if differs.is_empty() {
        differs.push("its biases or head width differ from GPT blocks");
    }
    format!(
        "cannot build {} ({}); only the reference stack answers",
        arch.family,
        differs.join(", ")
    )
}

/// One configuration of the reference stack.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Setup {
    /// B.
    pub micro_batch: u64,
    /// K.
    pub accum_steps: u64,
    /// The attention kernel.
    pub attention: Attention,
    /// What is recomputed in the backward.
    pub recompute: Recompute,
    /// ZeRO stage, ranks and offload: where the model states live.
    pub placement: Placement,
}

/// Bytes and time of one setup.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Outcome {
    /// The setup.
    pub setup: Setup,
    /// Weights, gradients and optimizer state, placed.
    pub model_states: ModelStates,
    /// Activations per micro-batch.
    pub activations: Activations,
    /// Bytes on each rank's device: model states and the micro-batch's activations.
    pub device: u64,
    /// Bytes in host memory, all ranks together.
    pub host: u64,
    /// Whether the device bytes fit the budget.
    pub fits: bool,
    /// The step's time and what bounds it.
    pub time: StepTime,
}

/// What a configuration needs, for `arch` against a device `budget`.
pub fn outcome(arch: &Arch, setup: &Setup, rates: &Rates, budget: u64) -> Outcome {
    let model_states = model_states(
        arch.param_count(),
        arch.largest_module_params(),
        &setup.placement,
    );
    let activations = activations(arch, setup.micro_batch, setup.attention, setup.recompute);
    let device = model_states.device() + activations.total;
    Outcome {
        model_states,
        activations,
        device,
        host: model_states.host(),
        fits: device <= budget,
        time: step_time(
            arch,
            setup.micro_batch,
            setup.accum_steps,
            setup.recompute,
            &setup.placement,
            rates,
        ),
        setup: setup.clone(),
    }
}

/// One lever and where it leads.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LeverRow {
    /// The lever, cumulatively ("+ offload optimizer").
    pub name: String,
    /// Bytes and time with it.
    pub outcome: Outcome,
}

/// The reference stack's whole answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReferencePlan {
    /// The architecture planned.
    pub arch: Arch,
    /// Its parameter count.
    pub params: u64,
    /// The hardware rates the time model uses.
    pub rates: Rates,
    /// Device bytes per rank judged against.
    pub budget: u64,
    /// The setup as given.
    pub configured: Outcome,
    /// The largest micro-batch dividing B·K whose device bytes fit, with its K, everything else
    /// as configured.
    pub largest_fitting: Option<Outcome>,
    /// Each lever on top of the ones before, at the configured effective batch per rank.
    pub levers: Vec<LeverRow>,
}

impl ReferencePlan {
    /// The plan for `setup` on `arch` with `rates`, against `budget` device bytes.
    pub fn new(arch: &Arch, setup: &Setup, rates: &Rates, budget: u64) -> ReferencePlan {
        ReferencePlan {
            arch: arch.clone(),
            params: arch.param_count(),
            rates: rates.clone(),
            budget,
            configured: outcome(arch, setup, rates, budget),
            largest_fitting: largest_fitting(arch, setup, rates, budget),
            levers: levers(setup)
                .into_iter()
                .map(|(name, s)| LeverRow {
                    name,
                    outcome: outcome(arch, &s, rates, budget),
                })
                .collect(),
        }
    }
}

/// The largest micro-batch dividing the configured B·K that fits `budget`, K raised to keep B·K.
fn largest_fitting(arch: &Arch, setup: &Setup, rates: &Rates, budget: u64) -> Option<Outcome> {
    let per_rank = setup.micro_batch * setup.accum_steps;
    (1..=per_rank)
        .rev()
        .filter(|b| per_rank.is_multiple_of(*b))
        .map(|b| {
            let s = Setup {
                micro_batch: b,
                accum_steps: per_rank / b,
                ..setup.clone()
            };
            outcome(arch, &s, rates, budget)
        })
        .find(|o| o.fits)
}

/// The levers in order, each on top of the previous: FlashAttention, micro-batch 1 with K
/// keeping B·K, full recomputation, ZeRO-3 (when there are ranks to partition over), optimizer
/// offload, parameter offload (ZeRO-3). Levers already in force are skipped.
fn levers(configured: &Setup) -> Vec<(String, Setup)> {
    let mut out = vec![("as configured".to_string(), configured.clone())];
    let mut s = configured.clone();
    let push = |name: &str, s: &Setup, out: &mut Vec<(String, Setup)>| {
        if out.last().is_none_or(|(_, last)| last != s) {
            out.push((name.to_string(), s.clone()));
        }
    };
    s.attention = Attention::Flash;
    push("+ FlashAttention", &s, &mut out);
    s.accum_steps *= s.micro_batch;
    s.micro_batch = 1;
    push("+ micro-batch 1", &s, &mut out);
    s.recompute = Recompute::Full;
    push("+ full recompute", &s, &mut out);
    if s.placement.ranks > 1 {
        s.placement.stage = 3;
        push("+ ZeRO-3", &s, &mut out);
    }
    s.placement.offload.optimizer = true;
    s.placement.offload.gradients = true;
    push("+ offload optimizer", &s, &mut out);
    s.placement.stage = 3;
    s.placement.offload.parameters = true;
    push("+ offload parameters", &s, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::named;
    use crate::planner::model_states::Offload;
    use crate::planner::step_time::gpu;

    fn rates() -> Rates {
        Rates {
            gpu: gpu("a100").unwrap(),
            mfu: 0.4,
            cpu_adam_bytes_per_s: 5e9,
        }
    }

    fn setup(b: u64, k: u64, stage: u8, offload: &str) -> Setup {
        Setup {
            micro_batch: b,
            accum_steps: k,
            attention: Attention::Full,
            recompute: Recompute::None,
            placement: Placement::new(stage, 1, Offload::parse(offload).unwrap()).unwrap(),
        }
    }

    #[test]
    fn device_bytes_are_model_states_and_activations() {
        let a = named("llama3-8b").unwrap();
        let o = outcome(&a, &setup(2, 4, 0, "none"), &rates(), 80 << 30);
        assert_eq!(o.model_states.device(), 20 * a.param_count());
        assert_eq!(o.device, 20 * a.param_count() + o.activations.total);
        assert_eq!(o.host, 0);
        assert!(!o.fits);
    }

    #[test]
    fn the_largest_fitting_micro_batch_keeps_b_times_k() {
        let a = named("llama3-8b").unwrap();
        let s = Setup {
            attention: Attention::Flash,
            ..setup(16, 2, 3, "optimizer")
        };
        // Room for the model states and between 4 and 5 samples' activations.
        let states = outcome(&a, &s, &rates(), u64::MAX).model_states.device();
        let one = activations(&a, 1, Attention::Flash, Recompute::None).total;
        let budget = states + 4 * one + one / 2;
        let plan = ReferencePlan::new(&a, &s, &rates(), budget);
        let best = plan.largest_fitting.unwrap();
        assert_eq!((best.setup.micro_batch, best.setup.accum_steps), (4, 8));
        assert!(!plan.configured.fits && best.fits);
        assert!(ReferencePlan::new(&a, &s, &rates(), states)
            .largest_fitting
            .is_none());
    }

    #[test]
    fn levers_never_raise_device_bytes_and_end_on_the_host() {
        let a = named("gpt3-175b").unwrap();
        let plan = ReferencePlan::new(&a, &setup(4, 1, 0, "none"), &rates(), 40 << 30);
        let device: Vec<u64> = plan.levers.iter().map(|l| l.outcome.device).collect();
        assert!(device.windows(2).all(|w| w[1] <= w[0]), "{device:?}");
        let last = &plan.levers.last().unwrap().outcome;
        assert_eq!(last.setup.placement.stage, 3);
        assert_eq!(last.setup.micro_batch * last.setup.accum_steps, 4);
        assert_eq!(last.host, 18 * a.param_count());
        let names: Vec<&str> = plan.levers.iter().map(|l| l.name.as_str()).collect();
        assert!(!names.contains(&"+ ZeRO-3"), "one rank: {names:?}");
    }
}
