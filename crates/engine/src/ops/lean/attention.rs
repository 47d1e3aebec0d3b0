//! Causal self-attention that keeps its `qkv` input, its output and an f32 log-sum-exp L per
//! (sequence, head, row): no `T×T` tensor outlives the forward. The backward recomputes the
//! probabilities with FlashAttention's algebra (Dao et al. 2022):
//!
//! P = exp(scale·QKᵀ + M − L), dV = Pᵀ·dO, dP = dO·Vᵀ, D = rowsum(dO∘O),
//! dS = P∘(dP − D), dQ = scale·dS·K, dK = scale·dSᵀ·Q.
//!
//! Grouped-query attention stacks the query heads that share a key/value head along the
//! position axis (`[b, KV, group·T, hd]`), so one product per key/value head covers its group
//! and the keys and values are never repeated; dK and dV sum over the group inside that product.
//! Rotary positions turn the queries and keys (in f32, rounded to the compute dtype) before the
//! scores; the backward turns their gradients back.
//!
//! M is the causal mask (0 on and below the diagonal, −∞ above): a constant, never an input of
//! the graph, so it has no gradient. Scores, probabilities and their gradients are f32; the
//! products run in the compute dtype. Sequences go through in chunks of `sequences_per_chunk`,
//! so the score-sized temporaries of one pass are bounded whatever the micro-batch.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, D};

use super::apply;
use crate::ops::composite::causal_mask;
use crate::ops::rope::RopeTable;
use crate::ops::AttentionShape;

/// Score elements (heads × T × T × sequences) one chunk holds at most, unless one sequence
/// alone is more: 2M, as the head's logits chunk.
const CHUNK_SCORES: usize = 1 << 21;

/// Sequences per chunk of the forward and the backward: as many as keep the chunk's scores
/// under `CHUNK_SCORES`, at least one.
pub fn sequences_per_chunk(t: usize, heads: usize) -> usize {
    (CHUNK_SCORES / (heads * t * t).max(1)).max(1)
}

/// Causal self-attention of `shape` over `qkv`, rotary when `rope` is given.
pub fn causal_attention(
    qkv: &Tensor,
    shape: AttentionShape,
    rope: Option<&Arc<RopeTable>>,
) -> Result<Tensor> {
    let pass = Pass::new(qkv, shape, rope)?;
    let (y, lse) = pass.forward(&qkv.detach())?;
    apply(
        "lean-attention",
        &[qkv],
        y,
        vec![lse.clone()],
        move |i, o, dy| Ok(vec![Some(pass.backward(&i[0], o, dy, &lse)?)]),
    )
}

/// One attention's forward and backward on detached tensors, chunked by sequences (also a step
/// of `lean::branch`).
pub(super) struct Pass {
    heads: Heads,
    per: usize,
}

impl Pass {
    /// The pass of `shape` (with `rope`) over a `qkv` like this one.
    pub(super) fn new(
        qkv: &Tensor,
        shape: AttentionShape,
        rope: Option<&Arc<RopeTable>>,
    ) -> Result<Pass> {
        shape.check(qkv)?;
        Ok(Pass {
            heads: Heads {
                s: shape,
                rope: rope.map(|r| Rotary::new(r, qkv.device())).transpose()?,
            },
            per: sequences_per_chunk(shape.t, shape.heads),
        })
    }

    /// The output `[B·T, H·hd]` and the f32 log-sum-exp kept for the backward.
    pub(super) fn forward(&self, qkv: &Tensor) -> Result<(Tensor, Tensor)> {
        let s = self.heads.s;
        let whole = qkv.reshape((s.batch, s.t, s.qkv_width()))?;
        let (mut outputs, mut lses) = (Vec::new(), Vec::new());
        for start in (0..s.batch).step_by(self.per) {
            let chunk = whole.narrow(0, start, self.per.min(s.batch - start))?;
            let (o, lse) = self.heads.forward(&chunk)?;
            outputs.push(o);
            lses.push(lse);
        }
        let y = Tensor::cat(&outputs, 0)?.reshape((s.batch * s.t, s.q_width()))?;
        drop(outputs);
        Ok((y, Tensor::cat(&lses, 0)?))
    }

    /// `dqkv` from the input, the output, its gradient and the log-sum-exp.
    pub(super) fn backward(
        &self,
        qkv: &Tensor,
        o: &Tensor,
        dy: &Tensor,
        lse: &Tensor,
    ) -> Result<Tensor> {
        let s = self.heads.s;
        let qkv = qkv.reshape((s.batch, s.t, s.qkv_width()))?;
        let (o, dy) = (
            o.reshape((s.batch, s.t, s.q_width()))?,
            dy.reshape((s.batch, s.t, s.q_width()))?,
        );
        let mut grads = Vec::new();
        for start in (0..s.batch).step_by(self.per) {
            let len = self.per.min(s.batch - start);
            let part = |x: &Tensor| x.narrow(0, start, len);
            let d = self
                .heads
                .backward(&part(&qkv)?, &part(&o)?, &part(&dy)?, &part(lse)?)?;
            grads.push(d);
        }
        Tensor::cat(&grads, 0)?.reshape((s.batch * s.t, s.qkv_width()))
    }
}

/// The cosines and sines of a rotary table as `[T, hd/2]` f32 tensors on the device.
struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    fn new(table: &RopeTable, device: &Device) -> Result<Rotary> {
        let shape = (table.t, table.half);
        Ok(Rotary {
            cos: Tensor::from_slice(&table.cos, shape, device)?,
            sin: Tensor::from_slice(&table.sin, shape, device)?,
        })
    }

    /// `x` `[.., T, hd]` turned by each position's angles (backwards with `inverse`), in f32,
    /// returned in `x`'s dtype.
    fn turn(&self, x: &Tensor, inverse: bool) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let half = self.cos.dim(1)?;
        let (x1, x2) = (
            x.narrow(D::Minus1, 0, half)?,
            x.narrow(D::Minus1, half, half)?,
        );
        let sin = if inverse {
            self.sin.neg()?
        } else {
            self.sin.clone()
        };
        let first = (x1.broadcast_mul(&self.cos)? - x2.broadcast_mul(&sin)?)?;
        let second = (x2.broadcast_mul(&self.cos)? + x1.broadcast_mul(&sin)?)?;
        Tensor::cat(&[first, second], D::Minus1)?.to_dtype(dtype)
    }
}

/// The head layout of one attention and its rotary table.
struct Heads {
    s: AttentionShape,
    rope: Option<Rotary>,
}

impl Heads {
    fn scale(&self) -> f64 {
        1.0 / (self.s.head_dim as f64).sqrt()
    }

    fn group(&self) -> usize {
        self.s.heads / self.s.kv_heads
    }

    /// Columns `start..start + heads·hd` of `x` `[b, T, ·]` as `[b, heads, T, hd]`.
    fn heads_of(&self, x: &Tensor, start: usize, heads: usize) -> Result<Tensor> {
        let b = x.dim(0)?;
        x.narrow(2, start, heads * self.s.head_dim)?
            .reshape((b, self.s.t, heads, self.s.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// Query heads `[b, H, T, hd]` as `[b, KV, group·T, hd]`: each key/value head's queries.
    fn grouped(&self, q: &Tensor) -> Result<Tensor> {
        let b = q.dim(0)?;
        let s = &self.s;
        q.reshape((b, s.kv_heads, self.group() * s.t, s.head_dim))
    }

    /// Q (turned, grouped), K (turned) and V of `qkv` `[b, T, ·]`.
    fn split(&self, qkv: &Tensor) -> Result<[Tensor; 3]> {
        let s = &self.s;
        let mut q = self.heads_of(qkv, 0, s.heads)?;
        let mut k = self.heads_of(qkv, s.q_width(), s.kv_heads)?;
        let v = self.heads_of(qkv, s.q_width() + s.kv_width(), s.kv_heads)?;
        if let Some(rope) = &self.rope {
            q = rope.turn(&q, false)?;
            k = rope.turn(&k, false)?;
        }
        Ok([self.grouped(&q)?, k, v])
    }

    /// `[b, H, T, hd]` back to `[b, T, H·hd]`.
    fn merge(&self, x: &Tensor) -> Result<Tensor> {
        let b = x.dim(0)?;
        x.transpose(1, 2)?
            .contiguous()?
            .reshape((b, self.s.t, self.s.heads * self.s.head_dim))
    }

    /// The causal mask of a group: `[group·T, T]`, each query block masked as its own sequence.
    fn mask(&self, device: &Device) -> Result<Tensor> {
        let mask = causal_mask(self.s.t, device, DType::F32)?;
        match self.group() {
            1 => Ok(mask),
            g => Tensor::cat(&vec![mask; g], 0),
        }
    }

    /// scale·QKᵀ + M in f32, `[b, KV, group·T, T]`.
    fn scores(&self, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        let mask = self.mask(q.device())?;
        (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * self.scale())?.broadcast_add(&mask)
    }

    /// The output `[b, T, H·hd]` and the log-sum-exp `[b, KV, group·T, 1]` (f32) of one chunk.
    fn forward(&self, qkv: &Tensor) -> Result<(Tensor, Tensor)> {
        let [q, k, v] = self.split(qkv)?;
        let s = self.scores(&q, &k)?;
        let max = s.max_keepdim(D::Minus1)?;
        let e = s.broadcast_sub(&max)?.exp()?;
        drop(s);
        let sum = e.sum_keepdim(D::Minus1)?;
        let p = e.broadcast_div(&sum)?.to_dtype(v.dtype())?;
        drop(e);
        let b = qkv.dim(0)?;
        let o = p
            .matmul(&v)?
            .reshape((b, self.s.heads, self.s.t, self.s.head_dim))?;
        Ok((self.merge(&o)?, (max + sum.log()?)?))
    }

    /// dqkv `[b, T, (H + 2·KV)·hd]` of one chunk from its qkv, output and output gradient
    /// `[b, T, ·]` and log-sum-exp.
    fn backward(&self, qkv: &Tensor, o: &Tensor, dy: &Tensor, lse: &Tensor) -> Result<Tensor> {
        let dtype = qkv.dtype();
        let s = &self.s;
        let [q, k, v] = self.split(qkv)?;
        let p = self.scores(&q, &k)?.broadcast_sub(lse)?.exp()?;
        let d_o = self.grouped(&self.heads_of(dy, 0, s.heads)?)?;
        let dv = p.to_dtype(dtype)?.t()?.matmul(&d_o)?;
        let dp = d_o.matmul(&v.t()?)?.to_dtype(DType::F32)?;
        let o = self.grouped(&self.heads_of(o, 0, s.heads)?)?;
        let rowsum =
            (d_o.to_dtype(DType::F32)? * o.to_dtype(DType::F32)?)?.sum_keepdim(D::Minus1)?;
        let ds = ((p * dp.broadcast_sub(&rowsum)?)? * self.scale())?.to_dtype(dtype)?;
        let b = qkv.dim(0)?;
        let mut dq = ds.matmul(&k)?.reshape((b, s.heads, s.t, s.head_dim))?;
        let mut dk = ds.t()?.matmul(&q)?;
        if let Some(rope) = &self.rope {
            dq = rope.turn(&dq, true)?;
            dk = rope.turn(&dk, true)?;
        }
        // Each `[b, heads, T, hd]` back to `[b, T, heads·hd]`, side by side as in qkv.
        let cols = |x: &Tensor| -> Result<Tensor> {
            let heads = x.dim(1)?;
            x.transpose(1, 2)?
                .contiguous()?
                .reshape((b, s.t, heads * s.head_dim))
        };
        Tensor::cat(&[cols(&dq)?, cols(&dk)?, cols(&dv)?], 2)
    }
}
