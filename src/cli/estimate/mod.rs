//! `gaccwb estimate`: predicted memory per category and phase, the micro-batch table and a
//! verdict for a budget, also for shapes this program cannot train; beside it the reference
//! stack (16-bit mixed precision, ZeRO, offload, recomputation) with its device and host bytes
//! and the time of a step.

use std::path::PathBuf;

use clap::Args;

use gaccwb::hf::Arch;
use gaccwb::memory::estimate::{self as est, Config};
use gaccwb::planner::options::{self as opts, Options};
use gaccwb::planner::plan::{engine_unavailable, ReferencePlan};
use gaccwb::presets;
use gaccwb::scenario::Scenario;
use serde::Serialize;

use super::{usage, UsageError};

mod render;

/// Which stacks `gaccwb estimate` answers for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::EnumString, strum::Display)]
#[strum(serialize_all = "lowercase")]
pub enum Stack {
    /// This engine's estimate.
    Engine,
    /// The usual mixed-precision stack's.
    Reference,
    /// Both, one after the other.
    Both,
}

/// Both answers: this engine's estimate (its fields at the top level) and the reference
/// stack's; `--json` prints it.
#[derive(Clone, Debug, Serialize)]
struct StackReport {
    /// This engine's estimate, when it can build the architecture.
    #[serde(flatten)]
    engine: Option<est::Report>,
    /// Why this engine has no answer (an architecture it cannot build), when it has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_unavailable: Option<String>,
    /// The reference stack's plan, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    reference: Option<ReferencePlan>,
}

impl StackReport {
    /// The report as the terminal shows it.
    fn render(&self) -> String {
        let mut parts = Vec::new();
        if let Some(e) = &self.engine {
            parts.push(format!("This engine:\n{}", render::engine(e)));
        }
        if let Some(why) = &self.engine_unavailable {
            parts.push(format!("This engine: {why}\n"));
        }
        if let Some(r) = &self.reference {
            parts.push(render::reference(r));
        }
        parts.join("\n")
    }
}

#[derive(Args)]
pub struct EstimateArgs {
    /// Built-in preset name or path to a preset TOML file.
    #[arg(default_value = presets::DEFAULT)]
    preset: String,
    /// Override a preset field, e.g. --set train.micro_batch=32 (repeatable). Model fields
    /// may name shapes this program cannot train (any vocabulary size).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// A published shape, applied before --set: gpt2, gpt2-medium, gpt2-large, gpt2-xl,
    /// gpt3-175b (this engine's head is untied), llama3-8b, llama3-70b, mistral-7b.
    #[arg(long, value_name = "NAME")]
    shape: Option<String>,
    /// A Hugging Face config.json (model_type gpt2, llama, mistral, qwen2 or gpt_neox).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Tie the head to the token embedding in the reference stack.
    #[arg(long)]
    tied: bool,
    /// Tokens per sample for the reference stack (default: the shape's context).
    #[arg(long, value_name = "N")]
    seq_len: Option<u64>,
    /// Which stacks answer: engine, reference or both.
    #[arg(long, default_value = "both", value_parser = parse_stack)]
    stack: Stack,
    /// Effective batch for the micro-batch table (default: the preset's B·K).
    #[arg(long)]
    effective: Option<usize>,
    /// Device memory budget in GiB (default: the --gpu-model's memory, else 8).
    #[arg(long)]
    budget_gib: Option<f64>,
    /// Predict this engine for a GPU (device memory separate from the host: offload frees it).
    #[arg(long)]
    gpu: bool,
    /// Reference stack: ZeRO stage 0–3.
    #[arg(long, default_value_t = 0)]
    zero: u8,
    /// Reference stack: data-parallel ranks (GPUs) on one host (1 to 1024).
    #[arg(long, default_value_t = 1)]
    ranks: u64,
    /// Reference stack: what lives in host memory, comma-separated: optimizer, gradients,
    /// parameters (ZeRO-3), or none.
    #[arg(long, value_name = "TARGETS")]
    offload: Option<String>,
    /// Reference stack: attention kernel, full or flash (default flash).
    #[arg(long)]
    attention: Option<String>,
    /// Reference stack: activation recomputation, none, selective or full (default none).
    #[arg(long)]
    recompute: Option<String>,
    /// The device for the time per step: h100, h200, a100, rtx4090 or cpu (default h100).
    #[arg(long, value_name = "NAME")]
    gpu_model: Option<String>,
    /// Override the device's dense 16-bit peak (cpu: its f32 product rate), TFLOP/s.
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Override the host link, GB/s in each direction.
    #[arg(long)]
    pcie_gbps: Option<f64>,
    /// Override the link between ranks, GB/s in each direction.
    #[arg(long)]
    link_gbps: Option<f64>,
    /// Model FLOPs utilisation, in (0, 1] (default 0.4).
    #[arg(long)]
    mfu: Option<f64>,
    /// The host's AdamW rate, GB/s of optimizer state (measure it: gaccwb bench --adamw).
    #[arg(long)]
    cpu_adam_gbps: Option<f64>,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

fn parse_stack(text: &str) -> Result<Stack, String> {
    text.parse()
        .map_err(|_| format!("`{text}`: expected engine, reference or both"))
}

impl EstimateArgs {
    fn options(&self) -> Options {
        Options {
            config: self.config.clone(),
            shape: self.shape.clone(),
            tied: self.tied,
            seq_len: self.seq_len,
            zero: self.zero,
            ranks: self.ranks,
            offload: self.offload.clone(),
            attention: self.attention.clone(),
            recompute: self.recompute.clone(),
            gpu_model: self.gpu_model.clone(),
            peak_tflops: self.peak_tflops,
            pcie_gbps: self.pcie_gbps,
            link_gbps: self.link_gbps,
            mfu: self.mfu,
            cpu_adam_gbps: self.cpu_adam_gbps,
        }
    }

    /// The files estimate reads: the preset's, and the `config.json` when one is named.
    pub(super) fn inputs(&self) -> gaccwb::safe_write::Inputs {
        let mut inputs = super::inputs::preset(&self.preset);
        if let Some(path) = &self.config {
            inputs.add("the model config", path);
        }
        inputs
    }
}

pub fn estimate(args: EstimateArgs) -> anyhow::Result<()> {
    let options = args.options();
    let mut scenario = presets::resolve(&args.preset).map_err(usage)?;
    // A GPT shape is this engine's model too; the others exist for the reference stack only.
    if let Some(m) = args
        .shape
        .as_deref()
        .and_then(|n| gaccwb::memory::verdict::named_shape(n).ok())
    {
        scenario.model = m;
        scenario.name = args.shape.clone().unwrap_or_default();
    }
    for assignment in &args.sets {
        scenario.set_unvalidated(assignment).map_err(usage)?;
    }
    let mut arch = opts::resolve_arch(&options, Arch::engine(&scenario.model))?;
    if args.config.is_none() && args.seq_len.is_none() && arch.engine_model().is_some() {
        // A GPT shape or the preset: `--set model.seq_len` reaches both stacks.
        arch.seq_len = scenario.model.seq_len as u64;
        arch.positions_table = arch.seq_len;
    }
    let engine_model = arch.engine_model();
    if let Some(m) = &engine_model {
        scenario.model = m.clone();
        if let Some(path) = &args.config {
            scenario.name = path.display().to_string();
        }
    }
    let budget_gib = match (args.budget_gib, &args.gpu_model) {
        (Some(g), _) => g,
        (None, Some(name)) if name != "cpu" => {
            opts::resolve_rates(&options)?.gpu.memory_bytes as f64 / (1u64 << 30) as f64
        }
        _ => 8.0,
    };
    if !(budget_gib > 0.0 && budget_gib.is_finite()) {
        anyhow::bail!(UsageError(format!(
            "--budget-gib {budget_gib}: expected a positive number of GiB"
        )));
    }
    let budget = (budget_gib * (1u64 << 30) as f64) as u64;
    let engine_builds = engine_model.is_some();
    if args.stack == Stack::Engine && !engine_builds {
        anyhow::bail!(UsageError(format!(
            "--stack engine: this engine {}",
            engine_unavailable(&arch)
                .replace("only the reference stack answers", "use --stack reference")
        )));
    }
    let engine = match (args.stack, engine_builds) {
        (Stack::Reference, _) | (_, false) => None,
        _ => Some(engine_report(&args, &mut scenario, budget)?),
    };
    let reference = match args.stack {
        Stack::Engine => None,
        _ => Some(reference_plan(&options, &arch, &scenario, budget)?),
    };
    let report = StackReport {
        engine,
        engine_unavailable: (!engine_builds).then(|| engine_unavailable(&arch)),
        reference,
    };
    if args.json {
        gaccwb::out::println(&serde_json::to_string_pretty(&report)?)?;
    } else {
        // A preset's name or a config's path may hold escape sequences: printed as text only.
        gaccwb::out::print(&gaccwb::headless::strip(&report.render()))?;
    }
    Ok(())
}

/// This engine's estimate, as before the reference stack existed.
fn engine_report(
    args: &EstimateArgs,
    scenario: &mut Scenario,
    budget: u64,
) -> anyhow::Result<est::Report> {
    // The estimate needs only a well-formed shape; what this program can train is reported.
    let not_trainable_here = scenario.validate().err().map(|e| e.message);
    gaccwb::memory::verdict::check_shape(scenario)?;
    if not_trainable_here.is_none()
        && scenario.data.tokenizer == gaccwb::scenario::TokenizerKind::Bpe
    {
        // The vocabulary is the tokenizer's: train it (or hit the cache) to know it.
        gaccwb::data::Corpus::open_sizing(scenario)?;
    }
    let cfg = Config::from_scenario(scenario, !args.gpu);
    if args.effective == Some(0) {
        anyhow::bail!(UsageError(
            "--effective 0: the effective batch is at least 1 sequence".into()
        ));
    }
    let effective = args.effective.unwrap_or(cfg.micro_batch * cfg.accum_steps);
    if effective > gaccwb::limits::MAX_EFFECTIVE_BATCH {
        // Name what set it: the flag, or the preset's B·K when no --effective was given.
        let what = match args.effective {
            Some(_) => format!("--effective {effective}"),
            None => format!(
                "the effective batch train.micro_batch × train.accum_steps = {} × {} = \
                 {effective}",
                cfg.micro_batch, cfg.accum_steps
            ),
        };
        anyhow::bail!(UsageError(format!(
            "{what}: at most {} (the table tries every micro-batch that divides it); give a \
             smaller --effective",
            gaccwb::limits::MAX_EFFECTIVE_BATCH
        )));
    }
    let widest = Config {
        micro_batch: effective.max(cfg.micro_batch),
        ..cfg.clone()
    };
    gaccwb::memory::fit::check_fits(&widest, None).map_err(usage)?;
    let mut report = est::Report::new(&scenario.name, &cfg, effective, budget);
    report.not_trainable_here = not_trainable_here;
    Ok(report)
}

/// The reference stack at the preset's (or --set) micro-batch and K.
fn reference_plan(
    options: &Options,
    arch: &Arch,
    scenario: &Scenario,
    budget: u64,
) -> anyhow::Result<ReferencePlan> {
    let (b, k) = (
        scenario.train.micro_batch as u64,
        scenario.train.accum_steps as u64,
    );
    if b == 0 || k == 0 {
        anyhow::bail!(UsageError(
            "train.micro_batch and train.accum_steps must be at least 1".into()
        ));
    }
    let setup = opts::resolve_setup(options, b, k)?;
    opts::check_size(arch, b * k)?;
    let rates = opts::resolve_rates(options)?;
    Ok(ReferencePlan::new(arch, &setup, &rates, budget))
}
