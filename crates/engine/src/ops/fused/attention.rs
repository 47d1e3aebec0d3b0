//! Causal multi-head self-attention as one op: `qkv` (`[B·T, 3·D]`, the output of the qkv
//! projection) to `y` (`[B·T, D]`, heads side by side). Heads are read and written in place
//! through strides, so no split, permute or copy is made. Like FlashAttention, nothing of size
//! T×T is kept for the backward: it recomputes the probabilities from `qkv`, which costs one
//! `QKᵀ` per head and saves B·H·T² floats per layer (and the graph nodes that would hold them).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::{filled, for_each_unit, storage, Mat, MatMut};
use crate::ops::vmath;

/// Causal self-attention over `qkv` of `batch` sequences of `t` tokens with `heads` heads.
pub fn causal_attention(qkv: &Tensor, batch: usize, t: usize, heads: usize) -> Result<Tensor> {
    let (n, d3) = qkv.dims2()?;
    if n != batch * t || d3 % (3 * heads) != 0 {
        candle_core::bail!("attention: qkv {n}×{d3} for {batch}×{t} tokens and {heads} heads");
    }
    qkv.contiguous()?.apply_op1(Attention {
        batch,
        t,
        heads,
        d: d3 / 3,
    })
}

#[derive(Clone, Copy)]
pub(super) struct Attention {
    batch: usize,
    t: usize,
    heads: usize,
    d: usize,
}

impl Attention {
    /// Attention over `batch` sequences of `t` tokens, `heads` heads, model width `d`.
    pub(super) fn new(batch: usize, t: usize, heads: usize, d: usize) -> Attention {
        Attention { batch, t, heads, d }
    }

    fn head_dim(&self) -> usize {
        self.d / self.heads
    }

    fn scale(&self) -> f32 {
        1.0 / (self.head_dim() as f32).sqrt()
    }

    /// Q, K or V (`part` 0, 1, 2) of sequence `b`, head `h`: a T×hd view into `qkv`.
    fn part(&self, qkv: &[f32], part: usize, b: usize, h: usize) -> Mat {
        let offset = b * self.t * 3 * self.d + part * self.d + h * self.head_dim();
        Mat::new(qkv[offset..].as_ptr(), self.t, self.head_dim(), 3 * self.d)
    }

    /// Row-wise causal softmax of `scale · S` in place (T×T, row i keeps columns 0..=i).
    #[inline(always)]
    fn softmax_rows(&self, s: &mut [f32]) {
        let (t, scale) = (self.t, self.scale());
        for (i, row) in s.chunks_exact_mut(t).enumerate() {
            let (seen, future) = row.split_at_mut(i + 1);
            let max = vmath::max(seen) * scale;
            // Exponentiate, then sum: a running total in the same loop would not vectorise.
            seen.iter_mut()
                .for_each(|v| *v = vmath::exp(*v * scale - max));
            let inv = 1.0 / vmath::sum(seen);
            seen.iter_mut().for_each(|v| *v *= inv);
            future.fill(0.0);
        }
    }

    /// P = softmax(scale · Q Kᵀ) for one (sequence, head) into `p` (T×T).
    fn probabilities(&self, qkv: &[f32], b: usize, h: usize, p: &mut [f32]) {
        let (q, k) = (self.part(qkv, 0, b, h), self.part(qkv, 1, b, h));
        // SAFETY: `p` is T×T; q and k are views of `qkv` (`part`); `p` is not part of `qkv`.
        unsafe { super::matmul(MatMut::rows(p, self.t), q, k.t(), false, false) };
        vmath::widest(
            #[inline(always)]
            || self.softmax_rows(p),
        );
    }

    fn units(&self) -> usize {
        self.batch * self.heads
    }

    /// `y` (`[B·T, D]`) from `qkv` (`[B·T, 3·D]`), in f32.
    pub(super) fn forward_rows(&self, qkv: &[f32]) -> Vec<f32> {
        let (n, d, t) = (self.batch * self.t, self.d, self.t);
        // Every (sequence, head) writes its T×hd block of y: all of it.
        filled(n * d, |out| {
            for_each_unit(self.units(), |units| {
                let mut p = vec![0f32; t * t];
                for unit in units {
                    let (b, h) = (unit / self.heads, unit % self.heads);
                    self.probabilities(qkv, b, h, &mut p);
                    let v = self.part(qkv, 2, b, h);
                    let dst = out.offset(b * t * d + h * self.head_dim());
                    let dst = MatMut::new(dst, t, self.head_dim(), d);
                    // SAFETY: `dst` is head h's T×hd block of sequence b in the output, this
                    // unit's alone; `p` and `v` are separate buffers.
                    unsafe { super::matmul(dst, Mat::rows(&p, t), v, false, false) };
                }
            })
        })
    }

    /// `dqkv` (`[B·T, 3·D]`) from `qkv` and the output gradient `dy`, in f32: the probabilities
    /// are recomputed from `qkv`.
    pub(super) fn backward_rows(&self, qkv: &[f32], dy: &[f32]) -> Vec<f32> {
        let a = self;
        let (n, d, t, hd) = (a.batch * a.t, a.d, a.t, a.head_dim());
        let scale = a.scale();
        // Every (sequence, head) writes its dQ, dK and dV blocks: all of dqkv.
        filled(n * 3 * d, |out| {
            for_each_unit(a.units(), |units| {
                let (mut p, mut ds) = (vec![0f32; t * t], vec![0f32; t * t]);
                for unit in units {
                    let (b, h) = (unit / a.heads, unit % a.heads);
                    a.probabilities(qkv, b, h, &mut p);
                    let (q, k, v) = (
                        a.part(qkv, 0, b, h),
                        a.part(qkv, 1, b, h),
                        a.part(qkv, 2, b, h),
                    );
                    let dy = Mat::new(dy[b * t * d + h * hd..].as_ptr(), t, hd, d);
                    // dP = dY Vᵀ, then dS = scale · P ⊙ (dP − rowsum(dP ⊙ P)).
                    // SAFETY: `ds` is this unit's T×T scratch; dy and v are views of other buffers.
                    unsafe { super::matmul(MatMut::rows(&mut ds, t), dy, v.t(), false, false) };
                    vmath::widest(
                        #[inline(always)]
                        || {
                            for (dr, pr) in ds.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
                                let dot = vmath::dot(dr, pr);
                                for (d, &p) in dr.iter_mut().zip(pr) {
                                    *d = scale * p * (*d - dot);
                                }
                            }
                        },
                    );
                    let grad = |part: usize| {
                        let dst = out.offset(b * t * 3 * d + part * d + h * hd);
                        MatMut::new(dst, t, hd, 3 * d)
                    };
                    // SAFETY: grad(part) is head h's block of q, k or v's gradient for sequence
                    // b, this unit's alone, in the output; the inputs are other buffers.
                    unsafe {
                        super::matmul(grad(0), Mat::rows(&ds, t), k, false, false);
                        super::matmul(grad(1), Mat::rows(&ds, t).t(), q, false, false);
                        super::matmul(grad(2), Mat::rows(&p, t).t(), dy, false, false);
                    }
                }
            })
        })
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "gaccwb-causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = storage::input(s, l, self.name())?;
        let y = self.forward_rows(&qkv);
        Ok((
            storage::stored(y, s)?,
            Shape::from((self.batch * self.t, self.d)),
        ))
    }

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let op = AttentionBackward(*self);
        Ok(Some(qkv.apply_op2_no_bwd(&grad.contiguous()?, &op)?))
    }
}

/// The backward: `(qkv, dy)` to `dqkv`.
struct AttentionBackward(Attention);

impl CustomOp2 for AttentionBackward {
    fn name(&self) -> &'static str {
        "gaccwb-causal-attention-backward"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (qkv, dy) = (
            storage::input(qs, ql, self.name())?,
            storage::input(gs, gl, self.name())?,
        );
        let dqkv = self.0.backward_rows(&qkv, &dy);
        let n = self.0.batch * self.0.t;
        Ok((storage::stored(dqkv, qs)?, Shape::from((n, 3 * self.0.d))))
    }
}
