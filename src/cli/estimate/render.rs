//! The estimate as people read it: the model and the budget once, this engine's ledger per
//! phase, its micro-batch table and verdict, and the reference stack's (`reference.rs`), in
//! aligned columns of human units. The JSON (`--json`) is the same answer serialised.

use gaccwb::control::OffloadGrads;
use gaccwb::hf::{Arch, Mlp, Norm, Positions};
use gaccwb::memory::estimate::{model_states, Report};
use gaccwb::memory::{human_bytes, Verdict};
use gaccwb::telemetry::Categories;

use super::Answer;

/// The whole answer: the model, the budget, then each stack's.
pub fn answer(a: &Answer) -> String {
    let hint = if a.budget.source == "--budget-gib" {
        ""
    } else {
        "; --budget-gib to change"
    };
    let mut out = format!(
        "Model: {}: {}\nBudget: {} per device ({}{hint})\n\n",
        printable(&a.model.name),
        describe(&a.model.arch),
        human_bytes(a.budget.bytes),
        a.budget.source,
    );
    let mut parts = Vec::new();
    if let Some(e) = &a.engine {
        parts.push(format!("This engine:\n{}", engine(e)));
    }
    if let Some(why) = &a.engine_unavailable {
        parts.push(format!("This engine: {why}\n"));
    }
    if let Some(r) = &a.reference {
        parts.push(super::reference::reference(r));
    }
    out += &parts.join("\n");
    out
}

/// `text` with control characters shown as escapes, so a name cannot move the terminal's cursor.
pub fn printable(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

/// A count in digits, or in scientific notation once it has more than twelve.
pub fn count(x: f64) -> String {
    if x.abs() < 1e12 {
        format!("{x:.0}")
    } else {
        format!("{x:.3e}")
    }
}

/// Seconds with a readable unit.
pub fn seconds(s: f64) -> String {
    if s == 0.0 {
        "0 s".into()
    } else if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else if s < 1e6 {
        format!("{s:.2} s")
    } else {
        format!("{s:.3e} s")
    }
}

/// `1,234,567`.
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The architecture in one line, with its parameter count (and the active ones with experts).
fn describe(a: &Arch) -> String {
    let head = if a.tied { "tied head" } else { "untied head" };
    let params = match a.experts {
        Some(e) => format!(
            "{} parameters ({head}; {} active: {} of {} experts of {} per token{})",
            grouped(a.param_count()),
            grouped(a.active_params()),
            e.per_token,
            e.count,
            e.intermediate,
            if e.shared > 0 {
                format!(" and a shared expert of {}", e.shared)
            } else {
                String::new()
            }
        ),
        None => format!("{} parameters ({head})", grouped(a.param_count())),
    };
    let act = match a.mlp {
        Mlp::Gelu => "GELU MLP",
        Mlp::SwiGlu => "SwiGLU",
        Mlp::GeGlu => "GeGLU",
    };
    let mlp = match a.dense_layers() {
        0 => format!("{act} experts in every layer"),
        n if n == a.layers => format!("{act} {}", a.intermediate),
        n => format!("{act} experts, {n} dense layers of {}", a.intermediate),
    };
    let norm = match a.norm {
        Norm::LayerNorm => "LayerNorm",
        Norm::RmsNorm => "RMSNorm",
    };
    let positions = match a.positions {
        Positions::Learned => "learned positions",
        Positions::Rotary => "rotary positions",
    };
    let mut extras: Vec<String> = Vec::new();
    for (on, what) in [
        (a.qk_norm, "q/k norms"),
        (a.post_norms, "post-norms"),
        (a.fused_qkv, "fused qkv"),
        (a.fused_mlp, "fused gate_up"),
        (a.scaled_embedding, "scaled embedding"),
        (a.attention_softcap, "soft-capped scores"),
        (a.logit_softcap, "soft-capped logits"),
        (a.dropout, "dropout"),
    ] {
        if on {
            extras.push(what.into());
        }
    }
    if let Some(w) = a.sliding {
        extras.push(format!(
            "sliding window {} in {} layers",
            w.window, w.layers
        ));
    }
    let wrapper = a
        .wrapper
        .as_ref()
        .map(|w| format!(" (the language model of a {w}; its vision tower is not counted)"))
        .unwrap_or_default();
    format!(
        "{}{wrapper}, {params}, hidden {}, {} layers, {} heads ({} key/value, head {}), {mlp}, \
         {norm}, {positions}{}, vocab {}; planned at {} tokens per sample (its context: {})",
        a.family,
        a.hidden,
        a.layers,
        a.heads,
        a.kv_heads,
        a.head_dim,
        extras.iter().map(|e| format!(", {e}")).collect::<String>(),
        a.vocab,
        a.seq_len,
        a.max_context,
    )
}

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
    let per = |b: u64| b as f64 / r.config.arch.param_count().max(1) as f64;
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
        "{}: {} d_model={} layers={} heads={} seq_len={} vocab={} ({} parameters, {})\n\
         B={} K={} {} offload {}; {}\n",
        printable(&report.preset),
        c.arch.family,
        m.d_model,
        m.layers,
        m.heads,
        m.seq_len,
        m.vocab,
        c.arch.param_count(),
        match c.arch.tied {
            true => "tied head".to_string(),
            false => format!("untied head {} of them", c.arch.hidden * c.arch.vocab),
        },
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
    if let Some(l) = &c.lora {
        out += &format!(
            "LoRA r={}: {} adapter parameters trained, the base frozen in {}\n",
            l.rank,
            report.params,
            c.dtype.name()
        );
    }
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
