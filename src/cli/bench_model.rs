//! `gaccwb bench --model PATH`: the training step of a Hugging Face model (a checkpoint, or a
//! shape's config.json alone with random weights) on the CPU or a GPU, its FLOP/s against that
//! device's own product rate in the step's dtype, measured in the same process, and where the
//! step's time goes (the fused head's share of the forward and backward).

use std::path::PathBuf;

use candle_core::Device;
use gaccwb::bench::{self, Case, HeadMs, Measurement, ProductRate};
use gaccwb::control::Dtype;
use gaccwb::device::DeviceChoice;
use gaccwb::ops::peak::FmaPeak;
use gaccwb::planner::{flops_per_token, Recompute};
use gaccwb::presets;
use gaccwb::scenario::{DataSource, Scenario};

use super::bench::{case_json, print_ratios, BenchArgs};

/// The case `--model` runs when none is given: a fine-tuning micro-batch.
const MODEL_CASE: Case = Case {
    micro_batch: 2,
    accum_steps: 1,
};

/// The side of the square product timed beside the step's own shapes.
const SQUARE: usize = 1024;

pub(super) fn bench_model(args: &BenchArgs) -> anyhow::Result<()> {
    let (base, flops) = model_scenario(args)?;
    let device = args.device.unwrap_or(DeviceChoice::Cpu).open()?;
    let m = &base.model;
    let cases = if args.cases.is_empty() {
        vec![MODEL_CASE]
    } else {
        args.cases.clone()
    };
    let source = args.model.as_deref().unwrap_or_default();
    if !args.json {
        gaccwb::out::println(&format!(
            "gaccwb bench --model {source}: vocab {} d_model {} layers {} seq_len {}, {:.3} GFLOP \
             per token (6 per multiplied parameter + attention), {}, {} timed steps after {} \
             warm-up",
            m.vocab,
            m.d_model,
            m.layers,
            m.seq_len,
            flops / 1e9,
            on(&device),
            args.steps,
            args.warmup
        ))?;
    }
    let mut results = Vec::new();
    for case in &cases {
        let scenarios: Vec<Scenario> = dtypes(args)
            .iter()
            .map(|&d| {
                let mut s = bench::case_scenario(&base, *case);
                s.train.dtype = d;
                s
            })
            .collect();
        let rs = bench::measure_interleaved(
            scenarios,
            &device,
            args.warmup as usize,
            args.steps as usize,
        )?;
        if !args.json && rs.len() > 1 {
            print_ratios(
                &rs,
                &format!("B={},K={}", case.micro_batch, case.accum_steps),
            )?;
        }
        results.extend(rs);
    }
    let shapes = product_shapes(&base, &cases);
    let mut products = bench::measure_products(&shapes, Dtype::F32, args.steps as usize, &device)?;
    for &d in dtypes(args).iter().filter(|&&d| d != Dtype::F32) {
        products.extend(bench::measure_products(
            &shapes,
            d,
            args.steps as usize,
            &device,
        )?);
    }
    let limits = Limits {
        peak: bench::measure_fma_peak(&device),
        on_fmas: dtypes(args)
            .iter()
            .copied()
            .filter(|&d| bench::on_fmas(d, &device))
            .collect(),
        products,
    };
    report(args, source, &results, &limits, flops)
}

/// What the step's rate is read against: the best product timed in each dtype and, where a
/// dtype's products run on f32 FMAs, the CPU's FMA peak.
struct Limits {
    products: Vec<ProductRate>,
    peak: Option<FmaPeak>,
    /// The dtypes whose products run on f32 FMAs.
    on_fmas: Vec<Dtype>,
}

impl Limits {
    /// The best rate among the products of `dtype` (0 where none was timed).
    fn best(&self, dtype: Dtype) -> f64 {
        self.products
            .iter()
            .filter(|p| p.dtype == dtype.name())
            .map(|p| p.flops_per_s)
            .fold(0.0, f64::max)
    }

    /// The FMA peak that bounds `dtype`'s products, in FLOP/s.
    fn peak(&self, dtype: Dtype) -> Option<f64> {
        self.peak
            .filter(|_| self.on_fmas.contains(&dtype))
            .map(|p| p.flops_per_s)
    }
}

/// Where the step runs, for the header: the CPU with its thread count, or the GPU.
fn on(device: &Device) -> String {
    match device.is_cpu() {
        true => format!("CPU, {} thread(s)", bench::threads()),
        false => gaccwb::device::device_name(device),
    }
}

/// The dtypes `--dtype` asks for (f32 alone by default).
fn dtypes(args: &BenchArgs) -> &[Dtype] {
    args.dtypes.as_ref().map_or(&[Dtype::F32], |d| &d.0[..])
}

/// The default preset's training settings on the model at `--model`, and its FLOPs per token.
fn model_scenario(args: &BenchArgs) -> anyhow::Result<(Scenario, f64)> {
    let mut s = presets::resolve(presets::DEFAULT)?;
    s.model.path = args.model.as_ref().map(PathBuf::from);
    if let Some(t) = args.seq_len {
        s.model.seq_len = t;
    }
    // Synthetic samples: the step's cost does not depend on which tokens it reads.
    s.data.source = DataSource::Synthetic;
    s.data.path = None;
    let Some((_, spec)) = gaccwb::model::hf::prepare(&mut s)? else {
        anyhow::bail!("--model needs a path");
    };
    s.validate()?;
    let mut arch = spec.arch;
    arch.seq_len = s.model.seq_len as u64;
    Ok((s, flops_per_token(&arch, Recompute::None, None)))
}

/// A square product, and `[rows, d]·[d, 4d]` and the head's `[rows, d]·[d, V]` at each case's rows.
fn product_shapes(s: &Scenario, cases: &[Case]) -> Vec<(usize, usize, usize)> {
    let (d, v) = (s.model.d_model, s.model.vocab);
    let mut shapes = vec![(SQUARE, SQUARE, SQUARE)];
    for c in cases {
        let rows = c.micro_batch * s.model.seq_len;
        for shape in [(rows, d, 4 * d), (rows, d, v)] {
            if !shapes.contains(&shape) {
                shapes.push(shape);
            }
        }
    }
    shapes
}

fn report(
    args: &BenchArgs,
    source: &str,
    results: &[Measurement],
    limits: &Limits,
    flops: f64,
) -> anyhow::Result<()> {
    if args.json {
        return report_json(source, results, limits, flops);
    }
    gaccwb::out::println(&format!(
        "{:>3} {:>2} {:>5} {:>9} {:>8} {:>8} {:>7} {:>9} {:>6} {:>9} {:>6} {:>9}",
        "B",
        "K",
        "dtype",
        "tok/s med",
        "GFLOP/s",
        "of best",
        "of FMA",
        "fwd ms",
        "head",
        "bwd ms",
        "head",
        "optim ms"
    ))?;
    for r in results {
        let rate = r.median_tokens_per_s() * flops;
        let p = r.median_phase_ms();
        let head = |f: fn(&HeadMs) -> f64| {
            r.median_head_ms()
                .map_or_else(|| "-".to_string(), |h| format!("{:.0}", f(&h)))
        };
        gaccwb::out::println(&format!(
            "{:>3} {:>2} {:>5} {:>9.1} {:>8.1} {:>7.1}% {:>7} {:>9.0} {:>6} {:>9.0} {:>6} {:>9.0}",
            r.micro_batch,
            r.accum_steps,
            r.dtype.name(),
            r.median_tokens_per_s(),
            rate / 1e9,
            100.0 * rate / limits.best(r.dtype),
            share(rate, limits.peak(r.dtype)),
            p.forward,
            head(|h| h.forward),
            p.backward,
            head(|h| h.backward),
            p.optimizer
        ))?;
    }
    gaccwb::out::println(
        "head: the fused LM head and loss, part of the fwd and bwd times before it (- where the \
         lean or plain ops ran it)",
    )?;
    for p in &limits.products {
        gaccwb::out::println(&format!(
            "{} product [{}x{}]·[{}x{}] on {}: {:.1} GFLOP/s{}",
            p.dtype,
            p.m,
            p.k,
            p.k,
            p.n,
            p.kernel,
            p.flops_per_s / 1e9,
            match limits.peak.filter(|_| p.on_fmas()) {
                Some(peak) => format!(
                    " ({} of the FMA peak)",
                    share(p.flops_per_s, Some(peak.flops_per_s))
                ),
                None => String::new(),
            }
        ))?;
    }
    for &d in dtypes(args) {
        gaccwb::out::println(&format!(
            "best {} product rate: {:.1} GFLOP/s (\"of best\" above for {} rows is the step's model FLOP/s over it)",
            d.name(),
            limits.best(d) / 1e9,
            d.name()
        ))?;
    }
    if let Some(p) = limits.peak {
        gaccwb::out::println(&format!(
            "f32 FMA peak: {:.1} GFLOP/s on {} thread(s), {} (\"of FMA\": the step's model FLOP/s \
             over it, for rows whose products run on f32 FMAs; the ceiling no product passes)",
            p.flops_per_s / 1e9,
            p.threads,
            p.isa
        ))?;
    }
    Ok(())
}

/// `rate` as a percentage of `limit`, or `-` where there is none.
fn share(rate: f64, limit: Option<f64>) -> String {
    limit.map_or_else(|| "-".to_string(), |l| format!("{:.1}%", 100.0 * rate / l))
}

/// One JSON line per measured step, then one with the products and the FMA peak.
fn report_json(
    source: &str,
    results: &[Measurement],
    limits: &Limits,
    flops: f64,
) -> anyhow::Result<()> {
    for r in results {
        let mut row = case_json(r);
        let rate = r.median_tokens_per_s() * flops;
        row["model"] = source.into();
        row["seq_len"] = (r.tokens_per_step / (r.micro_batch * r.accum_steps) as u64).into();
        row["flops_per_token"] = flops.into();
        row["flops_per_s"] = rate.into();
        row["of_best_product"] = (rate / limits.best(r.dtype)).into();
        row["of_fma_peak"] = limits.peak(r.dtype).map(|p| rate / p).into();
        gaccwb::out::println(&row.to_string())?;
    }
    let peak = limits.peak.map(
        |p| serde_json::json!({"flops_per_s": p.flops_per_s, "threads": p.threads, "isa": p.isa}),
    );
    let row = serde_json::json!({
        "impl": "candle-product",
        "threads": bench::threads(),
        "products": limits.products,
        "best_flops_per_s": limits.best(Dtype::F32),
        "fma_peak": peak,
    });
    Ok(gaccwb::out::println(&row.to_string())?)
}
