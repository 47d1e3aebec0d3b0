//! `gaccwb estimate`: predicted memory per category and phase, the micro-batch table and a
//! verdict for a budget, also for shapes this program cannot train; beside it the reference
//! stack (16-bit mixed precision, ZeRO, offload, recomputation, LoRA) with its device and host
//! bytes and the time of a step.

use std::path::PathBuf;

use clap::Args;

use gaccwb::hf::Arch;
use gaccwb::memory::estimate::{self as est, Config};
use gaccwb::planner::{self, engine_lora, engine_model, Options, ReferencePlan};
use gaccwb::presets;
use gaccwb::scenario::Scenario;
use serde::Serialize;

use super::{usage, UsageError};

mod host;
mod reference;
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

/// The model planned, once for both stacks: its name, its true parameter count (every expert;
/// the published, tied count where the head is tied) and what one token meets.
#[derive(Clone, Debug, Serialize)]
struct Model {
    /// The preset, shape or config file it came from.
    name: String,
    /// Parameters as `transformers` counts them.
    params: u64,
    /// Parameters one token meets (the routed experts only); `params` for a dense model.
    active_params: u64,
    /// The architecture, the sequence length planned included.
    arch: Arch,
}

/// The device budget judged against and where it comes from.
#[derive(Clone, Debug, Serialize)]
struct Budget {
    /// Bytes per device.
    bytes: u64,
    /// `--budget-gib`, the GPU's memory, or this host's.
    source: String,
}

/// Every answer, in one shape for every family: the model and the budget once, then each stack's
/// answer or why it has none. `--json` prints it.
#[derive(Clone, Debug, Serialize)]
struct Answer {
    model: Model,
    budget: Budget,
    /// This engine's estimate, when it can build the model.
    engine: Option<est::Report>,
    /// Why this engine has no answer, when it has none.
    engine_unavailable: Option<String>,
    /// The reference stack's plan, unless `--stack engine`.
    reference: Option<ReferencePlan>,
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
    /// A Hugging Face config.json (model_type gpt2, gpt_neox, llama, mistral, mixtral, qwen2,
    /// qwen2_moe, qwen3, qwen3_moe, gemma, gemma2, phi3; a multimodal wrapper's text_config).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Tie the head to the token embedding in the reference stack.
    #[arg(long)]
    tied: bool,
    /// Tokens per sample, the same setting as --set model.seq_len (default: the preset's; for
    /// --config and --shape the model's context up to 4096).
    #[arg(long, value_name = "N")]
    seq_len: Option<u64>,
    /// Which stacks answer: engine, reference or both.
    #[arg(long, default_value = "both", value_parser = parse_stack)]
    stack: Stack,
    /// Effective batch for the micro-batch table (default: the preset's B·K).
    #[arg(long)]
    effective: Option<usize>,
    /// Device memory budget in GiB (default: the memory of --gpu-model; cpu: this host's).
    #[arg(long)]
    budget_gib: Option<f64>,
    /// Predict this engine for a GPU (device memory separate from the host: offload frees it).
    #[arg(long)]
    gpu: bool,
    /// Reference stack: ZeRO stage 0–3.
    #[arg(long, default_value_t = 0)]
    zero: u8,
    /// Reference stack: data-parallel ranks (GPUs) on one host.
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
    /// Reference stack: train LoRA adapters of this rank on a frozen base (0: every weight).
    #[arg(long, value_name = "R")]
    lora_rank: Option<u64>,
    /// Reference stack: the linear layers adapted, comma-separated module names (default:
    /// every projection of the attention and the MLP, the experts' too).
    #[arg(long, value_name = "NAMES")]
    lora_targets: Option<String>,
    /// Reference stack: dropout on the adapters' inputs (default 0).
    #[arg(long, value_name = "P")]
    lora_dropout: Option<f64>,
    /// Reference stack: the frozen base's storage under LoRA: bf16, int8 or nf4 (default bf16).
    #[arg(long, value_name = "DTYPE")]
    base_dtype: Option<String>,
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
    /// Model FLOPs utilisation, from 0.001 to 1 (default 0.4).
    #[arg(long)]
    mfu: Option<f64>,
    /// The host's AdamW rate, GB/s of optimizer state (default: timed on this host once and
    /// cached).
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
            host: Default::default(),
            lora_rank: self.lora_rank,
            lora_targets: self.lora_targets.clone(),
            lora_dropout: self.lora_dropout,
            base_dtype: self.base_dtype.clone(),
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

    /// Whether a `--set` names `key`.
    fn sets(&self, key: &str) -> bool {
        self.sets
            .iter()
            .any(|s| s.split_once('=').is_some_and(|(k, _)| k.trim() == key))
    }
}

pub fn estimate(args: EstimateArgs) -> anyhow::Result<()> {
    let mut options = args.options();
    let mut scenario = presets::resolve(&args.preset)?;
    // A GPT shape is this engine's model too; the others exist for the reference stack only.
    if let Some(m) = args
        .shape
        .as_deref()
        .and_then(|n| gaccwb::memory::named_shape(n).ok())
    {
        scenario.model = m;
        scenario.name = args.shape.clone().unwrap_or_default();
    }
    for assignment in &args.sets {
        scenario.set_unvalidated(assignment)?;
    }
    options.seq_len = seq_len(&args, &scenario)?;
    if let Some(s) = options.seq_len {
        scenario.model.seq_len = usize::try_from(s).unwrap_or(usize::MAX);
    }
    let arch = planner::resolve_arch(&options, Arch::engine(&scenario.model))?;
    share_lora(&mut options, &mut scenario, &arch);
    let lora = planner::resolve_lora(&options, &arch)?;
    // A config of a family the engine trains is estimated as a run would load it (GPT-2's tied
    // head included), not as this engine's GPT of the same widths.
    let engine = match trained_family(&args, usize::try_from(arch.seq_len).unwrap_or(usize::MAX)) {
        Some(model) => engine_lora(lora.as_ref()).map(|()| model),
        None => engine_model(&arch, lora.as_ref()),
    };
    if let Ok(m) = &engine {
        scenario.model = m.clone();
    }
    match (&args.config, &args.shape) {
        (Some(path), _) => scenario.name = path.display().to_string(),
        (None, Some(shape)) => scenario.name = shape.clone(),
        (None, None) => {}
    }
    let hub_model = engine.is_err() || args.config.is_some();
    if hub_model && !args.sets("train.micro_batch") && !args.sets("train.accum_steps") {
        // A Hugging Face model: start from one sample per micro-batch at the preset's effective
        // batch, what a fine-tune of a large model starts from.
        let t = &mut scenario.train;
        t.accum_steps *= t.micro_batch;
        t.micro_batch = 1;
    }
    let budget = budget(&args, &options)?;
    let answer = answer(&args, &options, &arch, engine, &mut scenario, budget)?;
    if args.json {
        gaccwb::out::println(&serde_json::to_string_pretty(&answer)?)?;
    } else {
        // A preset's name or a config's path may hold escape sequences: printed as text only.
        gaccwb::out::print(&gaccwb::headless::strip(&render::answer(&answer)))?;
    }
    Ok(())
}

/// `--lora-*` and `--set train.lora_*` are one setting for both stacks: the flags win, and a
/// preset's or `--set`'s LoRA reaches the reference stack when no flag names one (its targets
/// only when they are names the reference stack knows, such as `q_proj`, not this engine's
/// `attn.qkv`: else it plans its default, every projection, and says so in its line).
fn share_lora(options: &mut Options, scenario: &mut Scenario, arch: &Arch) {
    let t = &mut scenario.train;
    match options.lora_rank {
        Some(rank) => {
            t.lora_rank = usize::try_from(rank).unwrap_or(usize::MAX);
            if let Some(targets) = &options.lora_targets {
                t.lora_targets = targets
                    .split(',')
                    .map(|n| n.trim().to_string())
                    .filter(|n| !n.is_empty())
                    .collect();
            }
            if let Some(dropout) = options.lora_dropout {
                t.lora_dropout = dropout;
            }
        }
        None if t.lora_rank > 0 => {
            options.lora_rank = Some(t.lora_rank as u64);
            let known = gaccwb::planner::Lora::new(
                arch,
                t.lora_rank as u64,
                Some(t.lora_targets.clone()),
                0.0,
                Default::default(),
            )
            .is_ok();
            if !t.lora_targets.is_empty() && known {
                options.lora_targets = Some(t.lora_targets.join(","));
            }
            if t.lora_dropout > 0.0 {
                options.lora_dropout = Some(t.lora_dropout);
            }
        }
        None => {}
    }
}

/// `--seq-len` and `--set model.seq_len` are one setting: either, or both when they agree.
fn seq_len(args: &EstimateArgs, scenario: &Scenario) -> anyhow::Result<Option<u64>> {
    let set = args
        .sets("model.seq_len")
        .then_some(scenario.model.seq_len as u64);
    match (args.seq_len, set) {
        (Some(a), Some(b)) if a != b => anyhow::bail!(UsageError(format!(
            "--seq-len {a} and --set model.seq_len={b} name one setting; give one"
        ))),
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

/// The budget: `--budget-gib`, else the memory of the GPU `--gpu-model` names (h100 when none),
/// or this host's installed memory for `cpu`.
fn budget(args: &EstimateArgs, options: &Options) -> anyhow::Result<Budget> {
    const GIB: f64 = (1u64 << 30) as f64;
    if let Some(g) = args.budget_gib {
        if !(g > 0.0 && g.is_finite() && g * GIB < u64::MAX as f64) {
            anyhow::bail!(UsageError(format!(
                "--budget-gib {g}: expected a positive number of GiB below 2^34"
            )));
        }
        return Ok(Budget {
            bytes: (g * GIB) as u64,
            source: "--budget-gib".into(),
        });
    }
    let rates = planner::resolve_rates(options)?;
    if !rates.gpu.host {
        return Ok(Budget {
            bytes: rates.gpu.memory_bytes,
            source: format!(
                "the {}'s {} GB{}",
                rates.gpu.name,
                rates.gpu.memory_bytes / 1_000_000_000,
                if args.gpu_model.is_none() {
                    ", the default --gpu-model"
                } else {
                    ""
                }
            ),
        });
    }
    Ok(match gaccwb::memory::gpu::host_memory_total() {
        Some(bytes) => Budget {
            bytes,
            source: "this host's installed memory".into(),
        },
        None => Budget {
            bytes: 8 << 30,
            source: "8 GiB (this host's memory is unknown)".into(),
        },
    })
}

/// Both stacks' answers.
fn answer(
    args: &EstimateArgs,
    options: &Options,
    arch: &Arch,
    engine: Result<gaccwb::scenario::ModelConfig, String>,
    scenario: &mut Scenario,
    budget: Budget,
) -> anyhow::Result<Answer> {
    if args.stack == Stack::Engine {
        if let Err(why) = &engine {
            anyhow::bail!(UsageError(format!(
                "--stack engine: this engine {}",
                why.replace("only the reference stack answers", "use --stack reference")
            )));
        }
    }
    let engine_report = match (args.stack, &engine) {
        (Stack::Reference, _) | (_, Err(_)) => None,
        _ => Some(engine_report(args, scenario, budget.bytes)?),
    };
    let reference = match args.stack {
        Stack::Engine => None,
        _ => Some(reference_plan(options, arch, scenario, budget.bytes)?),
    };
    Ok(Answer {
        model: Model {
            name: scenario.name.clone(),
            params: arch.param_count(),
            active_params: arch.active_params(),
            arch: arch.clone(),
        },
        budget,
        engine: engine_report,
        engine_unavailable: engine.err(),
        reference,
    })
}

/// `--config` of a family this engine trains (`model::spec`), as a run reads it: the estimator
/// then books that family's blocks (`memory::estimate::arch_of`).
fn trained_family(args: &EstimateArgs, seq_len: usize) -> Option<gaccwb::scenario::ModelConfig> {
    let path = args.config.as_ref()?;
    let dir = gaccwb::model::hf::resolve(&path.to_string_lossy()).ok()?;
    let spec = gaccwb::model::hf::ModelDir::open(&dir).ok()?.spec().ok()?;
    let mut model = spec.model_config(seq_len);
    model.path = Some(path.clone());
    Some(model)
}

/// This engine's estimate for the GPT model it builds.
fn engine_report(
    args: &EstimateArgs,
    scenario: &mut Scenario,
    budget: u64,
) -> anyhow::Result<est::Report> {
    // The estimate needs only a well-formed shape; what this program can train is reported.
    // A Hugging Face model's vocabulary is its tokenizer's, which a run reads (`hf::prepare`).
    let not_trainable_here = match scenario.model.path {
        Some(_) => None,
        None => scenario.validate().err().map(|e| e.message),
    };
    gaccwb::memory::check_shape(scenario)?;
    if not_trainable_here.is_none()
        && scenario.data.tokenizer == gaccwb::scenario::TokenizerKind::Bpe
    {
        // The vocabulary is the tokenizer's: train it (or hit the cache) to know it.
        gaccwb::data::Corpus::open_sizing(scenario)?;
    }
    let cfg = Config::from_scenario(scenario, !args.gpu)?;
    if cfg.lora.as_ref().is_some_and(|a| !a.any()) {
        anyhow::bail!(UsageError(format!(
            "train.lora_targets {:?}: no layer of this engine's {} model has that name; its \
             layers are {} (or give --stack reference)",
            scenario.train.lora_targets,
            cfg.arch.family,
            est::Adapters::layer_names(&cfg.arch).join(", ")
        )));
    }
    if args.effective == Some(0) {
        anyhow::bail!(UsageError(
            "--effective 0: the effective batch is at least 1 sequence".into()
        ));
    }
    let effective = match args.effective {
        Some(e) => e,
        None => cfg.micro_batch.saturating_mul(cfg.accum_steps),
    };
    if effective > gaccwb::limits::MAX_EFFECTIVE_BATCH {
        let named = match args.effective {
            Some(e) => format!("--effective {e}"),
            None => format!(
                "train.micro_batch × train.accum_steps = {} × {} = {effective}",
                cfg.micro_batch, cfg.accum_steps
            ),
        };
        anyhow::bail!(UsageError(format!(
            "{named}: the effective batch is at most {} (the table tries every micro-batch that \
             divides it)",
            gaccwb::limits::MAX_EFFECTIVE_BATCH
        )));
    }
    let widest = Config {
        micro_batch: effective.max(cfg.micro_batch),
        ..cfg.clone()
    };
    gaccwb::memory::check_fits(&widest, None).map_err(usage)?;
    let mut report = est::Report::new(&scenario.name, &cfg, effective, budget);
    report.not_trainable_here = not_trainable_here;
    Ok(report)
}

/// The reference stack at the scenario's micro-batch and K.
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
    let setup = planner::resolve_setup(options, arch, b, k)?;
    planner::check_size(arch, b.saturating_mul(k))?;
    planner::resolve_rates(options)?;
    // Timed only once everything else is known to be good, and only when no flag gives it.
    let cpu_peak_needed =
        options.gpu_model.as_deref() == Some("cpu") && options.peak_tflops.is_none();
    let host = if options.cpu_adam_gbps.is_none() || cpu_peak_needed {
        host::figures()
    } else {
        Default::default()
    };
    let rates = planner::resolve_rates(&Options {
        host,
        ..options.clone()
    })?;
    Ok(ReferencePlan::new(arch, &setup, &rates, budget))
}
