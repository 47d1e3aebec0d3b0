//! `gaccwb bench`: training tokens/s of the default model on the CPU (or of `--model`, on the CPU
//! or a GPU), case by case.

use clap::Args;

use gaccwb::bench::{self, Case, DEFAULT_CASES};
use gaccwb::control::Dtype;
use gaccwb::device::DeviceChoice;
use gaccwb::presets;
use strum::VariantArray;

use super::UsageError;

#[derive(Args)]
pub struct BenchArgs {
    /// CPU threads for Candle's kernels (default: RAYON_NUM_THREADS, else every core).
    #[arg(long)]
    pub(super) threads: Option<usize>,
    /// Micro-batch and accumulation steps to measure, as B,K (repeatable; default 8,1 8,4 32,1
    /// plus the default preset's steps/s).
    #[arg(long = "case", value_name = "B,K", value_parser = parse_case)]
    pub(super) cases: Vec<Case>,
    /// Timed optimizer steps per case (at most 100000).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=MAX_STEPS))]
    pub(super) steps: u64,
    /// Compute dtypes, comma-separated (f32, bf16, f16): with several, each case runs in every
    /// one, a step of each in turn, and a ratio against the first is printed [default: f32].
    #[arg(long = "dtype", value_name = "LIST", value_parser = parse_dtypes)]
    pub(super) dtypes: Option<DtypeList>,
    /// Untimed optimizer steps before timing (at most 100000).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(..=MAX_STEPS))]
    pub(super) warmup: u64,
    /// One JSON object per case on stdout instead of the table.
    #[arg(long)]
    pub(super) json: bool,
    /// Measure this host's rates for `gaccwb estimate` instead of training: the fused AdamW
    /// (GB/s of optimizer state) and the f32 product (TFLOP/s).
    #[arg(long)]
    adamw: bool,
    /// Time this Hugging Face model's step instead of the default model's: a directory with
    /// config.json (a shape's config.json alone trains random weights), or ORG/NAME from the
    /// local cache. Prints FLOP/s (6 per multiplied parameter per token plus attention) beside
    /// the product rate of the device it runs on in each dtype asked for (bf16 on AMX tiles or
    /// AVX-512 BF16 dot products where the CPU has them, `GACCWB_BF16_PRODUCTS`). Default case
    /// 2,1.
    #[arg(long, value_name = "PATH")]
    pub(super) model: Option<String>,
    /// Positions per sample with `--model` (default: the default preset's).
    #[arg(long, value_name = "T", requires = "model")]
    pub(super) seq_len: Option<usize>,
    /// Where `--model`'s step runs: cpu (default), cuda or cuda:N (a build with `--features
    /// cuda`); the product rate is then cuBLAS's through Candle on that GPU.
    #[arg(long, value_name = "DEVICE", requires = "model")]
    pub(super) device: Option<DeviceChoice>,
    /// Data parallel: positions/s and the share of the step in collectives with N ranks
    /// against one rank on the same cores (each a run under mpirun; `--features mpi`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(2..))]
    ranks: Option<u64>,
}

/// Most timed or warm-up steps a benchmark takes (each is a whole optimizer step).
const MAX_STEPS: u64 = 100_000;

/// Parameters `--adamw` updates per step (16 bytes each of optimizer state: 256 MiB).
const ADAMW_PARAMS: usize = 1 << 24;
/// The side of the product `--adamw` times.
const MATMUL_N: usize = 1024;

/// The `--dtype` list, in the order given.
#[derive(Clone, Debug)]
pub(super) struct DtypeList(pub(super) Vec<Dtype>);

/// One compute dtype by name: f32, bf16 or f16.
pub(super) fn parse_dtype(name: &str) -> Result<Dtype, String> {
    Dtype::VARIANTS
        .iter()
        .copied()
        .find(|d| d.name() == name.trim())
        .ok_or_else(|| format!("`{}`: expected f32, bf16 or f16", name.trim()))
}

fn parse_dtypes(text: &str) -> Result<DtypeList, String> {
    let list = text
        .split(',')
        .map(parse_dtype)
        .collect::<Result<Vec<_>, _>>()?;
    if (1..list.len()).any(|i| list[..i].contains(&list[i])) {
        return Err(format!("`{text}`: a dtype is listed twice"));
    }
    Ok(DtypeList(list))
}

fn parse_case(text: &str) -> Result<Case, String> {
    let parse = |s: &str| s.trim().parse::<usize>().ok().filter(|&n| n > 0);
    match text.split_once(',') {
        Some((b, k)) => match (parse(b), parse(k)) {
            (Some(micro_batch), Some(accum_steps)) => Ok(Case {
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

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    if let Some(n) = args.threads {
        if n == 0 {
            anyhow::bail!(UsageError("--threads must be at least 1".into()));
        }
        // Candle sizes its thread pools from this on first use, which has not happened yet.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let (warmup, steps) = (args.warmup as usize, args.steps as usize);
    refuse_unused(&args)?;
    if args.adamw {
        return host_rates(&args);
    }
    if args.model.is_some() {
        return super::bench_model::bench_model(&args);
    }
    if let Some(ranks) = args.ranks {
        let threads = args.threads.unwrap_or_else(bench::threads);
        return super::bench_ranks::bench_ranks(ranks as usize, threads, warmup, steps);
    }
    let preset = presets::resolve(presets::DEFAULT)?;
    let device = candle_core::Device::Cpu;
    let whole_suite = args.cases.is_empty();
    let cases = if whole_suite {
        DEFAULT_CASES.to_vec()
    } else {
        args.cases.clone()
    };
    let f32_only = [Dtype::F32];
    let dtypes = args.dtypes.as_ref().map_or(&f32_only[..], |d| &d.0[..]);
    // Every case is checked before anything is printed or trained.
    for &case in &cases {
        check_case(&preset, case, dtypes)?;
    }
    let m = &preset.model;
    let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
    if !args.json {
        gaccwb::out::println(&format!(
            "gaccwb bench: model vocab {} d_model {} layers {} heads {} seq_len {}, {}, CPU, {} thread(s), \
             {} timed steps after {} warm-up{}",
            m.vocab, m.d_model, m.layers, m.heads, m.seq_len, names.join(" and "), bench::threads(),
            steps, warmup,
            if dtypes.len() > 1 { " (the dtypes' steps interleaved)" } else { "" }
        ))?;
        gaccwb::out::println(&format!(
            "{:>4} {:>3} {:>5} {:>12} {:>12} {:>12} {:>12}",
            "B", "K", "dtype", "tokens/step", "tok/s min", "tok/s med", "tok/s max"
        ))?;
    }
    let in_dtypes = |s: &gaccwb::scenario::Scenario| {
        dtypes
            .iter()
            .map(|&d| {
                let mut s = s.clone();
                s.train.dtype = d;
                s
            })
            .collect::<Vec<_>>()
    };
    let mut results = Vec::new();
    for case in cases {
        let scenarios = in_dtypes(&bench::case_scenario(&preset, case));
        let rs = bench::measure_interleaved(scenarios, &device, warmup, steps)?;
        for r in &rs {
            print_case(r, args.json)?;
        }
        if !args.json {
            print_ratios(
                &rs,
                &format!("B={},K={}", case.micro_batch, case.accum_steps),
            )?;
        }
        results.extend(rs);
    }
    if !whole_suite || args.json {
        return Ok(());
    }
    let median_at = |micro_batch, accum_steps| {
        results
            .iter()
            .find(|r| {
                r.micro_batch == micro_batch && r.accum_steps == accum_steps && r.dtype == dtypes[0]
            })
            .map(|r| r.median_tokens_per_s())
    };
    if let (Some(k1), Some(k4)) = (median_at(8, 1), median_at(8, 4)) {
        gaccwb::out::println(&format!(
            "K=4 vs K=1 at B=8 ({}): {:.3}x tokens/s (accumulation costs {:.1}%; budget 2%)",
            dtypes[0].name(),
            k4 / k1,
            (1.0 - k4 / k1) * 100.0
        ))?;
    }
    let defaults = bench::measure_interleaved(in_dtypes(&preset), &device, warmup, steps)?;
    for default in &defaults {
        gaccwb::out::println(&format!(
            "default preset `{}` (B={}, K={}, variable-length documents, {}): {:.2} optimizer steps/s (median; target >= 2)",
            preset.name, default.micro_batch, default.accum_steps, default.dtype.name(),
            default.median_steps_per_s()
        ))?;
    }
    print_ratios(&defaults, &format!("default preset `{}`", preset.name))?;
    Ok(())
}

/// `--ranks` and `--adamw` measure fixed things: the flags that choose what else to measure
/// are refused with them rather than ignored.
fn refuse_unused(args: &BenchArgs) -> Result<(), UsageError> {
    let chosen = [
        (!args.cases.is_empty(), "--case"),
        (args.dtypes.is_some(), "--dtype"),
        (args.json && args.ranks.is_some(), "--json"),
        (args.ranks.is_some() && args.adamw, "--ranks"),
    ];
    let given: Vec<&str> = chosen.iter().filter(|(g, _)| *g).map(|(_, f)| *f).collect();
    let with = match (args.adamw, args.ranks) {
        (true, _) => "--adamw",
        (false, Some(_)) => "--ranks",
        (false, None) => return Ok(()),
    };
    if given.is_empty() {
        return Ok(());
    }
    Err(UsageError(format!(
        "{with} measures the default preset's own case in f32 and prints a table; {} cannot \
         be used with it",
        given.join(", ")
    )))
}

/// A case the default model can run: B and K within bounds (else a usage error), and a window
/// that fits in memory (else the failure any run that does not fit is).
fn check_case(
    preset: &gaccwb::scenario::Scenario,
    case: Case,
    dtypes: &[Dtype],
) -> anyhow::Result<()> {
    let name = format!("--case {},{}", case.micro_batch, case.accum_steps);
    let (b, k) = (case.micro_batch, case.accum_steps);
    gaccwb::limits::check_window(b, k, preset.model.seq_len)
        .map_err(|e| UsageError(format!("{name}: {e}")))?;
    for &dtype in dtypes {
        let mut s = bench::case_scenario(preset, case);
        s.train.dtype = dtype;
        let cfg = gaccwb::memory::estimate::Config::from_scenario(&s, true)?;
        gaccwb::memory::check_fits(&cfg, None).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    }
    Ok(())
}

/// Each later dtype's median tokens/s against the first's, from interleaved measurements.
pub(super) fn print_ratios(
    rs: &[bench::Measurement],
    what: &str,
) -> Result<(), gaccwb::out::OutputError> {
    let Some((first, rest)) = rs.split_first() else {
        return Ok(());
    };
    for r in rest {
        gaccwb::out::println(&format!(
            "{} vs {} at {what}: {:.3}x tokens/s (medians, steps interleaved)",
            r.dtype.name(),
            first.dtype.name(),
            r.median_tokens_per_s() / first.median_tokens_per_s()
        ))?;
    }
    Ok(())
}

/// `--adamw`: the rates `gaccwb estimate` reads, with the flags that pass them on.
fn host_rates(args: &BenchArgs) -> anyhow::Result<()> {
    let r = bench::measure_host_rates(ADAMW_PARAMS, MATMUL_N, args.steps as usize)?;
    if args.json {
        gaccwb::out::println(&serde_json::to_string(&r)?)?;
        return Ok(());
    }
    gaccwb::out::println(&format!(
        "fused AdamW (f32), {} parameters, {} thread(s): {:.3} GB/s of optimizer state \
         (16 bytes per parameter; median of {} steps)",
        r.adamw_params,
        r.threads,
        r.adamw_bytes_per_s / 1e9,
        r.adamw_step_s.len()
    ))?;
    gaccwb::out::println(&format!(
        "f32 product {n}x{n}x{n}: {:.1} GFLOP/s (median of {} products)",
        r.matmul_flops_per_s / 1e9,
        r.matmul_s.len(),
        n = r.matmul_n
    ))?;
    gaccwb::out::println(&format!(
        "for gaccwb estimate: --cpu-adam-gbps {:.3} (and on this host --gpu-model cpu --peak-tflops {:.4})",
        r.adamw_bytes_per_s / 1e9,
        r.matmul_flops_per_s / 1e12
    ))?;
    Ok(())
}

/// One case as a JSON object: the medians, each step's time, the median phase times and the
/// fused head's share of the forward and backward (null where it did not run).
pub(super) fn case_json(r: &bench::Measurement) -> serde_json::Value {
    let (phase, head) = (r.median_phase_ms(), r.median_head_ms());
    serde_json::json!({
        "impl": "candle",
        "micro_batch": r.micro_batch,
        "accum_steps": r.accum_steps,
        "dtype": r.dtype.name(),
        "threads": r.threads,
        "tokens_per_step": r.tokens_per_step,
        "tokens_per_s": r.median_tokens_per_s(),
        "step_s": r.step_s,
        "forward_ms": phase.forward,
        "backward_ms": phase.backward,
        "optimizer_ms": phase.optimizer,
        "head_forward_ms": head.map(|h| h.forward),
        "head_backward_ms": head.map(|h| h.backward),
    })
}

/// One case as a table row, or as a JSON object.
fn print_case(r: &bench::Measurement, json: bool) -> Result<(), gaccwb::out::OutputError> {
    if json {
        return gaccwb::out::println(&case_json(r).to_string());
    }
    let sorted = r.tokens_per_s_sorted();
    gaccwb::out::println(&format!(
        "{:>4} {:>3} {:>5} {:>12} {:>12.0} {:>12.0} {:>12.0}",
        r.micro_batch,
        r.accum_steps,
        r.dtype.name(),
        r.tokens_per_step,
        sorted[0],
        r.median_tokens_per_s(),
        sorted[sorted.len() - 1]
    ))
}
