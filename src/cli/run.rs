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

use gaccwb::signals::Signalled;

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
    /// the directory it was read from).
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
    /// Where checkpoints go [default: the --resume directory, else ./checkpoints].
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
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

    /// What every rank of a job must agree on before anything is built: the scenario (the
    /// checkpoint's when resuming, with `--steps`), the step resumed from, `--control` and
    /// `--checkpoint-every` (ranks gather what rank 0 saves).
    pub(super) fn fingerprint(&self, scenario: &Scenario) -> serde_json::Value {
        let resumed = self
            .resume
            .as_deref()
            .map(|dir| checkpoint::read_state(dir).ok());
        let (scenario, step) = match resumed {
            Some(Some(mut state)) => {
                if let Some(n) = self.steps {
                    state.scenario.train.steps = n;
                }
                (serde_json::to_value(&state.scenario), Some(state.step))
            }
            Some(None) => (Ok(serde_json::Value::Null), None),
            None => (serde_json::to_value(scenario), None),
        };
        serde_json::json!({
            "scenario": scenario.unwrap_or_default(),
            "resumed step": step,
            "--control": self.controls,
            "--checkpoint-every": self.checkpoint_every,
        })
    }

    /// Where checkpoints go: as given, else the checkpoint resumed (a resumed run continues
    /// it), else `./checkpoints`.
    fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint_dir
            .clone()
            .or_else(|| self.resume.clone())
            .unwrap_or_else(|| PathBuf::from("checkpoints"))
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
        if let Some(controls) = &self.controls_from {
            inputs.add("the controls file", controls);
        }
        inputs
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    // Building the model (or training a tokenizer) can take a while; a signal meanwhile ends
    // the process with a line saying so. The run takes over once it starts.
    gaccwb::signals::until_started()?;
    let launched = gaccwb::dist::launched(|n| std::env::var(n).ok())?.is_some();
    // A rank dies with the launcher that started it, however that ends.
    if launched && !gaccwb::children::die_with_parent() {
        return Err(Signalled(libc::SIGTERM).into());
    }
    let scenario = scenario_from(&args)?;
    if !args.headless && args.controls_from.is_some() {
        return Err(
            usage("--controls-from steers a headless run; on the screen, use the keys").into(),
        );
    }
    if let Some((ranks, flag)) = ranks_asked(&args, &scenario, launched)? {
        let launch = super::ranks::Launch {
            ranks,
            flag,
            headless: args.headless,
            record: args.record.as_deref(),
            keys: args.keys.as_deref(),
        };
        // What rank 0 would refuse is refused here, before any rank starts.
        return super::ranks::launch(launch, || prepare(&args, &scenario).map(drop));
    }
    let mut group = join_ranks(&args, &scenario)?;
    let lead = group.rank() == 0;
    // The keymap and rank 0's files are checked (and claimed) before anything is built; every
    // rank hears how it went on the others.
    let local = keymap(&args).and_then(|keys| {
        let prepared = match lead {
            true => prepare(&args, &scenario)?,
            false => Prepared::default(),
        };
        Ok((keys, prepared))
    });
    let (keys, prepared) = start_together(&mut group, &args, &scenario, local)?;
    let overwrite = Overwrite::new(args.force, args.inputs());
    // Rank 0 writes what the run writes; the other ranks train beside it.
    let record = args.record.clone().filter(|_| lead);
    let device = match group.is_parallel() {
        true => args
            .device
            .open_for_rank(gaccwb::dist::local_rank(|n| std::env::var(n).ok())),
        false => args.device.open(),
    };
    let device = together(&mut group, device.map_err(anyhow::Error::from))?;
    let group = group.adopt_device(&device)?;
    if lead && group.gradients_cross_the_host(&device) {
        eprintln!(
            "gaccwb: the ranks' gradients cross the host on every reduce (this build has no \
             NCCL); `cargo build --release --features nccl` keeps them on the GPUs"
        );
    }
    let trainer = build_trainer(&args, scenario, device, group, prepared.lock)?;
    if !args.headless {
        let options = LiveOptions {
            record,
            keys,
            overwrite,
        };
        return tui::run_live(trainer, options);
    }
    headless::refuse_screen_controls(&trainer)?;
    let session = gaccwb::session::Session::start(trainer, record.as_deref(), &overwrite)?;
    if let Some(controls) = prepared.controls {
        controls.follow(session.handle.controls.clone())?;
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

/// Ranks `run` starts itself (through mpirun), and the flag that asked for them: `--ranks`, or
/// the preset's `train.ranks` when not under a launcher already.
fn ranks_asked(
    args: &RunArgs,
    scenario: &Scenario,
    launched: bool,
) -> Result<Option<(usize, &'static str)>, UsageError> {
    let asked = match args.ranks {
        Some(n) => Some((n, "--ranks")),
        None if !launched && scenario.train.ranks > 1 => {
            Some((scenario.train.ranks as u64, "train.ranks"))
        }
        None => None,
    };
    let Some((n, flag)) = asked else {
        return Ok(None);
    };
    let max = gaccwb::limits::MAX_RANKS as u64;
    if n > max {
        return Err(UsageError(format!(
            "{flag} {n}: at most {max} ranks on one host"
        )));
    }
    Ok((n > 1).then_some((n as usize, flag)))
}

/// The keys of the screen; a keymap given with `--keys` is checked headless too (a bad one
/// fails now, not on the next screen run).
fn keymap(args: &RunArgs) -> anyhow::Result<KeyMap> {
    if args.headless && args.keys.is_none() {
        return Ok(KeyMap::default());
    }
    let keys = KeyMap::load(args.keys.as_deref()).map_err(usage)?;
    if !args.headless {
        tui::require_terminal().map_err(usage)?;
    }
    Ok(keys)
}

/// What rank 0 claims and opens before anything is built.
#[derive(Default)]
struct Prepared {
    /// The checkpoint directory's lock, held for the run's life.
    lock: Option<gaccwb::safe_write::DirLock>,
    /// `--controls-from`, opened (a FIFO or a directory is refused, never waited on).
    controls: Option<gaccwb::steer::ControlReader>,
}

/// Rank 0's files: the recording's name, the checkpoint directory (locked), the controls
/// file (opened before the recording is created, so a refused one leaves no file behind),
/// `--save-model`'s directory. Each refusal is a usage error.
fn prepare(args: &RunArgs, scenario: &Scenario) -> anyhow::Result<Prepared> {
    let overwrite = Overwrite::new(args.force, args.inputs());
    if let Some(record) = &args.record {
        // The recorder checks again, race-free; said here before anything starts.
        gaccwb::safe_write::check(record, "recording", &overwrite).map_err(usage)?;
    }
    if let Some(dir) = &args.save_model {
        // Checked again once built (a resumed run's model is the checkpoint's).
        gaccwb::model::check_target(scenario.model.path.as_deref(), dir).map_err(usage)?;
    }
    let controls = match &args.controls_from {
        Some(path) => Some(
            gaccwb::steer::ControlReader::open(path)
                .map_err(|e| usage(format!("--controls-from {}: {e}", path.display())))?,
        ),
        None => None,
    };
    let lock = match args.checkpoint_every {
        Some(_) => Some(checkpoint::claim_dir(
            &args.checkpoint_dir(),
            args.resume.as_deref(),
            args.force,
        )?),
        None => None,
    };
    Ok(Prepared { lock, controls })
}

/// Under a launcher, before anything is built: every rank compares its scenario with rank 0's
/// (a rank started with another shape, seed or step count would corrupt the collectives), then
/// all hear how `local` went on every rank ([`together`]). Alone, `local` as it is.
fn start_together<T>(
    group: &mut gaccwb::dist::Group,
    args: &RunArgs,
    scenario: &Scenario,
    local: anyhow::Result<T>,
) -> anyhow::Result<T> {
    if !group.is_parallel() {
        return local;
    }
    let mine = args.fingerprint(scenario);
    let rank0 = group.rank0_bytes(mine.to_string().as_bytes());
    let local = match super::rank_check::difference(&mine, &rank0) {
        Some(why) => local.and(Err(usage(format!(
            "rank {} was started with another run than rank 0: {why}; start every rank with \
             the same preset, --set, --seed, --steps, --data, --control, --resume and \
             --checkpoint-every",
            group.rank()
        ))
        .into())),
        None => local,
    };
    together(group, local)
}

/// Under a launcher, every rank hears how a stage went on every rank: all go on, or all end at
/// once with the first failing rank's exit code (that rank says why), instead of the others
/// waiting in their next collective until `train.comm_timeout`.
fn together<T>(group: &mut gaccwb::dist::Group, local: anyhow::Result<T>) -> anyhow::Result<T> {
    if !group.is_parallel() {
        return local;
    }
    let code = local
        .as_ref()
        .err()
        .map_or(0, |e| super::ExitClass::of(e).code());
    let codes = group.settle(u64::from(code));
    // A launcher ends the whole job when its first rank exits (the others get SIGTERM): after a
    // refusal a refusing rank says why, then every rank meets once more, so none ends before
    // every refusal is out.
    let ended = match local {
        Err(e) => Err(super::rank_check::say(&e).into()),
        Ok(local) => super::rank_check::peer_refusal(&codes)
            .map(|()| local)
            .map_err(anyhow::Error::from),
    };
    if codes.iter().any(|&c| c != 0) {
        group.settle(0);
    }
    ended
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
        s.set(assignment)?;
    }
    if let Some(budget) = &args.budget {
        s.train.memory_budget = gaccwb::budget::MemoryBudget::parse(budget).context("--budget")?;
    }
    gaccwb::model::hf::prepare(&mut s)?;
    s.validate()?;
    Ok(s)
}

/// This process's data-parallel group: alone, or one rank of the job an MPI launcher started
/// (`mpirun -n N gaccwb run --headless`). Ranks have no screen.
fn join_ranks(args: &RunArgs, scenario: &Scenario) -> anyhow::Result<gaccwb::dist::Group> {
    let timeout = std::time::Duration::from_secs_f64(scenario.train.comm_timeout);
    let group = gaccwb::dist::from_env(timeout)?;
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
    mut group: gaccwb::dist::Group,
    lock: Option<gaccwb::safe_write::DirLock>,
) -> anyhow::Result<Trainer> {
    let lead = group.rank() == 0;
    let saves = args.checkpoint_every.filter(|_| lead);
    let built = refuse_with_resume(args)
        .map_err(anyhow::Error::from)
        .and_then(|()| match &args.resume {
            Some(dir) => resume(args, dir, device, group.ranks()),
            None => Ok(Trainer::new(scenario, device)?),
        });
    // A rank that failed to build ends every rank now, not at their first collective.
    let mut trainer = together(&mut group, built)?;
    trainer.join(group)?;
    // Every rank takes part in gathering what rank 0 saves (ZeRO's sharded moments).
    if let Some(every) = args.checkpoint_every {
        trainer.gather_state_every(every);
    }
    let controls = args
        .controls
        .iter()
        .map(|c| gaccwb::scenario::parse_control_arg(c))
        .collect::<Result<_, _>>()?;
    trainer.set_cli_controls(controls);
    check_cli_controls(&trainer).map_err(UsageError)?;
    if args.resume.is_some() {
        refuse_past_controls(&trainer)?;
    }
    let inputs = args.inputs_but_resumed(Some(trainer.scenario()));
    if let Some(dir) = args.save_model.clone().filter(|_| lead) {
        let source = trainer.scenario().model.path.as_deref();
        gaccwb::model::check_target(source, &dir).map_err(usage)?;
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
            dir: args.checkpoint_dir(),
            inputs,
        };
        trainer.add_after_step(policy.after_step(lock));
    }
    Ok(trainer)
}

/// The checkpoint in `dir` continued on `ranks` ranks: refused when saved on another number of
/// ranks, or when `--steps` (the checkpoint's own, or the one given) is already reached.
fn resume(
    args: &RunArgs,
    dir: &Path,
    device: candle_core::Device,
    ranks: usize,
) -> anyhow::Result<Trainer> {
    let state = checkpoint::read_state(dir)?;
    checkpoint::check_ranks(dir, &state, ranks)?;
    let steps = args.steps.unwrap_or(state.scenario.train.steps);
    if steps > 0 && state.step >= steps {
        return Err(usage(format!(
            "--resume {}: the checkpoint is at step {}, and the run ends at step {steps}: \
             nothing is left to train; give --steps beyond {} (or 0: until stopped)",
            dir.display(),
            state.step,
            state.step
        ))
        .into());
    }
    let trainer = checkpoint::resume(dir, device, |s| {
        if let Some(n) = args.steps {
            s.train.steps = n;
        }
    })?;
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
