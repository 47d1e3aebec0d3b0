//! The model's numerical building blocks, each with a backward pass.
//!
//! Candle's fused `LayerNorm`, `softmax_last_dim` and `sdpa` are forward-only (gradients silently
//! stop there), so the model calls these instead. They are the seam where faster fused kernels
//! go: whatever replaces a body here must keep its gradients exact (the equivalence tests hold it).

use candle_core::{DType, Result, Tensor, D};

/// Layer norm over the last dimension, computed in f32 whatever the input dtype.
pub fn layer_norm(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let mean = x.mean_keepdim(D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
    let gain = gain.to_dtype(DType::F32)?;
    let bias = bias.to_dtype(DType::F32)?;
    normed
        .broadcast_mul(&gain)?
        .broadcast_add(&bias)?
        .to_dtype(dtype)
}

/// GELU, tanh approximation (as GPT-2 and `torch.nn.functional.gelu(approximate="tanh")`).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    x.gelu()
}

/// Softmax over the last dimension of attention scores `[.., T, T]` with a causal mask.
pub fn causal_softmax(scores: &Tensor) -> Result<Tensor> {
    let t = scores.dim(D::Minus1)?;
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), scores.device())?.to_dtype(scores.dtype())?;
    candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)
}

/// Sum over counted positions of the negative log-likelihood of `targets`.
/// `logits`: `[N, V]` (any float dtype; the softmax runs in f32), `targets`: `[N]` u32,
/// `mask`: `[N]` f32 with 1 for counted positions and 0 for padding.
pub fn nll_sum(logits: &Tensor, targets: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let picked = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?;
    (picked * mask)?.sum_all()?.neg()
}
