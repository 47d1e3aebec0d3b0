//! The command line: one file per command, each holding its clap arguments and the function
//! that carries it out. `run` is the default command: `gaccwb --headless` is `gaccwb run
//! --headless`, parsed by the same clap arguments (and defaults) as `run` itself.

mod bench;
mod bench_model;
mod bench_ranks;
mod compare;
mod error;
mod estimate;
mod eval;
mod export;
mod inputs;
mod presets;
mod rank_check;
mod ranks;
mod replay;
mod run;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use gaccwb::safe_write::{Inputs, WriteError};

pub use error::{usage, ExitClass, UsageError};

/// A terminal workbench for gradient accumulation: train a small GPT and watch memory,
/// gradients and the loss scale answer every knob.
#[derive(Parser)]
#[command(
    name = "gaccwb",
    version,
    about,
    // The command may be left out (it is then `run`); clap would show it as required.
    override_usage = "gaccwb [OPTIONS] [COMMAND]",
    after_help = "With no command, `run`: `gaccwb --headless` is `gaccwb run --headless`."
)]
struct Cli {
    /// The command; `run` when none is named.
    #[command(subcommand)]
    command: Command,
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
    /// A Hugging Face model's perplexity on a text, as transformers reports it.
    Eval(eval::EvalArgs),
    /// Measure training tokens/s of the default model on CPU.
    Bench(bench::BenchArgs),
    /// Train a preset under several configurations (same seed, same samples) and print one
    /// table: memory, throughput and loss side by side.
    Compare(compare::CompareArgs),
}

/// Parse the command line, carry out the command, and turn its outcome into the exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse_from(with_default_command(std::env::args_os().collect()));
    if let Some(path) = &cli.log {
        let record = match &cli.command {
            Command::Run(args) => args.record(),
            _ => None,
        };
        if let Some(record) = record.filter(|r| same_path(r, path)) {
            gaccwb::out::note(&format!(
                "gaccwb: --log {} and --record {} name the same file; give each its own",
                path.display(),
                record.display()
            ));
            return ExitCode::from(2);
        }
        if let Err(e) = start_log(path, &cli.inputs()) {
            gaccwb::out::note(&format!("gaccwb: --log: {e}"));
            return ExitCode::from(2);
        }
    }
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Presets => presets::list(),
        Command::Replay(args) => replay::replay(args),
        Command::Estimate(args) => estimate::estimate(args),
        Command::Export(args) => export::export(args),
        Command::Eval(args) => eval::eval(args),
        Command::Bench(args) => bench::bench(args),
        Command::Compare(args) => compare::compare(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A reader that went away (`| head`) is told nothing, as `head` users expect.
            let closed = e
                .downcast_ref::<gaccwb::out::OutputError>()
                .is_some_and(|o| o.is_broken_pipe());
            // A rank's refusal was printed while the other ranks waited for it.
            let said = e.is::<rank_check::Said>();
            if !closed && !said {
                error::print(&e);
            }
            ExitClass::of(&e).exit_code()
        }
    }
}

/// `a` and `b` are one file: the same once resolved, or (not there yet) the same absolute path.
fn same_path(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => std::path::absolute(a).ok() == std::path::absolute(b).ok(),
    }
}

/// `--speed`: a positive, finite factor (replay and the cast export).
pub fn speed(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(format!(
            "`{text}`: expected a positive number, e.g. 2 or 0.5"
        )),
    }
}

/// `args` with `run` inserted where the command belongs when none is named: after the program
/// and the global `--log FILE`, unless what stands there is a command or asks for help.
fn with_default_command(mut args: Vec<OsString>) -> Vec<OsString> {
    let mut at = 1;
    while let Some(arg) = args.get(at).and_then(|a| a.to_str()) {
        match arg {
            "--log" => at += 2,
            _ if arg.starts_with("--log=") => at += 1,
            _ => break,
        }
    }
    let named = args.get(at).and_then(|a| a.to_str()).is_some_and(|a| {
        matches!(a, "help" | "-h" | "--help" | "-V" | "--version")
            || Cli::command().get_subcommands().any(|c| c.get_name() == a)
    });
    if !named && at <= args.len() {
        args.insert(at, "run".into());
    }
    args
}

impl Cli {
    /// The files the command reads, so that `--log` appends to none of them.
    fn inputs(&self) -> Inputs {
        match &self.command {
            Command::Run(args) => args.inputs(),
            Command::Replay(args) => args.inputs(),
            Command::Estimate(args) => args.inputs(),
            Command::Export(args) => args.inputs(),
            Command::Compare(args) => args.inputs(),
            Command::Presets | Command::Bench(_) | Command::Eval(_) => Inputs::default(),
        }
    }
}

/// Diagnostics appended to `path` (an earlier log is never lost), debug level and above: a
/// regular file or a terminal, none of `inputs`, opened without blocking.
fn start_log(path: &Path, inputs: &Inputs) -> Result<(), WriteError> {
    let file = gaccwb::safe_write::open_append(path, "log", inputs)?;
    tracing_subscriber::fmt()
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .init();
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "gaccwb started");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command_of(args: &[&str]) -> String {
        let args = std::iter::once("gaccwb").chain(args.iter().copied());
        let cli = Cli::try_parse_from(with_default_command(args.map(OsString::from).collect()))
            .unwrap_or_else(|e| panic!("{e}"));
        match cli.command {
            Command::Run(_) => "run",
            Command::Presets => "presets",
            Command::Estimate(_) => "estimate",
            _ => "other",
        }
        .to_string()
    }

    #[test]
    fn run_is_the_command_when_none_is_named_wherever_the_global_log_stands() {
        assert_eq!(command_of(&[]), "run");
        assert_eq!(command_of(&["--headless", "--steps", "3"]), "run");
        assert_eq!(command_of(&["baseline", "--headless"]), "run");
        assert_eq!(command_of(&["--log", "x.log", "--headless"]), "run");
        assert_eq!(command_of(&["--log", "x.log", "presets"]), "presets");
        assert_eq!(command_of(&["--log=x.log", "estimate"]), "estimate");
        assert_eq!(command_of(&["presets", "--log", "x.log"]), "presets");
    }

    #[test]
    fn the_default_run_has_the_defaults_of_the_named_one() {
        let parse = |args: &[&str]| {
            let argv = std::iter::once("gaccwb").chain(args.iter().copied());
            match Cli::parse_from(with_default_command(argv.map(OsString::from).collect())).command
            {
                Command::Run(a) => format!("{a:?}"),
                _ => unreachable!("a run"),
            }
        };
        assert_eq!(parse(&[]), parse(&["run"]));
    }
}
