//! The estimate as people read it: this engine's ledger per phase, its micro-batch table and
//! verdict, and the reference stack's placement, step time and levers, in aligned columns of
//! human units. The JSON (`--json`) is the same reports serialised.

use gaccwb::hf::{Arch, Mlp, Norm, Positions};
use gaccwb::memory::estimate::{model_states, Report};
use gaccwb::memory::verdict::{human_bytes, Verdict};
use gaccwb::planner::model_states::Offload;
use gaccwb::planner::plan::{LeverRow, Outcome, ReferencePlan, Setup};
use gaccwb::planner::step_time::{Rates, StepTime};
use gaccwb::telemetry::{Categories, OffloadGrads};

/// Rows of cells padded into columns; `right[i]` right-aligns column i. Columns are two spaces
/// apart so cells never run together, whatever their width.
pub fn aligned(rows: &[Vec<String>], right: &[bool]) -> String {
    let columns = right.len();
    let widths: Vec<usize> = (0..columns)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = (0..columns)
            .map(|i| match right[i] {
                true => format!("{:>w$}", row[i], w = widths[i]),
                false => format!("{:<w$}", row[i], w = widths[i]),
            })
            .collect();
        out += cells.join("  ").trim_end();
        out += "\n";
    }
    out
}

/// Model states per parameter, device and host, beside DeepSpeed's way of counting them.
fn model_states_line(r: &Report) -> String {
    let m = model_states(&r.config);
    let per = |b: u64| b as f64 / r.params.max(1) as f64;
    format!(
        "model states (weights, gradient buffer, optimizer state): {} on the device ({:.2} \
         bytes/parameter), {} in host memory ({:.2} bytes/parameter)\n\n",
        human_bytes(m.device),
        per(m.device),
        human_bytes(m.host),
        per(m.host),
    )
}

/// This engine's estimate as the terminal shows it.
pub fn engine(report: &Report) -> String {
    let c = &report.config;
    let m = &c.model;
    let mut out = format!(
        "{}: d_model={} layers={} heads={} seq_len={} vocab={} ({} parameters, untied head {} of them)\n\
         B={} K={} {} offload {}; {}\n",
        report.preset,
        m.d_model,
        m.layers,
        m.heads,
        m.seq_len,
        m.vocab,
        report.params,
        m.d_model as u64 * m.vocab as u64,
        c.micro_batch,
        c.accum_steps,
        c.dtype.name(),
        match (c.offload, c.offload_grads) {
            (false, _) => "off",
            (true, OffloadGrads::Device) => "on (gradients accumulate on the device)",
            (true, OffloadGrads::Host) => "on (gradients accumulate in host memory)",
        },
        if c.unified {
            "CPU: host and device are one memory"
        } else {
            "GPU: offloaded bytes live in host memory"
        },
    );
    if let Some(why) = &report.not_trainable_here {
        out += &format!("This shape cannot be trained here ({why}); the estimate is for this engine's stack (the reference stack is the usual one).\n");
    }
    out += "\n";
    let phases = report.estimate.phases();
    let mut rows = vec![["predicted", "forward", "backward", "optimizer", "step"]
        .map(String::from)
        .to_vec()];
    // `other` is what a measurement finds beyond the categories: the estimate has none.
    for (i, name) in Categories::NAMES.iter().enumerate() {
        if *name == "other" || (*name == "frozen" && phases.iter().all(|(_, c)| c.frozen == 0)) {
            continue;
        }
        let mut row = vec![name.to_string()];
        row.extend(phases.iter().map(|(_, cats)| human_bytes(cats.values()[i])));
        rows.push(row);
    }
    let mut total = vec!["total".to_string()];
    total.extend(
        phases
            .iter()
            .map(|(_, cats)| human_bytes(report.estimate.resident(cats))),
    );
    rows.push(total);
    out += &aligned(&rows, &[false, true, true, true, true]);
    out += &format!(
        "peak {} (allocator workspace and CUDA context not included)\n",
        human_bytes(report.peak)
    );
    out += &model_states_line(report);
    out += &format!("At effective batch {}:\n", report.effective_batch);
    let mut rows = vec![["B", "K", "activations", "grad transient", "peak"]
        .map(String::from)
        .to_vec()];
    rows.extend(report.table.iter().map(|r| {
        vec![
            r.micro_batch.to_string(),
            r.accum_steps.to_string(),
            human_bytes(r.activations),
            human_bytes(r.gradients_transient),
            human_bytes(r.peak),
        ]
    }));
    out += &aligned(&rows, &[true; 5]);
    out += "\n";
    out += &verdict(&report.verdict, report.effective_batch);
    out
}

/// This engine's verdict in a few lines.
pub fn verdict(v: &Verdict, effective: usize) -> String {
    let budget = human_bytes(v.budget);
    let mut out = format!(
        "Verdict for a budget of {budget}: the configured micro-batch needs {} ({}).\n",
        human_bytes(v.configured_peak),
        if v.configured_fits {
            "fits"
        } else {
            "does not fit"
        }
    );
    out += &match &v.largest_fitting {
        Some(r) => format!(
            "  largest micro-batch that fits at effective batch {effective}: B={} K={} (peak {})\n",
            r.micro_batch,
            r.accum_steps,
            human_bytes(r.peak)
        ),
        None => format!("  no micro-batch fits at effective batch {effective}\n"),
    };
    out += "  least memory each lever reaches (each on top of the one before):\n";
    let rows: Vec<Vec<String>> = v
        .levers
        .iter()
        .map(|l| {
            vec![
                format!("    {}", l.name),
                format!(
                    "B={} K={} {} offload {}",
                    l.micro_batch,
                    l.accum_steps,
                    l.dtype.name(),
                    if l.offload { "on" } else { "off" }
                ),
                format!(
                    "{} {}",
                    human_bytes(l.peak),
                    if l.fits { "fits" } else { "over" }
                ),
            ]
        })
        .collect();
    out += &aligned(&rows, &[false, false, true]);
    if let (Some(b), Some(best)) = (&v.blocker, v.best()) {
        // Named at the lever that reaches the least, whose settings may not be the configured ones.
        let at = format!("at `{}`", best.name.trim_start_matches("+ "));
        out += &if b.alone_exceeds {
            format!(
                "  cannot fit: {at}, {} alone need {}, more than the {budget} budget, whatever the micro-batch\n",
                b.category,
                human_bytes(b.bytes)
            )
        } else {
            format!(
                "  cannot fit: {at}, the largest category at the peak is {} ({})\n",
                b.category,
                human_bytes(b.bytes)
            )
        };
    }
    out
}

/// The reference stack's plan as the terminal shows it.
pub fn reference(plan: &ReferencePlan) -> String {
    let mut out = format!(
        "Reference stack: 16-bit mixed-precision AdamW, model states as DeepSpeed counts them, \
         activations after Korthikanti et al. 2022\n{}\n{}\n\n",
        describe(&plan.arch, plan.params),
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
    out
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
        s.placement.ranks,
        s.placement.stage,
        offload_name(&s.placement.offload),
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
            s.placement.stage.to_string(),
            offload_name(&s.placement.offload),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_stay_apart_at_any_width() {
        let rows = [
            vec!["a".to_string(), human_bytes(u64::MAX), human_bytes(1)],
            vec![
                "longer".to_string(),
                human_bytes(1),
                human_bytes(u64::MAX / 3),
            ],
        ];
        let text = aligned(&rows, &[false, true, true]);
        for line in text.lines() {
            assert!(line.contains("B  ") || line.contains("B "), "{text}");
            assert!(!line.contains("TiB1") && !line.contains("iB1"), "{text}");
        }
        let widths: Vec<usize> = text.lines().map(|l| l.chars().count()).collect();
        assert_eq!(
            widths[0], widths[1],
            "right-aligned rows end together: {text}"
        );
    }
}
