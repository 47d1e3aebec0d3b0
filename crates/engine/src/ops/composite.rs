//! The reference versions: plain differentiable Candle ops, any dtype, any device. The fused
//! ops are tested against these.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, DeviceLocation, Result, Tensor, D};

use super::rope::RopeTable;
use super::AttentionShape;

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

/// RMS norm as transformers' `LlamaRMSNorm`: `x/√(mean(x²) + eps)` in f32, rounded to `x`'s
/// dtype, then times the gain.
pub fn rms_norm(x: &Tensor, gain: &Tensor, eps: f64) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let ms = x32.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = x32
        .broadcast_div(&(ms + eps)?.sqrt()?)?
        .to_dtype(x.dtype())?;
    normed.broadcast_mul(gain)
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

/// Causal self-attention of `shape` over `qkv`, as transformers writes it: split the heads,
/// turn queries and keys (`rotate`), repeat each key/value head for its query heads
/// (`repeat_kv`), softmax(QKᵀ/√hd)V, merge the heads.
pub fn causal_attention(
    qkv: &Tensor,
    shape: AttentionShape,
    rope: Option<&Arc<RopeTable>>,
) -> Result<Tensor> {
    shape.check(qkv)?;
    let s = shape;
    let heads = |start: usize, n: usize| -> Result<Tensor> {
        qkv.narrow(1, start, n * s.head_dim)?
            .reshape((s.batch, s.t, n, s.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (mut q, mut k) = (heads(0, s.heads)?, heads(s.q_width(), s.kv_heads)?);
    let v = heads(s.q_width() + s.kv_width(), s.kv_heads)?;
    if let Some(table) = rope {
        q = rotate(&q, table)?;
        k = rotate(&k, table)?;
    }
    let (k, v) = (repeat_kv(&k, s)?, repeat_kv(&v, s)?);
    let scale = 1.0 / (s.head_dim as f64).sqrt();
    let att = causal_softmax(&q.contiguous()?.matmul(&k.t()?)?, scale)?;
    att.matmul(&v)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((s.batch * s.t, s.q_width()))
}

/// `x` `[B, heads, T, hd]` turned as transformers does: `x·cos + rotate_half(x)·sin` with the
/// table's angles repeated over both halves and cast to `x`'s dtype.
pub fn rotate(x: &Tensor, table: &RopeTable) -> Result<Tensor> {
    let dev = x.device();
    let half = table.half;
    let both = |v: &[f32]| -> Result<Tensor> {
        let t = Tensor::from_slice(v, (table.t, half), dev)?;
        Tensor::cat(&[&t, &t], 1)?.to_dtype(x.dtype())
    };
    let (cos, sin) = (both(&table.cos)?, both(&table.sin)?);
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

/// Key/value heads `[B, KV, T, hd]` repeated to `[B, H, T, hd]`, head `g` serving query heads
/// `g·H/KV ..` (`repeat_interleave` over heads).
fn repeat_kv(x: &Tensor, s: AttentionShape) -> Result<Tensor> {
    let group = s.heads / s.kv_heads;
    if group == 1 {
        return Ok(x.clone());
    }
    x.unsqueeze(2)?
        .broadcast_as((s.batch, s.kv_heads, group, s.t, s.head_dim))?
        .contiguous()?
        .reshape((s.batch, s.heads, s.t, s.head_dim))
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
