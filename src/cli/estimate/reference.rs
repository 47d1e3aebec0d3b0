//! The reference stack's plan as people read it: the setup and the rates in two lines, where the
//! model states and activations live, the time of a step and its bound, the verdict and the
//! levers (and LoRA's, where it lowers the device bytes).

use gaccwb::memory::human_bytes;
use gaccwb::planner::{
    HostSource, LeverRow, Lora, Offload, Outcome, Rates, ReferencePlan, Setup, StepTime, LEVER_RANK,
};

use super::render::{aligned, count, seconds};

/// The reference stack's plan as the terminal shows it.
pub fn reference(plan: &ReferencePlan) -> String {
    let mut out = format!(
        "Reference stack: 16-bit mixed-precision AdamW, model states as DeepSpeed counts them, \
         activations after Korthikanti et al. 2022\n{}\n\n",
        describe_setup(&plan.configured.setup, &plan.rates),
    );
    out += &placement_table(&plan.configured);
    out += &time_line(&plan.configured.time);
    out += &format!(
        "\nVerdict for a device budget of {}: {}: {} on the device, {} on the host.\n",
        human_bytes(plan.budget),
        if plan.configured.fits {
            "fits"
        } else {
            "does not fit"
        },
        human_bytes(plan.configured.device),
        human_bytes(plan.configured.host),
    );
    let per_rank = plan.configured.setup.micro_batch * plan.configured.setup.accum_steps;
    out += &match &plan.largest_fitting {
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
    out += &lever_table(&plan.levers);
    if !plan.adapters.is_empty() {
        out += &format!(
            "  or LoRA instead of training every weight (rank {LEVER_RANK} on every projection, \
             with FlashAttention, micro-batch 1 and full recompute):\n"
        );
        out += &lever_table(&plan.adapters);
    }
    out
}

/// `LoRA r=16 on q_proj, v_proj (bf16 base)`, or `every weight trained`.
pub fn training(lora: Option<&Lora>) -> String {
    let Some(l) = lora else {
        return "every weight trained".into();
    };
    format!(
        "LoRA r={} on {} ({} base{})",
        l.rank,
        l.targets.join(", "),
        l.base,
        if l.dropout > 0.0 {
            format!(", dropout {}", l.dropout)
        } else {
            String::new()
        }
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
    let host = match r.host_source {
        HostSource::Flag => "--cpu-adam-gbps",
        HostSource::Measured if cfg!(debug_assertions) => {
            "timed on this host by a debug build, slower than a release build's"
        }
        HostSource::Measured => "timed on this host",
        HostSource::Assumed => "assumed: a 2-core development machine's; pass --cpu-adam-gbps",
    };
    format!(
        "B={} K={} on each of {} rank(s), ZeRO-{}, offload {}, attention {}, recompute {}, {}; \
         {}: {} TFLOPS × MFU {}, {links}; host AdamW {:.3} GB/s ({host})",
        s.micro_batch,
        s.accum_steps,
        s.placement.ranks,
        s.placement.stage,
        offload_name(&s.placement.offload),
        s.attention,
        s.recompute,
        training(s.lora.as_ref()),
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
    let mut pieces = Vec::new();
    if let Some(l) = &o.setup.lora {
        pieces.push((format!("frozen base ({})", l.base), m.frozen));
    }
    let trained = if o.setup.lora.is_some() {
        " of the adapters"
    } else {
        ""
    };
    pieces.extend([
        (format!("weights (16-bit){trained}"), m.weights16),
        (format!("gradients (16-bit){trained}"), m.gradients16),
        (format!("gradients (fp32){trained}"), m.gradients32),
        (
            format!("optimizer (fp32 master, m, v){trained}"),
            m.optimizer,
        ),
    ]);
    for (name, p) in pieces {
        rows.push(vec![name, human_bytes(p.device), human_bytes(p.host)]);
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
        count(t.tokens_per_s),
    )
}

/// `full`, or `LoRA r16 nf4`.
fn trained_short(s: &Setup) -> String {
    match &s.lora {
        None => "full".into(),
        Some(l) => format!("LoRA r{} {}", l.rank, l.base),
    }
}

fn lever_table(levers: &[LeverRow]) -> String {
    let mut rows = vec![[
        "    lever",
        "B",
        "K",
        "ZeRO",
        "offload",
        "train",
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
            s.placement.stage.to_string(),
            offload_name(&s.placement.offload),
            trained_short(s),
            human_bytes(o.device),
            human_bytes(o.host),
            if o.fits { "fits" } else { "over" }.into(),
            seconds(o.time.step_s),
            o.time.bound.into(),
            count(o.time.tokens_per_s),
        ]);
    }
    let right = [
        false, true, true, true, false, false, true, true, false, true, false, true,
    ];
    aligned(&rows, &right)
}
