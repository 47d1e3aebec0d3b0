//! What measuring the gradient noise scale costs per optimizer step.
//!
//! `RAYON_NUM_THREADS=2 cargo run --release --example noise_cost [PRESET] [STEPS] [K]` (or, reusing
//! the debug build's dependencies, `CARGO_PROFILE_DEV_OPT_LEVEL=3 cargo run --example noise_cost`).
//!
//! The default preset runs with K = 1, where nothing is measured (the estimator needs K ≥ 2), so
//! K is raised (default 4). Two figures:
//! 1. the time spent computing the squared norms (one per micro-batch, one per window) as a
//!    share of the same window's time, measured inside each window so machine load cancels out;
//! 2. windows with the measurement against windows without it, interleaved, medians.

use std::time::Instant;

use candle_core::Device;
use gaccwb::data::Split;
use gaccwb::train::{window_gradients, Trainer};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    gaccwb::ops::configure_process();
    let args: Vec<String> = std::env::args().collect();
    let preset = args.get(1).map_or("baseline", String::as_str);
    let steps: usize = args.get(2).map_or(Ok(10), |s| s.parse())?;
    let k: usize = args.get(3).map_or(Ok(4), |s| s.parse())?;
    let mut scenario = gaccwb::presets::resolve(preset)?;
    scenario.set("train.eval_every=0")?;
    scenario.set(&format!("train.accum_steps={k}"))?;
    let mut t = Trainer::new(scenario, Device::Cpu)?;
    t.train_step(|| true).ok();
    let mut off = t.knobs().clone();
    off.noise = false;
    let on = t.knobs().clone();

    let (mut with, mut without, mut share, mut cost) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The windows after the trainer's own step, drawn from its data stream as it would.
    let window = t.knobs().effective_batch() as u64;
    for i in 0..steps as u64 {
        let start = t.cursor() + i * window;
        let samples: Vec<_> = (start..start + window)
            .map(|n| t.corpus().sample(Split::Train, n))
            .collect();
        let t0 = Instant::now();
        let plain = window_gradients(t.model(), &samples, &off, 1.0, t.device(), || true);
        without.push(t0.elapsed().as_secs_f64() * 1e3);
        drop(plain);
        let t0 = Instant::now();
        let w = window_gradients(t.model(), &samples, &on, 1.0, t.device(), || true)
            .map_err(|_| anyhow::anyhow!("window failed"))?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let norms = w.noise.expect("K ≥ 2 is measured");
        with.push(ms);
        share.push(norms.cost_ms / ms);
        cost.push(norms.cost_ms);
    }
    let (mw, mo) = (median(with), median(without));
    println!(
        "preset {preset}, K={k}, {steps} windows, RAYON_NUM_THREADS={:?}",
        std::env::var("RAYON_NUM_THREADS").ok()
    );
    println!(
        "noise norms: median {:.2} ms per window, {:.3}% of the window (max {:.3}%)",
        median(cost),
        100.0 * median(share.clone()),
        100.0 * share.iter().cloned().fold(0.0, f64::max)
    );
    println!(
        "window with measurement {mw:.1} ms, without {mo:.1} ms (medians; difference {:+.2}%, machine noise included)",
        100.0 * (mw - mo) / mo
    );
    Ok(())
}
