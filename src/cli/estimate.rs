//! `gaccwb estimate`: predicted memory per category and phase, the micro-batch table and a
//! verdict for a budget, also for shapes this program cannot train.

use clap::Args;

use gaccwb::memory::estimate::{self as est, Config};
use gaccwb::presets;

use super::{usage, UsageError};

#[derive(Args)]
pub struct EstimateArgs {
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

pub fn estimate(args: EstimateArgs) -> anyhow::Result<()> {
    let mut scenario = presets::resolve(&args.preset).map_err(usage)?;
    if let Some(name) = &args.shape {
        scenario.model = gaccwb::memory::planner::named_shape(name).map_err(usage)?;
        scenario.name = name.clone();
    }
    for assignment in &args.sets {
        scenario.set_unvalidated(assignment).map_err(usage)?;
    }
    // The estimate needs only a well-formed shape; what this program can train is reported.
    let not_trainable_here = scenario.validate().err();
    gaccwb::memory::planner::check_shape(&scenario).map_err(usage)?;
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
