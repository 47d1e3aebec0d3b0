//! TUI benchmarks: `cargo bench --bench tui` (set RAYON_NUM_THREADS; default 1).
//!
//! 1. render time per frame at 160×48 (the full layout, 1000 steps of history);
//! 2. bytes written to the terminal per second at 120×40 while a real trainer runs, through the
//!    real event loop and crossterm backend (steady state: after a warm-up);
//! 3. the TUI's overhead on training throughput: per-step tokens/s with the screen vs headless.
//!
//! GACCWB_BENCH_SECS sets the measuring window of 2 and 3 (default 20 s).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gaccwb::headless::{self, HeadlessOptions};
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::Event;
use gaccwb::tui::app::App;
use gaccwb::tui::event_loop;
use gaccwb::tui::feed::{Feed, Live};
use gaccwb::tui::keymap::KeyMap;
use gaccwb::tui::testing::{sample_run, step};
use gaccwb::tui::ui;
use ratatui::backend::{CrosstermBackend, TestBackend};
use ratatui::layout::Rect;
use ratatui::{Terminal, TerminalOptions, Viewport};

/// A terminal that only counts what it is sent.
#[derive(Clone, Default)]
struct Counter(Arc<AtomicU64>);

impl Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// CPU seconds (user + system) this thread has used, from /proc (Linux); None elsewhere.
fn thread_cpu_s() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the parenthesised name; utime and stime are the 14th and 15th overall.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Milliseconds per `draw` with a new step before each frame.
fn frame_times<B: ratatui::backend::Backend>(t: &mut Terminal<B>) -> Vec<f64> {
    let mut app = App::default();
    for e in sample_run(1000) {
        app.update(&e);
    }
    let keys = KeyMap::default();
    let mut times = Vec::new();
    for i in 0..500u64 {
        app.update(&Event::Step(step(1001 + i, 1.3)));
        let t0 = Instant::now();
        t.draw(|f| ui::render(f, &app, &keys)).unwrap();
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    times
}

fn report_frames(what: &str, times: &[f64]) {
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!(
        "{what}: mean {mean:.3} ms, p50 {:.3} ms, p99 {:.3} ms per frame ({} frames)",
        percentile(times, 0.5),
        percentile(times, 0.99),
        times.len()
    );
}

fn render_time() {
    let mut test = Terminal::new(TestBackend::new(160, 48)).unwrap();
    report_frames("render 160x48 into a TestBackend", &frame_times(&mut test));
    let mut ansi = Terminal::with_options(
        CrosstermBackend::new(Counter::default()),
        TerminalOptions {
            viewport: Viewport::Fixed(Rect::new(0, 0, 160, 48)),
        },
    )
    .unwrap();
    report_frames(
        "render 160x48 + diff + ANSI via crossterm",
        &frame_times(&mut ansi),
    );
}

fn scenario(tiny: bool) -> Scenario {
    let mut s = gaccwb::presets::resolve(gaccwb::presets::DEFAULT).unwrap();
    if tiny {
        for set in ["model.d_model=32", "model.layers=1", "model.seq_len=32"] {
            s.set(set).unwrap();
        }
    }
    s.train.steps = 0;
    s
}

/// The live workbench at 120×40 for `warmup + window`; returns (bytes/s over the window,
/// per-step tokens/s the trainer reported, share of a core the UI thread used in the window).
fn live_screen(s: Scenario, warmup: Duration, window: Duration) -> (f64, Vec<f64>, f64) {
    let counter = Counter::default();
    let mut terminal = Terminal::with_options(
        CrosstermBackend::new(counter.clone()),
        TerminalOptions {
            viewport: Viewport::Fixed(Rect::new(0, 0, 120, 40)),
        },
    )
    .unwrap();
    // As `gaccwb run` does (and the headless run it is compared with): with the device sampler.
    let (handle, sink) = gaccwb::train::spawn(s, candle_core::Device::Cpu).unwrap();
    let sampler = gaccwb::memory::gpu::start_sampler(sink, &candle_core::Device::Cpu);
    let mut feed = Feed::Live(Live::new(handle, None).unwrap().with_sampler(sampler));
    let mut app = App::default();
    let keys = KeyMap::default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let bytes = counter.0.clone();
    let mut at_start = 0;
    let mut cpu_at_start = 0.0;
    rt.block_on(async {
        let run = event_loop::run(
            &mut terminal,
            &mut app,
            &keys,
            &mut feed,
            futures_util::stream::pending(),
            tokio::time::sleep(warmup + window),
        );
        let mark = async {
            tokio::time::sleep(warmup).await;
            at_start = bytes.load(Ordering::Relaxed);
            cpu_at_start = thread_cpu_s().unwrap_or(f64::NAN);
        };
        let (r, ()) = tokio::join!(run, mark);
        r.unwrap();
    });
    let sent = bytes.load(Ordering::Relaxed) - at_start;
    let ui_cpu = (thread_cpu_s().unwrap_or(f64::NAN) - cpu_at_start) / window.as_secs_f64();
    // The first steps pay for warming caches; headless skips them too.
    let tok: Vec<f64> = app
        .run
        .steps
        .iter()
        .skip(3)
        .map(|s| s.tokens_per_s)
        .collect();
    (sent as f64 / window.as_secs_f64(), tok, ui_cpu)
}

fn headless_tokens(mut s: Scenario, steps: u64) -> Vec<f64> {
    s.train.steps = steps;
    let summary = headless::run(
        s,
        candle_core::Device::Cpu,
        HeadlessOptions {
            record: None,
            quiet: true,
        },
    )
    .unwrap();
    summary
        .steps
        .iter()
        .skip(3)
        .map(|s| s.tokens_per_s)
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

fn main() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    let secs: u64 = std::env::var("GACCWB_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let window = Duration::from_secs(secs);
    let warmup = Duration::from_secs(3);
    println!(
        "RAYON_NUM_THREADS={}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_default()
    );
    render_time();
    let rounds: usize = std::env::var("GACCWB_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    for (name, tiny) in [("tiny model", true), ("baseline preset", false)] {
        // Alternate screen and headless runs so drifting machine load hits both alike.
        let (mut tui_all, mut head_all) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let (bps, tui_tok, ui_cpu) = live_screen(scenario(tiny), warmup, window);
            let steps = tui_tok.len() as u64;
            let head_tok = headless_tokens(scenario(tiny), steps.max(5) + 3);
            let (tui, head) = (median(tui_tok.clone()), median(head_tok.clone()));
            println!(
                "{name} round {round}: {:.2} KiB/s to the terminal at 120x40 over {secs} s \
                 ({steps} steps); UI thread {:.2}% of a core; tokens/s median: TUI {tui:.0}, \
                 headless {head:.0} ({:+.1}%)",
                bps / 1024.0,
                ui_cpu * 100.0,
                (head - tui) / head * 100.0
            );
            tui_all.extend(tui_tok);
            head_all.extend(head_tok);
        }
        let (tui, head) = (median(tui_all), median(head_all));
        println!(
            "{name} over {rounds} rounds: tokens/s median TUI {tui:.0}, headless {head:.0}, \
             TUI overhead {:+.1}%",
            (head - tui) / head * 100.0
        );
    }
}
