//! The reference stack's answer for `gaccwb estimate`: device and host bytes of one
//! configuration (`model_states`, `activations`), the time of a step
//! (`step_time`), a verdict for a device budget, and the levers taken one on top of another at
//! the same effective batch, each with its bytes, time and bound.

use serde::Serialize;

use super::activations::{activations, Activations, Attention, Recompute};
use super::lora::{BaseDtype, Lora};
use super::model_states::{model_states, ModelStates, Placement, Weights};
use super::step_time::{step_time, Rates, StepTime};
use crate::hf::{Arch, Mlp, Norm, Positions};
use crate::scenario::ModelConfig;

/// The model this engine would estimate for `arch` trained as `lora` says (`None`: every weight),
/// or why it cannot, in one line. Its estimator books GPT blocks here (the engine trains more:
/// `model::spec::TRAINED`), every weight trained or LoRA on a base in the run's dtype
/// (`memory::estimate::Adapters`).
pub fn engine_model(arch: &Arch, lora: Option<&Lora>) -> Result<ModelConfig, String> {
    let Some(model) = arch.engine_model() else {
        return Err(format!(
            "has no estimate for {} ({}; it trains and estimates its own GPT, gpt2, llama, \
             mistral and qwen2 from their config.json); only the reference stack answers",
            arch.family,
            differences(arch).join(", ")
        ));
    };
    engine_lora(lora).map(|()| model)
}

/// Whether this engine's estimate covers LoRA as `lora` asks it (`None`: every weight trained).
pub fn engine_lora(lora: Option<&Lora>) -> Result<(), String> {
    match lora {
        Some(l) if l.base != BaseDtype::Bf16 => Err(format!(
            "has no estimate with a {} base (it trains LoRA on a bf16 or f32 base only); only \
             the reference stack answers",
            l.base
        )),
        _ => Ok(()),
    }
}

/// What sets `arch` apart from this engine's GPT blocks.
fn differences(arch: &Arch) -> Vec<&'static str> {
    let checks = [
        (arch.experts.is_some(), "a mixture of experts"),
        (
            arch.mlp != Mlp::Gelu || arch.intermediate != 4 * arch.hidden,
            "its MLP is not 4×GELU",
        ),
        (arch.norm != Norm::LayerNorm, "RMSNorm"),
        (arch.qk_norm, "q/k norms"),
        (arch.post_norms, "post-norms"),
        (arch.positions != Positions::Learned, "rotary positions"),
        (arch.kv_heads != arch.heads, "grouped-query attention"),
        (arch.sliding.is_some(), "sliding-window attention"),
        (arch.attention_softcap || arch.logit_softcap, "soft-capping"),
    ];
    let mut out: Vec<&'static str> = checks
        .into_iter()
        .filter_map(|(differs, what)| differs.then_some(what))
        .collect();
    if out.is_empty() {
        out.push("its biases or head width differ from GPT blocks");
    }
    out
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
    /// LoRA adapters trained on a frozen base; `None`: every weight is trained.
    pub lora: Option<Lora>,
}

/// Bytes and time of one setup.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Outcome {
    /// The setup.
    pub setup: Setup,
    /// Parameters AdamW trains (the adapters under LoRA).
    pub trained_params: u64,
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

/// The model states of `setup` on `arch`: every parameter trained, or under LoRA the adapters
/// trained and the base frozen at its dtype (ZeRO-3 gathers its largest module's 16-bit
/// weights, an upper bound for a quantised base, and no gradient).
pub(crate) fn weights(arch: &Arch, setup: &Setup) -> Weights {
    match &setup.lora {
        None => Weights::full(arch.param_count(), arch.largest_module_params()),
        Some(lora) => Weights {
            trained: lora.adapter_params(arch),
            frozen_bytes: lora.base_bytes(arch),
            gathered: 2 * arch.largest_module_params(),
        },
    }
}

/// What a configuration needs, for `arch` against a device `budget`.
pub(crate) fn outcome(arch: &Arch, setup: &Setup, rates: &Rates, budget: u64) -> Outcome {
    let w = weights(arch, setup);
    let model_states = model_states(&w, &setup.placement);
    let activations = activations(
        arch,
        setup.micro_batch,
        setup.attention,
        setup.recompute,
        setup.lora.as_ref(),
    );
    let device = model_states.device() + activations.total;
    Outcome {
        trained_params: w.trained,
        model_states,
        activations,
        device,
        host: model_states.host(),
        fits: device <= budget,
        time: step_time(arch, setup, &w, rates),
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
    /// The architecture planned (in the JSON once, beside the model's name, not here).
    #[serde(skip)]
    pub arch: Arch,
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
    /// Without `--lora-rank`: LoRA instead of training every weight, on top of the levers up to
    /// full recomputation, where it lowers the device bytes (rank 16 on every projection, then
    /// the base in 4 bits).
    pub adapters: Vec<LeverRow>,
}

/// The rank the adapters' lever offers.
pub const LEVER_RANK: u64 = 16;

impl ReferencePlan {
    /// The plan for `setup` on `arch` with `rates`, against `budget` device bytes.
    pub fn new(arch: &Arch, setup: &Setup, rates: &Rates, budget: u64) -> ReferencePlan {
        let row = |(name, s): (String, Setup)| LeverRow {
            outcome: outcome(arch, &s, rates, budget),
            name,
        };
        let levers: Vec<LeverRow> = levers(setup, rates.gpu.host).into_iter().map(row).collect();
        let adapters = match setup.lora {
            Some(_) => Vec::new(),
            None => adapter_levers(arch, setup).into_iter().map(row).fold(
                Vec::new(),
                |mut kept: Vec<LeverRow>, r| {
                    let before = kept.last().map_or_else(
                        || recomputed(setup, arch, rates, budget),
                        |l| l.outcome.device,
                    );
                    if r.outcome.device < before {
                        kept.push(r);
                    }
                    kept
                },
            ),
        };
        ReferencePlan {
            arch: arch.clone(),
            rates: rates.clone(),
            budget,
            configured: outcome(arch, setup, rates, budget),
            largest_fitting: largest_fitting(arch, setup, rates, budget),
            levers,
            adapters,
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

/// `configured` with FlashAttention, micro-batch 1 (K keeping B·K) and full recomputation.
fn lean(configured: &Setup) -> Setup {
    Setup {
        attention: Attention::Flash,
        accum_steps: configured.accum_steps * configured.micro_batch,
        micro_batch: 1,
        recompute: Recompute::Full,
        ..configured.clone()
    }
}

/// Device bytes of a full fine-tune at `lean(configured)`: what the adapters' levers must beat.
fn recomputed(configured: &Setup, arch: &Arch, rates: &Rates, budget: u64) -> u64 {
    outcome(arch, &lean(configured), rates, budget).device
}

/// The levers in order, each on top of the previous: FlashAttention, micro-batch 1 with K
/// keeping B·K, full recomputation, a 4-bit base (under LoRA), ZeRO-3 (when there are ranks to
/// partition over), optimizer offload and parameter offload (ZeRO-3; not on the host, where
/// they move nothing). Levers already in force are skipped.
fn levers(configured: &Setup, host: bool) -> Vec<(String, Setup)> {
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
    if let Some(lora) = &mut s.lora {
        lora.base = BaseDtype::Nf4;
        push("+ 4-bit base", &s, &mut out);
    }
    if s.placement.ranks > 1 {
        s.placement.stage = 3;
        push("+ ZeRO-3", &s, &mut out);
    }
    if host {
        return out;
    }
    s.placement.offload.optimizer = true;
    s.placement.offload.gradients = true;
    push("+ offload optimizer", &s, &mut out);
    s.placement.stage = 3;
    s.placement.offload.parameters = true;
    push("+ offload parameters", &s, &mut out);
    out
}

/// LoRA instead of training every weight, on `lean(configured)`: rank 16 on every projection
/// with a 16-bit base, then the base in 4 bits (QLoRA).
fn adapter_levers(arch: &Arch, configured: &Setup) -> Vec<(String, Setup)> {
    let Ok(lora) = Lora::new(arch, LEVER_RANK, None, 0.0, BaseDtype::Bf16) else {
        return Vec::new();
    };
    let s = Setup {
        lora: Some(lora.clone()),
        ..lean(configured)
    };
    let q = Setup {
        lora: Some(Lora {
            base: BaseDtype::Nf4,
            ..lora
        }),
        ..s.clone()
    };
    vec![
        (format!("LoRA r={LEVER_RANK}"), s),
        ("+ 4-bit base".to_string(), q),
    ]
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
            host_source: crate::planner::step_time::HostSource::Flag,
        }
    }

    fn setup(b: u64, k: u64, stage: u8, offload: &str) -> Setup {
        Setup {
            micro_batch: b,
            accum_steps: k,
            attention: Attention::Full,
            recompute: Recompute::None,
            placement: Placement::new(stage, 1, Offload::parse(offload).unwrap()).unwrap(),
            lora: None,
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
        let one = activations(&a, 1, Attention::Flash, Recompute::None, None).total;
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

    #[test]
    fn lora_is_offered_where_it_lowers_the_device_bytes() {
        let a = named("llama3-8b").unwrap();
        let plan = ReferencePlan::new(&a, &setup(4, 2, 0, "none"), &rates(), 24 << 30);
        let names: Vec<&str> = plan.adapters.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["LoRA r=16", "+ 4-bit base"]);
        let recompute = plan
            .levers
            .iter()
            .find(|l| l.name == "+ full recompute")
            .unwrap();
        let (lora, qlora) = (&plan.adapters[0].outcome, &plan.adapters[1].outcome);
        assert!(lora.device < recompute.outcome.device && qlora.device < lora.device);
        assert_eq!(lora.trained_params, 41_943_040);
        // The adapters' 20 bytes each, the base's 2: no gradient or optimizer state for it.
        let m = &lora.model_states;
        assert_eq!(m.frozen.device, 2 * a.param_count());
        assert_eq!(m.optimizer.device, 12 * 41_943_040);
        assert_eq!(m.device() - m.frozen.device, 20 * 41_943_040);
        assert!(
            qlora.fits,
            "QLoRA of an 8B model fits 24 GiB: {}",
            qlora.device
        );
        // A LoRA run is offered the 4-bit base among its levers and no second LoRA.
        let lora_setup = Setup {
            lora: Some(Lora::new(&a, 8, None, 0.0, BaseDtype::Bf16).unwrap()),
            ..setup(4, 2, 0, "none")
        };
        let plan = ReferencePlan::new(&a, &lora_setup, &rates(), 24 << 30);
        assert!(plan.adapters.is_empty());
        assert!(plan.levers.iter().any(|l| l.name == "+ 4-bit base"));
    }

    #[test]
    fn on_the_host_no_offload_is_offered() {
        let a = named("gpt2").unwrap();
        let host = Rates {
            gpu: crate::planner::step_time::Gpu {
                host: true,
                ..gpu("a100").unwrap()
            },
            ..rates()
        };
        let plan = ReferencePlan::new(&a, &setup(4, 1, 0, "none"), &host, 8 << 30);
        assert!(
            plan.levers.iter().all(|l| !l.name.contains("offload")),
            "{:?}",
            plan.levers
        );
    }

    #[test]
    fn the_engine_column_says_what_its_estimator_does_not_book() {
        let gpt2 = named("gpt2").unwrap();
        assert!(engine_model(&gpt2, None).is_ok());
        let lora = Lora::new(&gpt2, 8, None, 0.0, BaseDtype::Bf16).unwrap();
        assert!(engine_model(&gpt2, Some(&lora)).is_ok());
        let nf4 = Lora::new(&gpt2, 8, None, 0.0, BaseDtype::Nf4).unwrap();
        assert!(engine_model(&gpt2, Some(&nf4))
            .unwrap_err()
            .starts_with("has no estimate with a nf4 base"));
        let llama = named("llama3-8b").unwrap();
        assert_eq!(
            engine_model(&llama, None).unwrap_err(),
            "has no estimate for llama (its MLP is not 4×GELU, RMSNorm, rotary positions, \
             grouped-query attention; it trains and estimates its own GPT, gpt2, llama, mistral \
             and qwen2 from their config.json); only the reference stack answers"
        );
    }
}
