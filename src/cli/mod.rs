//! The command line: one file per command, each holding its clap arguments and the function
//! that carries it out. `run` is the default command: `gaccwb --headless` is `gaccwb run
//! --headless`, with the same defaults (clap's, declared once on [`run::RunArgs`]).

mod bench;
mod compare;
mod error;
mod estimate;
mod export;
mod presets;
mod replay;
mod run;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub use error::{usage, ExitClass, UsageError};

/// A terminal workbench for gradient accumulation: train a small GPT and watch memory,
/// gradients and the loss scale answer every knob.
#[derive(Parser)]
#[command(
    name = "gaccwb",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// `run`'s arguments, for `gaccwb` with no command.
    #[command(flatten)]
    run: run::RunArgs,
    /// Append diagnostics (every event, key and decision, with timestamps) to FILE. Nothing is
    /// ever written to the screen's output.
    #[arg(long, global = true, value_name = "FILE")]
    log: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Train a preset (the default command).
    Run(run::RunArgs),
    /// List the built-in presets.
    Presets,
    /// Play a recording on the workbench screen (no Candle, no GPU needed).
    Replay(replay::ReplayArgs),
    /// Predict memory per category for a preset, how it moves with the micro-batch at a fixed
    /// effective batch, and the largest micro-batch that fits a budget.
    Estimate(estimate::EstimateArgs),
    /// Turn a recording into CSV files, SVG charts or an asciinema cast of the screen.
    Export(export::ExportArgs),
    /// Measure training tokens/s of the default model on CPU.
    Bench(bench::BenchArgs),
    /// Train a preset under several configurations (same seed, same samples) and print one
    /// table: memory, throughput and loss side by side.
    Compare(compare::CompareArgs),
}

/// Parse the command line, carry out the command, and turn its outcome into the exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(path) = &cli.log {
        if let Err(e) = start_log(path) {
            eprintln!("gaccwb: --log {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    let result = match cli.command {
        None => run::run(cli.run),
        Some(Command::Run(args)) => run::run(args),
        Some(Command::Presets) => presets::list(),
        Some(Command::Replay(args)) => replay::replay(args),
        Some(Command::Estimate(args)) => estimate::estimate(args),
        Some(Command::Export(args)) => export::export(args),
        Some(Command::Bench(args)) => bench::bench(args),
        Some(Command::Compare(args)) => compare::compare(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gaccwb: {e:#}");
            ExitClass::of(&e).exit_code()
        }
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
