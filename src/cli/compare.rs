//! `gaccwb compare`: each configuration of a grid as its own recorded `gaccwb run`, one table.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use gaccwb::device::DeviceChoice;
use gaccwb::{compare, presets};

use gaccwb::signals::Signalled;

use super::{usage, UsageError};

#[derive(Args)]
pub struct CompareArgs {
    /// The preset every configuration starts from.
    #[arg(default_value = presets::DEFAULT)]
    preset: String,
    /// Configurations, e.g. "B=32,K=1; B=4,K=8; B=4,K=8,offload; B=32,K=1,ckpt" (default:
    /// the preset's [compare] grid).
    #[arg(long)]
    grid: Option<String>,
    /// The Hugging Face model every configuration trains (as `run --model`): a directory,
    /// ORG/NAME[@REVISION] from the local cache, or a config.json alone (random weights).
    #[arg(long, value_name = "PATH")]
    model: Option<String>,
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

impl CompareArgs {
    /// The files compare reads: the preset, the data it names, and the data every grid item
    /// names (`data.path="corpus.txt"`): no output may replace one of them.
    pub(super) fn inputs(&self) -> gaccwb::safe_write::Inputs {
        let mut inputs = super::inputs::preset(&self.preset);
        let Ok(base) = presets::resolve(&self.preset) else {
            return inputs;
        };
        let spec = base.compare.clone().unwrap_or_default();
        let grid = self.grid.clone().unwrap_or(spec.grid);
        for config in compare::parse_grid(&grid, &base).unwrap_or_default() {
            super::inputs::add_scenario(&config.scenario, &mut inputs);
        }
        inputs
    }
}

pub fn compare(args: CompareArgs) -> anyhow::Result<()> {
    let rules = &gaccwb::safe_write::Overwrite::new(args.force, args.inputs());
    let base = presets::resolve(&args.preset)?;
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
    // The runs check it too, but only after the ones before them trained.
    gaccwb::limits::at_most("--steps", steps, gaccwb::limits::MAX_INTEGER)?;
    let configs = compare::parse_grid(&grid, &base).map_err(usage)?;
    // Refuse before the runs, not after minutes of training.
    if args.csv.is_some() && args.csv == args.svg {
        anyhow::bail!(UsageError("--csv and --svg name the same file".into()));
    }
    for (path, what) in [(&args.csv, "table"), (&args.svg, "chart")] {
        if let Some(path) = path {
            gaccwb::safe_write::check(path, what, rules)?;
        }
    }
    // Without --record-dir the recordings are scratch; a compare killed before it removes
    // them leaves them to the next one.
    let temporary = (args.record_dir.is_none())
        .then(|| gaccwb::children::Scratch::create("compare"))
        .transpose()?;
    let record_dir = match &temporary {
        Some(t) => t.path().to_path_buf(),
        None => args.record_dir.clone().unwrap_or_default(),
    };
    let runner = compare::Runner {
        exe: std::env::current_exe()?,
        preset: args.preset.clone(),
        model: args.model.clone(),
        device: args.device.clone(),
        steps,
        record_dir,
        keep: args.record_dir.is_some(),
        force: args.force,
    };
    if let Some(dir) = &args.record_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (i, c) in configs.iter().enumerate() {
            gaccwb::safe_write::check(&runner.recording(i, c), "recording", rules)?;
        }
    }
    compare::forward_signals()?;
    let bar = progress(configs.len());
    let mut rows = Vec::new();
    let mut stopped = None;
    for (i, c) in configs.iter().enumerate() {
        let line = format!("[{}/{}] {} ({steps} steps)", i + 1, configs.len(), c.label);
        match bar.is_hidden() {
            true => gaccwb::out::note(&line),
            false => bar.set_message(line),
        }
        match gaccwb::signals::caught().map_or_else(|| runner.run(i, c), |s| Err(s.into())) {
            Ok(row) => rows.push(row),
            Err(e) => match e.downcast::<Signalled>() {
                Ok(signal) => {
                    stopped = Some(signal);
                    break;
                }
                Err(e) => return Err(e),
            },
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    print_rows(&rows, args.json)?;
    if let Some(signal) = stopped {
        // The temporary directory goes with `temporary`; the outputs are not written for a
        // table cut short.
        let done = format!(
            "compare stopped after {} of {} configurations (--csv and --svg not written)",
            rows.len(),
            configs.len()
        );
        return Err(anyhow::Error::new(signal).context(done));
    }
    if let Some(path) = &args.csv {
        let csv = compare::csv(&rows)?;
        gaccwb::safe_write::write_file(path, &csv, "table", rules)?;
    }
    if let Some(path) = &args.svg {
        let title = format!(
            "{}: {steps} optimizer steps per configuration, same seed and samples",
            base.name
        );
        gaccwb::export::compare_svg::write_compare_svg(&rows, &title, path, rules)?;
    }
    Ok(())
}

/// The table (or JSON) of the rows so far.
fn print_rows(rows: &[compare::Row], json: bool) -> anyhow::Result<()> {
    if json {
        gaccwb::out::println(&serde_json::to_string_pretty(rows)?)?;
        return Ok(());
    }
    gaccwb::out::print(&compare::table(rows))?;
    gaccwb::out::note(
        "Each row is its own `gaccwb run --headless` process; --json and --csv give the command \
         that runs it again, --record-dir DIR keeps its recording.",
    );
    Ok(())
}

/// A bar over the configurations, ticking while each one's run is in progress; hidden when
/// stderr is not a terminal (a line per configuration is printed instead).
fn progress(configs: usize) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    // A fixed template: its parse cannot fail at run time.
    let style = indicatif::ProgressStyle::with_template(
        "{spinner} {wide_msg} [{elapsed_precise}] {pos}/{len} done",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner());
    let bar = indicatif::ProgressBar::new(configs as u64).with_style(style);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}
