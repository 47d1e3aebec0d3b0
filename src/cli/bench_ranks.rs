//! `gaccwb bench --ranks N`: positions/s of the default model with N data-parallel ranks
//! against one rank on the same cores, and the share of the step spent in collectives.
//!
//! Each configuration is a recorded `run --headless` under mpirun, timed from its step events
//! (median over the timed steps), so one rank and N ranks are measured the same way. The cores
//! are shared: each rank gets cores/N threads.

use std::process::{Command, Stdio};

use gaccwb::telemetry::{Event, StepEvent};

use super::usage;

/// What one configuration measured.
struct RanksRow {
    ranks: usize,
    threads: usize,
    positions_per_s: f64,
    sent_per_rank: f64,
    comm_share: f64,
}

/// Measure 1 rank and `ranks` ranks, `warmup` untimed then `steps` timed steps each.
pub fn bench_ranks(
    ranks: usize,
    threads: usize,
    warmup: usize,
    steps: usize,
) -> anyhow::Result<()> {
    if !cfg!(feature = "mpi") {
        return Err(usage("--ranks needs a gaccwb built with `--features mpi`").into());
    }
    let scratch = tempfile::tempdir()?;
    let preset = gaccwb::presets::resolve(gaccwb::presets::DEFAULT).map_err(usage)?;
    gaccwb::out::println(&format!(
        "gaccwb bench --ranks {ranks}: default preset `{}` (B={} K={} per rank), CPU, {threads} \
         core(s) shared by the ranks, {steps} timed steps after {warmup} warm-up",
        preset.name, preset.train.micro_batch, preset.train.accum_steps
    ))?;
    gaccwb::out::println(&format!(
        "{:>5} {:>12} {:>13} {:>9} {:>16} {:>11}",
        "ranks", "threads/rank", "positions/s", "x 1 rank", "MiB sent/rank", "in comm"
    ))?;
    let mut one = None;
    for w in [1, ranks] {
        let row = measure(w, (threads / w).max(1), warmup, steps, scratch.path())?;
        let base = *one.get_or_insert(row.positions_per_s);
        gaccwb::out::println(&format!(
            "{:>5} {:>12} {:>13.0} {:>9.2} {:>16.2} {:>10.0}%",
            row.ranks,
            row.threads,
            row.positions_per_s,
            row.positions_per_s / base,
            row.sent_per_rank / f64::from(1 << 20),
            row.comm_share * 100.0
        ))?;
    }
    Ok(())
}

fn measure(
    ranks: usize,
    threads: usize,
    warmup: usize,
    steps: usize,
    dir: &std::path::Path,
) -> anyhow::Result<RanksRow> {
    let record = dir.join(format!("ranks-{ranks}.jsonl"));
    let status = Command::new("mpirun")
        .args(["-n", &ranks.to_string()])
        .arg(std::env::current_exe()?)
        .args(["run", "--headless", "--device", "cpu", "--steps"])
        .arg((warmup + steps).to_string())
        .args(["--set", "train.eval_every=0", "--record"])
        .arg(&record)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .map_err(|e| anyhow::anyhow!("starting mpirun (Debian: openmpi-bin): {e}"))?;
    if !status.success() {
        anyhow::bail!("the {ranks}-rank run failed ({status})");
    }
    let events = gaccwb::record::read_recording(&record)?.events;
    let timed: Vec<&StepEvent> = events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) => Some(s),
            _ => None,
        })
        .skip(warmup)
        .collect();
    let seq_len = preset_seq_len()?;
    let mut rates: Vec<f64> = timed
        .iter()
        .map(|s| (ranks * s.micro_batch * s.accum_steps * seq_len) as f64 / (s.step_ms / 1e3))
        .collect();
    rates.sort_by(f64::total_cmp);
    let comms: Vec<(f64, f64)> = timed
        .iter()
        .filter_map(|s| s.comm.as_ref().map(|c| (c, s.step_ms)))
        .map(|(c, ms)| (c.sent_bytes() as f64 / c.ranks as f64, c.comm_ms() / ms))
        .collect();
    let mean =
        |f: fn(&(f64, f64)) -> f64| comms.iter().map(f).sum::<f64>() / comms.len().max(1) as f64;
    Ok(RanksRow {
        ranks,
        threads,
        positions_per_s: gaccwb::bench::median(&rates),
        sent_per_rank: mean(|c| c.0),
        comm_share: mean(|c| c.1),
    })
}

fn preset_seq_len() -> anyhow::Result<usize> {
    Ok(gaccwb::presets::resolve(gaccwb::presets::DEFAULT)
        .map_err(usage)?
        .model
        .seq_len)
}
