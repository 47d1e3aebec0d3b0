//! What Candle's backward pays per graph edge: `cargo bench --bench grad_add` (set
//! RAYON_NUM_THREADS; default 1). For every op input with a gradient, `Tensor::backward` starts
//! from `zeros_like` and adds the gradient to it (`GradStore::or_insert`, then `add`). This times
//! that pair at one residual-stream activation (B=2, T=256) of GPT-2-small (d 768) and
//! SmolLM-135M (d 576) in f32 and bf16, and what it comes to per training step, where each
//! residual step's input is one edge (docs/PERFORMANCE.md).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

const ROUNDS: u32 = 200;
const ROWS: usize = 512;

/// Milliseconds per `zeros_like` + `add` of a `[ROWS, d]` tensor in `dtype`.
fn zeros_then_add(d: usize, dtype: DType) -> candle_core::Result<f64> {
    let grad = Tensor::randn(0f32, 1.0, (ROWS, d), &Device::Cpu)?.to_dtype(dtype)?;
    grad.zeros_like()?.add(&grad)?; // warm-up
    let start = Instant::now();
    for _ in 0..ROUNDS {
        std::hint::black_box(grad.zeros_like()?.add(&grad)?);
    }
    Ok(start.elapsed().as_secs_f64() * 1e3 / f64::from(ROUNDS))
}

fn main() -> candle_core::Result<()> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    println!(
        "zeros_like + add of [{ROWS}, d], {ROUNDS} rounds, threads {}:",
        candle_core::utils::get_num_threads()
    );
    // (shape, d, residual steps: two per layer)
    for (shape, d, edges) in [("GPT-2-small", 768, 24), ("SmolLM-135M", 576, 60)] {
        let f32_ms = zeros_then_add(d, DType::F32)?;
        let bf16_ms = zeros_then_add(d, DType::BF16)?;
        println!("  {shape} (d {d}, {edges} edges a step):");
        println!(
            "    f32  {f32_ms:.3} ms, {:.1} ms a step",
            f32_ms * edges as f64
        );
        println!(
            "    bf16 {bf16_ms:.3} ms, {:.1} ms a step ({:.1}x f32)",
            bf16_ms * edges as f64,
            bf16_ms / f32_ms
        );
    }
    Ok(())
}
