//! Fused CPU kernels (f32 arithmetic; f32, bf16 or f16 storage) as Candle custom ops: each forward is one pass over its input, each
//! backward one more (Candle's composite versions cost a dozen element-wise ops and as many
//! temporaries). Work is split over Candle's own CPU thread pool, never along a sum: element-wise
//! work by rows, reductions into per-unit partial sums whose units depend on the shape alone,
//! products by rows of the result. So results do not depend on the thread count (tested).
//!
//! Callers (`crate::ops`) route CPU tensors stored in f32, bf16 or f16 here (all of one op's
//! float inputs in one dtype; the loss mask f32); the arithmetic is f32 whatever the storage
//! (`storage`), but for a bf16 op's products where the CPU has AMX or AVX-512 BF16 (`tiles`),
//! which read the weight matrices as stored (`Values::Bf16`).

use std::mem::MaybeUninit;
use std::ops::Range;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use crate::ops::vmath;

mod attention;
mod branch;
mod cast;
mod clock;
mod embedding;
mod head;
mod layer;
mod linear;
mod norm;
mod optim;
mod storage;
#[cfg(test)]
mod tests;
mod tiles;
mod transpose;

pub use attention::causal_attention;
pub use branch::branch;
pub use cast::{to_bf16, widen};
pub use clock::{head as head_clock, Reading};
pub use embedding::{embedding, Positions};
pub use head::{block as head_block, kept as head_kept, linear_nll_sum};

pub use linear::{act_linear, gelu_linear, linear, project};
pub use norm::{layer_norm, rms_norm};
use norm::{norm_backward_rows, norm_rows};
pub use optim::{
    adamw_update_all, scale_in_place, sum_squared_difference, sum_squares, sums_of_squares,
    AdamWJob, AdamWStep,
};
pub(crate) use storage::round_in_place;

pub use tiles::{Bf16Kernel, KERNEL_ENV};

/// What this process's bf16 products run on (`tiles`): AMX tiles where the CPU has AMX-BF16
/// and the kernel granted the tile state, else AVX-512 BF16 dot products where the CPU has
/// them, else `gemm`; capped by `GACCWB_BF16_PRODUCTS`.
pub fn bf16_kernel() -> Bf16Kernel {
    tiles::kernel()
}

// ---------------------------------------------------------------------------------------------
// Plumbing

/// The f32 values a contiguous layout covers.
fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        (CpuStorage::F32(_), None) => candle_core::bail!("{op}: input must be contiguous"),
        _ => candle_core::bail!("{op}: expects f32 storage"),
    }
}

fn u32_slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [u32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("{op}: expects contiguous u32 indices"),
    }
}

/// A pointer that disjoint row ranges write through from several threads.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: written only through disjoint row ranges, one thread each, while the buffer lives.
unsafe impl Send for Shared {}
// SAFETY: as for `Send`: concurrent users touch disjoint rows.
unsafe impl Sync for Shared {}

impl Shared {
    /// Rows `rows` (of `width`) of a buffer not initialised yet, to be written.
    /// SAFETY: as `rows`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn uninit_rows(&self, rows: &Range<usize>, width: usize) -> &mut [MaybeUninit<f32>] {
        let start = self.0.add(rows.start * width).cast::<MaybeUninit<f32>>();
        std::slice::from_raw_parts_mut(start, rows.len() * width)
    }

    fn offset(&self, elements: usize) -> *mut f32 {
        // SAFETY: callers stay inside the buffer the pointer was made from.
        unsafe { self.0.add(elements) }
    }

    /// Rows `rows` of a row-major buffer with `width` columns.
    /// SAFETY: callers hand each row range to exactly one writer.
    #[allow(clippy::mut_from_ref)]
    unsafe fn rows(&self, rows: &Range<usize>, width: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(rows.start * width), rows.len() * width)
    }
}

/// Rows per parallel unit: enough work (~16K elements) to pay for a hand-off.
fn unit_rows(width: usize) -> usize {
    (16 * 1024 / width.max(1)).max(1)
}

/// Run `f(unit, rows)` for every unit of `unit_rows(width)` rows, on the CPU pool.
fn for_units(n_rows: usize, width: usize, f: impl Fn(usize, Range<usize>) + Sync) {
    let per = unit_rows(width);
    for_each_unit(n_rows.div_ceil(per), |units| {
        for u in units {
            f(u, u * per..((u + 1) * per).min(n_rows));
        }
    });
}

/// Run `f(units)` over disjoint ranges of `0..units` on the CPU pool (`ops::pool`).
fn for_each_unit(units: usize, f: impl Fn(Range<usize>) + Sync) {
    crate::ops::pool::for_chunks(units, f);
}

/// `n` f32 values that `fill` initialises, every one, before anything reads them: no zeroing
/// pass (a zeroed buffer measured 10–20% slower at two threads: the memset is serial). `fill`
/// writes through raw pointers (`gemm` with `accumulate` off) or `Shared::uninit_rows`.
fn filled(n: usize, fill: impl FnOnce(Shared)) -> Vec<f32> {
    let mut v = Vec::<f32>::with_capacity(n);
    fill(Shared(v.as_mut_ptr()));
    // SAFETY: each caller's `fill` writes all `n` values (stated at every call site).
    unsafe { v.set_len(n) };
    v
}

/// Where a matrix's values start: f32, or bf16 (read by tile products as they are, widened for
/// `gemm`: `Values::Bf16`).
#[derive(Clone, Copy)]
enum Ptr {
    F32(*const f32),
    Bf16(*const u16),
}

impl Ptr {
    /// `count` values on (wrapping: the result is only read inside the view).
    fn offset(self, count: isize) -> Ptr {
        match self {
            Ptr::F32(p) => Ptr::F32(p.wrapping_offset(count)),
            Ptr::Bf16(p) => Ptr::Bf16(p.wrapping_offset(count)),
        }
    }
}

/// An op's values as its products read them: f32, or bf16 as stored (`storage::operand`).
#[derive(Clone, Copy)]
pub(super) enum Values<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
}

impl Values<'_> {
    fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::Bf16(v) => v.len(),
        }
    }
}

/// A read-only strided matrix of f32 or bf16 values.
#[derive(Clone, Copy)]
struct Mat {
    ptr: Ptr,
    rows: usize,
    cols: usize,
    row_stride: isize,
    col_stride: isize,
}

impl Mat {
    /// `rows × cols` with rows `row_stride` apart and contiguous columns.
    fn new(ptr: *const f32, rows: usize, cols: usize, row_stride: usize) -> Mat {
        Mat {
            ptr: Ptr::F32(ptr),
            rows,
            cols,
            row_stride: row_stride as isize,
            col_stride: 1,
        }
    }

    /// A contiguous row-major matrix of `cols` columns.
    fn rows(v: &[f32], cols: usize) -> Mat {
        Mat::new(v.as_ptr(), v.len() / cols, cols, cols)
    }

    /// `values` as a contiguous row-major matrix of `cols` columns.
    fn of(values: Values, cols: usize) -> Mat {
        match values {
            Values::F32(v) => Mat::rows(v, cols),
            Values::Bf16(v) => Mat {
                // bf16 is a transparent u16.
                ptr: Ptr::Bf16(v.as_ptr().cast()),
                rows: v.len() / cols,
                cols,
                row_stride: cols as isize,
                col_stride: 1,
            },
        }
    }

    /// Columns `c` of this matrix.
    fn columns(self, c: Range<usize>) -> Mat {
        assert!(c.end <= self.cols);
        Mat {
            ptr: self.ptr.offset(c.start as isize * self.col_stride),
            cols: c.len(),
            ..self
        }
    }

    /// Rows `r` of this matrix.
    fn row_range(self, r: Range<usize>) -> Mat {
        assert!(r.end <= self.rows);
        Mat {
            ptr: self.ptr.offset(r.start as isize * self.row_stride),
            rows: r.len(),
            ..self
        }
    }

    fn t(self) -> Mat {
        Mat {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// This view's values in f32: itself when f32, else widened into `buf` (`rows × cols`,
    /// row-major), for `gemm`.
    ///
    /// # Safety
    /// The view lies in a live buffer.
    unsafe fn widened(self, buf: &mut Vec<f32>) -> Mat {
        let Ptr::Bf16(p) = self.ptr else { return self };
        buf.clear();
        buf.reserve(self.rows * self.cols);
        for r in 0..self.rows as isize {
            buf.extend((0..self.cols as isize).map(|c| {
                // SAFETY: row r, column c of the caller's in-bounds view.
                let bits = unsafe { *p.offset(r * self.row_stride + c * self.col_stride) };
                f32::from_bits(u32::from(bits) << 16)
            }));
        }
        Mat::rows(buf, self.cols)
    }
}

/// A writable strided f32 matrix (rows `row_stride` apart, contiguous columns).
struct MatMut {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
    row_stride: usize,
}

// SAFETY: blocks (rows or columns) of one MatMut are written by one thread each (see `matmul`).
unsafe impl Sync for MatMut {}
// SAFETY: `Mat` is a read-only view; the buffer outlives every product that reads it.
unsafe impl Send for Mat {}
// SAFETY: as for `Send`: readers never write.
unsafe impl Sync for Mat {}

impl MatMut {
    fn new(ptr: *mut f32, rows: usize, cols: usize, row_stride: usize) -> MatMut {
        MatMut {
            ptr,
            rows,
            cols,
            row_stride,
        }
    }

    fn rows(v: &mut [f32], cols: usize) -> MatMut {
        MatMut::new(v.as_mut_ptr(), v.len() / cols, cols, cols)
    }

    /// Rows `r` of this matrix.
    fn row_range(&self, r: Range<usize>) -> MatMut {
        assert!(r.end <= self.rows);
        MatMut::new(
            self.ptr.wrapping_add(r.start * self.row_stride),
            r.len(),
            self.cols,
            self.row_stride,
        )
    }

    /// Columns `c` of this matrix: the same rows, `c.start` values in.
    fn columns(&self, c: Range<usize>) -> MatMut {
        assert!(c.end <= self.cols);
        MatMut::new(
            self.ptr.wrapping_add(c.start),
            self.rows,
            c.len(),
            self.row_stride,
        )
    }
}

/// `dst = a·b`, or `dst += a·b` when `accumulate`. With `parallel`, blocks of `dst` (rows or
/// columns, `matmul_split`) go to the CPU pool (`ops::pool`), each one single-threaded `gemm`
/// call (or, in a bf16 op where the CPU has AMX or AVX-512 BF16, one `tiles` call on
/// `tiles::split`'s blocks):
/// the same pool as every other fused op (a second pool, rayon's, would compete with it for
/// the cores).
///
/// # Safety
/// The views lie inside live buffers, and `dst` overlaps neither `a` nor `b` (shapes are checked).
unsafe fn matmul(dst: MatMut, a: Mat, b: Mat, accumulate: bool, parallel: bool) {
    assert!(a.rows == dst.rows && b.cols == dst.cols && a.cols == b.rows);
    if !parallel {
        // SAFETY: the caller's contract, for all of dst.
        return unsafe { gemm_block(&dst, a, b, accumulate, 0..dst.rows) };
    }
    let (mut wide_a, mut wide_b) = (Vec::new(), Vec::new());
    let (split, gemm_block, a, b): (_, BlockProduct, _, _) = if tiles::fit(a.cols) {
        (tiles::split(dst.rows, b.cols), tiles::gemm_block, a, b)
    } else {
        // bf16 operands are widened once here, not by every block.
        // SAFETY: the caller's views are in bounds.
        let (a, b) = unsafe { (a.widened(&mut wide_a), b.widened(&mut wide_b)) };
        (matmul_split(dst.rows, a.cols, b.cols), gemm_block, a, b)
    };
    let dst = &dst;
    // One thread runs the same blocks in order (tiles: any blocks give the same bits), so the
    // result is the same at any thread count.
    for_each_unit(split.blocks, |range| {
        for block in range {
            let r = split.block(block);
            // SAFETY: the caller's contract; each block's rows (or columns) of dst are written
            // by this thread alone.
            unsafe {
                match split.by {
                    Cut::Rows => gemm_block(dst, a, b, accumulate, r),
                    Cut::Columns => gemm_block(
                        &dst.columns(r.clone()),
                        a,
                        b.columns(r),
                        accumulate,
                        0..dst.rows,
                    ),
                }
            }
        }
    });
}

/// Rows of a product on the calling thread (`gemm_block`, `tiles::gemm_block`).
type BlockProduct = unsafe fn(&MatMut, Mat, Mat, bool, Range<usize>);

/// Most blocks one product is cut into. Every block packs again the operand it shares with
/// the others, and one thread runs all of them too, so fewer blocks are faster alone: 4 (two per
/// thread at two threads) measured 5% below the unsplit product at one thread and level with it
/// at two; 8 measured 8% and 2–4% below (docs/PERFORMANCE.md). Beyond four threads a product uses
/// four.
const MATMUL_MAX_BLOCKS: usize = 4;

/// Which side of `dst` a parallel product is cut along.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cut {
    /// Row blocks: each block reads all of `b` (and packs it again).
    Rows,
    /// Column blocks: each block reads only its columns of `b`, and all of `a`.
    Columns,
}

/// How a parallel product is cut: along which side, into how many blocks of `size`.
#[derive(Clone, Copy, Debug)]
struct Split {
    by: Cut,
    size: usize,
    blocks: usize,
    len: usize,
}

impl Split {
    /// Block `i`'s rows or columns.
    fn block(&self, i: usize) -> Range<usize> {
        i * self.size..((i + 1) * self.size).min(self.len)
    }
}

/// The blocks of a parallel product `[rows, inner]·[inner, cols]`, from its shape alone. `gemm`
/// picks its blocking of the inner sum from the sizes it is given, so an entry's bits depend on
/// the block it falls in; blocks sized by the thread count made results differ between 1 and 2
/// threads. The product is cut along the longer side of `dst`, so the operand every block packs
/// again is the smaller one: a wide product (the LM head's `[N, D]·[D, V]` with V ≫ N) cut into
/// row blocks packed all of `[D, V]` once per block, and ran 2–4× slower than in column blocks
/// (docs/PERFORMANCE.md). Blocks are ≥ 32 rows or columns and ≥ ~64K multiply-adds.
fn matmul_split(rows: usize, inner: usize, cols: usize) -> Split {
    let (by, len, other) = if cols > rows {
        (Cut::Columns, cols, rows)
    } else {
        (Cut::Rows, rows, cols)
    };
    let work_per_line = (inner * other).max(1);
    let size = len
        .div_ceil(MATMUL_MAX_BLOCKS)
        .max(32)
        .max((1 << 16) / work_per_line)
        .max(1);
    Split {
        by,
        size,
        blocks: len.div_ceil(size),
        len,
    }
}

/// What `gemm` allocates while a parallel product `[rows, inner]·[inner, cols]` runs: each block
/// packs its own copy of its part of the right-hand matrix (all of it for row blocks, its
/// columns for column blocks; `inner·cols` floats at most, while that fits `gemm`'s cache
/// blocking), so up to one copy per block is live at once. Returns the bytes of one copy and the
/// number of blocks.
pub fn rhs_packing(rows: usize, inner: usize, cols: usize) -> (u64, usize) {
    let split = matmul_split(rows, inner, cols);
    let packed_cols = match split.by {
        Cut::Rows => cols,
        Cut::Columns => split.size.min(cols),
    };
    ((inner * packed_cols * 4) as u64, split.blocks)
}

/// The most of an inner sum `gemm` packs at once in the products measured (its depth block):
/// packed copies hold at most this many values along the inner dimension.
pub const GEMM_INNER_BLOCK: usize = 512;

/// `gemm`'s packed copy, per block, of the right-hand matrix of a parallel product cut into
/// column blocks (the head's logits, `x·W` over a slice of the vocabulary), and the number of
/// blocks: `inner` (at most `GEMM_INNER_BLOCK`, as in the head's backward)
/// by the block's columns rounded up to the micro-kernel's rows (`gemm_kernel_rows`). With
/// AVX2 a matrix read as stored is packed only where the block's width is no multiple of
/// those rows. Measured with AVX2 (the allocator's peak beside `linear_nll_sum`'s forward, per
/// thread): read `transposed` (a tied head), 12,288 bytes at `[128, 32]·[32, 360]` and
/// `[32, 384]`, 16,384 at `[128, 64]·[64, 256]`, 49,152 at `[96, 48]·[48, 1000]`; stored,
/// the same at widths 90 and 250, none at 96 and 64. Not measured with AVX-512 or larger D.
/// Row blocks are not counted here.
pub fn column_packing(rows: usize, inner: usize, cols: usize, transposed: bool) -> (u64, usize) {
    let split = matmul_split(rows, inner, cols);
    let width = split.size.min(cols);
    let in_place = !transposed && !gemm_packs_stored() && width.is_multiple_of(gemm_kernel_rows());
    let bytes = match split.by {
        Cut::Columns if !in_place => {
            (inner.min(GEMM_INNER_BLOCK) * width.next_multiple_of(gemm_kernel_rows()) * 4) as u64
        }
        _ => 0,
    };
    (bytes, split.blocks)
}

/// Whether `gemm` packs a right-hand matrix it reads as stored (contiguous rows, not a
/// transposed view), as `rhs_packing` books. Its AVX-512 kernel does (the estimate's figures
/// were measured on such CPUs); its AVX2 kernel reads such a matrix in place (measured: at most
/// 64 bytes beside products from `[96, 48]·[48, 192]` to `[128, 256]·[256, 64]`, docs/MEMORY.md)
/// but for column blocks of a width its micro-kernel does not divide (`column_packing`). A
/// transposed view is packed by both.
pub fn gemm_packs_stored() -> bool {
    gemm_avx512()
}

/// Rows to which `gemm` rounds a transposed right-hand matrix it packs (its f32 micro-kernel's
/// rows): 64 with AVX-512 (measured at D 16–64: `memory::estimate`'s head packing), 16 with
/// AVX2 (measured at D 32 and 64).
pub fn gemm_kernel_rows() -> usize {
    if gemm_avx512() {
        64
    } else {
        16
    }
}

/// `gemm`'s packed copy, per block, of a left-hand matrix read transposed (x in a weight's
/// gradient `xᵀ·dy`) in a parallel product `[rows, inner]·[inner, cols]`, and the number of
/// blocks. With AVX2 a block more than 32 columns wide packs `min(inner, 512)` by `rows`
/// rounded up to 6 (its micro-kernel's columns): measured 73,728 bytes a thread at
/// `[32, 512]·[512, 256]` (blocks of 64 columns), 25,344 at `[64, 96]·[96, 192]`, none with
/// blocks 32 wide. The inner block holds where blocks and rows are at most 64 wide (`gemm`
/// sizes it from the caches beyond). With AVX-512 none is booked: its wider micro-kernel would
/// need blocks over 128 columns (not measured).
pub fn transposed_lhs_packing(rows: usize, inner: usize, cols: usize) -> (u64, usize) {
    let split = matmul_split(rows, inner, cols);
    let width = match split.by {
        Cut::Rows => cols,
        Cut::Columns => split.size.min(cols),
    };
    if gemm_avx512() || width <= 2 * gemm_kernel_rows() {
        return (0, split.blocks);
    }
    let bytes = inner.min(GEMM_INNER_BLOCK) * rows.next_multiple_of(6) * 4;
    (bytes as u64, split.blocks)
}

/// Whether `gemm` runs its AVX-512 kernels here (its `x86-v4` dispatch; AVX-512F stands for it).
fn gemm_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows `r` of `dst = a·b` (or `+=`), on the calling thread.
///
/// # Safety
/// As `matmul`, and no other thread writes rows `r` of `dst` meanwhile.
unsafe fn gemm_block(dst: &MatMut, a: Mat, b: Mat, accumulate: bool, r: Range<usize>) {
    let (Ptr::F32(pa), Ptr::F32(pb)) = (a.ptr, b.ptr) else {
        let (mut wide_a, mut wide_b) = (Vec::new(), Vec::new());
        // SAFETY: the caller's contract; the widened copies are f32.
        return unsafe {
            let (a, b) = (a.widened(&mut wide_a), b.widened(&mut wide_b));
            gemm_block(dst, a, b, accumulate, r)
        };
    };
    // SAFETY: the views are in bounds of live buffers (callers' contract), rows `r` of dst are
    // written by this call alone, and dst does not overlap a or b.
    unsafe {
        gemm::gemm(
            r.len(),
            dst.cols,
            a.cols,
            dst.ptr.add(r.start * dst.row_stride),
            1,
            dst.row_stride as isize,
            accumulate,
            pa.offset(r.start as isize * a.row_stride),
            a.col_stride,
            a.row_stride,
            pb,
            b.col_stride,
            b.row_stride,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// A zeroed output of `n` f32 values, filled by `fill` through a shared pointer.
fn output(n: usize, fill: impl FnOnce(Shared)) -> Vec<f32> {
    let mut out = vec![0f32; n];
    fill(Shared(out.as_mut_ptr()));
    out
}

fn last_dim(shape: &Shape) -> Result<(usize, usize)> {
    let d = *shape
        .dims()
        .last()
        .ok_or_else(|| candle_core::Error::Msg("fused op on a scalar".into()))?;
    Ok((shape.elem_count() / d.max(1), d))
}

// ---------------------------------------------------------------------------------------------
// Column sums (a bias's gradient)

/// `dst` = the sum over all rows of `x` (rows of `dst.len()`): per unit row by row
/// (vectorised), then units in order, so the result does not depend on the thread count.
fn column_sums(x: &[f32], d: usize, dst: &mut [f32]) {
    let n = x.len() / d;
    let units = n.div_ceil(unit_rows(d));
    let partial = output(units * d, |out| {
        for_units(n, d, |unit, rows| {
            // SAFETY: unit `unit` is this call's alone; `output` holds `units` rows of d.
            let acc = unsafe { out.rows(&(unit..unit + 1), d) };
            for row in x[rows.start * d..rows.end * d].chunks_exact(d) {
                for i in 0..d {
                    acc[i] += row[i];
                }
            }
        })
    });
    dst.fill(0.0);
    for unit in partial.chunks_exact(d) {
        for i in 0..d {
            dst[i] += unit[i];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise plumbing

/// `n` outputs, written (every one) by `f(range, dst)` for disjoint ranges in parallel.
fn map_range(n: usize, f: impl Fn(Range<usize>, &mut [MaybeUninit<f32>]) + Sync) -> Vec<f32> {
    // `for_ranges` covers 0..n and `f` writes each element of its range.
    filled(n, |out| {
        for_ranges(n, |range| {
            // SAFETY: `for_ranges` gives each call its own range of the n outputs.
            let dst = unsafe { out.uninit_rows(&range, 1) };
            f(range.clone(), dst)
        })
    })
}

/// `f(range)` for disjoint ranges covering `0..n`, in parallel.
fn for_ranges(n: usize, f: impl Fn(Range<usize>) + Sync) {
    const WIDTH: usize = 1024;
    for_units(n.div_ceil(WIDTH), WIDTH, |_, blocks| {
        f(blocks.start * WIDTH..(blocks.end * WIDTH).min(n))
    })
}

// ---------------------------------------------------------------------------------------------
// Masked token NLL

/// Summed token NLL of `logits` against `targets`, counting only positions where `mask` is 1, as one fused op with its own backward.
pub fn nll_sum(logits: &Tensor, targets: &Tensor, mask: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op3(&targets.contiguous()?, &mask.contiguous()?, NllSum)
}

struct NllSum;

/// `(max, log Σ exp(row − max))` of one row of logits; `scratch` holds the row's exps.
#[inline(always)]
fn log_sum_exp(row: &[f32], scratch: &mut [f32]) -> (f32, f32) {
    let max = vmath::max(row);
    scratch
        .iter_mut()
        .zip(row)
        .for_each(|(e, &v)| *e = vmath::exp(v - max));
    (max, vmath::sum(scratch).ln())
}

impl CustomOp3 for NllSum {
    fn name(&self) -> &'static str {
        "gaccwb-nll-sum"
    }

    fn cpu_fwd(
        &self,
        ls: &CpuStorage,
        ll: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
        ms: &CpuStorage,
        ml: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let logits = storage::input(ls, ll, self.name())?;
        let logits = &logits[..];
        let targets = u32_slice(ts, tl, self.name())?;
        let mask = f32_slice(ms, ml, self.name())?;
        let (n, v) = last_dim(ll.shape())?;
        if targets.len() != n || mask.len() != n {
            candle_core::bail!("nll: {n} rows of logits, {} targets", targets.len());
        }
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("nll: target {t} outside vocab {v}");
        }
        // Per-unit partial sums, added in unit order: the same total for any thread count.
        let units = n.div_ceil(unit_rows(v));
        let partial = output(units, |out| {
            for_units(n, v, |unit, rows| {
                let mut scratch = vec![0f32; v];
                let total = vmath::widest(
                    #[inline(always)]
                    || {
                        let mut total = 0f32;
                        for i in rows.clone() {
                            if mask[i] == 0.0 {
                                continue;
                            }
                            let row = &logits[i * v..(i + 1) * v];
                            let (max, lse) = log_sum_exp(row, &mut scratch);
                            total -= mask[i] * (row[targets[i] as usize] - max - lse);
                        }
                        total
                    },
                );
                // SAFETY: unit `unit` is this call's alone; `output` holds one value per unit.
                unsafe { out.rows(&(unit..unit + 1), 1)[0] = total };
            })
        });
        let total: f32 = partial.iter().sum();
        Ok((CpuStorage::F32(vec![total]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        mask: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let scale = grad.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        let op = NllBackward { scale };
        Ok((
            Some(logits.apply_op3_no_bwd(targets, mask, &op)?),
            None,
            None,
        ))
    }
}

struct NllBackward {
    scale: f32,
}

impl CustomOp3 for NllBackward {
    fn name(&self) -> &'static str {
        "gaccwb-nll-backward"
    }

    /// d logits = scale · mask · (softmax(row) − onehot(target)).
    fn cpu_fwd(
        &self,
        ls: &CpuStorage,
        ll: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
        ms: &CpuStorage,
        ml: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let logits = storage::input(ls, ll, self.name())?;
        let logits = &logits[..];
        let targets = u32_slice(ts, tl, self.name())?;
        let mask = f32_slice(ms, ml, self.name())?;
        let (n, v) = last_dim(ll.shape())?;
        let scale = self.scale;
        let d = output(n * v, |out| {
            for_units(n, v, |_, rows| {
                // SAFETY: `for_units` gives each call its own rows, inside `output`'s buffer.
                let dst = unsafe { out.rows(&rows, v) };
                let src = &logits[rows.start * v..rows.end * v];
                let mut scratch = vec![0f32; v];
                vmath::widest(
                    #[inline(always)]
                    || {
                        let rows_iter = dst.chunks_exact_mut(v).zip(src.chunks_exact(v));
                        for (r, (dr, row)) in rows_iter.enumerate() {
                            let i = rows.start + r;
                            dr.copy_from_slice(row);
                            let target = targets[i] as usize;
                            head::softmax_minus_onehot(dr, target, scale * mask[i], &mut scratch);
                        }
                    },
                )
            })
        });
        Ok((storage::stored(d, ls)?, ll.shape().clone()))
    }
}
