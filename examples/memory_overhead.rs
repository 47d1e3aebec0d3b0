//! What the memory ledger and the device sampler cost per optimizer step.
//!
//! `RAYON_NUM_THREADS=2 cargo run --release --example memory_overhead [PRESET] [STEPS]`
//!
//! Two figures, both on the default preset unless told otherwise:
//! 1. the time spent inside the ledger's hooks (graph walk for activations, gradient-store walk,
//!    phase bookkeeping) as a share of the same steps' time, measured inside each step so load
//!    on the machine cancels out;
//! 2. windows with the ledger against windows without it (no observer), interleaved, medians;
//! 3. the sampler's cost per second at 10 Hz (time per reading × 10).

use std::time::{Duration, Instant};

use candle_core::Device;
use gaccwb::data::Split;
use gaccwb::memory::gpu::{AllocatorSource, GpuSource, SAMPLE_INTERVAL};
use gaccwb::memory::Ledger;
use gaccwb::train::{
    window_gradients, window_gradients_observed, BackwardEnd, ForwardEnd, Trainer, WindowObserver,
};

/// Times every measurement point of the ledger it wraps.
struct Timed<'a> {
    ledger: &'a mut Ledger,
    spent: Duration,
}

impl Timed<'_> {
    fn time<T>(&mut self, f: impl FnOnce(&mut Ledger) -> T) -> T {
        let t = Instant::now();
        let out = f(self.ledger);
        self.spent += t.elapsed();
        out
    }
}

impl WindowObserver for Timed<'_> {
    fn forward_start(&mut self) -> candle_core::Result<()> {
        self.time(|l| l.forward_start())
    }
    fn forward_end(&mut self, at: &ForwardEnd) -> candle_core::Result<()> {
        self.time(|l| l.forward_end(at))
    }
    fn backward_start(&mut self) -> candle_core::Result<()> {
        self.time(|l| l.backward_start())
    }
    fn backward_end(&mut self, at: &BackwardEnd) -> candle_core::Result<()> {
        self.time(|l| l.backward_end(at))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    gaccwb::ops::configure_process();
    let args: Vec<String> = std::env::args().collect();
    let preset = args.get(1).map_or("baseline", String::as_str);
    let steps: usize = args.get(2).map_or(Ok(10), |s| s.parse())?;
    let mut scenario = gaccwb::presets::resolve(preset)?;
    scenario.set("train.eval_every=0")?;
    let mut t = Trainer::new(scenario, Device::Cpu)?;
    t.train_step(|| true).ok();
    let mut ledger = Ledger::new(gaccwb::memory::gpu::meter_for(&Device::Cpu));

    let (mut with, mut without, mut hook_share) = (Vec::new(), Vec::new(), Vec::new());
    let mut hook_us = Vec::new();
    // The windows after the trainer's own step, drawn from its data stream as it would.
    let window = t.knobs().effective_batch() as u64;
    for i in 0..steps as u64 {
        let start = t.cursor() + i * window;
        let samples: Vec<_> = (start..start + window)
            .map(|n| t.corpus().sample(Split::Train, n))
            .collect();
        // Without the ledger.
        let t0 = Instant::now();
        let w = window_gradients(t.model(), &samples, t.knobs(), 1.0, t.device(), || true);
        let plain = t0.elapsed();
        drop(w);
        // With it, timing the hooks and the boundary bookkeeping.
        let params = t.model().vars().map(|v| v.as_tensor().clone()).collect();
        let t0 = Instant::now();
        let th = Instant::now();
        ledger.begin_window(params, Vec::new(), t.persistent_memory());
        let mut spent = th.elapsed();
        let mut timed = Timed {
            ledger: &mut ledger,
            spent: Duration::ZERO,
        };
        let w = window_gradients_observed(
            t.model(),
            &samples,
            t.knobs(),
            1.0,
            t.device(),
            || true,
            &mut [&mut timed],
        );
        spent += timed.spent;
        let w = w.map_err(|_| anyhow::anyhow!("window failed"))?;
        let th = Instant::now();
        ledger.optimizer_start(&w.buffer());
        ledger.finish_window(1, t.persistent_memory());
        ledger.take_events();
        spent += th.elapsed();
        let measured = t0.elapsed();
        with.push(measured.as_secs_f64() * 1e3);
        without.push(plain.as_secs_f64() * 1e3);
        hook_share.push(spent.as_secs_f64() / measured.as_secs_f64());
        hook_us.push(spent.as_secs_f64() * 1e6);
    }
    let mut source = AllocatorSource::new();
    let n = 1000;
    let t0 = Instant::now();
    for _ in 0..n {
        std::hint::black_box(source.sample().ok());
    }
    let per_reading = t0.elapsed().as_secs_f64() / n as f64;
    let sampler_share = per_reading / SAMPLE_INTERVAL.as_secs_f64();

    let (mw, mo) = (median(with), median(without));
    println!(
        "preset {preset}, {steps} windows, RAYON_NUM_THREADS={:?}",
        std::env::var("RAYON_NUM_THREADS").ok()
    );
    println!("ledger hooks: median {:.0} µs per window", median(hook_us));
    println!(
        "ledger hooks: median {:.3}% of the window (max {:.3}%)",
        100.0 * median(hook_share.clone()),
        100.0 * hook_share.iter().cloned().fold(0.0, f64::max)
    );
    println!("window with ledger {mw:.1} ms, without {mo:.1} ms (medians; difference {:+.2}%, machine noise included)", 100.0 * (mw - mo) / mo);
    println!(
        "sampler: {:.1} µs per reading, {:.4}% of one core at 10 Hz",
        per_reading * 1e6,
        100.0 * sampler_share
    );
    Ok(())
}
