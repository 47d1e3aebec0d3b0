//! The LM head and the token NLL as one op: `Σ mask·−log softmax(x·W)[target]` without the
//! N×V logits. Rows go through in chunks of `chunk_rows(V)`: a chunk's logits are made, reduced
//! to each row's loss and dropped. The backward makes each chunk's logits again, turns them in
//! place into `dlogits = scale·mask·(softmax − onehot)`, and adds the chunk's share to dW
//! (`x_cᵀ·dlogits_c`) and writes its rows of dx (`dlogits_c·Wᵀ`). So at most one chunk of
//! logits exists at a time, forward or backward, at the cost of the head's product done twice
//! (the fused linear-cross-entropy kernels' trade).
//!
//! Chunks depend on V alone and go one after another (each product parallel inside, by rows of
//! its result), and dW adds the chunks in order: the same bits at any thread count.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor};

use super::{
    f32_slice, filled, for_units, log_sum_exp, matmul, storage, u32_slice, Mat, MatMut, Shared,
};
use crate::ops::{vmath, GradTarget, WeightLayout};

/// Logits one chunk holds: 2M floats (8 MiB), 256 rows at V = 8192. Measured on `text-bpe`
/// at two threads (docs/TOKENIZER.md): 64, 256 and 1024 rows ran at the same speed within noise,
/// 16 rows 35% slower (a product under 32 rows is one block, one thread); 1024 rows added 21 MiB
/// to the peak. A chunk's products are wider than tall, so they are cut into column blocks
/// (`matmul_split`): 4 of them, each packing only its columns of W.
const CHUNK_ELEMENTS: usize = 1 << 21;

/// Rows per chunk at vocabulary `v`: at least 128, since each chunk's products pack all of W
/// again (a huge vocabulary's W is tens of MB) and dW is read and written once per chunk. At
/// GPT-2's V = 50,257 a chunk of 64 rows ran the head's products about 9% slower than one of
/// 128 (docs/PERFORMANCE.md); 128 rows hold 25.7 MB of logits there (78 MB at V = 151,936).
pub fn chunk_rows(v: usize) -> usize {
    (CHUNK_ELEMENTS / v.max(1)).max(128)
}

/// Sum over counted rows of `−log softmax(x·W)[target]`: `x` `[N, D]`, `w` `[D, V]` (or
/// `[V, D]` with `WeightLayout::OutIn`: a head tied to the token embedding), `targets` `[N]`
/// u32, `mask` `[N]` f32. Gradients flow to `x` and to `w`, or with `target` into it
/// (`ops::GradTarget`).
pub fn linear_nll_sum(
    x: &Tensor,
    w: &Tensor,
    layout: WeightLayout,
    targets: &Tensor,
    mask: &Tensor,
    target: Option<Arc<dyn GradTarget>>,
) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    // A weight whose gradient goes beside the graph is no graph input.
    let w = match target {
        Some(_) => w.detach(),
        None => w,
    };
    let (n, d) = x.dims2()?;
    let wd = match layout {
        WeightLayout::InOut => w.dim(0)?,
        WeightLayout::OutIn => w.dim(1)?,
    };
    // n ≥ 1: the backward's first chunk is what writes dW.
    if n == 0 || wd != d || targets.dims1()? != n || mask.dims1()? != n {
        candle_core::bail!(
            "linear nll: x {:?}, w {:?}, targets {:?}, mask {:?}",
            x.dims(),
            w.dims(),
            targets.dims(),
            mask.dims()
        );
    }
    let op = LinearNll {
        targets: targets.contiguous()?,
        mask: mask.contiguous()?,
        layout,
        target,
    };
    x.apply_op2(&w, op)
}

/// The targets and mask ride in the op (no gradient): the same storages as the batch's, so the
/// op adds nothing to what the step holds.
struct LinearNll {
    targets: Tensor,
    mask: Tensor,
    layout: WeightLayout,
    target: Option<Arc<dyn GradTarget>>,
}

/// Where the backward puts W's gradient.
#[derive(Clone)]
enum WeightGrad {
    /// Nowhere: a frozen head (LoRA) takes part in no graph.
    None,
    /// After dx in the op's result, for the gradient store.
    Packed,
    /// Added into a gradient held beside the graph.
    Beside(Arc<dyn GradTarget>),
}

/// The shapes one pass works on.
#[derive(Clone, Copy)]
struct Dims {
    n: usize,
    d: usize,
    v: usize,
    layout: WeightLayout,
}

impl Dims {
    fn of(xl: &Layout, wl: &Layout, layout: WeightLayout) -> Dims {
        let v = match layout {
            WeightLayout::InOut => wl.dims()[1],
            WeightLayout::OutIn => wl.dims()[0],
        };
        Dims {
            n: xl.dims()[0],
            d: xl.dims()[1],
            v,
            layout,
        }
    }

    /// W as the `d × v` matrix the logits multiply by.
    fn w(&self, w: &[f32]) -> Mat {
        match self.layout {
            WeightLayout::InOut => Mat::rows(w, self.v),
            WeightLayout::OutIn => Mat::rows(w, self.d).t(),
        }
    }

    /// The row ranges of the chunks, in order.
    fn chunks(&self) -> impl Iterator<Item = Range<usize>> {
        let (n, rows) = (self.n, chunk_rows(self.v));
        (0..n.div_ceil(rows)).map(move |c| c * rows..((c + 1) * rows).min(n))
    }

    /// Floats of the chunk buffer: one chunk's logits.
    fn chunk_len(&self) -> usize {
        chunk_rows(self.v).min(self.n) * self.v
    }
}

/// Run `f` with the targets and mask as slices, checked against `dims`.
fn with_labels<R>(
    targets: &Tensor,
    mask: &Tensor,
    dims: Dims,
    f: impl FnOnce(&[u32], &[f32]) -> Result<R>,
) -> Result<R> {
    let (ts, tl) = targets.storage_and_layout();
    let (ms, ml) = mask.storage_and_layout();
    let (Storage::Cpu(ts), Storage::Cpu(ms)) = (&*ts, &*ms) else {
        candle_core::bail!("linear nll: targets and mask must be on the CPU");
    };
    let targets = u32_slice(ts, tl, "linear nll")?;
    let mask = f32_slice(ms, ml, "linear nll")?;
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= dims.v) {
        candle_core::bail!("linear nll: target {t} outside vocab {}", dims.v);
    }
    f(targets, mask)
}

/// `buf` (rows `rows`, V columns) = `x[rows]·w`.
fn chunk_logits(buf: &mut [f32], x: &[f32], w: &[f32], dims: Dims, rows: &Range<usize>) {
    let Dims { d, v, .. } = dims;
    let x_rows = &x[rows.start * d..rows.end * d];
    // SAFETY: `buf` is this call's own scratch, apart from `x` and `w`; the views are in bounds.
    unsafe {
        matmul(
            MatMut::rows(&mut buf[..rows.len() * v], v),
            Mat::rows(x_rows, d),
            dims.w(w),
            false,
            true,
        )
    };
}

/// The buffer one chunk's logits (then their gradient) live in, reused by every chunk.
fn chunk_buffer(dims: Dims) -> Vec<f32> {
    vec![0f32; dims.chunk_len()]
}

impl CustomOp2 for LinearNll {
    fn name(&self) -> &'static str {
        "gaccwb-linear-nll-sum"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let _products = super::tiles::scope(candle_core::backend::BackendStorage::dtype(xs));
        let x = storage::input(xs, xl, self.name())?;
        let w = storage::input(ws, wl, self.name())?;
        let (x, w) = (&x[..], &w[..]);
        let dims = Dims::of(xl, wl, self.layout);
        let losses = with_labels(&self.targets, &self.mask, dims, |targets, mask| {
            Ok(row_losses(x, w, dims, targets, mask))
        })?;
        // Rows in order: the same total for any thread count.
        let total: f32 = losses.iter().sum();
        Ok((CpuStorage::F32(vec![total]), Shape::from(())))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, d) = x.dims2()?;
        let scale = grad.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        let weight_grad = match (&self.target, w.track_op()) {
            (Some(target), _) => WeightGrad::Beside(target.clone()),
            (None, true) => WeightGrad::Packed,
            (None, false) => WeightGrad::None,
        };
        let op = LinearNllBackward {
            scale,
            targets: self.targets.clone(),
            mask: self.mask.clone(),
            layout: self.layout,
            weight_grad,
        };
        // One buffer holds [dx; dw], as the fused linear's backward.
        let packed = x.apply_op2_no_bwd(w, &op)?;
        let dx = packed.narrow(0, 0, n * d)?.reshape((n, d))?;
        let dw = match op.weight_grad {
            WeightGrad::Packed => Some(
                packed
                    .narrow(0, n * d, w.elem_count())?
                    .reshape(w.shape())?,
            ),
            WeightGrad::None | WeightGrad::Beside(_) => None,
        };
        Ok((Some(dx), dw))
    }
}

/// Each row's `mask·−log softmax(logits)[target]`, chunk by chunk.
fn row_losses(x: &[f32], w: &[f32], dims: Dims, targets: &[u32], mask: &[f32]) -> Vec<f32> {
    let v = dims.v;
    let mut buf = chunk_buffer(dims);
    // `for_units` covers every row of every chunk and each unit writes all its rows.
    filled(dims.n, |out| {
        for rows in dims.chunks() {
            chunk_logits(&mut buf, x, w, dims, &rows);
            let logits = &buf[..rows.len() * v];
            for_units(rows.len(), v, |_, local| {
                // SAFETY: units cover disjoint row ranges; the global rows are inside `0..n`.
                let dst = unsafe {
                    out.uninit_rows(&(rows.start + local.start..rows.start + local.end), 1)
                };
                let mut scratch = vec![0f32; v];
                vmath::widest(
                    #[inline(always)]
                    || {
                        for (slot, r) in dst.iter_mut().zip(local.clone()) {
                            let i = rows.start + r;
                            let loss = if mask[i] == 0.0 {
                                0.0
                            } else {
                                let row = &logits[r * v..(r + 1) * v];
                                let (max, lse) = log_sum_exp(row, &mut scratch);
                                -mask[i] * (row[targets[i] as usize] - max - lse)
                            };
                            slot.write(loss);
                        }
                    },
                )
            });
        }
    })
}

struct LinearNllBackward {
    scale: f32,
    targets: Tensor,
    mask: Tensor,
    layout: WeightLayout,
    weight_grad: WeightGrad,
}

impl CustomOp2 for LinearNllBackward {
    fn name(&self) -> &'static str {
        "gaccwb-linear-nll-backward"
    }

    /// `[dx; dw]`, `n·d + d·v` floats: per chunk, dlogits from recomputed logits, then
    /// `dx[chunk] = dlogits·wᵀ` and `dw (+)= x[chunk]ᵀ·dlogits`.
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let _products = super::tiles::scope(candle_core::backend::BackendStorage::dtype(xs));
        let (xw, ww) = (
            storage::input(xs, xl, self.name())?,
            storage::input(ws, wl, self.name())?,
        );
        let (x, w) = (&xw[..], &ww[..]);
        let dims = Dims::of(xl, wl, self.layout);
        let Dims { n, d, v, .. } = dims;
        let packed = with_labels(&self.targets, &self.mask, dims, |targets, mask| {
            let labels = Labels {
                targets,
                mask,
                scale: self.scale,
            };
            let packed_dw = matches!(self.weight_grad, WeightGrad::Packed);
            // dx rows are written by their chunk's product, a packed dw by the first chunk's
            // (then added to): every value, as chunks cover all rows and n ≥ 1.
            let len = n * d + if packed_dw { d * v } else { 0 };
            // `beside`: a dw buffer of d·v values apart from `out`, and whether to add to it.
            let run = |beside: Option<(*mut f32, bool)>| {
                filled(len, |out| {
                    let dw = beside.or_else(|| packed_dw.then(|| (out.offset(n * d), false)));
                    // SAFETY: `out` holds n·d dx values (then a packed dw's d·v), `beside` d·v.
                    unsafe { backward_chunks(x, w, dims, &labels, out.offset(0), dw) }
                })
            };
            match &self.weight_grad {
                WeightGrad::Beside(target) => {
                    let mut packed = None;
                    target.add_into(d * v, &mut |held| match held {
                        Some(held) => {
                            packed = Some(run(Some((held.as_mut_ptr(), true))));
                            None
                        }
                        // The first chunk's product writes every value of dw (no zeros first).
                        None => Some(filled(d * v, |dw| {
                            packed = Some(run(Some((dw.offset(0), false))));
                        })),
                    })?;
                    packed.ok_or_else(|| candle_core::Error::Msg("linear nll: no gradient".into()))
                }
                _ => Ok(run(None)),
            }
        })?;
        drop((xw, ww));
        let len = packed.len();
        Ok((storage::stored(packed, xs)?, Shape::from(len)))
    }
}

/// One batch's labels and the loss's incoming gradient.
struct Labels<'a> {
    targets: &'a [u32],
    mask: &'a [f32],
    scale: f32,
}

/// Per chunk: dlogits from recomputed logits, then `dx[chunk] = dlogits·wᵀ` into `dx` (`n·d`
/// values) and `dw (+)= x[chunk]ᵀ·dlogits` into `dw`'s `d·v` values, the first chunk writing
/// them unless `dw.1` (added to from the start).
///
/// # Safety
/// `dx` and `dw` point to buffers of those sizes that nothing else reads or writes meanwhile.
unsafe fn backward_chunks(
    x: &[f32],
    w: &[f32],
    dims: Dims,
    labels: &Labels,
    dx: *mut f32,
    dw: Option<(*mut f32, bool)>,
) {
    let Dims { d, v, .. } = dims;
    let mut buf = chunk_buffer(dims);
    for (c, rows) in dims.chunks().enumerate() {
        chunk_logits(&mut buf, x, w, dims, &rows);
        let dlogits = &mut buf[..rows.len() * v];
        to_dlogits(
            dlogits,
            v,
            rows.start,
            labels.targets,
            labels.mask,
            labels.scale,
        );
        let x_rows = Mat::rows(&x[rows.start * d..rows.end * d], d);
        // SAFETY: the caller's buffers; these views are this chunk's dx rows and all of dw,
        // apart from `buf`, `x` and `w`.
        unsafe {
            matmul(
                MatMut::new(dx.add(rows.start * d), rows.len(), d, d),
                Mat::rows(dlogits, v),
                dims.w(w).t(),
                false,
                true,
            );
            let Some((dw, add)) = dw else { continue };
            match dims.layout {
                WeightLayout::InOut => matmul(
                    MatMut::new(dw, d, v, v),
                    x_rows.t(),
                    Mat::rows(dlogits, v),
                    add || c > 0,
                    true,
                ),
                WeightLayout::OutIn => matmul(
                    MatMut::new(dw, v, d, d),
                    Mat::rows(dlogits, v).t(),
                    x_rows,
                    add || c > 0,
                    true,
                ),
            }
        }
    }
}

/// Turn one chunk's logits (rows from global row `first`) into their gradient, in place:
/// `scale·mask·(softmax(row) − onehot(target))`, zero for uncounted rows.
fn to_dlogits(
    chunk: &mut [f32],
    v: usize,
    first: usize,
    targets: &[u32],
    mask: &[f32],
    scale: f32,
) {
    let rows = chunk.len() / v;
    let shared = Shared(chunk.as_mut_ptr());
    for_units(rows, v, |_, local| {
        // SAFETY: units cover disjoint row ranges of `chunk`.
        let dst = unsafe { shared.rows(&local, v) };
        let mut scratch = vec![0f32; v];
        vmath::widest(
            #[inline(always)]
            || {
                for (row, r) in dst.chunks_exact_mut(v).zip(local.clone()) {
                    let i = first + r;
                    softmax_minus_onehot(row, targets[i] as usize, scale * mask[i], &mut scratch);
                }
            },
        )
    });
}

/// `row` ← `weight·(softmax(row) − onehot(target))` in place (all zeros when `weight` is 0).
#[inline(always)]
pub(super) fn softmax_minus_onehot(
    row: &mut [f32],
    target: usize,
    weight: f32,
    scratch: &mut [f32],
) {
    if weight == 0.0 {
        row.fill(0.0);
        return;
    }
    let (max, lse) = log_sum_exp(row, scratch);
    let shift = max + lse;
    row.iter_mut()
        .for_each(|x| *x = weight * vmath::exp(*x - shift));
    row[target] -= weight;
}
