//! The LM head and the token NLL as one op: `Σ mask·−log softmax(x·W)[target]`. The logits go
//! through in blocks (`block`): up to 1024 rows by a slice of the vocabulary, 2M floats (8 MiB)
//! in all. The forward makes each block's logits and folds them into each row's running
//! log-sum-exp (its max and the sum of exponentials under it) and its target's logit; the
//! log-sum-exps are kept for the backward. The backward takes each block's logits into one
//! buffer it reuses, turns them in place into `dlogits = scale·mask·(softmax − onehot)` with the
//! kept log-sum-exps, adds the block's share to its rows of dx (`dlogits·W_sliceᵀ`) and writes
//! (or adds to) its slice of dW (`x_rowsᵀ·dlogits`).
//!
//! Where the logits come from in the backward is a trade of memory for time (`keeps`): when a
//! gradient is wanted, the inputs are f32 and the N×V logits take at most `KEEP_ELEMENTS`, the
//! forward keeps every block for the backward, which then copies each block instead of making
//! it again (a quarter of the head's products, 39.5 GFLOP a step at GPT-2-small with 512 rows).
//! Otherwise only one block of logits exists at a time, and the backward makes each block again
//! (the fused linear-cross-entropy kernels' trade). Either way the backward reads the same bits.
//!
//! Blocks run along the vocabulary inside a block of rows, so each slice of W serves all the
//! rows of its block, and each slice of dW is written once per block of rows: at GPT-2-small
//! (V = 50,257, 512 rows) a tile product at one thread packs W three times a step, not twelve,
//! and dW's 154 MB are written once, not read and written four times (docs/PERFORMANCE.md).
//!
//! Blocks depend on N and V alone and go one after another (each product parallel inside, by
//! blocks of its result); each row's statistics and dx, and each slice of dW, add the blocks in
//! order: the same bits at any thread count.

use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor};

use super::clock::Timer;
use super::{
    f32_slice, filled, for_units, log_sum_exp, matmul, storage, u32_slice, Mat, MatMut, Shared,
    Values,
};
use crate::ops::{vmath, GradTarget, WeightLayout};
use crate::tensors::{keep_beside, KeptBeside};

/// Logits one block holds: 2M floats (8 MiB), as the rows-only chunks held before at V ≤ 16K.
/// At GPT-2-small (512 rows, one thread) blocks of 1M and 4M floats ran within noise of 2M;
/// blocks of 256 rows (two per step) ran 5–7% slower (docs/PERFORMANCE.md).
const BLOCK_ELEMENTS: usize = 1 << 21;
/// Rows one block takes at most. Every block of rows packs all of W again (three times), and
/// every slice of the vocabulary packs its rows of x again: at 2M floats a block of ~1,450
/// rows packs the least in all. 1024 keeps slices ≥ 2,048 wide.
const BLOCK_ROWS: usize = 1024;

/// Logits the forward keeps for the backward at most: 32M floats (128 MiB). At GPT-2-small's
/// and SmolLM-135M's vocabularies that is up to 667 and 682 rows (B·T = 512 in the benchmark).
/// Larger batches recompute, so the head's memory stays bounded however many rows a step
/// takes (docs/MEMORY.md).
const KEEP_ELEMENTS: usize = 1 << 25;

/// The rows and vocabulary columns of one block of logits for `n` rows at vocabulary `v`.
pub fn block(n: usize, v: usize) -> (usize, usize) {
    let rows = n.clamp(1, BLOCK_ROWS);
    (rows, (BLOCK_ELEMENTS / rows).min(v.max(1)))
}

/// Whether a training step's forward keeps all `n`×`v` logits for its backward: when they take
/// at most `KEEP_ELEMENTS` and the head's products run on `gemm` in f32 (f32 inputs, or half
/// ones widened). Never when they run on bf16 tiles (`on_tiles`): at GPT-2-small the bf16 step
/// on AMX ran no faster keeping them, while on `gemm` (an AVX2 CPU) keeping them took 9% off
/// the bf16 backward (docs/PERFORMANCE.md).
fn keeps(n: usize, v: usize, on_tiles: bool) -> bool {
    !on_tiles && n.saturating_mul(v) <= KEEP_ELEMENTS
}

/// Floats of logits a training step's forward keeps for its backward (the head's products
/// `on_tiles` or not: `tiles::takes`): all N×V (`keeps`), or none.
pub fn kept(n: usize, v: usize, on_tiles: bool) -> usize {
    if keeps(n, v, on_tiles) {
        n * v
    } else {
        0
    }
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
    // n ≥ 1: the backward's first block of rows is what writes dW.
    if n == 0 || wd != d || targets.dims1()? != n || mask.dims1()? != n {
        candle_core::bail!(
            "linear nll: x {:?}, w {:?}, targets {:?}, mask {:?}",
            x.dims(),
            w.dims(),
            targets.dims(),
            mask.dims()
        );
    }
    let v = w.elem_count() / d;
    // Only a step that will run the backward keeps the logits: one whose inputs carry a
    // gradient (an evaluation's forward holds one block at a time).
    let wanted = x.track_op() || w.track_op() || target.is_some();
    let kept = Arc::new(Mutex::new(Kept::Not));
    let op = LinearNll {
        targets: targets.contiguous()?,
        mask: mask.contiguous()?,
        layout,
        target,
        shifts: OnceLock::new(),
        keep: wanted && keeps(n, v, super::tiles::takes(x.dtype())),
        kept: kept.clone(),
    };
    let loss = x.apply_op2(&w, op)?;
    let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
    if let Kept::Made(all) = std::mem::take(&mut *kept) {
        // The vector becomes the tensor's storage as it is (no copy).
        let all = Tensor::from_vec(all, n * v, x.device())?;
        let booking = keep_beside(&loss, vec![all.clone()]);
        *kept = Kept::Booked(all, booking);
    }
    Ok(loss)
}

/// The targets and mask ride in the op (no gradient): the same storages as the batch's, so the
/// op adds nothing to what the step holds but each row's log-sum-exp (N floats).
struct LinearNll {
    targets: Tensor,
    mask: Tensor,
    layout: WeightLayout,
    target: Option<Arc<dyn GradTarget>>,
    /// Each row's `log Σ exp(logits)`, from the forward, for the backward's softmax.
    shifts: OnceLock<Arc<Vec<f32>>>,
    /// Whether the forward keeps the logits (`keeps`).
    keep: bool,
    /// The logits kept, until the backward takes them.
    kept: Arc<Mutex<Kept>>,
}

/// The logits a training step's forward keeps for its backward, block after block in
/// `Dims::blocks` order. They are activations: booked with the loss (`tensors::keep_beside`)
/// so the ledger counts them, and freed when the head's backward ends.
#[derive(Default)]
enum Kept {
    /// None: the backward makes each block's logits again.
    #[default]
    Not,
    /// The forward's values, before `linear_nll_sum` books them with the op's output.
    Made(Vec<f32>),
    /// The values as a tensor, and their booking.
    Booked(Tensor, KeptBeside),
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

    /// Columns `cols` of W as the `d × v` matrix the logits multiply by.
    fn w(&self, w: Values, cols: &Range<usize>) -> Mat {
        let w = match self.layout {
            WeightLayout::InOut => Mat::of(w, self.v),
            WeightLayout::OutIn => Mat::of(w, self.d).t(),
        };
        w.columns(cols.clone())
    }

    /// The blocks, in order: each block of rows with its index, each slice of the vocabulary
    /// with its index.
    fn blocks(&self) -> impl Iterator<Item = ((usize, Range<usize>), (usize, Range<usize>))> {
        let (rows, cols) = block(self.n, self.v);
        let cuts = |len: usize, size: usize| {
            (0..len.div_ceil(size)).map(move |i| (i, i * size..((i + 1) * size).min(len)))
        };
        let v = self.v;
        cuts(self.n, rows).flat_map(move |r| cuts(v, cols).map(move |c| (r.clone(), c)))
    }

    /// Floats of the block buffer: one block's logits.
    fn block_len(&self) -> usize {
        let (rows, cols) = block(self.n, self.v);
        rows * cols
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

/// `buf` (`rows` × `cols`, row-major) = `x[rows]·W[:, cols]`: one block's logits.
fn block_logits(
    buf: &mut [f32],
    x: &[f32],
    w: Values,
    dims: Dims,
    rows: &Range<usize>,
    cols: &Range<usize>,
) {
    let d = dims.d;
    let x_rows = &x[rows.start * d..rows.end * d];
    // SAFETY: `buf` is this call's own scratch, apart from `x` and `w`; the views are in bounds.
    unsafe {
        matmul(
            MatMut::rows(&mut buf[..rows.len() * cols.len()], cols.len()),
            Mat::rows(x_rows, d),
            dims.w(w, cols),
            false,
            true,
        )
    };
}

/// Where each block's logits (then their gradient) live.
enum Logits {
    /// One block's buffer, reused by every block.
    Reused(Vec<f32>),
    /// All N×V logits, each block at its place in `Dims::blocks` order (`at`: the next one's).
    All { all: Vec<f32>, at: usize },
}

impl Logits {
    /// Space for one block of logits, reused by every block.
    fn reused(dims: Dims) -> Logits {
        Logits::Reused(vec![0f32; dims.block_len()])
    }

    /// Space for all the logits, each block's its own.
    fn all(dims: Dims) -> Logits {
        Logits::All {
            all: vec![0f32; dims.n * dims.v],
            at: 0,
        }
    }

    /// The next block's `len` values, in `Dims::blocks` order.
    fn next(&mut self, len: usize) -> &mut [f32] {
        match self {
            Logits::Reused(buf) => &mut buf[..len],
            Logits::All { all, at } => {
                *at += len;
                &mut all[*at - len..*at]
            }
        }
    }
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
        let _timer = Timer::head_forward();
        let _products = super::tiles::scope(candle_core::backend::BackendStorage::dtype(xs));
        let x = storage::input(xs, xl, self.name())?;
        let w = storage::operand(ws, wl, self.name())?;
        let (x, w) = (&x[..], w.values());
        let dims = Dims::of(xl, wl, self.layout);
        let mut logits = match self.keep {
            true => Logits::all(dims),
            false => Logits::reused(dims),
        };
        let (losses, shifts) = with_labels(&self.targets, &self.mask, dims, |targets, mask| {
            Ok(finish(
                &row_statistics(x, w, dims, targets, &mut logits),
                mask,
            ))
        })?;
        if self.shifts.set(Arc::new(shifts)).is_err() {
            candle_core::bail!("linear nll: the op ran its forward twice");
        }
        if let Logits::All { all, .. } = logits {
            *self.kept.lock().unwrap_or_else(PoisonError::into_inner) = Kept::Made(all);
        }
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
        let shifts =
            self.shifts.get().cloned().ok_or_else(|| {
                candle_core::Error::Msg("linear nll: backward before forward".into())
            })?;
        // Taken, so they are freed when this backward ends (a second backward over the same
        // graph makes the logits again).
        let kept =
            match std::mem::take(&mut *self.kept.lock().unwrap_or_else(PoisonError::into_inner)) {
                Kept::Booked(all, _booking) => Some(all),
                Kept::Not | Kept::Made(_) => None,
            };
        let op = LinearNllBackward {
            scale,
            targets: self.targets.clone(),
            mask: self.mask.clone(),
            shifts,
            layout: self.layout,
            weight_grad,
            kept,
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

/// Values kept per row while the forward folds the blocks in: the running max of its logits,
/// the sum of their exponentials under that max, and its target's logit.
const STATS: usize = 3;

/// Each row's statistics (`STATS` values per row), folded block by block, the blocks' logits
/// made in `logits`.
fn row_statistics(
    x: &[f32],
    w: Values,
    dims: Dims,
    targets: &[u32],
    logits: &mut Logits,
) -> Vec<f32> {
    let mut stats: Vec<f32> = (0..dims.n)
        .flat_map(|_| [f32::NEG_INFINITY, 0.0, 0.0])
        .collect();
    let shared = Shared(stats.as_mut_ptr());
    for ((_, rows), (_, cols)) in dims.blocks() {
        let (width, buf) = (cols.len(), logits.next(rows.len() * cols.len()));
        block_logits(buf, x, w, dims, &rows, &cols);
        let logits = &*buf;
        for_units(rows.len(), width, |_, local| {
            let global = rows.start + local.start..rows.start + local.end;
            // SAFETY: units cover disjoint rows of `stats`, which outlives this loop.
            let dst = unsafe { shared.rows(&global, STATS) };
            let mut scratch = vec![0f32; width];
            vmath::widest(
                #[inline(always)]
                || {
                    for (s, r) in dst.chunks_exact_mut(STATS).zip(local.clone()) {
                        let row = &logits[r * width..(r + 1) * width];
                        fold(s, row, &mut scratch);
                        let t = targets[rows.start + r] as usize;
                        if cols.contains(&t) {
                            s[2] = row[t - cols.start];
                        }
                    }
                },
            )
        });
    }
    stats
}

/// Fold one block's logits of a row into its running max and sum of exponentials.
#[inline(always)]
fn fold(stats: &mut [f32], row: &[f32], scratch: &mut [f32]) {
    let (max, lse) = log_sum_exp(row, scratch);
    let (old, sum) = (stats[0], stats[1]);
    if max > old {
        stats[0] = max;
        stats[1] = sum * (old - max).exp() + lse.exp();
    } else {
        stats[1] = sum + (lse + max - old).exp();
    }
}

/// Each row's loss, `mask·(log Σ exp − target's logit)`, and its log-sum-exp.
fn finish(stats: &[f32], mask: &[f32]) -> (Vec<f32>, Vec<f32>) {
    stats
        .chunks_exact(STATS)
        .zip(mask)
        .map(|(s, &m)| {
            let shift = s[0] + s[1].ln();
            let loss = if m == 0.0 { 0.0 } else { -m * (s[2] - shift) };
            (loss, shift)
        })
        .unzip()
}

struct LinearNllBackward {
    scale: f32,
    targets: Tensor,
    mask: Tensor,
    shifts: Arc<Vec<f32>>,
    layout: WeightLayout,
    weight_grad: WeightGrad,
    /// The forward's logits (`LinearNll::kept`); without them each block's are made again.
    kept: Option<Tensor>,
}

impl CustomOp2 for LinearNllBackward {
    fn name(&self) -> &'static str {
        "gaccwb-linear-nll-backward"
    }

    /// `[dx; dw]`, `n·d + d·v` floats: per block, dlogits from its kept or recomputed logits, then
    /// `dx[rows] (+)= dlogits·W[:, cols]ᵀ` and `dw[cols] (+)= x[rows]ᵀ·dlogits`.
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let _timer = Timer::head_backward();
        let _products = super::tiles::scope(candle_core::backend::BackendStorage::dtype(xs));
        let (xw, ww) = (
            storage::input(xs, xl, self.name())?,
            storage::operand(ws, wl, self.name())?,
        );
        let (x, w) = (&xw[..], ww.values());
        let dims = Dims::of(xl, wl, self.layout);
        let Dims { n, d, v, .. } = dims;
        if self.shifts.len() != n {
            candle_core::bail!(
                "linear nll: {} log-sum-exps for {n} rows",
                self.shifts.len()
            );
        }
        let packed = with_labels(&self.targets, &self.mask, dims, |targets, mask| {
            let labels = Labels {
                targets,
                mask,
                shifts: &self.shifts,
                scale: self.scale,
            };
            let guard = self.kept.as_ref().map(Tensor::storage_and_layout);
            let kept = match &guard {
                Some((storage, layout)) => match &**storage {
                    Storage::Cpu(all) => Some(f32_slice(all, layout, self.name())?),
                    _ => candle_core::bail!("linear nll: kept logits must be on the CPU"),
                },
                None => None,
            };
            let packed_dw = matches!(self.weight_grad, WeightGrad::Packed);
            // dx rows are written by their first slice's product, a packed dw by the first
            // block of rows' (then added to): every value, as blocks cover all rows and columns
            // and n ≥ 1.
            let len = n * d + if packed_dw { d * v } else { 0 };
            // `beside`: a dw buffer of d·v values apart from `out`, and whether to add to it.
            let run = |beside: Option<(*mut f32, bool)>| {
                filled(len, |out| {
                    let dw = beside.or_else(|| packed_dw.then(|| (out.offset(n * d), false)));
                    // SAFETY: `out` holds n·d dx values (then a packed dw's d·v), `beside` d·v.
                    unsafe { backward_blocks(x, w, dims, &labels, kept, out.offset(0), dw) }
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
                        // The first block of rows writes every value of dw (no zeros first).
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

/// One batch's labels, the forward's log-sum-exps and the loss's incoming gradient.
struct Labels<'a> {
    targets: &'a [u32],
    mask: &'a [f32],
    shifts: &'a [f32],
    scale: f32,
}

/// Per block: dlogits from its logits (copied from `kept`, or made again) in one buffer reused
/// by every block, then `dx[rows] (+)= dlogits·W[:, cols]ᵀ` into
/// `dx` (`n·d` values, written by each row block's first slice) and
/// `dw[cols] (+)= x[rows]ᵀ·dlogits` into `dw`'s `d·v` values, the first block of rows writing
/// them unless `dw.1` (added to from the start).
///
/// # Safety
/// `dx` and `dw` point to buffers of those sizes that nothing else reads or writes meanwhile.
unsafe fn backward_blocks(
    x: &[f32],
    w: Values,
    dims: Dims,
    labels: &Labels,
    kept: Option<&[f32]>,
    dx: *mut f32,
    dw: Option<(*mut f32, bool)>,
) {
    let Dims { d, v, .. } = dims;
    let mut buf = Logits::reused(dims);
    let mut at = 0;
    for ((rb, rows), (cb, cols)) in dims.blocks() {
        let len = rows.len() * cols.len();
        let dlogits = buf.next(len);
        match kept {
            Some(all) => dlogits.copy_from_slice(&all[at..at + len]),
            None => block_logits(dlogits, x, w, dims, &rows, &cols),
        }
        at += len;
        to_dlogits(dlogits, &rows, &cols, labels);
        let (dlogits, width) = (Mat::rows(dlogits, cols.len()), cols.len());
        let x_rows = Mat::rows(&x[rows.start * d..rows.end * d], d);
        // SAFETY: the caller's buffers; these views are this block's rows of dx and its slice
        // of dw, apart from `buf`, `x` and `w`.
        unsafe {
            matmul(
                MatMut::new(dx.add(rows.start * d), rows.len(), d, d),
                dlogits,
                dims.w(w, &cols).t(),
                cb > 0,
                true,
            );
            let Some((dw, add)) = dw else { continue };
            match dims.layout {
                WeightLayout::InOut => matmul(
                    MatMut::new(dw.add(cols.start), d, width, v),
                    x_rows.t(),
                    dlogits,
                    add || rb > 0,
                    true,
                ),
                WeightLayout::OutIn => matmul(
                    MatMut::new(dw.add(cols.start * d), width, d, d),
                    dlogits.t(),
                    x_rows,
                    add || rb > 0,
                    true,
                ),
            }
        }
    }
}

/// Turn one block's logits (rows `rows`, vocabulary columns `cols`) into their gradient, in
/// place: `scale·mask·(softmax − onehot(target))` with each row's kept log-sum-exp, zero for
/// uncounted rows.
fn to_dlogits(block: &mut [f32], rows: &Range<usize>, cols: &Range<usize>, labels: &Labels) {
    let width = cols.len();
    let shared = Shared(block.as_mut_ptr());
    for_units(rows.len(), width, |_, local| {
        // SAFETY: units cover disjoint row ranges of `block`.
        let dst = unsafe { shared.rows(&local, width) };
        vmath::widest(
            #[inline(always)]
            || {
                for (row, r) in dst.chunks_exact_mut(width).zip(local.clone()) {
                    let i = rows.start + r;
                    let t = labels.targets[i] as usize;
                    let target = cols.contains(&t).then(|| t - cols.start);
                    let weight = labels.scale * labels.mask[i];
                    softmax_grad(row, labels.shifts[i], target, weight);
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
    softmax_grad(row, max + lse, Some(target), weight);
}

/// `row` ← `weight·(exp(row − shift) − onehot(target))` in place, `shift` the whole row's
/// log-sum-exp and `target` its column in `row` if `row` holds it (all zeros when `weight` is 0).
#[inline(always)]
fn softmax_grad(row: &mut [f32], shift: f32, target: Option<usize>, weight: f32) {
    if weight == 0.0 {
        row.fill(0.0);
        return;
    }
    row.iter_mut()
        .for_each(|x| *x = weight * vmath::exp(*x - shift));
    if let Some(t) = target {
        row[t] -= weight;
    }
}
