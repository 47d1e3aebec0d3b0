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
    /// Mean bytes each rank sent per step and share of the step in collectives; `None` for one
    /// rank, which does not communicate.
    comm: Option<(f64, f64)>,
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
    let scratch = gaccwb::children::Scratch::create("bench")?;
    let preset = gaccwb::presets::resolve(gaccwb::presets::DEFAULT)?;
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
        let (sent, share) = match row.comm {
            Some((sent, share)) => (
                format!("{:.2}", sent / f64::from(1 << 20)),
                format!("{:.0}%", share * 100.0),
            ),
            None => ("-".into(), "-".into()),
        };
        gaccwb::out::println(&format!(
            "{:>5} {:>12} {:>13.0} {:>9.2} {:>16} {:>11}",
            row.ranks,
            row.threads,
            row.positions_per_s,
            row.positions_per_s / base,
            sent,
            share
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
    let mut command = Command::new("mpirun");
    super::ranks::allow_root(&mut command, super::ranks::is_root());
    command
        .args(["-n", &ranks.to_string()])
        .arg(std::env::current_exe()?)
        .args(["run", "--headless", "--device", "cpu", "--steps"])
        .arg((warmup + steps).to_string())
        .args(["--set", "train.eval_every=0", "--record"])
        .arg(&record)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // The ranks end with this process, however it ends.
    let status = gaccwb::children::spawn_tied(&mut command, false)
        .and_then(|mut child| child.wait())
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
        .map(|(c, ms)| (c.sent_bytes() as f64 / c.ranks as f64, c.share_of_step(ms)))
        .collect();
    let n = comms.len() as f64;
    let comm = (!comms.is_empty()).then(|| {
        (
            comms.iter().map(|c| c.0).sum::<f64>() / n,
            comms.iter().map(|c| c.1).sum::<f64>() / n,
        )
    });
    Ok(RanksRow {
        ranks,
        threads,
        positions_per_s: gaccwb::bench::median(&rates),
        comm,
    })
}

fn preset_seq_len() -> anyhow::Result<usize> {
    Ok(gaccwb::presets::resolve(gaccwb::presets::DEFAULT)?
        .model
        .seq_len)
}
