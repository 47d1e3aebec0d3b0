//! What Candle's backward pays per graph edge: `cargo bench --bench grad_add` (set
//! RAYON_NUM_THREADS; default 1). For every op input with a gradient, `Tensor::backward` starts
//! from `zeros_like` and adds the gradient to it (`GradStore::or_insert`, then `add`). This times
//! that pair at one residual-stream activation of SmolLM-135M (B=2, T=256, d 576) in f32 and
//! bf16, and prints the ratio (docs/PERFORMANCE.md).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

const ROUNDS: u32 = 200;

/// Milliseconds per `zeros_like` + `add` of a `[512, 576]` tensor in `dtype`.
fn zeros_then_add(dtype: DType) -> candle_core::Result<f64> {
    let grad = Tensor::randn(0f32, 1.0, (512, 576), &Device::Cpu)?.to_dtype(dtype)?;
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
    let f32_ms = zeros_then_add(DType::F32)?;
    let bf16_ms = zeros_then_add(DType::BF16)?;
    println!(
        "zeros_like + add of [512, 576], {ROUNDS} rounds, threads {}:",
        candle_core::utils::get_num_threads()
    );
    println!("  f32  {f32_ms:.3} ms");
    println!("  bf16 {bf16_ms:.3} ms ({:.1}x f32)", bf16_ms / f32_ms);
    Ok(())
}
