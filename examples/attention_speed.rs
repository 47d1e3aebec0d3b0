//! The fused causal attention's forward and backward alone, at the attention shapes of the
//! speed benchmark's models: milliseconds per forward + backward, median of the rounds.
//!
//! `RAYON_NUM_THREADS=1 cargo run --release --example attention_speed [ROUNDS]`
//!
//! Build it at two commits and run them in turn to compare attention kernels: the step-level
//! benchmark (`gaccwb bench --model`) sees attention as a few percent of the step, inside its
//! noise.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use gaccwb::ops::{fused, AttentionShape};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Milliseconds of one forward and backward of attention over `qkv`.
fn once(qkv: &Var, shape: AttentionShape, dtype: DType) -> candle_core::Result<f64> {
    let start = Instant::now();
    let x = qkv.as_tensor().to_dtype(dtype)?;
    let y = fused::causal_attention(&x, shape, None)?;
    let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
    grads.get(qkv).expect("qkv takes a gradient");
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

fn main() -> anyhow::Result<()> {
    gaccwb::ops::configure_process();
    let rounds: usize = std::env::args().nth(1).map_or(Ok(9), |s| s.parse())?;
    // GPT-2-small (12 heads of 64) and SmolLM-135M (9 query heads over 3 key/value heads of
    // 64), B = 2, T = 256, as `benches/hf_speed.py` runs them.
    let shapes = [
        ("gpt2-small", AttentionShape::multi_head(2, 256, 12, 768)),
        (
            "smollm-135m",
            AttentionShape {
                batch: 2,
                t: 256,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
            },
        ),
    ];
    println!("shape        dtype  ms (median of {rounds})");
    for (name, shape) in shapes {
        let n = shape.batch * shape.t;
        let qkv = Var::from_tensor(&Tensor::randn(
            0f32,
            1.0,
            (n, shape.qkv_width()),
            &Device::Cpu,
        )?)?;
        for dtype in [DType::F32, DType::BF16] {
            once(&qkv, shape, dtype)?;
            let times = (0..rounds)
                .map(|_| once(&qkv, shape, dtype))
                .collect::<candle_core::Result<Vec<_>>>()?;
            println!(
                "{name:12} {:5} {:8.2}",
                format!("{dtype:?}").to_lowercase(),
                median(times)
            );
        }
    }
    Ok(())
}
