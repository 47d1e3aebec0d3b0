//! `gaccwb compare`: the same preset under several configurations, one after another from the
//! same seed on the same samples, side by side in one table.
//!
//! A grid spec lists configurations separated by `;`, each a comma-separated list of items: a
//! knob's short item from the knob table (`B=4`, `K=8`, `offload`, `bf16`, `ckpt` or
//! `ckpt=every-2`; `control::Grid`), or any `section.key=value` that `--set` takes. Each item
//! becomes one typed `scenario::Assignment`.

use std::fmt;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;

use anyhow::Context;
use serde::Serialize;

use crate::control::{Grid, Knob, Values, KNOBS};
use crate::memory::{highest_figure, step_figures};
use crate::record::{read_recording, Recording};
use crate::scenario::{nearest, Assignment, Scenario};
use crate::telemetry::{Categories, Event};

/// The short items a grid entry accepts (besides `section.key=value`), from the knob table:
/// each knob's item, or each of its value names.
pub fn short_items() -> Vec<(&'static str, &'static Knob)> {
    let mut items = Vec::new();
    for knob in KNOBS {
        match (knob.grid, knob.values) {
            (Some(Grid::Item { item, .. }), _) => items.push((item, knob)),
            (Some(Grid::ValueNames), Values::Names(names)) => {
                items.extend(names.iter().map(|n| (*n, knob)));
            }
            _ => {}
        }
    }
    items
}

/// A bad grid spec: which entry, where in the spec, and why.
#[derive(Debug)]
pub struct GridError {
    /// 1-based entry number.
    pub entry: usize,
    /// 1-based character column of the bad item in the spec.
    pub column: usize,
    pub message: String,
}

impl fmt::Display for GridError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "--grid entry {} (column {}): {}",
            self.entry, self.column, self.message
        )
    }
}

impl std::error::Error for GridError {}

/// One configuration of the grid: its label (the entry as written), the assignments it stands
/// for, and the scenario they make of the base.
pub struct Config {
    pub label: String,
    pub sets: Vec<Assignment>,
    pub scenario: Scenario,
}

/// The grid's configurations applied to `base`.
pub fn parse_grid(spec: &str, base: &Scenario) -> Result<Vec<Config>, GridError> {
    let mut configs = Vec::new();
    let mut offset = 0;
    for (i, entry) in spec.split(';').enumerate() {
        let mut scenario = base.clone();
        let mut sets: Vec<Assignment> = Vec::new();
        let mut item_offset = offset;
        for raw in entry.split(',') {
            let column = item_offset + raw.len() - raw.trim_start().len() + 1;
            item_offset += raw.len() + 1;
            let item = raw.trim();
            if item.is_empty() {
                continue;
            }
            let fail = |message: String| GridError {
                entry: i + 1,
                column,
                message,
            };
            let assignment = assignment(item).map_err(fail)?;
            if let Some(earlier) = sets.iter().find(|s| s.key == assignment.key) {
                return Err(fail(format!(
                    "`{item}` sets {} again (after `{earlier}`); one value per entry",
                    assignment.key
                )));
            }
            scenario
                .apply(&assignment, true)
                .map_err(|e| fail(e.to_string()))?;
            sets.push(assignment);
        }
        scenario.validate().map_err(|e| GridError {
            entry: i + 1,
            column: offset + 1,
            message: e.to_string(),
        })?;
        let label = entry.trim().to_string();
        if !label.is_empty() {
            configs.push(Config {
                label,
                sets,
                scenario,
            });
        }
        offset += entry.len() + 1;
    }
    if configs.is_empty() {
        return Err(GridError {
            entry: 1,
            column: 1,
            message: "no configuration; e.g. \"B=32,K=1; B=4,K=8\"".into(),
        });
    }
    Ok(configs)
}

/// The assignment a grid item stands for: a knob's short item, or `section.key=value`.
fn assignment(item: &str) -> Result<Assignment, String> {
    let (key, value) = match item.split_once('=') {
        Some((k, v)) => (k.trim(), Some(v.trim())),
        None => (item, None),
    };
    let items = short_items();
    let Some((_, knob)) = items.iter().find(|(i, _)| *i == key) else {
        if key.contains('.') {
            return Assignment::parse(item).map_err(|e| e.to_string());
        }
        let names: Vec<&str> = items.iter().map(|(i, _)| *i).collect();
        let hint = nearest(key, &names)
            .map(|n| format!("did you mean `{n}`? "))
            .unwrap_or_default();
        return Err(format!(
            "unknown key `{key}`; {hint}accepted: {}, or section.key=value",
            names.join(", ")
        ));
    };
    let value = match knob.grid {
        // The item is the value (`bf16`).
        Some(Grid::ValueNames) => Some(key),
        Some(Grid::Item { bare, .. }) => value.or(bare),
        None => value,
    };
    let value = value.ok_or_else(|| format!("`{key}` needs a value, e.g. {key}=4"))?;
    Assignment::knob(knob, value).map_err(|e| e.to_string())
}

/// What one configuration measured, read from its run's recording.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub config: String,
    pub micro_batch: usize,
    pub accum_steps: usize,
    pub effective_batch: usize,
    /// Highest measured peak over the steps (bytes).
    pub measured_peak: u64,
    /// The largest category of `measured_ledger`.
    pub largest_category: String,
    /// By category, the bytes of the step with the highest peak, at its fullest phase
    /// (`memory::figure`), counting only what lies in the measured memory.
    pub measured_ledger: Categories,
    /// The estimator's peak for the configuration the run started with.
    pub predicted_peak: u64,
    pub tokens_per_s: f64,
    pub steps_per_s: f64,
    pub train_loss: f64,
    pub val_loss: Option<f64>,
    /// The `gaccwb` arguments that run this configuration again, as they are (compare's own run
    /// also had `--record` into its recordings' folder, which may be temporary).
    pub command: Vec<String>,
    /// Where compare's run of it recorded, when the recording was kept (`--record-dir`).
    pub recording: Option<PathBuf>,
}

impl Row {
    /// The row of a finished run of `config`: the last step's knobs and loss, tokens over the
    /// summed step times, the highest step figure, the first estimate and the last evaluation.
    pub fn from_recording(
        config: &str,
        command: Vec<String>,
        recording: &Recording,
    ) -> anyhow::Result<Row> {
        let mut steps = Vec::new();
        let (mut memory, mut estimates, mut val_loss) = (Vec::new(), Vec::new(), None);
        for event in &recording.events {
            match event {
                Event::Step(s) => steps.push(s),
                Event::Memory(m) => memory.push(m),
                Event::Estimate(e) => estimates.push(e),
                Event::Eval(e) => val_loss = Some(e.val_loss),
                _ => {}
            }
        }
        let Some(last) = steps.last() else {
            anyhow::bail!("the run of `{config}` recorded no steps");
        };
        let tokens: u64 = steps.iter().map(|s| s.tokens).sum();
        let seconds = (steps.iter().map(|s| s.step_ms).sum::<f64>() / 1e3).max(f64::MIN_POSITIVE);
        let first_estimate = estimates.first().map(|e| e.step);
        let predicted_peak = estimates
            .iter()
            .filter(|e| Some(e.step) == first_estimate)
            .map(|e| e.total)
            .max()
            .unwrap_or(0);
        let peak = highest_figure(step_figures(memory));
        let (measured_peak, ledger) = peak
            .map(|p| (p.peak, p.measured_ledger()))
            .unwrap_or_default();
        // Every rank trains its own K·B samples of the window.
        let ranks = recording.header.ranks.unwrap_or(1);
        Ok(Row {
            config: config.to_string(),
            micro_batch: last.micro_batch,
            accum_steps: last.accum_steps,
            effective_batch: ranks * last.micro_batch * last.accum_steps,
            measured_peak,
            largest_category: largest_category(&ledger),
            measured_ledger: ledger,
            predicted_peak,
            tokens_per_s: tokens as f64 / seconds,
            steps_per_s: steps.len() as f64 / seconds,
            train_loss: last.loss,
            val_loss,
            command,
            recording: None,
        })
    }
}

/// How `compare` runs a configuration: as its own `gaccwb run --headless` process, recorded.
/// A process of its own is what makes the row the run's figures, to the byte: the counting
/// allocator measures a whole process, and nothing `compare` holds, nor any configuration before
/// it, is in that process.
pub struct Runner {
    /// The `gaccwb` executable.
    pub exe: PathBuf,
    /// The preset as the user named it (a built-in name or a path).
    pub preset: String,
    /// `run --model` for every configuration.
    pub model: Option<String>,
    pub device: String,
    pub steps: u64,
    /// Where the recordings go.
    pub record_dir: PathBuf,
    /// The recordings stay there after compare (`--record-dir`); otherwise it is temporary.
    pub keep: bool,
    /// Replace recordings that exist.
    pub force: bool,
}

impl Runner {
    /// The `gaccwb` arguments that run `config`, with nothing that depends on where compare
    /// keeps its recordings: they run as they are. Evaluation runs at the last step so every
    /// row has its validation loss; the grid's items come after and may change that.
    pub fn command(&self, config: &Config) -> Vec<String> {
        let steps = self.steps.to_string();
        let mut args: Vec<String> = [
            "run",
            &self.preset,
            "--headless",
            "--device",
            &self.device,
            "--steps",
            &steps,
            "--set",
            &format!("train.eval_every={steps}"),
        ]
        .map(String::from)
        .to_vec();
        if let Some(model) = &self.model {
            args.extend(["--model".to_string(), model.clone()]);
        }
        for set in &config.sets {
            args.extend(["--set".to_string(), set.to_string()]);
        }
        args
    }

    /// The arguments compare runs configuration `index` (0-based) with: its command, recording
    /// into the recordings' folder.
    pub fn arguments(&self, index: usize, config: &Config) -> Vec<String> {
        let mut args = self.command(config);
        let record = self.recording(index, config);
        args.extend(["--record".to_string(), record.to_string_lossy().into()]);
        if self.force {
            args.push("--force".into());
        }
        args
    }

    /// The recording of configuration `index`: numbered, named after its label.
    pub fn recording(&self, index: usize, config: &Config) -> PathBuf {
        let slug: String = config
            .label
            .chars()
            .filter_map(|c| match c {
                c if c.is_ascii_alphanumeric() => Some(c),
                ',' | ' ' | '.' => Some('-'),
                _ => None,
            })
            .take(60)
            .collect();
        self.record_dir
            .join(format!("{:02}-{}.jsonl", index + 1, slug.trim_matches('-')))
    }

    /// Run configuration `index` to its end and read its row from the recording. A signal
    /// `compare` caught meanwhile (forwarded to the run by `forward_signals`) is the error.
    pub fn run(&self, index: usize, config: &Config) -> anyhow::Result<Row> {
        let args = self.arguments(index, config);
        let out = run_child(&self.exe, &args)?;
        if let Some(signal) = crate::signals::caught() {
            return Err(signal.into());
        }
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            anyhow::bail!(
                "configuration {} (`{}`) failed ({}): {}\n{}",
                index + 1,
                config.label,
                out.status,
                command_line(&args),
                stderr.trim_end()
            );
        }
        let path = self.recording(index, config);
        let recording = read_recording(&path)?;
        let mut row = Row::from_recording(&config.label, self.command(config), &recording)?;
        row.recording = self.keep.then_some(path);
        Ok(row)
    }
}

/// The configuration's process now running (pid 0: none), and a signal that arrived while
/// none was, to forward as soon as one is.
static CHILD: Mutex<Child> = Mutex::new(Child {
    pid: 0,
    pending: None,
});

struct Child {
    pid: i32,
    pending: Option<i32>,
}

/// The child now running is `pid` (0: none); it is sent the signal that came meanwhile.
fn set_child(pid: i32) {
    let mut child = CHILD.lock().unwrap_or_else(|e| e.into_inner());
    child.pid = pid;
    if pid > 0 {
        if let Some(signo) = child.pending.take() {
            send(pid, signo);
        }
    }
}

/// From now on, pass SIGINT, SIGTERM and SIGHUP to the configuration's run as they arrive: it
/// stops at its next micro-batch and records its end (a second signal ends it at once), and
/// `Runner::run` returns the signal once it has exited.
pub fn forward_signals() -> anyhow::Result<()> {
    let mut stoppers = crate::signals::Stoppers::register()?;
    std::thread::Builder::new()
        .name("gaccwb-forward".into())
        .spawn(move || loop {
            let signo = stoppers.wait();
            let mut child = CHILD.lock().unwrap_or_else(|e| e.into_inner());
            match child.pid {
                0 => child.pending = Some(signo),
                pid => send(pid, signo),
            }
        })?;
    Ok(())
}

fn send(pid: i32, signo: i32) {
    if pid > 0 {
        // SAFETY: kill only sends a signal, to the child this process started and still waits
        // for (its pid cannot be reused before the wait).
        unsafe { libc::kill(pid, signo) };
    }
}

/// Run `exe` to its end. It gets a process group of its own, so a terminal's ctrl-c reaches
/// `compare` alone and is forwarded once, and it is sent SIGTERM if `compare` dies first (even
/// by SIGKILL): no run outlives `compare`.
fn run_child(exe: &Path, args: &[String]) -> anyhow::Result<std::process::Output> {
    let mut command = std::process::Command::new(exe);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = crate::children::spawn_tied(&mut command, true)
        .with_context(|| format!("starting {}", exe.display()))?;
    set_child(child.id() as i32);
    let out = child.wait_with_output();
    set_child(0);
    Ok(out?)
}

fn largest_category(c: &Categories) -> String {
    Categories::NAMES
        .iter()
        .zip(c.values())
        .max_by_key(|(_, v)| *v)
        .map(|(n, _)| n.to_string())
        .unwrap_or_default()
}

/// The table `gaccwb compare` prints.
pub fn table(rows: &[Row]) -> String {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut out = format!(
        "{:<28} {:>4} {:>3} {:>5} {:>10} {:<20} {:>10} {:>9} {:>8} {:>8} {:>8}\n",
        "configuration",
        "B",
        "K",
        "W·K·B",
        "peak MiB",
        "largest",
        "pred. MiB",
        "tok/s",
        "steps/s",
        "loss",
        "val"
    );
    for r in rows {
        let val = r.val_loss.map_or("-".into(), |v| format!("{v:.4}"));
        out += &format!(
            "{:<28} {:>4} {:>3} {:>5} {:>10.2} {:<20} {:>10.2} {:>9.0} {:>8.2} {:>8.4} {:>8}\n",
            r.config,
            r.micro_batch,
            r.accum_steps,
            r.effective_batch,
            mib(r.measured_peak),
            r.largest_category,
            mib(r.predicted_peak),
            r.tokens_per_s,
            r.steps_per_s,
            r.train_loss,
            val
        );
    }
    out
}

/// `gaccwb` with `args`, as a line to paste into a POSIX shell.
pub fn command_line(args: &[String]) -> String {
    let quote = |a: &String| {
        let plain = a
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
        match plain && !a.is_empty() {
            true => a.clone(),
            false => format!("'{}'", a.replace('\'', "'\\''")),
        }
    };
    std::iter::once("gaccwb".to_string())
        .chain(args.iter().map(quote))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One line of the CSV: a row's scalar columns and its command.
#[derive(Serialize)]
struct CsvRow<'a> {
    config: &'a str,
    micro_batch: usize,
    accum_steps: usize,
    effective_batch: usize,
    measured_peak: u64,
    largest_category: &'a str,
    predicted_peak: u64,
    tokens_per_s: f64,
    steps_per_s: f64,
    train_loss: f64,
    val_loss: Option<f64>,
    command: String,
}

/// The rows as CSV (header first).
pub fn csv(rows: &[Row]) -> anyhow::Result<Vec<u8>> {
    let mut out = csv::Writer::from_writer(Vec::new());
    for r in rows {
        out.serialize(CsvRow {
            config: &r.config,
            micro_batch: r.micro_batch,
            accum_steps: r.accum_steps,
            effective_batch: r.effective_batch,
            measured_peak: r.measured_peak,
            largest_category: &r.largest_category,
            predicted_peak: r.predicted_peak,
            tokens_per_s: r.tokens_per_s,
            steps_per_s: r.steps_per_s,
            train_loss: r.train_loss,
            val_loss: r.val_loss,
            command: command_line(&r.command),
        })?;
    }
    Ok(out.into_inner()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grid_maps_short_items_onto_the_scenario() {
        let base = Scenario::default();
        let c = parse_grid("B=32,K=1; B=4,K=8,offload,bf16; B=4,ckpt", &base).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c[1].label, "B=4,K=8,offload,bf16");
        let t = &c[1].scenario.train;
        assert_eq!((t.micro_batch, t.accum_steps, t.offload), (4, 8, true));
        assert_eq!(t.dtype, crate::control::Dtype::Bf16);
        assert_eq!(
            c[2].scenario.train.checkpointing,
            crate::control::Checkpointing::Blocks
        );
    }

    #[test]
    fn a_bad_entry_is_named_with_its_position_and_a_suggestion() {
        let e = parse_grid("B=32,K=1; B=4,offlaod", &Scenario::default())
            .err()
            .unwrap();
        assert_eq!((e.entry, e.column), (2, 15), "{e}");
        assert!(e.message.contains("did you mean `offload`"), "{e}");
        let e = parse_grid("B=4; train.acum_steps=2", &Scenario::default())
            .err()
            .unwrap();
        assert_eq!(e.entry, 2);
        assert!(e.to_string().contains("accum_steps"), "{e}");
    }

    /// `B=2,B=4` ran B=4 under that label.
    #[test]
    fn an_entry_setting_a_key_twice_is_refused() {
        let e = parse_grid("B=8; B=2, train.micro_batch = 4", &Scenario::default())
            .err()
            .unwrap();
        assert_eq!((e.entry, e.column), (2, 11), "{e}");
        assert!(e.message.contains("sets train.micro_batch again"), "{e}");
        assert!(parse_grid("B=2,K=2", &Scenario::default()).is_ok());
    }
}
