//! The reference versions: plain differentiable Candle ops, any dtype, any device. The fused
//! ops are tested against these.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{DType, Device, DeviceLocation, Result, Tensor, D};

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

/// `x + bias`, broadcast over the rows of `x`. In half precision the bias gradient is summed
/// in f32 (Candle's broadcast backward would sum it in the half type).
pub fn bias_add(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    if x.dtype() == DType::F32 {
        x.broadcast_add(bias)
    } else {
        super::half::broadcast_add(x, bias)
    }
}

/// `x·w + b`.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    bias_add(&x.matmul(w)?, b)
}

/// Causal multi-head self-attention over `qkv` `[B·T, 3·D]`: split heads, softmax(QKᵀ/√hd)V,
/// merge heads.
pub fn causal_attention(qkv: &Tensor, batch: usize, t: usize, heads: usize) -> Result<Tensor> {
    let d = qkv.dim(1)? / 3;
    let hd = d / heads;
    let qkv = qkv
        .reshape((batch, t, 3, heads, hd))?
        .permute((2, 0, 3, 1, 4))?; // [3, B, H, T, hd]
    let q = qkv.get(0)?.contiguous()?;
    let k = qkv.get(1)?.contiguous()?;
    let v = qkv.get(2)?.contiguous()?;
    let att = causal_softmax(&q.matmul(&k.t()?)?, 1.0 / (hd as f64).sqrt())?;
    att.matmul(&v)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((batch * t, d))
}

/// GELU, tanh approximation.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    x.gelu()
}

/// Causal softmax of `scale * scores` over the last dimension of `[.., T, T]`.
pub fn causal_softmax(scores: &Tensor, scale: f64) -> Result<Tensor> {
    let mask = causal_mask(scores.dim(D::Minus1)?, scores.device(), scores.dtype())?;
    candle_nn::ops::softmax(&(scores * scale)?.broadcast_add(&mask)?, D::Minus1)
}

/// Masks kept per thread; a run uses one or two shapes, so a handful is plenty.
const MASK_CACHE_LIMIT: usize = 8;

type MaskKey = (usize, DeviceLocation, DType);

thread_local! {
    static MASKS: RefCell<HashMap<MaskKey, Tensor>> = RefCell::new(HashMap::new());
}

/// The `[T, T]` additive causal mask (0 on and below the diagonal, −∞ above), built once per
/// size, device and dtype instead of once per layer per micro-batch (on CUDA each build is a
/// host-to-device copy).
pub fn causal_mask(t: usize, device: &Device, dtype: DType) -> Result<Tensor> {
    let key = (t, device.location(), dtype);
    if let Some(mask) = MASKS.with(|m| m.borrow().get(&key).cloned()) {
        return Ok(mask);
    }
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), device)?.to_dtype(dtype)?;
    MASKS.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() >= MASK_CACHE_LIMIT {
            m.clear();
        }
        m.insert(key, mask.clone());
    });
    Ok(mask)
}

/// Sum over counted positions of the negative log-likelihood of `targets` (softmax in f32).
pub fn nll_sum(logits: &Tensor, targets: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let picked = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?;
    (picked * mask)?.sum_all()?.neg()
}
