use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use gaccwb::device::DeviceChoice;
use gaccwb::export::cast::{write_cast, CastOptions};
use gaccwb::headless;
use gaccwb::presets;
use gaccwb::record::read_recording;
use gaccwb::scenario::{DataSource, Scenario};
use gaccwb::train::Trainer;
use gaccwb::tui::{self, keymap::KeyMap, LiveOptions};
use gaccwb::{checkpoint, export};

/// A terminal workbench for gradient accumulation: train a small GPT and watch memory,
/// gradients and the loss scale answer every knob.
#[derive(Parser)]
#[command(name = "gaccwb", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Append diagnostics (every event, key and decision, with timestamps) to FILE. Nothing is
    /// ever written to the screen's output.
    #[arg(long, global = true, value_name = "FILE")]
    log: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Train a preset (the default command).
    Run(RunArgs),
    /// List the built-in presets.
    Presets,
    /// Play a recording on the workbench screen (no Candle, no GPU needed).
    Replay(ReplayArgs),
    /// Predict memory per category for a preset, how it moves with the micro-batch at a fixed
    /// effective batch, and the largest micro-batch that fits a budget.
    Estimate(EstimateArgs),
    /// Turn a recording into CSV files, SVG charts or an asciinema cast of the screen.
    Export(ExportArgs),
    /// Measure training tokens/s of the default model on CPU.
    Bench(BenchArgs),
    /// Train a preset under several configurations (same seed, same samples) and print one
    /// table: memory, throughput and loss side by side.
    Compare(CompareArgs),
}

#[derive(Args)]
struct CompareArgs {
    /// The preset every configuration starts from.
    #[arg(default_value = presets::DEFAULT)]
    preset: String,
    /// Configurations, e.g. "B=32,K=1; B=4,K=8; B=4,K=8,offload; B=32,K=1,ckpt" (default:
    /// the preset's [compare] grid).
    #[arg(long)]
    grid: Option<String>,
    /// Optimizer steps per configuration (default: the preset's [compare] steps, else 20).
    #[arg(long)]
    steps: Option<u64>,
    /// Also write the table as CSV.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Also draw the table as an SVG chart (grouped bars: peak memory, tokens/s).
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Replace the --csv / --svg files when they exist.
    #[arg(long)]
    force: bool,
    /// Print the rows as JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// cpu, cuda, cuda:N or auto, for every configuration.
    #[arg(long, default_value = "auto", value_parser = device_name)]
    device: String,
    /// Keep each configuration's recording in DIR (NN-LABEL.jsonl), to replay or export;
    /// by default they go to a temporary directory that is removed.
    #[arg(long, value_name = "DIR")]
    record_dir: Option<PathBuf>,
}

fn device_name(s: &str) -> Result<String, String> {
    s.parse::<DeviceChoice>().map(|_| s.to_string())
}

#[derive(Args)]
struct ReplayArgs {
    /// A recording written by --record (JSON Lines).
    file: PathBuf,
    /// Playback speed against the recorded step times (2 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// No screen: print the run's summary.
    #[arg(long)]
    headless: bool,
    /// Key bindings (TOML); default: $XDG_CONFIG_HOME/gaccwb/keys.toml when it exists.
    #[arg(long, value_name = "FILE")]
    keys: Option<PathBuf>,
}

fn parse_size(s: &str) -> Result<(u16, u16), String> {
    let bad = || format!("bad size `{s}`: expected COLSxROWS, at least 80x24, e.g. 120x40");
    let (w, h) = s.split_once('x').ok_or_else(bad)?;
    let (w, h): (u16, u16) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
    if w < 80 || h < 24 {
        return Err(bad());
    }
    Ok((w, h))
}

#[derive(Args)]
struct EstimateArgs {
    /// Built-in preset name or path to a preset TOML file.
    #[arg(default_value = presets::DEFAULT)]
    preset: String,
    /// Override a preset field, e.g. --set train.micro_batch=32 (repeatable). Model fields
    /// may name shapes this program cannot train (any vocabulary size).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// A published GPT shape (its d_model, layers, heads, context and vocab), applied before
    /// --set: gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt3-175b. The head here is untied.
    #[arg(long, value_name = "NAME")]
    shape: Option<String>,
    /// Effective batch for the micro-batch table (default: the preset's B·K).
    #[arg(long)]
    effective: Option<usize>,
    /// Memory budget in GiB for "largest micro-batch that fits".
    #[arg(long, default_value_t = 8.0)]
    budget_gib: f64,
    /// Predict for a GPU (device memory separate from the host: offload frees it).
    #[arg(long)]
    gpu: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ExportArgs {
    /// A recording made with --record.
    file: PathBuf,
    /// csv: a directory of steps.csv, memory.csv, controls.csv, evals.csv; svg: one chart file.
    #[arg(long = "to", value_enum)]
    format: ExportFormat,
    /// Output directory (csv) or file (svg, cast).
    #[arg(short = 'o', long = "out", value_name = "OUT")]
    out: PathBuf,
    /// cast: screen size, COLSxROWS.
    #[arg(long, default_value = "120x40", value_parser = parse_size)]
    size: (u16, u16),
    /// cast: time runs this many times faster than the recorded step times.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Replace existing output files (by default they are refused).
    #[arg(long)]
    force: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ExportFormat {
    Csv,
    Svg,
    /// asciinema v2 recording of the replayed screen.
    Cast,
}

#[derive(Args)]
struct BenchArgs {
    /// CPU threads for Candle's kernels (default: RAYON_NUM_THREADS, else every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Micro-batch and accumulation steps to measure, as B,K (repeatable; default 8,1 8,4 32,1
    /// plus the default preset's steps/s).
    #[arg(long = "case", value_name = "B,K", value_parser = parse_case)]
    cases: Vec<gaccwb::bench::Case>,
    /// Timed optimizer steps per case.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed optimizer steps before timing.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// One JSON object per case on stdout instead of the table.
    #[arg(long)]
    json: bool,
}

fn parse_case(text: &str) -> Result<gaccwb::bench::Case, String> {
    let parse = |s: &str| s.trim().parse::<usize>().ok().filter(|&n| n > 0);
    match text.split_once(',') {
        Some((b, k)) => match (parse(b), parse(k)) {
            (Some(micro_batch), Some(accum_steps)) => Ok(gaccwb::bench::Case {
                micro_batch,
                accum_steps,
            }),
            _ => Err(format!(
                "`{text}`: B and K must be positive integers, e.g. 8,4"
            )),
        },
        None => Err(format!("`{text}`: expected B,K, e.g. 8,4")),
    }
}

#[derive(Args, Default)]
struct RunArgs {
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

/// A problem with what the user asked for: exit code 2, like a usage error.
#[derive(Debug)]
struct UsageError(String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Keep freed buffers in the process instead of returning them to the OS after every step:
/// with glibc's defaults, a CPU training step spends a large share of its time in mmap/munmap and
/// page faults (measured: kernel CPU time per 8 steps 0.40–0.49 s by default, 0.06–0.12 s tuned).
/// 32 MiB is the largest mmap threshold glibc accepts.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator parameters; called before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// Diagnostics to `path` (appended: an earlier log is never lost), debug level and above.
fn start_log(path: &Path) -> std::io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    tracing_subscriber::fmt()
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .init();
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "gaccwb started");
    Ok(())
}

fn main() -> ExitCode {
    tune_allocator();
    gaccwb::ops::pool::configure_process();
    let cli = Cli::parse();
    if let Some(path) = &cli.log {
        if let Err(e) = start_log(path) {
            eprintln!("gaccwb: --log {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    let result = match cli.command {
        None => run(RunArgs {
            preset: presets::DEFAULT.into(),
            ..Default::default()
        }),
        Some(Command::Run(args)) => run(args),
        Some(Command::Presets) => list_presets(),
        Some(Command::Replay(args)) => replay(args),
        Some(Command::Estimate(args)) => estimate(args),
        Some(Command::Export(args)) => export(args),
        Some(Command::Bench(args)) => bench(args),
        Some(Command::Compare(args)) => compare(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gaccwb: {e:#}");
            if let Some(signal) = e.downcast_ref::<gaccwb::signals::Signalled>() {
                return ExitCode::from(signal.exit_code());
            }
            if e.downcast_ref::<UsageError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// The preset with every command-line override applied.
fn scenario_from(args: &RunArgs) -> anyhow::Result<Scenario> {
    let usage = |e: &dyn std::fmt::Display| UsageError(e.to_string());
    let mut s = presets::resolve(&args.preset).map_err(|e| usage(&e))?;
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
        .map_err(|e| usage(&format!("{e} (from --steps/--seed)")))?;
    for assignment in &args.sets {
        s.set(assignment).map_err(|e| usage(&e))?;
    }
    if let Some(budget) = &args.budget {
        gaccwb::budget::MemoryBudget::parse(budget)
            .map_err(|e| usage(&format!("--budget: {e}")))?;
        s.set(&format!("train.memory_budget=\"{budget}\""))
            .map_err(|e| usage(&e))?;
    }
    s.validate().map_err(|e| usage(&e))?;
    Ok(s)
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    let scenario = scenario_from(&args)?;
    let keys = match args.headless {
        false => {
            let keys = KeyMap::load(args.keys.as_deref()).map_err(|e| UsageError(e.to_string()))?;
            tui::require_terminal().map_err(|e| UsageError(e.to_string()))?;
            Some(keys)
        }
        true => None,
    };
    if let Some(record) = &args.record {
        check_record_target(record, &args, &scenario)?;
    }
    let device = args.device.open()?;
    if let Some(keys) = keys {
        return tui::run_live(
            build_trainer(&args, scenario, device)?,
            LiveOptions {
                record: args.record,
                keys,
                force: args.force,
            },
        );
    }
    let trainer = build_trainer(&args, scenario, device)?;
    headless::refuse_screen_controls(&trainer).map_err(|e| UsageError(format!("{e:#}")))?;
    let session = gaccwb::session::Session::start(trainer, args.record.as_deref(), args.force)
        .map_err(|e| UsageError(format!("{e:#}")))?;
    let summary = headless::run_session(session, false, true)?;
    println!("{}", summary.render());
    if let Some(signal) = summary.signal {
        return Err(signal.into());
    }
    if gaccwb::train::guard::is_failure(&summary.end_reason) {
        anyhow::bail!("training failed: {}", headless::strip(&summary.end_reason));
    }
    Ok(())
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

fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    if !(args.speed > 0.0 && args.speed.is_finite()) {
        anyhow::bail!(UsageError(format!(
            "--speed {}: expected a positive number, e.g. 2 or 0.5",
            args.speed
        )));
    }
    if !args.headless {
        let keys = KeyMap::load(args.keys.as_deref()).map_err(|e| UsageError(e.to_string()))?;
        tui::require_terminal().map_err(|e| UsageError(e.to_string()))?;
        return tui::run_replay(&args.file, args.speed, &keys);
    }
    let recording = read_recording(&args.file)?;
    for w in &recording.warnings {
        eprintln!("warning: {}", headless::strip(w));
    }
    println!("{}", tui::summarize(&recording.events).render());
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
            .map_err(|e| UsageError(format!("{e:#}")))?;
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

fn export(args: ExportArgs) -> anyhow::Result<()> {
    let recording = read_recording(&args.file)?;
    for w in &recording.warnings {
        eprintln!("gaccwb: warning: {}", headless::strip(w));
    }
    let same_file = matches!(
        (args.file.canonicalize(), args.out.canonicalize()),
        (Ok(a), Ok(b)) if a == b
    );
    if same_file {
        anyhow::bail!(UsageError(format!(
            "-o {} is the recording being exported; write to another file",
            args.out.display()
        )));
    }
    match args.format {
        ExportFormat::Csv => {
            for path in export::csv::write_csv(&recording, &args.out, args.force)? {
                println!("{}", path.display());
            }
        }
        ExportFormat::Svg => {
            export::svg::write_svg(&recording, &args.out, args.force)?;
            println!("{}", args.out.display());
        }
        ExportFormat::Cast => {
            gaccwb::safe_write::check_free(&args.out, "cast", args.force)?;
            let mut out = Vec::new();
            let opts = CastOptions {
                width: args.size.0,
                height: args.size.1,
                speed: args.speed,
                ..CastOptions::default()
            };
            let stats = write_cast(&recording.events, &mut out, &opts)?;
            gaccwb::safe_write::write_file(&args.out, &out, "cast", args.force)?;
            eprintln!(
                "wrote {}: {} frames, {} control markers, {:.1} s",
                args.out.display(),
                stats.frames,
                stats.markers,
                stats.duration_s
            );
        }
    }
    Ok(())
}

fn list_presets() -> anyhow::Result<()> {
    for s in presets::all() {
        println!("{:<24} {}", s.name, s.description);
    }
    Ok(())
}

fn estimate(args: EstimateArgs) -> anyhow::Result<()> {
    use gaccwb::memory::estimate::{self as est, Config};
    let usage = |e: &dyn std::fmt::Display| UsageError(e.to_string());
    let mut scenario = presets::resolve(&args.preset).map_err(|e| usage(&e))?;
    if let Some(name) = &args.shape {
        scenario.model = gaccwb::memory::planner::named_shape(name).map_err(|e| usage(&e))?;
        scenario.name = name.clone();
    }
    for assignment in &args.sets {
        scenario
            .set_unvalidated(assignment)
            .map_err(|e| usage(&e))?;
    }
    // The estimate needs only a well-formed shape; what this program can train is reported.
    let not_trainable_here = scenario.validate().err();
    gaccwb::memory::planner::check_shape(&scenario).map_err(|e| usage(&e))?;
    if not_trainable_here.is_none()
        && scenario.data.tokenizer == gaccwb::scenario::TokenizerKind::Bpe
    {
        // The vocabulary is the tokenizer's: train it (or hit the cache) to know it.
        gaccwb::data::Corpus::open_sizing(&mut scenario)?;
    }
    if !(args.budget_gib > 0.0 && args.budget_gib.is_finite()) {
        anyhow::bail!(UsageError(format!(
            "--budget-gib {}: expected a positive number of GiB",
            args.budget_gib
        )));
    }
    let cfg = Config::from_scenario(&scenario, !args.gpu);
    let effective = args
        .effective
        .unwrap_or(cfg.micro_batch * cfg.accum_steps)
        .max(1);
    if effective > gaccwb::limits::MAX_EFFECTIVE_BATCH {
        anyhow::bail!(UsageError(format!(
            "--effective {effective}: at most {} (the table tries every micro-batch that divides it)",
            gaccwb::limits::MAX_EFFECTIVE_BATCH
        )));
    }
    let widest = Config {
        micro_batch: effective.max(cfg.micro_batch),
        ..cfg.clone()
    };
    gaccwb::memory::fit::check_fits(&widest, None).map_err(UsageError)?;
    let budget = (args.budget_gib * (1u64 << 30) as f64) as u64;
    let mut report = est::Report::new(&scenario.name, &cfg, effective, budget);
    report.not_trainable_here = not_trainable_here;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(())
}

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    use gaccwb::bench::{self, DEFAULT_CASES};
    if let Some(n) = args.threads {
        if n == 0 {
            anyhow::bail!(UsageError("--threads must be at least 1".into()));
        }
        // Candle sizes its thread pools from this on first use, which has not happened yet.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    if args.steps == 0 {
        anyhow::bail!(UsageError("--steps must be at least 1".into()));
    }
    let preset = presets::resolve(presets::DEFAULT).map_err(|e| UsageError(e.to_string()))?;
    let device = candle_core::Device::Cpu;
    let whole_suite = args.cases.is_empty();
    let cases = if whole_suite {
        DEFAULT_CASES.to_vec()
    } else {
        args.cases.clone()
    };
    let m = &preset.model;
    if !args.json {
        println!(
            "gaccwb bench: model vocab {} d_model {} layers {} heads {} seq_len {}, f32, CPU, {} thread(s), \
             {} timed steps after {} warm-up",
            m.vocab, m.d_model, m.layers, m.heads, m.seq_len, bench::threads(), args.steps, args.warmup
        );
        println!(
            "{:>4} {:>3} {:>12} {:>12} {:>12} {:>12}",
            "B", "K", "tokens/step", "tok/s min", "tok/s med", "tok/s max"
        );
    }
    let mut results = Vec::new();
    for case in cases {
        let r = bench::measure_case(&preset, case, &device, args.warmup, args.steps)?;
        let sorted = r.tokens_per_s_sorted();
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "impl": "candle",
                    "micro_batch": r.micro_batch,
                    "accum_steps": r.accum_steps,
                    "threads": r.threads,
                    "tokens_per_step": r.tokens_per_step,
                    "tokens_per_s": r.median_tokens_per_s(),
                    "step_s": r.step_s,
                })
            );
        } else {
            println!(
                "{:>4} {:>3} {:>12} {:>12.0} {:>12.0} {:>12.0}",
                r.micro_batch,
                r.accum_steps,
                r.tokens_per_step,
                sorted[0],
                r.median_tokens_per_s(),
                sorted[sorted.len() - 1]
            );
        }
        results.push(r);
    }
    if !whole_suite || args.json {
        return Ok(());
    }
    let k1 = results[0].median_tokens_per_s();
    let k4 = results[1].median_tokens_per_s();
    println!(
        "K=4 vs K=1 at B=8: {:.3}x tokens/s (accumulation costs {:.1}%; budget 2%)",
        k4 / k1,
        (1.0 - k4 / k1) * 100.0
    );
    let default = bench::measure(preset.clone(), &device, args.warmup, args.steps)?;
    println!(
        "default preset `{}` (B={}, K={}, variable-length documents): {:.2} optimizer steps/s (median; target >= 2)",
        preset.name, default.micro_batch, default.accum_steps, default.median_steps_per_s()
    );
    Ok(())
}

fn compare(args: CompareArgs) -> anyhow::Result<()> {
    use gaccwb::compare;
    let usage = |e: &dyn std::fmt::Display| UsageError(e.to_string());
    let base = presets::resolve(&args.preset).map_err(|e| usage(&e))?;
    let spec = base.compare.clone().unwrap_or_default();
    let grid = match args.grid.or(Some(spec.grid).filter(|g| !g.is_empty())) {
        Some(g) => g,
        None => anyhow::bail!(UsageError(format!(
            "preset {} has no [compare] grid; give one with --grid, e.g. \"B=32,K=1; B=4,K=8\"",
            args.preset
        ))),
    };
    let steps = args.steps.or(spec.steps).unwrap_or(20);
    if steps == 0 {
        anyhow::bail!(UsageError("--steps must be at least 1".into()));
    }
    let configs = compare::parse_grid(&grid, &base).map_err(|e| usage(&e))?;
    // Refuse before the runs, not after minutes of training.
    if args.csv.is_some() && args.csv == args.svg {
        anyhow::bail!(UsageError("--csv and --svg name the same file".into()));
    }
    for (path, what) in [(&args.csv, "table"), (&args.svg, "chart")] {
        if let Some(path) = path {
            gaccwb::safe_write::check_free(path, what, args.force)?;
        }
    }
    let temporary = tempfile::tempdir()?;
    let runner = compare::Runner {
        exe: std::env::current_exe()?,
        preset: args.preset.clone(),
        device: args.device.clone(),
        steps,
        record_dir: args
            .record_dir
            .clone()
            .unwrap_or_else(|| temporary.path().to_path_buf()),
        force: args.force,
    };
    if let Some(dir) = &args.record_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (i, c) in configs.iter().enumerate() {
            gaccwb::safe_write::check_free(&runner.recording(i, c), "recording", args.force)?;
        }
    }
    let bar = compare_progress(configs.len());
    let mut rows = Vec::new();
    for (i, c) in configs.iter().enumerate() {
        let line = format!("[{}/{}] {} ({steps} steps)", i + 1, configs.len(), c.label);
        match bar.is_hidden() {
            true => eprintln!("{line}"),
            false => bar.set_message(line),
        }
        rows.push(runner.run(i, c)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", compare::table(&rows));
        eprintln!(
            "Each row is its own `gaccwb run --headless` process; --json and --csv give its \
             command, --record-dir DIR keeps its recording."
        );
    }
    if let Some(path) = &args.csv {
        let csv = compare::csv(&rows)?;
        gaccwb::safe_write::write_file(path, &csv, "table", args.force)?;
    }
    if let Some(path) = &args.svg {
        let title = format!(
            "{}: {steps} optimizer steps per configuration, same seed and samples",
            base.name
        );
        gaccwb::export::compare_svg::write_compare_svg(&rows, &title, path, args.force)?;
    }
    Ok(())
}

/// A bar over the configurations, ticking while each one's run is in progress; hidden when
/// stderr is not a terminal (a line per configuration is printed instead).
fn compare_progress(configs: usize) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(configs as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} {wide_msg} [{elapsed_precise}] {pos}/{len} done",
        )
        .expect("valid template"),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}
