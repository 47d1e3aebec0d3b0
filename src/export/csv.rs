//! `gaccwb export FILE --to csv -o DIR`: the recording's series as CSV files in DIR.
//!
//! - `steps.csv`: one row per optimizer step (`Event::Step`), columns `STEP_COLUMNS`.
//! - `memory.csv`: one row per memory measurement (`Event::Memory`), columns `MEMORY_COLUMNS`
//!   (bytes per ledger category); header only when the recording has none.
//! - `controls.csv`: every applied control: step, origin, kind, label.
//! - `evals.csv`: validation loss by step.
//!
//! Numbers are written in Rust's shortest round-trip form, so parsing a cell gives back the
//! recorded `f64` exactly; an absent optional value is an empty cell.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::record::Recording;
use crate::telemetry::{Categories, Event, MemoryEvent, NoiseEvent, StepEvent};

pub const STEP_COLUMNS: [&str; 28] = [
    "step",
    "loss",
    "grad_norm",
    "grad_norm_clipped",
    "lr",
    "accum_steps",
    "micro_batch",
    "effective_batch",
    "tokens",
    "tokens_per_s",
    "step_ms",
    "skipped",
    "loss_scale",
    "overflow_count",
    "dtype",
    "offload",
    "clip",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "grad_error",
    "noise_g2",
    "noise_trace",
    "noise_b_simple_tokens",
    "noise_b_simple_seqs",
    "noise_raw_g2",
    "noise_raw_trace",
    "noise_windows",
];

/// `step, phase, source, unified, total, peak`, then one column per ledger category.
pub fn memory_columns() -> Vec<&'static str> {
    let mut cols = vec!["step", "phase", "source", "unified", "total", "peak"];
    cols.extend(Categories::NAMES);
    cols
}

/// Write the four files into `dir` (created if missing); returns their paths.
pub fn write_csv(recording: &Recording, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let files = [
        ("steps.csv", steps_csv(&recording.events)),
        ("memory.csv", memory_csv(&recording.events)),
        ("controls.csv", controls_csv(&recording.events)),
        ("evals.csv", evals_csv(&recording.events)),
    ];
    let mut written = Vec::new();
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

pub fn steps_csv(events: &[Event]) -> String {
    let mut out = STEP_COLUMNS.join(",") + "\n";
    for s in events.iter().filter_map(|e| match e {
        Event::Step(s) => Some(s),
        _ => None,
    }) {
        out += &step_row(s);
        out.push('\n');
    }
    out
}

fn step_row(s: &StepEvent) -> String {
    let opt = |v: Option<f64>| v.map(|x| x.to_string()).unwrap_or_default();
    [
        s.step.to_string(),
        s.loss.to_string(),
        s.grad_norm.to_string(),
        s.grad_norm_clipped.to_string(),
        s.lr.to_string(),
        s.accum_steps.to_string(),
        s.micro_batch.to_string(),
        s.effective_batch().to_string(),
        s.tokens.to_string(),
        s.tokens_per_s.to_string(),
        s.step_ms.to_string(),
        s.skipped.to_string(),
        s.loss_scale.to_string(),
        s.overflow_count.to_string(),
        s.dtype.name().to_string(),
        s.offload.to_string(),
        opt(s.clip),
        s.phase_ms.forward.to_string(),
        s.phase_ms.backward.to_string(),
        s.phase_ms.optimizer.to_string(),
        opt(s.grad_error),
    ]
    .into_iter()
    .chain(noise_cells(s.noise.as_ref()))
    .collect::<Vec<_>>()
    .join(",")
}

/// The `noise_*` cells: empty where the window gave no estimate (K = 1, overflow).
fn noise_cells(n: Option<&NoiseEvent>) -> [String; 7] {
    let Some(n) = n else {
        return Default::default();
    };
    let opt = |v: Option<f64>| v.map(|x| x.to_string()).unwrap_or_default();
    [
        n.g2.to_string(),
        n.trace.to_string(),
        opt(n.b_simple_tokens),
        opt(n.b_simple_seqs),
        n.raw_g2.to_string(),
        n.raw_trace.to_string(),
        n.windows.to_string(),
    ]
}

pub fn memory_csv(events: &[Event]) -> String {
    let mut out = memory_columns().join(",") + "\n";
    for m in events.iter().filter_map(|e| match e {
        Event::Memory(m) => Some(m),
        _ => None,
    }) {
        out += &memory_row(m);
        out.push('\n');
    }
    out
}

fn memory_row(m: &MemoryEvent) -> String {
    let mut row = format!(
        "{},{},{},{},{},{}",
        m.step,
        json_name(&m.phase),
        json_name(&m.source),
        m.unified,
        m.total,
        m.peak
    );
    for v in m.categories.values() {
        let _ = write!(row, ",{v}");
    }
    row
}

fn controls_csv(events: &[Event]) -> String {
    let mut out = String::from("step,origin,kind,label\n");
    for c in events.iter().filter_map(|e| match e {
        Event::Control(c) => Some(c),
        _ => None,
    }) {
        let kind = serde_json::to_value(&c.control)
            .ok()
            .and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_string))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{},{},{},{}",
            c.step,
            json_name(&c.origin),
            kind,
            quote(&c.control.describe())
        );
    }
    out
}

fn evals_csv(events: &[Event]) -> String {
    let mut out = String::from("step,val_loss\n");
    for e in events.iter().filter_map(|e| match e {
        Event::Eval(e) => Some(e),
        _ => None,
    }) {
        let _ = writeln!(out, "{},{}", e.step, e.val_loss);
    }
    out
}

/// The name serde gives a unit enum value (`"backward"`, `"cuda-pool"`), as in the recording.
fn json_name<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        _ => String::new(),
    }
}

/// RFC 4180 quoting when a cell holds a comma, quote or newline.
fn quote(cell: &str) -> String {
    if cell.contains([',', '"', '\n']) {
        format!("\"{}\"", cell.replace('"', "\"\""))
    } else {
        cell.to_string()
    }
}
