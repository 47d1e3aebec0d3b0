//! The reference stack's answer for `gaccwb estimate`: device and host bytes of one
//! configuration (model states from `zero`, activations from `reference`), the time of a step
//! (`step_time`), a verdict for a device budget, and the levers taken one on top of another at
//! the same effective batch, each with its bytes, time and bound.

use serde::Serialize;

use super::arch::{Arch, Mlp, Norm, Positions};
use super::planner::{aligned, human_bytes};
use super::reference::{activations, Activations, Attention, Recompute};
use super::step_time::{step_time, Rates, StepTime};
use super::zero::{model_states, ModelStates, Offload, Zero};

/// Which stacks `gaccwb estimate` answers for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, strum::EnumString, strum::Display)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Stack {
    /// This engine's estimate.
    Engine,
    /// The usual mixed-precision stack's.
    Reference,
    /// Both, one after the other.
    Both,
}

/// Both answers: this engine's estimate (its fields at the top level, as before) and the
/// reference stack's.
#[derive(Clone, Debug, Serialize)]
pub struct StackReport {
    #[serde(flatten)]
    /// This engine's estimate, when it can build the architecture.
    pub engine: Option<super::estimate::Report>,
    /// Why this engine has no answer (an architecture it cannot build), when it has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_unavailable: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// The reference stack's plan, when asked for.
    pub reference: Option<ReferencePlan>,
}

impl StackReport {
    /// The report as the terminal shows it.
    pub fn render(&self) -> String {
        let mut parts = Vec::new();
        if let Some(e) = &self.engine {
            parts.push(format!("This engine:\n{}", e.render()));
        }
        if let Some(why) = &self.engine_unavailable {
            parts.push(format!("This engine: {why}\n"));
        }
        if let Some(r) = &self.reference {
            parts.push(r.render());
        }
        parts.join("\n")
    }
}

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
    /// ZeRO stage, ranks and offload.
    pub zero: Zero,
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
        &setup.zero,
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
            &setup.zero,
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

    /// Text for people.
    pub fn render(&self) -> String {
        let mut out = format!(
            "Reference stack: 16-bit mixed-precision AdamW, model states as DeepSpeed counts them, \
             activations after Korthikanti et al. 2022\n{}\n{}\n\n",
            describe(&self.arch, self.params),
            describe_setup(&self.configured.setup, &self.rates),
        );
        out += &placement_table(&self.configured);
        out += &time_line(&self.configured.time);
        out += &format!(
            "\nVerdict for a device budget of {}: {}: {} on the device, {} on the host.\n",
            human_bytes(self.budget),
            if self.configured.fits {
                "fits"
            } else {
                "does not fit"
            },
            human_bytes(self.configured.device),
            human_bytes(self.configured.host),
        );
        let per_rank = self.configured.setup.micro_batch * self.configured.setup.accum_steps;
        out += &match &self.largest_fitting {
            Some(o) => format!(
                "  largest micro-batch that fits at B·K = {per_rank}: B={} K={} ({} on the device, {} per step)\n",
                o.setup.micro_batch,
                o.setup.accum_steps,
                human_bytes(o.device),
                seconds(o.time.step_s)
            ),
            None => format!("  no micro-batch fits at B·K = {per_rank} as configured\n"),
        };
        out += "  levers, each on top of the ones before:\n";
        out += &lever_table(&self.levers);
        out
    }
}

/// The architecture in one line.
fn describe(a: &Arch, params: u64) -> String {
    let mlp = match a.mlp {
        Mlp::Gelu => format!("GELU MLP {}", a.intermediate),
        Mlp::SwiGlu => format!("SwiGLU {}", a.intermediate),
    };
    let norm = match a.norm {
        Norm::LayerNorm => "LayerNorm",
        Norm::RmsNorm => "RMSNorm",
    };
    let positions = match a.positions {
        Positions::Learned => "learned positions",
        Positions::Rotary => "rotary positions",
    };
    format!(
        "{}: {params} parameters ({} head), hidden {}, {} layers, {} heads ({} key/value), {mlp}, \
         {norm}, {positions}, vocab {}, context {}{}",
        a.family,
        if a.tied { "tied" } else { "untied" },
        a.hidden,
        a.layers,
        a.heads,
        a.kv_heads,
        a.vocab,
        a.seq_len,
        if a.dropout { ", dropout" } else { "" },
    )
}

fn describe_setup(s: &Setup, r: &Rates) -> String {
    let links = if r.gpu.host {
        "no PCIe".to_string()
    } else {
        format!(
            "PCIe {} GB/s, link {} GB/s",
            r.gpu.pcie_gbps, r.gpu.link_gbps
        )
    };
    format!(
        "B={} K={} on each of {} rank(s), ZeRO-{}, offload {}, attention {}, recompute {}; {}: \
         {} TFLOPS × MFU {}, {links}; host AdamW {:.3} GB/s",
        s.micro_batch,
        s.accum_steps,
        s.zero.ranks,
        s.zero.stage,
        offload_name(&s.zero.offload),
        s.attention,
        s.recompute,
        r.gpu.name,
        r.gpu.peak_tflops,
        r.mfu,
        r.cpu_adam_bytes_per_s / 1e9,
    )
}

/// `optimizer+gradients`, or `none`.
pub fn offload_name(o: &Offload) -> String {
    let names: Vec<&str> = [
        (o.optimizer, "optimizer"),
        (o.gradients, "gradients"),
        (o.parameters, "parameters"),
    ]
    .into_iter()
    .filter_map(|(on, name)| on.then_some(name))
    .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join("+")
    }
}

fn placement_table(o: &Outcome) -> String {
    let m = &o.model_states;
    let mut rows = vec![vec!["".to_string(), "device".into(), "host".into()]];
    for (name, p) in [
        ("weights (16-bit)", m.weights16),
        ("gradients (16-bit)", m.gradients16),
        ("gradients (fp32)", m.gradients32),
        ("optimizer (fp32 master, m, v)", m.optimizer),
    ] {
        rows.push(vec![
            name.into(),
            human_bytes(p.device),
            human_bytes(p.host),
        ]);
    }
    rows.push(vec![
        "gathered module (ZeRO-3)".into(),
        human_bytes(m.gathered),
        human_bytes(0),
    ]);
    rows.push(vec![
        "activations".into(),
        human_bytes(o.activations.total),
        human_bytes(0),
    ]);
    rows.push(vec![
        "total".into(),
        human_bytes(o.device),
        human_bytes(o.host),
    ]);
    aligned(&rows, &[false, true, true])
}

fn time_line(t: &StepTime) -> String {
    format!(
        "step: {:.3e} FLOPs per rank: compute {}, PCIe {} ({} up, {} down), network {} ({}), \
         CPU AdamW {} -> {} per step, bound: {}, {} tokens/s\n",
        t.flops,
        seconds(t.compute_s),
        seconds(t.pcie_s),
        human_bytes(t.h2d_bytes),
        human_bytes(t.d2h_bytes),
        seconds(t.network_s),
        human_bytes(t.network_bytes),
        seconds(t.cpu_adam_s),
        seconds(t.step_s),
        t.bound,
        rate(t.tokens_per_s),
    )
}

/// A rate such as tokens/s: whole numbers, scientific notation beyond a trillion.
fn rate(x: f64) -> String {
    match x {
        x if !x.is_finite() => "-".into(),
        x if x >= 1e12 => format!("{x:.3e}"),
        x => format!("{x:.0}"),
    }
}

/// Seconds with a readable unit (a time beyond a million seconds in scientific notation: a
/// tiny MFU or rate makes times no one would print digit by digit).
pub fn seconds(s: f64) -> String {
    if s == 0.0 {
        "0 s".into()
    } else if !s.is_finite() {
        "-".into()
    } else if s >= 1e6 {
        format!("{s:.3e} s")
    } else if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

fn lever_table(levers: &[LeverRow]) -> String {
    let mut rows = vec![[
        "    lever",
        "B",
        "K",
        "ZeRO",
        "offload",
        "device",
        "host",
        "",
        "step",
        "bound",
        "tokens/s",
    ]
    .map(String::from)
    .to_vec()];
    for l in levers {
        let (s, o) = (&l.outcome.setup, &l.outcome);
        rows.push(vec![
            format!("    {}", l.name),
            s.micro_batch.to_string(),
            s.accum_steps.to_string(),
            s.zero.stage.to_string(),
            offload_name(&s.zero.offload),
            human_bytes(o.device),
            human_bytes(o.host),
            if o.fits { "fits" } else { "over" }.into(),
            seconds(o.time.step_s),
            o.time.bound.into(),
            rate(o.time.tokens_per_s),
        ]);
    }
    let right = [
        false, true, true, true, false, true, true, false, true, false, true,
    ];
    aligned(&rows, &right)
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
    if s.zero.ranks > 1 {
        s.zero.stage = 3;
        push("+ ZeRO-3", &s, &mut out);
    }
    s.zero.offload.optimizer = true;
    s.zero.offload.gradients = true;
    push("+ offload optimizer", &s, &mut out);
    s.zero.stage = 3;
    s.zero.offload.parameters = true;
    push("+ offload parameters", &s, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::arch::named;
    use crate::memory::step_time::gpu;

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
            zero: Zero::new(stage, 1, Offload::parse(offload).unwrap()).unwrap(),
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
        assert_eq!(last.setup.zero.stage, 3);
        assert_eq!(last.setup.micro_batch * last.setup.accum_steps, 4);
        assert_eq!(last.host, 18 * a.param_count());
        let names: Vec<&str> = plan.levers.iter().map(|l| l.name.as_str()).collect();
        assert!(!names.contains(&"+ ZeRO-3"), "one rank: {names:?}");
    }
}
