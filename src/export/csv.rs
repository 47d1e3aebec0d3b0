//! `gaccwb export FILE --to csv -o DIR`: the recording's series as CSV files in DIR, written by
//! the `csv` crate from one serde row type per file (quoting and float formatting are its job).
//!
//! - `steps.csv`: one row per optimizer step (`Event::Step`), columns `STEP_COLUMNS`; a knob the
//!   step event carries has the column its row of the knob table names (`control::Knob::csv`).
//! - `memory.csv`: one row per memory measurement (`Event::Memory`), columns `memory_columns()`
//!   (bytes per ledger category).
//! - `estimates.csv`: the analytic estimate of each phase whenever it was (re)sent
//!   (`Event::Estimate`): step, phase, unified, total, then bytes per category.
//! - `controls.csv`: every applied control: step, origin, kind, label.
//! - `evals.csv`: validation loss by step.
//!
//! Every file has its header even when it has no rows. Floats are written in shortest round-trip
//! form, so parsing a cell gives back the recorded `f64` exactly; an absent value is an empty cell.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;

use crate::control::{Dtype, Origin};
use crate::record::Recording;
use crate::telemetry::{
    Categories, EstimateEvent, Event, MemoryEvent, MemorySource, Phase, StepEvent,
};

pub const STEP_COLUMNS: &[&str] = &[
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
    "host_device_bytes",
    "clip",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "cpu_threads",
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

/// `step, phase, unified, total`, then one column per ledger category.
pub fn estimate_columns() -> Vec<&'static str> {
    let mut cols = vec!["step", "phase", "unified", "total"];
    cols.extend(Categories::NAMES);
    cols
}

const CONTROL_COLUMNS: [&str; 4] = ["step", "origin", "kind", "label"];
const EVAL_COLUMNS: [&str; 2] = ["step", "val_loss"];

/// Write the five files into `dir` (created if missing); returns their paths. Existing files
/// of those names are refused (before anything is written) unless `rules` allow it.
pub fn write_csv(
    recording: &Recording,
    dir: &Path,
    rules: &crate::safe_write::Overwrite,
) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let events = &recording.events;
    let files = [
        ("steps.csv", steps_csv(events)?),
        ("memory.csv", memory_csv(events)?),
        ("estimates.csv", estimates_csv(events)?),
        ("controls.csv", controls_csv(events)?),
        ("evals.csv", evals_csv(events)?),
    ];
    for (name, _) in &files {
        crate::safe_write::check(&dir.join(name), "CSV export", rules)?;
    }
    // Every file is written whole under its temporary name first, then all are renamed: an
    // export cut short (killed, a full disk) leaves no file of the set to block the next one.
    let mut pending = Vec::new();
    for (name, text) in &files {
        let path = dir.join(name);
        let mut p = crate::safe_write::Pending::begin(&path, "CSV export", rules)?;
        std::io::Write::write_all(p.file(), text.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        pending.push((path, p));
    }
    let mut written = Vec::new();
    for (path, p) in pending {
        p.commit()?;
        written.push(path);
    }
    Ok(written)
}

#[derive(Serialize)]
struct StepRow {
    step: u64,
    loss: f64,
    grad_norm: f64,
    grad_norm_clipped: f64,
    lr: f64,
    accum_steps: usize,
    micro_batch: usize,
    effective_batch: usize,
    tokens: u64,
    tokens_per_s: f64,
    step_ms: f64,
    skipped: bool,
    loss_scale: f64,
    overflow_count: u64,
    dtype: Dtype,
    offload: bool,
    host_device_bytes: u64,
    clip: Option<f64>,
    forward_ms: f64,
    backward_ms: f64,
    optimizer_ms: f64,
    cpu_threads: Option<usize>,
    grad_error: Option<f64>,
    /// The `noise_*` cells: empty where the window gave no estimate (K = 1, overflow).
    noise_g2: Option<f64>,
    noise_trace: Option<f64>,
    noise_b_simple_tokens: Option<f64>,
    noise_b_simple_seqs: Option<f64>,
    noise_raw_g2: Option<f64>,
    noise_raw_trace: Option<f64>,
    noise_windows: Option<u64>,
}

impl From<&StepEvent> for StepRow {
    fn from(s: &StepEvent) -> Self {
        StepRow {
            step: s.step,
            loss: s.loss,
            grad_norm: s.grad_norm,
            grad_norm_clipped: s.grad_norm_clipped,
            lr: s.lr,
            accum_steps: s.accum_steps,
            micro_batch: s.micro_batch,
            effective_batch: s.effective_batch(),
            tokens: s.tokens,
            tokens_per_s: s.tokens_per_s,
            step_ms: s.step_ms,
            skipped: s.skipped,
            loss_scale: s.loss_scale,
            overflow_count: s.overflow_count,
            dtype: s.dtype,
            offload: s.offload,
            host_device_bytes: s.host_device_bytes,
            clip: s.clip,
            forward_ms: s.phase_ms.forward,
            backward_ms: s.phase_ms.backward,
            optimizer_ms: s.phase_ms.optimizer,
            cpu_threads: s.cpu_threads,
            grad_error: s.grad_error,
            noise_g2: s.noise.as_ref().map(|n| n.g2),
            noise_trace: s.noise.as_ref().map(|n| n.trace),
            noise_b_simple_tokens: s.noise.as_ref().and_then(|n| n.b_simple_tokens),
            noise_b_simple_seqs: s.noise.as_ref().and_then(|n| n.b_simple_seqs),
            noise_raw_g2: s.noise.as_ref().map(|n| n.raw_g2),
            noise_raw_trace: s.noise.as_ref().map(|n| n.raw_trace),
            noise_windows: s.noise.as_ref().map(|n| n.windows),
        }
    }
}

/// Bytes per ledger category, as trailing columns. Destructured field by field, so a new
/// category cannot be left out of the export.
#[derive(Serialize)]
struct CategoryCells {
    parameters: u64,
    compute_weights: u64,
    gradients: u64,
    gradients_transient: u64,
    optimizer_state: u64,
    offloaded: u64,
    activations: u64,
    frozen: u64,
    other: u64,
}

impl From<Categories> for CategoryCells {
    fn from(c: Categories) -> Self {
        let Categories {
            parameters,
            compute_weights,
            gradients,
            gradients_transient,
            optimizer_state,
            offloaded,
            activations,
            frozen,
            other,
        } = c;
        CategoryCells {
            parameters,
            compute_weights,
            gradients,
            gradients_transient,
            optimizer_state,
            offloaded,
            activations,
            frozen,
            other,
        }
    }
}

#[derive(Serialize)]
struct MemoryRow {
    step: u64,
    phase: Phase,
    source: MemorySource,
    unified: bool,
    total: u64,
    peak: u64,
}

#[derive(Serialize)]
struct EstimateRow {
    step: u64,
    phase: Phase,
    unified: bool,
    total: u64,
}

#[derive(Serialize)]
struct ControlRow {
    step: u64,
    origin: Origin,
    kind: String,
    label: String,
}

#[derive(Serialize)]
struct EvalRow {
    step: u64,
    val_loss: f64,
}

pub fn steps_csv(events: &[Event]) -> anyhow::Result<String> {
    let rows = events.iter().filter_map(|e| match e {
        Event::Step(s) => Some(StepRow::from(s)),
        _ => None,
    });
    table(STEP_COLUMNS, rows.map(|r| (r, None)))
}

pub fn memory_csv(events: &[Event]) -> anyhow::Result<String> {
    let rows = events.iter().filter_map(|e| match e {
        Event::Memory(m) => Some(memory_row(m)),
        _ => None,
    });
    table(&memory_columns(), rows)
}

fn memory_row(m: &MemoryEvent) -> (MemoryRow, Option<CategoryCells>) {
    let row = MemoryRow {
        step: m.step,
        phase: m.phase,
        source: m.source,
        unified: m.unified,
        total: m.total,
        peak: m.peak,
    };
    (row, Some(m.categories.into()))
}

pub fn estimates_csv(events: &[Event]) -> anyhow::Result<String> {
    let rows = events.iter().filter_map(|e| match e {
        Event::Estimate(x) => Some(estimate_row(x)),
        _ => None,
    });
    table(&estimate_columns(), rows)
}

fn estimate_row(e: &EstimateEvent) -> (EstimateRow, Option<CategoryCells>) {
    let row = EstimateRow {
        step: e.step,
        phase: e.phase,
        unified: e.unified,
        total: e.total,
    };
    (row, Some(e.categories.into()))
}

fn controls_csv(events: &[Event]) -> anyhow::Result<String> {
    let rows = events.iter().filter_map(|e| match e {
        Event::Control(c) => Some(ControlRow {
            step: c.step,
            origin: c.origin,
            kind: c.control.kind().to_string(),
            label: c.control.describe(),
        }),
        _ => None,
    });
    table(&CONTROL_COLUMNS, rows.map(|r| (r, None)))
}

fn evals_csv(events: &[Event]) -> anyhow::Result<String> {
    let rows = events.iter().filter_map(|e| match e {
        Event::Eval(e) => Some(EvalRow {
            step: e.step,
            val_loss: e.val_loss,
        }),
        _ => None,
    });
    table(&EVAL_COLUMNS, rows.map(|r| (r, None)))
}

/// The header, then each row (with its category cells, if any) as one record.
fn table<R: Serialize>(
    columns: &[&str],
    rows: impl Iterator<Item = (R, Option<CategoryCells>)>,
) -> anyhow::Result<String> {
    let mut w = csv::WriterBuilder::new()
        .has_headers(false)
        .from_writer(Vec::new());
    w.write_record(columns)?;
    for (row, categories) in rows {
        match categories {
            Some(c) => w.serialize((row, c))?,
            None => w.serialize(row)?,
        }
    }
    Ok(String::from_utf8(w.into_inner()?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_of(row: impl Serialize) -> Vec<String> {
        let mut w = csv::Writer::from_writer(Vec::new());
        w.serialize(row).unwrap();
        let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
        text.lines()
            .next()
            .unwrap()
            .split(',')
            .map(String::from)
            .collect()
    }

    /// Every knob with a `steps.csv` column in the knob table has that column.
    #[test]
    fn every_knob_column_is_written() {
        for knob in crate::control::KNOBS {
            if let Some(column) = knob.csv {
                assert!(
                    STEP_COLUMNS.contains(&column),
                    "{}: no column {column}",
                    knob.key
                );
            }
        }
    }

    /// The declared columns are exactly the row types' fields, in order: they cannot drift.
    #[test]
    fn declared_columns_match_the_row_types() {
        let step = crate::tui::testing::step(3, 2.5);
        assert_eq!(header_of(StepRow::from(&step)), STEP_COLUMNS);
        let memory = crate::tui::testing::sample_run(2)
            .into_iter()
            .find_map(|e| match e {
                Event::Memory(m) => Some(m),
                _ => None,
            })
            .unwrap();
        let (row, cells) = memory_row(&memory);
        let mut columns = header_of(row);
        columns.extend(header_of(cells.unwrap()));
        assert_eq!(columns, memory_columns());
        let estimate = EstimateRow {
            step: 0,
            phase: Phase::Step,
            unified: true,
            total: 0,
        };
        let mut columns = header_of(estimate);
        columns.extend(header_of(CategoryCells::from(Categories::default())));
        assert_eq!(columns, estimate_columns());
    }
}
