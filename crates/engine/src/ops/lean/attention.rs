//! Causal multi-head self-attention that keeps its `qkv` input, its output and an f32
//! log-sum-exp L per (sequence, head, row): no `T×T` tensor outlives the forward. The backward
//! recomputes the probabilities with FlashAttention's algebra (Dao et al. 2022):
//!
//! P = exp(scale·QKᵀ + M − L), dV = Pᵀ·dO, dP = dO·Vᵀ, D = rowsum(dO∘O),
//! dS = P∘(dP − D), dQ = scale·dS·K, dK = scale·dSᵀ·Q.
//!
//! M is the causal mask (0 on and below the diagonal, −∞ above): a constant, never an input of
//! the graph, so it has no gradient. Scores, probabilities and their gradients are f32; the
//! products run in the compute dtype. Sequences go through in chunks of `sequences_per_chunk`,
//! so the score-sized temporaries of one pass are bounded whatever the micro-batch.

use candle_core::{DType, Result, Tensor, D};

use super::apply;
use crate::ops::composite::causal_mask;

/// Score elements (heads × T × T × sequences) one chunk holds at most, unless one sequence
/// alone is more: 2M, as the head's logits chunk.
const CHUNK_SCORES: usize = 1 << 21;

/// Sequences per chunk of the forward and the backward: as many as keep the chunk's scores
/// under `CHUNK_SCORES`, at least one.
pub fn sequences_per_chunk(t: usize, heads: usize) -> usize {
    (CHUNK_SCORES / (heads * t * t).max(1)).max(1)
}

/// Causal self-attention over `qkv` `[B·T, 3·D]` (queries, keys, values side by side, heads
/// within each) to `[B·T, D]`, scores scaled by 1/√(D/heads).
pub fn causal_attention(qkv: &Tensor, batch: usize, t: usize, heads: usize) -> Result<Tensor> {
    let (n, d3) = qkv.dims2()?;
    if n != batch * t || d3 % (3 * heads) != 0 {
        candle_core::bail!("attention: qkv {n}×{d3} for {batch}×{t} tokens and {heads} heads");
    }
    let shape = Heads {
        t,
        heads,
        hd: d3 / 3 / heads,
    };
    let per = sequences_per_chunk(t, heads);
    let whole = qkv.detach().reshape((batch, t, d3))?;
    let (mut outputs, mut lses) = (Vec::new(), Vec::new());
    for start in (0..batch).step_by(per) {
        let chunk = whole.narrow(0, start, per.min(batch - start))?;
        let (o, lse) = shape.forward(&chunk)?;
        outputs.push(o);
        lses.push(lse);
    }
    let y = Tensor::cat(&outputs, 0)?.reshape((n, d3 / 3))?;
    drop(outputs);
    let lse = Tensor::cat(&lses, 0)?;
    drop(lses);
    apply(
        "lean-attention",
        &[qkv],
        y,
        vec![lse.clone()],
        move |i, o, dy| {
            let qkv = i[0].reshape((batch, t, d3))?;
            let (o, dy) = (
                o.reshape((batch, t, d3 / 3))?,
                dy.reshape((batch, t, d3 / 3))?,
            );
            let mut grads = Vec::new();
            for start in (0..batch).step_by(per) {
                let len = per.min(batch - start);
                let part = |x: &Tensor| x.narrow(0, start, len);
                grads.push(shape.backward(&part(&qkv)?, &part(&o)?, &part(&dy)?, &part(&lse)?)?);
            }
            Ok(vec![Some(Tensor::cat(&grads, 0)?.reshape((n, d3))?)])
        },
    )
}

/// The head layout of one attention.
#[derive(Clone, Copy)]
struct Heads {
    t: usize,
    heads: usize,
    hd: usize,
}

impl Heads {
    fn scale(&self) -> f64 {
        1.0 / (self.hd as f64).sqrt()
    }

    /// Q, K and V of `qkv` `[b, T, 3·D]` as `[b, H, T, hd]` each (contiguous copies).
    fn split(&self, qkv: &Tensor) -> Result<[Tensor; 3]> {
        let b = qkv.dim(0)?;
        let parts = qkv
            .reshape((b, self.t, 3, self.heads, self.hd))?
            .permute((2, 0, 3, 1, 4))?;
        Ok([
            parts.get(0)?.contiguous()?,
            parts.get(1)?.contiguous()?,
            parts.get(2)?.contiguous()?,
        ])
    }

    /// `[b, T, D]` as `[b, H, T, hd]` (a contiguous copy).
    fn heads_of(&self, x: &Tensor) -> Result<Tensor> {
        let b = x.dim(0)?;
        x.reshape((b, self.t, self.heads, self.hd))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// `[b, H, T, hd]` back to `[b, T, D]`.
    fn merge(&self, x: &Tensor) -> Result<Tensor> {
        let b = x.dim(0)?;
        x.transpose(1, 2)?
            .contiguous()?
            .reshape((b, self.t, self.heads * self.hd))
    }

    /// scale·QKᵀ + M in f32, `[b, H, T, T]`.
    fn scores(&self, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        let mask = causal_mask(self.t, q.device(), DType::F32)?;
        (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * self.scale())?.broadcast_add(&mask)
    }

    /// The output `[b, T, D]` and the log-sum-exp `[b, H, T, 1]` (f32) of one chunk.
    fn forward(&self, qkv: &Tensor) -> Result<(Tensor, Tensor)> {
        let [q, k, v] = self.split(qkv)?;
        let s = self.scores(&q, &k)?;
        let max = s.max_keepdim(D::Minus1)?;
        let e = s.broadcast_sub(&max)?.exp()?;
        drop(s);
        let sum = e.sum_keepdim(D::Minus1)?;
        let p = e.broadcast_div(&sum)?.to_dtype(v.dtype())?;
        drop(e);
        let o = self.merge(&p.matmul(&v)?)?;
        Ok((o, (max + sum.log()?)?))
    }

    /// dqkv `[b, T, 3·D]` of one chunk from its qkv, output and output gradient `[b, T, ·]`
    /// and log-sum-exp.
    fn backward(&self, qkv: &Tensor, o: &Tensor, dy: &Tensor, lse: &Tensor) -> Result<Tensor> {
        let dtype = qkv.dtype();
        let [q, k, v] = self.split(qkv)?;
        let p = self.scores(&q, &k)?.broadcast_sub(lse)?.exp()?;
        let d_o = self.heads_of(dy)?;
        let dv = p.to_dtype(dtype)?.t()?.matmul(&d_o)?;
        let dp = d_o.matmul(&v.t()?)?.to_dtype(DType::F32)?;
        let rowsum = (d_o.to_dtype(DType::F32)? * self.heads_of(o)?.to_dtype(DType::F32)?)?
            .sum_keepdim(D::Minus1)?;
        let ds = ((p * dp.broadcast_sub(&rowsum)?)? * self.scale())?.to_dtype(dtype)?;
        let dq = ds.matmul(&k)?;
        let dk = ds.t()?.matmul(&q)?;
        // [3, b, H, T, hd] → [b, T, 3, H, hd]: the layout of qkv.
        let b = qkv.dim(0)?;
        Tensor::stack(&[dq, dk, dv], 0)?
            .permute((1, 3, 0, 2, 4))?
            .contiguous()?
            .reshape((b, self.t, 3 * self.heads * self.hd))
    }
}
