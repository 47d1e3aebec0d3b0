//! `gaccwb run` (the default command): train a preset on the screen or headless.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;

use gaccwb::device::DeviceChoice;
use gaccwb::headless::{self, Progress, SignalHandling};
use gaccwb::safe_write::{Inputs, Overwrite};
use gaccwb::scenario::{DataSource, Scenario};
use gaccwb::train::Trainer;
use gaccwb::tui::{self, keymap::KeyMap, LiveOptions};
use gaccwb::{checkpoint, presets};

use super::{usage, UsageError};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Built-in preset name or path to a preset TOML file [default: baseline].
    preset: Option<String>,
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
    /// Fine-tune a Hugging Face model instead of the preset's GPT: a directory holding
    /// config.json, model.safetensors and tokenizer.json, or ORG/NAME[@REVISION] from the local
    /// Hugging Face cache (nothing is downloaded). Sets model.path.
    #[arg(long, value_name = "PATH")]
    model: Option<String>,
    /// At the end of the run, save the model in Hugging Face's layout into DIR (never into
    /// the directory it was read from); `S` on the screen saves it there at the next boundary.
    #[arg(long, value_name = "DIR")]
    save_model: Option<PathBuf>,
    /// With LoRA, --save-model writes the model with the adapters merged into it, not the
    /// adapter alone.
    #[arg(long, requires = "save_model")]
    merge: bool,
    /// Start LoRA from this PEFT adapter (adapter_config.json, adapter_model.safetensors) of
    /// --model: its settings become train.lora_*, its weights the adapters'.
    #[arg(long, value_name = "DIR", requires = "model")]
    adapter: Option<PathBuf>,
    /// Train on FILE instead of the preset's data: its bytes, or BPE tokens with --set
    /// data.tokenizer=bpe (with --model, the model's tokenizer; a .jsonl file's `text` fields).
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
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
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
    /// Read controls appended to FILE while the run goes on (one JSON object per line, e.g.
    /// {"kind": "set_accum_steps", "value": 8}), applied at the next boundary as keys are.
    #[arg(long, value_name = "FILE")]
    controls_from: Option<PathBuf>,
    /// Data parallel on this host: start N ranks through mpirun (a build with `--features
    /// mpi`); each window takes N·K·B samples. The screen follows rank 0.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    ranks: Option<u64>,
}

impl RunArgs {
    /// The `--record` file, if any.
    pub fn record(&self) -> Option<&Path> {
        self.record.as_deref()
    }

    /// The preset as named, or the default one.
    fn preset(&self) -> &str {
        self.preset.as_deref().unwrap_or(presets::DEFAULT)
    }

    /// Everything the run reads: no file it writes may be one of them.
    pub(super) fn inputs(&self) -> Inputs {
        let mut inputs = self.inputs_but_resumed(scenario_from(self).ok().as_ref());
        if let Some(dir) = &self.resume {
            checkpoint::add_inputs(dir, &mut inputs);
        }
        inputs
    }

    /// What the run reads but the checkpoint it resumes (which its own saves replace).
    fn inputs_but_resumed(&self, scenario: Option<&Scenario>) -> Inputs {
        let mut inputs = super::inputs::preset(self.preset());
        if let Some(s) = scenario {
            super::inputs::add_scenario(s, &mut inputs);
        }
        if let Some(state) = self
            .resume
            .as_deref()
            .and_then(|d| checkpoint::read_state(d).ok())
        {
            super::inputs::add_scenario(&state.scenario, &mut inputs);
        }
        if let Some(keys) = &self.keys {
            inputs.add("the keymap", keys);
        }
        inputs
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    // Building the model (or training a tokenizer) can take a while; a signal meanwhile ends
    // the process with a line saying so. The run takes over once it starts.
    gaccwb::signals::until_started()?;
    let scenario = scenario_from(&args)?;
    let launched = gaccwb::dist::launch::read(|n| std::env::var(n).ok())?.is_some();
    let ranks = args
        .ranks
        .or((!launched && scenario.train.ranks > 1).then_some(scenario.train.ranks as u64));
    if let Some(ranks) = ranks.filter(|&n| n > 1) {
        return super::ranks::launch(super::ranks::Launch {
            ranks: ranks as usize,
            headless: args.headless,
            record: args.record.as_deref(),
            keys: args.keys.as_deref(),
        });
    }
    let group = join_ranks(&args, &scenario)?;
    let lead = group.rank() == 0;
    let keys = match args.headless {
        false => {
            let keys = KeyMap::load(args.keys.as_deref()).map_err(usage)?;
            tui::require_terminal().map_err(usage)?;
            Some(keys)
        }
        true => None,
    };
    let overwrite = Overwrite::new(args.force, args.inputs());
    // Rank 0 writes what the run writes; the other ranks train beside it.
    let record = args.record.clone().filter(|_| lead);
    if let Some(record) = &record {
        // Checked here too (the recorder checks again, race-free) so the screen and headless
        // both say it before anything starts, as a usage error.
        gaccwb::safe_write::check(record, "recording", &overwrite).map_err(usage)?;
    }
    let device = match group.is_parallel() {
        true => args
            .device
            .open_for_rank(gaccwb::dist::launch::local_rank(|n| std::env::var(n).ok()))?,
        false => args.device.open()?,
    };
    let group = group.adopt_device(&device)?;
    if lead && group.gradients_cross_the_host(&device) {
        eprintln!(
            "gaccwb: the ranks' gradients cross the host on every reduce (this build has no \
             NCCL); `cargo build --release --features nccl` keeps them on the GPUs"
        );
    }
    let trainer = build_trainer(&args, scenario, device, group)?;
    if keys.is_some() && args.controls_from.is_some() {
        return Err(
            usage("--controls-from steers a headless run; on the screen, use the keys").into(),
        );
    }
    if let Some(keys) = keys {
        let options = LiveOptions {
            record,
            keys,
            overwrite,
        };
        return tui::run_live(trainer, options);
    }
    headless::refuse_screen_controls(&trainer).map_err(|e| usage(format!("{e:#}")))?;
    let session = gaccwb::session::Session::start(trainer, record.as_deref(), &overwrite)
        .map_err(|e| usage(format!("{e:#}")))?;
    if let Some(path) = args.controls_from.as_deref().filter(|_| lead) {
        let trainer = session.handle.controls.clone();
        gaccwb::steer::follow(path, trainer)
            .map_err(|e| usage(format!("--controls-from {}: {e}", path.display())))?;
    }
    let progress = if lead {
        Progress::Bar
    } else {
        Progress::Hidden
    };
    let summary = headless::run_session(session, progress, SignalHandling::Stop)?;
    let printed = if lead {
        gaccwb::out::println(&summary.render())
    } else {
        Ok(())
    };
    // How the run ended decides the exit code, even when the summary could not be printed.
    match summary.outcome() {
        Some(ended) => Err(ended.into()),
        None => Ok(printed?),
    }
}

/// The preset with every command-line override applied.
fn scenario_from(args: &RunArgs) -> anyhow::Result<Scenario> {
    let mut s = presets::resolve(args.preset()).map_err(usage)?;
    if let Some(model) = &args.model {
        s.model.path = Some(PathBuf::from(model));
    }
    if let Some(adapter) = &args.adapter {
        s.model.adapter = Some(adapter.clone());
    }
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
        s.train.memory_budget = gaccwb::budget::MemoryBudget::parse(budget).context("--budget")?;
    }
    gaccwb::model::hf::prepare(&mut s)?;
    s.validate().map_err(usage)?;
    Ok(s)
}

/// This process's data-parallel group: alone, or one rank of the job an MPI launcher started
/// (`mpirun -n N gaccwb run --headless`). Ranks have no screen.
fn join_ranks(args: &RunArgs, scenario: &Scenario) -> anyhow::Result<gaccwb::dist::Group> {
    let timeout = std::time::Duration::from_secs_f64(scenario.train.comm_timeout);
    let group = gaccwb::dist::from_env(timeout).map_err(|e| usage(e.to_string()))?;
    if group.is_parallel() && !args.headless {
        return Err(usage(format!(
            "rank {} of {}: ranks started by an MPI launcher run without a screen; add --headless",
            group.rank(),
            group.ranks()
        ))
        .into());
    }
    Ok(group)
}

/// A fresh trainer for `scenario`, or the one saved in `--resume DIR`, as a rank of `group`;
/// with the checkpoint policy on rank 0.
fn build_trainer(
    args: &RunArgs,
    scenario: Scenario,
    device: candle_core::Device,
    group: gaccwb::dist::Group,
) -> anyhow::Result<Trainer> {
    refuse_with_resume(args)?;
    let lead = group.rank() == 0;
    let saves = args.checkpoint_every.filter(|_| lead);
    // Held by the checkpoint hook, so for as long as the trainer lives.
    let lock = match saves {
        Some(_) => Some(
            checkpoint::claim_dir(&args.checkpoint_dir, args.resume.as_deref(), args.force)
                .map_err(|e| usage(format!("{e:#}")))?,
        ),
        None => None,
    };
    let mut trainer = match &args.resume {
        Some(dir) => checkpoint::resume(dir, device, |s| {
            if let Some(n) = args.steps {
                s.train.steps = n;
            }
        })?,
        None => Trainer::new(scenario, device)?,
    };
    trainer.join(group).map_err(|e| usage(format!("{e:#}")))?;
    // Every rank takes part in gathering what rank 0 saves (ZeRO's sharded moments).
    if let Some(every) = args.checkpoint_every {
        trainer.gather_state_every(every);
    }
    let controls = args
        .controls
        .iter()
        .map(|c| gaccwb::scenario::parse_control_arg(c).map_err(usage))
        .collect::<Result<_, _>>()?;
    trainer.set_cli_controls(controls);
    check_cli_controls(&trainer).map_err(UsageError)?;
    if args.resume.is_some() {
        refuse_past_controls(&trainer)?;
    }
    let inputs = args.inputs_but_resumed(Some(trainer.scenario()));
    if let Some(dir) = args.save_model.clone().filter(|_| lead) {
        let source = trainer.scenario().model.path.as_deref();
        gaccwb::model::save::check_target(source, &dir).map_err(usage)?;
        let rules = Overwrite::new(args.force, inputs.clone());
        trainer.add_after_step(Box::new(checkpoint::ModelSave {
            dir,
            rules,
            merge: args.merge,
        }));
    }
    if let Some((every, lock)) = saves.zip(lock) {
        let policy = checkpoint::Policy {
            every,
            dir: args.checkpoint_dir.clone(),
            inputs,
        };
        trainer.add_after_step(policy.after_step(lock));
    }
    Ok(trainer)
}

/// `--control` values checked against the run's model before the trainer starts, with the
/// rules presets follow (a window B·K·seq_len that overflows is refused here, not mid-run).
fn check_cli_controls(trainer: &Trainer) -> Result<(), String> {
    let (b, k) = (trainer.knobs().micro_batch, trainer.knobs().accum_steps);
    let entries = trainer.cli_controls();
    let (noise, seq_len) = (trainer.knobs().noise, trainer.scenario().model.seq_len);
    gaccwb::scenario::check_schedule(b, k, noise, seq_len, entries).map_err(|e| {
        let (entry, why) = (&entries[e.index], e.error);
        format!(
            "--control {}:{}: {why}",
            entry.step,
            entry.control.describe()
        )
    })
}

/// `--resume` continues the checkpoint's own run: what would start another one (a preset, a
/// seed, a budget, `--set`, `--data`) is refused rather than silently ignored.
fn refuse_with_resume(args: &RunArgs) -> Result<(), UsageError> {
    if args.resume.is_none() {
        return Ok(());
    }
    let given = [
        (args.preset.is_some(), "a preset"),
        (!args.sets.is_empty(), "--set"),
        (args.data.is_some(), "--data"),
        (args.seed.is_some(), "--seed"),
        (args.budget.is_some(), "--budget"),
    ];
    let named: Vec<&str> = given.iter().filter(|(g, _)| *g).map(|(_, n)| *n).collect();
    if named.is_empty() {
        return Ok(());
    }
    Err(UsageError(format!(
        "--resume continues the checkpoint's own preset, seed and budget; only --steps, \
         --control (from the checkpoint's step on) and the checkpoint options may be given \
         (drop {})",
        named.join(", ")
    )))
}

/// A resumed run starts at the checkpoint's step: a `--control` before it would never apply.
fn refuse_past_controls(trainer: &Trainer) -> Result<(), UsageError> {
    let past = trainer
        .cli_controls()
        .iter()
        .find(|e| e.step < trainer.step());
    match past {
        Some(e) => Err(UsageError(format!(
            "--control {}:{}: the checkpoint is at step {}, so this would never apply; give a \
             step from {} on",
            e.step,
            e.control.describe(),
            trainer.step(),
            trainer.step()
        ))),
        None => Ok(()),
    }
}
