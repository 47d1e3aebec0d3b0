//! `gaccwb run` (the default command): train a preset on the screen or headless.

use std::path::{Path, PathBuf};

use clap::Args;

use gaccwb::device::DeviceChoice;
use gaccwb::headless::{self, Progress, SignalHandling};
use gaccwb::scenario::{DataSource, Scenario};
use gaccwb::train::Trainer;
use gaccwb::tui::{self, keymap::KeyMap, LiveOptions};
use gaccwb::{checkpoint, presets};

use super::{usage, UsageError};

#[derive(Args)]
pub struct RunArgs {
    /// Built-in preset name or path to a preset TOML file.
    #[arg(default_value = presets::DEFAULT)]
    preset: String,
    /// No screen: a progress bar and a summary.
    #[arg(long)]
    headless: bool,
    /// Optimizer steps to run (0: until stopped).
    #[arg(long)]
    steps: Option<u64>,
    /// Seed for model initialisation and data order.
    #[arg(long)]
    seed: Option<u64>,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// Train on FILE instead of the preset's data: its bytes, or BPE tokens with --set data.tokenizer=bpe.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Override a preset field, e.g. --set train.accum_steps=4 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Write the session's events to FILE as JSON Lines.
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
    /// Apply a control at a step, reported with origin `cli`: STEP:KIND[=VALUE], e.g.
    /// 100:set_accum_steps=8 or 0:set_clip (off). Repeatable.
    #[arg(long = "control", value_name = "STEP:KIND[=VALUE]")]
    controls: Vec<String>,
    /// Key bindings (TOML); default: $XDG_CONFIG_HOME/gaccwb/keys.toml when it exists.
    #[arg(long, value_name = "FILE")]
    keys: Option<PathBuf>,
    /// Save a checkpoint every N optimizer steps (into --checkpoint-dir).
    #[arg(long, value_name = "N")]
    checkpoint_every: Option<u64>,
    /// Where checkpoints go.
    #[arg(long, value_name = "DIR", default_value = "checkpoints")]
    checkpoint_dir: PathBuf,
    /// Continue the run saved in DIR (its preset and knobs; --steps may extend it).
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Replace an existing --record file, and save into a --checkpoint-dir that holds another
    /// run's checkpoint (by default both are refused).
    #[arg(long)]
    force: bool,
    /// Memory the run may use (train.memory_budget): bytes, a size such as "6 GiB", or a share
    /// of the device such as "80%". The guard trades micro-batch for K to stay under it.
    #[arg(long, value_name = "SIZE")]
    budget: Option<String>,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let scenario = scenario_from(&args)?;
    let keys = match args.headless {
        false => {
            let keys = KeyMap::load(args.keys.as_deref()).map_err(usage)?;
            tui::require_terminal().map_err(usage)?;
            Some(keys)
        }
        true => None,
    };
    if let Some(record) = &args.record {
        check_record_target(record, &args, &scenario)?;
    }
    let device = args.device.open()?;
    let trainer = build_trainer(&args, scenario, device)?;
    if let Some(keys) = keys {
        let options = LiveOptions {
            record: args.record,
            keys,
            force: args.force,
        };
        return tui::run_live(trainer, options);
    }
    headless::refuse_screen_controls(&trainer).map_err(|e| usage(format!("{e:#}")))?;
    let session = gaccwb::session::Session::start(trainer, args.record.as_deref(), args.force)
        .map_err(|e| usage(format!("{e:#}")))?;
    let summary = headless::run_session(session, Progress::Bar, SignalHandling::Stop)?;
    println!("{}", summary.render());
    if let Some(signal) = summary.signal {
        return Err(signal.into());
    }
    if gaccwb::train::guard::is_failure(&summary.end_reason) {
        anyhow::bail!("training failed: {}", headless::strip(&summary.end_reason));
    }
    Ok(())
}

/// The preset with every command-line override applied.
fn scenario_from(args: &RunArgs) -> anyhow::Result<Scenario> {
    let mut s = presets::resolve(&args.preset).map_err(usage)?;
    if let Some(path) = &args.data {
        s.data.source = DataSource::File;
        s.data.path = Some(path.clone());
    }
    if let Some(n) = args.steps {
        s.train.steps = n;
    }
    if let Some(seed) = args.seed {
        s.train.seed = seed;
        s.data.seed = seed;
    }
    // Blame a bad --steps/--seed on itself, not on the first --set that re-reads the scenario.
    s.validate()
        .map_err(|e| usage(format!("{e} (from --steps/--seed)")))?;
    for assignment in &args.sets {
        s.set(assignment).map_err(usage)?;
    }
    if let Some(budget) = &args.budget {
        gaccwb::budget::MemoryBudget::parse(budget).map_err(|e| usage(format!("--budget: {e}")))?;
        s.set(&format!("train.memory_budget=\"{budget}\""))
            .map_err(usage)?;
    }
    s.validate().map_err(usage)?;
    Ok(s)
}

/// `--record` must not name an existing file without `--force`, nor one of the run's own
/// inputs (the preset, `--data`, a keymap) even with it: the run reads them.
fn check_record_target(record: &Path, args: &RunArgs, scenario: &Scenario) -> anyhow::Result<()> {
    let Ok(target) = record.canonicalize() else {
        return Ok(()); // not there yet: nothing to lose
    };
    if !args.force {
        // Checked here too (the recorder refuses it again, race-free) so the screen and
        // headless both say it before anything starts, as a usage error.
        anyhow::bail!(UsageError(gaccwb::safe_write::refusal(record, "recording")));
    }
    let inputs = [
        Some(PathBuf::from(&args.preset)),
        scenario.data.path.clone(),
        args.keys.clone(),
    ];
    for input in inputs.into_iter().flatten() {
        if input.canonicalize().is_ok_and(|p| p == target) {
            anyhow::bail!(UsageError(format!(
                "--record {} is an input of this run ({}); record to another file",
                record.display(),
                input.display()
            )));
        }
    }
    Ok(())
}

/// A fresh trainer for `scenario`, or the one saved in `--resume DIR`; with the checkpoint policy.
fn build_trainer(
    args: &RunArgs,
    scenario: Scenario,
    device: candle_core::Device,
) -> anyhow::Result<Trainer> {
    if args.resume.is_some() && (!args.sets.is_empty() || args.data.is_some()) {
        anyhow::bail!(UsageError(
            "--resume continues the checkpoint's own scenario; only --steps may change \
             (drop --set/--data)"
                .into()
        ));
    }
    if args.checkpoint_every.is_some() {
        checkpoint::claim_dir(&args.checkpoint_dir, args.resume.as_deref(), args.force)
            .map_err(|e| usage(format!("{e:#}")))?;
    }
    let mut trainer = match &args.resume {
        Some(dir) => checkpoint::resume(dir, device, |s| {
            if let Some(n) = args.steps {
                s.train.steps = n;
            }
        })?,
        None => Trainer::new(scenario, device)?,
    };
    trainer.cli_controls = args
        .controls
        .iter()
        .map(|c| gaccwb::scenario::parse_control_arg(c).map_err(UsageError))
        .collect::<Result<_, _>>()?;
    check_cli_controls(&trainer).map_err(UsageError)?;
    trainer.after_step = args.checkpoint_every.map(|every| {
        checkpoint::Policy {
            every,
            dir: args.checkpoint_dir.clone(),
        }
        .after_step()
    });
    Ok(trainer)
}

/// `--control` values checked against the run's model before the trainer starts, with the
/// rules presets follow (a window B·K·seq_len that overflows is refused here, not mid-run).
fn check_cli_controls(trainer: &Trainer) -> Result<(), String> {
    let (b, k) = (trainer.knobs.micro_batch, trainer.knobs.accum_steps);
    let entries = &trainer.cli_controls;
    gaccwb::scenario::check_schedule(b, k, trainer.scenario.model.seq_len, entries).map_err(
        |(i, m)| {
            let e = &entries[i];
            format!("--control {}:{}: {m}", e.step, e.control.describe())
        },
    )
}
