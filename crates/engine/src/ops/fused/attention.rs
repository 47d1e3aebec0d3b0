//! Causal self-attention as one op: `qkv` (`[B·T, (H + 2·KV)·hd]`, the queries of H heads, then
//! the keys and the values of KV heads, as the projections write them) to `y` (`[B·T, H·hd]`,
//! heads side by side). Grouped-query attention shares key/value head `g` among query heads
//! `g·H/KV ..`, as transformers' `repeat_kv` does, without copying it. With a rotary table the
//! queries and keys are turned (half-split, `ops::rope`) into a per-head scratch as they are
//! read; the kept `qkv` stays unturned and the backward turns again.
//!
//! Heads are read and written in place through strides. Like FlashAttention, nothing of size
//! T×T is kept for the backward: it recomputes the probabilities from `qkv`, which costs one
//! `QKᵀ` per head and saves B·H·T² floats per layer (and the graph nodes that would hold them).
//! Work is split by (sequence, key/value head), so the gradients of a shared key/value head are
//! summed by one thread in head order: the same bits at any thread count.
//!
//! The T×T products run a band of `BAND` query rows at a time, each only as wide as the band's
//! last row sees (keys `0..end`), and the key-side gradients a band of key rows at a time from
//! the first query that sees them: the masked half of each product, whose probabilities are
//! zero, is not computed. The sums skip only those zero terms.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::tiles::{chosen, serial};
use super::{filled, for_each_unit, storage, tiles, Mat, MatMut, Shared};
use crate::ops::rope::RopeTable;
use crate::ops::{vmath, AttentionShape};

/// Causal self-attention over `qkv` of the shape `shape`, rotary when `rope` is given.
pub fn causal_attention(
    qkv: &Tensor,
    shape: AttentionShape,
    rope: Option<&Arc<RopeTable>>,
) -> Result<Tensor> {
    shape.check(qkv)?;
    qkv.contiguous()?
        .apply_op1(Attention::new(shape, rope.cloned()))
}

/// Rows of a band of the T×T products: a multiple of the packed kernels' depth, so that every
/// band's inner dimension is at least one tile deep.
const BAND: usize = 64;

#[derive(Clone)]
pub(super) struct Attention {
    s: AttentionShape,
    rope: Option<Arc<RopeTable>>,
}

/// A head's block `T×hd` as the products read it: a view into `qkv`, or its turned copy.
struct Block {
    turned: Vec<f32>,
}

impl Attention {
    /// Attention of `shape`, rotary with `rope`.
    pub(super) fn new(s: AttentionShape, rope: Option<Arc<RopeTable>>) -> Attention {
        Attention { s, rope }
    }

    fn scale(&self) -> f32 {
        1.0 / (self.s.head_dim as f32).sqrt()
    }

    /// Q (`part` 0, query head `h`), K or V (`part` 1 or 2, key/value head `h`) of sequence
    /// `b`: a T×hd view into `qkv`.
    fn part(&self, qkv: &[f32], part: usize, b: usize, h: usize) -> Mat {
        Mat::new(
            qkv[self.offset(part, b, h)..].as_ptr(),
            self.s.t,
            self.s.head_dim,
            self.s.qkv_width(),
        )
    }

    /// Where `part` of head `h` of sequence `b` starts in a `qkv`-shaped buffer.
    fn offset(&self, part: usize, b: usize, h: usize) -> usize {
        let s = &self.s;
        let start = [0, s.q_width(), s.q_width() + s.kv_width()][part];
        b * s.t * s.qkv_width() + start + h * s.head_dim
    }

    /// Q or K (`part` 0 or 1) as the scores multiply it: the view itself, or with a rotary table
    /// its rows turned into `scratch`.
    fn turned(&self, qkv: &[f32], part: usize, b: usize, h: usize, scratch: &mut Block) -> Mat {
        let view = self.part(qkv, part, b, h);
        let Some(table) = &self.rope else {
            return view;
        };
        let (t, hd, w) = (self.s.t, self.s.head_dim, self.s.qkv_width());
        let start = self.offset(part, b, h);
        for (p, out) in scratch.turned.chunks_exact_mut(hd).enumerate().take(t) {
            let row = &qkv[start + p * w..start + p * w + hd];
            table.rotate(p, row, out, false);
        }
        Mat::rows(&scratch.turned[..t * hd], hd)
    }

    /// Row-wise causal softmax of `scale · S` in place (T×T, row i keeps columns 0..=i).
    #[inline(always)]
    fn softmax_rows(&self, s: &mut [f32]) {
        let (t, scale) = (self.s.t, self.scale());
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

    /// The bands of rows of a T×T product: `0..BAND`, `BAND..2·BAND`, … up to T.
    fn bands(&self) -> impl Iterator<Item = Range<usize>> {
        let t = self.s.t;
        (0..t)
            .step_by(BAND)
            .map(move |start| start..(start + BAND).min(t))
    }

    /// `dst = a·bᵀ` (T×T) where the causal mask keeps it: each band of rows only as wide as its
    /// last row sees. What lies past that in dst is left as it is.
    ///
    /// # Safety
    /// As `serial`, for `dst` (T×T), `a` and `b` (T×n).
    unsafe fn causal_scores(&self, tiles: bool, dst: MatMut, a: Mat, b: Mat) {
        for r in self.bands() {
            let seen = 0..r.end;
            let (a, b) = (a.row_range(r.clone()), b.row_range(seen.clone()));
            // SAFETY: the caller's contract, for rows `r` of dst up to column `r.end`.
            unsafe { serial(tiles, dst.row_range(r).columns(seen), a, b.t(), false) };
        }
    }

    /// `dst = a·b` (`+=` when `sum`) for a causal `a` (T×T, zero above the diagonal), a band of
    /// rows at a time, each reading `a` and `b` up to the band's end.
    ///
    /// # Safety
    /// As `serial`, for `dst` (T×n) and `b` (T×n).
    unsafe fn causal_rows(&self, tiles: bool, dst: MatMut, a: Mat, b: Mat, sum: bool) {
        for r in self.bands() {
            let seen = 0..r.end;
            let a = a.row_range(r.clone()).columns(seen.clone());
            // SAFETY: the caller's contract, for rows `r` of dst.
            unsafe { serial(tiles, dst.row_range(r), a, b.row_range(seen), sum) };
        }
    }

    /// `dst = aᵀ·b` (`+=` when `sum`) for a causal `a` (T×T): the rows `r` of dst read only the
    /// rows of `a` and `b` from `r.start` on (`a` is zero above them in those columns).
    ///
    /// # Safety
    /// As `serial`, for `dst` (T×n) and `b` (T×n).
    unsafe fn causal_columns(&self, tiles: bool, dst: MatMut, a: Mat, b: Mat, sum: bool) {
        let t = self.s.t;
        for r in self.bands() {
            let from = r.start..t;
            let at = a.row_range(from.clone()).columns(r.clone()).t();
            // SAFETY: the caller's contract, for rows `r` of dst.
            unsafe { serial(tiles, dst.row_range(r), at, b.row_range(from), sum) };
        }
    }

    /// P = softmax(scale · Q Kᵀ) into `p` (T×T), the scores a band of rows at a time (the
    /// softmax zeroes what each row does not see).
    fn probabilities(&self, q: Mat, k: Mat, p: &mut [f32], tiles: bool) {
        // SAFETY: `p` is T×T; q and k are views of `qkv` or of scratch blocks, none of them `p`.
        unsafe { self.causal_scores(tiles, MatMut::rows(p, self.s.t), q, k) };
        vmath::widest(
            #[inline(always)]
            || self.softmax_rows(p),
        );
    }

    /// Units of work: one per (sequence, key/value head).
    fn units(&self) -> usize {
        self.s.batch * self.s.kv_heads
    }

    fn scratch(&self) -> Block {
        let len = if self.rope.is_some() {
            self.s.t * self.s.head_dim
        } else {
            0
        };
        Block {
            turned: vec![0f32; len],
        }
    }

    /// `y` (`[B·T, H·hd]`) from `qkv`, in f32; the products on tiles when this thread's products
    /// are (`tiles::chosen`: a bf16 op where the CPU has AMX or AVX-512 BF16), their operands then
    /// rounded to bf16.
    pub(super) fn forward_rows(&self, qkv: &[f32]) -> Vec<f32> {
        let s = self.s;
        let (t, hd, width) = (s.t, s.head_dim, s.q_width());
        let tiles = chosen();
        // Every (sequence, query head) writes its T×hd block of y: all of it.
        filled(s.batch * t * width, |out| {
            for_each_unit(self.units(), |units| {
                let mut p = vec![0f32; t * t];
                let (mut kb, mut qb) = (self.scratch(), self.scratch());
                for unit in units {
                    let (b, g) = (unit / s.kv_heads, unit % s.kv_heads);
                    let k = self.turned(qkv, 1, b, g, &mut kb);
                    let v = self.part(qkv, 2, b, g);
                    for h in s.group_of(g) {
                        let q = self.turned(qkv, 0, b, h, &mut qb);
                        self.probabilities(q, k, &mut p, tiles);
                        let dst = MatMut::new(out.offset(b * t * width + h * hd), t, hd, width);
                        // SAFETY: `dst` is query head h's T×hd block of sequence b in the
                        // output, this unit's alone; `p` and `v` are separate buffers.
                        unsafe { self.causal_rows(tiles, dst, Mat::rows(&p, t), v, false) };
                    }
                }
            })
        })
    }

    /// `dqkv` (`[B·T, (H + 2·KV)·hd]`) from `qkv` and the output gradient `dy`, in f32, the
    /// products as `forward_rows` makes them: the probabilities are recomputed from `qkv`.
    pub(super) fn backward_rows(&self, qkv: &[f32], dy: &[f32]) -> Vec<f32> {
        let s = self.s;
        let (t, hd, width) = (s.t, s.head_dim, s.q_width());
        let scale = self.scale();
        let tiles = chosen();
        // Every (sequence, key/value head) writes its dK and dV blocks and the dQ blocks of
        // its query heads: all of dqkv.
        filled(s.batch * t * s.qkv_width(), |out| {
            for_each_unit(self.units(), |units| {
                let (mut p, mut ds) = (vec![0f32; t * t], vec![0f32; t * t]);
                let (mut kb, mut qb) = (self.scratch(), self.scratch());
                // With a rotary table, dQ and dK are made turned, then turned back.
                let (mut dq_turned, mut dk_turned) = (self.scratch(), self.scratch());
                for unit in units {
                    let (b, g) = (unit / s.kv_heads, unit % s.kv_heads);
                    let k = self.turned(qkv, 1, b, g, &mut kb);
                    let v = self.part(qkv, 2, b, g);
                    for (i, h) in s.group_of(g).enumerate() {
                        let q = self.turned(qkv, 0, b, h, &mut qb);
                        self.probabilities(q, k, &mut p, tiles);
                        let dy = Mat::new(dy[b * t * width + h * hd..].as_ptr(), t, hd, width);
                        // dP = dY Vᵀ where P is not zero, then dS = scale · P ⊙ (dP − rowsum(dP ⊙
                        // P)). Past each band's last column dP holds what the last head left
                        // there (zeros, as dS is zero there): P's zeros keep it out of the sums.
                        // SAFETY: `ds` is this unit's T×T scratch; dy and v are views of other
                        // buffers.
                        unsafe { self.causal_scores(tiles, MatMut::rows(&mut ds, t), dy, v) };
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
                        let sum = i > 0;
                        let (dq, dk) = match self.rope {
                            Some(_) => (
                                MatMut::rows(&mut dq_turned.turned, hd),
                                MatMut::rows(&mut dk_turned.turned, hd),
                            ),
                            None => (self.grad(out, 0, b, h), self.grad(out, 1, b, g)),
                        };
                        // SAFETY: the destinations are this unit's scratch blocks or its own
                        // blocks of the output (query head h, key/value head g of sequence b);
                        // the inputs are other buffers.
                        unsafe {
                            let (ds, p) = (Mat::rows(&ds, t), Mat::rows(&p, t));
                            self.causal_rows(tiles, dq, ds, k, false);
                            self.causal_columns(tiles, dk, ds, q, sum);
                            self.causal_columns(tiles, self.grad(out, 2, b, g), p, dy, sum);
                        }
                        if self.rope.is_some() {
                            self.turn_back(&dq_turned, out, 0, b, h);
                        }
                    }
                    if self.rope.is_some() {
                        self.turn_back(&dk_turned, out, 1, b, g);
                    }
                }
            })
        })
    }

    /// Head `h`'s block of `part` of sequence `b` in a `qkv`-shaped output.
    fn grad(&self, out: Shared, part: usize, b: usize, h: usize) -> MatMut {
        let (t, hd, w) = (self.s.t, self.s.head_dim, self.s.qkv_width());
        MatMut::new(out.offset(self.offset(part, b, h)), t, hd, w)
    }

    /// The turned gradient in `block` turned back into head `h`'s block of `part` of the output.
    fn turn_back(&self, block: &Block, out: Shared, part: usize, b: usize, h: usize) {
        let Some(table) = &self.rope else { return };
        let (hd, w) = (self.s.head_dim, self.s.qkv_width());
        let start = self.offset(part, b, h);
        for (p, row) in block.turned.chunks_exact(hd).enumerate() {
            // SAFETY: row p of head h's block of `part` of sequence b (hd values inside the
            // output) is this unit's alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.offset(start + p * w), hd) };
            table.rotate(p, row, dst, true);
        }
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "gaccwb-causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let _products = tiles::scope(candle_core::backend::BackendStorage::dtype(s));
        let qkv = storage::input(s, l, self.name())?;
        let y = self.forward_rows(&qkv);
        Ok((
            storage::stored(y, s)?,
            Shape::from((self.s.batch * self.s.t, self.s.q_width())),
        ))
    }

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let op = AttentionBackward(self.clone());
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
        let _products = tiles::scope(candle_core::backend::BackendStorage::dtype(qs));
        let dqkv = self.0.backward_rows(&qkv, &dy);
        let s = self.0.s;
        Ok((
            storage::stored(dqkv, qs)?,
            Shape::from((s.batch * s.t, s.qkv_width())),
        ))
    }
}
