//! bf16 products on packed blocks: bf16 operands, f32 sums. Where the CPU has AMX (Sapphire
//! Rapids and later Xeons) and the kernel grants the process its tile state, a bf16 model's
//! products run on its tiles (`tdpbf16ps`: a 16×32 by a 32×16 block, 8,192 multiply-adds);
//! where it has AVX-512 BF16 instead (Zen 4 and later, Cooper Lake), on dot products
//! (`vdpbf16ps`: 16 sums of two products each). Either is many times, or twice, the multiply-adds
//! per instruction of `gemm`'s f32 kernel, which widened bf16 would take (docs/PERFORMANCE.md).
//! "Tiles" below names the packed 32×32 blocks both kernels multiply.
//!
//! Operands are packed into bf16 from f32 views (rounded to nearest, ties to even; values a
//! bf16 tensor holds are exact) or from bf16 ones as stored (`Values::Bf16`: weights, half the
//! bytes to read and no f32 copy): the left-hand rows as rows of 32-column tiles, the
//! right-hand columns in the pair-interleaved ("VNNI") panels both instructions read. They are
//! packed into `gemm`'s own per-thread slab (`ops::workspace`, which the memory estimate already
//! counts, cache-line aligned: tile rows that cross lines load several times slower), in passes
//! of at most 384 inner values (`plan`); every value's sums run in one order wherever its block
//! falls, so results depend neither on the thread count nor on how a product is cut (`split`:
//! one block per thread). `GACCWB_BF16_PRODUCTS` caps the kernel: `gemm` keeps bf16 products in
//! f32 `gemm`, `avx512` leaves AMX aside.

use std::cell::Cell;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::OnceLock;

use candle_core::DType;

use super::transpose::transposed;
use super::{storage::bf16_bits, Mat, MatMut, Ptr};
use crate::ops::vmath;

/// The variable that caps the kernel bf16 products run on (`Bf16Kernel::cap`).
pub const KERNEL_ENV: &str = "GACCWB_BF16_PRODUCTS";

/// What a bf16 op's products run on, from the slowest to the fastest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Bf16Kernel {
    /// Both operands widened to f32 for `gemm`.
    Gemm,
    /// AVX-512 BF16 dot products (`vdpbf16ps`) on packed blocks.
    Avx512,
    /// AMX tiles (`tdpbf16ps`) on packed blocks.
    Amx,
}

impl Bf16Kernel {
    /// The name `GACCWB_BF16_PRODUCTS` takes and the benchmark prints.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Kernel::Gemm => "gemm",
            Bf16Kernel::Avx512 => "avx512",
            Bf16Kernel::Amx => "amx",
        }
    }

    /// The fastest kernel `GACCWB_BF16_PRODUCTS` allows (`gemm`, `avx512`, `amx`; unset or
    /// anything else: `amx`).
    fn cap() -> Bf16Kernel {
        let value = std::env::var(KERNEL_ENV).unwrap_or_default();
        [Bf16Kernel::Gemm, Bf16Kernel::Avx512]
            .into_iter()
            .find(|k| value.trim().eq_ignore_ascii_case(k.name()))
            .unwrap_or(Bf16Kernel::Amx)
    }

    /// Whether this CPU runs this kernel (AMX: and the kernel granted the tile state).
    fn runs(self) -> bool {
        match self {
            Bf16Kernel::Gemm => true,
            Bf16Kernel::Avx512 => cpu::has_avx512_bf16(),
            Bf16Kernel::Amx => cpu::has_amx_bf16() && cpu::request_tiles(),
        }
    }
}

/// The fastest packed kernel this CPU runs, whatever the cap. Asked once.
fn best() -> Bf16Kernel {
    static BEST: OnceLock<Bf16Kernel> = OnceLock::new();
    *BEST.get_or_init(|| {
        [Bf16Kernel::Amx, Bf16Kernel::Avx512]
            .into_iter()
            .find(|k| k.runs())
            .unwrap_or(Bf16Kernel::Gemm)
    })
}

/// The kernel bf16 products run on: the fastest this CPU runs within `GACCWB_BF16_PRODUCTS`.
/// Asked once.
pub(super) fn kernel() -> Bf16Kernel {
    static ON: OnceLock<Bf16Kernel> = OnceLock::new();
    *ON.get_or_init(|| match (best(), Bf16Kernel::cap()) {
        (best, cap) if best <= cap => best,
        // Capped below AMX: AVX-512 BF16 where the CPU has it too.
        (_, Bf16Kernel::Avx512) if Bf16Kernel::Avx512.runs() => Bf16Kernel::Avx512,
        _ => Bf16Kernel::Gemm,
    })
}

/// Whether this CPU has a packed kernel (AMX or AVX-512 BF16), whatever the cap.
pub(super) fn available() -> bool {
    best() != Bf16Kernel::Gemm
}

/// The packed kernel products on tiles use: `kernel()`, or where the cap keeps bf16 products
/// in `gemm` (so that only `scope_if` asks for tiles), `best()`.
fn packed_kernel() -> Bf16Kernel {
    match kernel() {
        Bf16Kernel::Gemm => best(),
        k => k,
    }
}

/// Rows and columns of a tile block: 2×2 tiles of 16×16 sums.
const BLOCK: usize = 32;
/// Inner values one tile multiply-add consumes.
const DEPTH: usize = 32;
/// Inner values packed at a time, at most: a block's 32 left-hand rows of them (24 KiB) stay in
/// the first-level cache while the right-hand panels stream past (512 ran slower, measured:
/// docs/PERFORMANCE.md).
const KC: usize = 384;
/// Rows of the left-hand matrix packed at a time.
const STRIP: usize = 128;

/// The inner values and right-hand columns packed at a time for a product `inner` deep: the
/// depth cut into equal passes of at most `KC` (whole tiles: a pass boundary does not change a
/// sum, which the tiles keep in f32), a strip of rows, and columns whose panels fill half the
/// slab (the second-level cache) so that they stream from it. `None` where the slab is too small.
fn plan(inner: usize) -> Option<(usize, usize)> {
    let passes = inner.div_ceil(KC).max(1);
    let kc = pad(inner.div_ceil(passes), DEPTH);
    let slab = crate::ops::workspace::slab_bytes() as usize;
    let panels = (slab / 2).min(slab.checked_sub(STRIP * kc * 2)?);
    let cols = panels / (kc * 2) / BLOCK * BLOCK;
    (cols >= BLOCK).then_some((kc, cols))
}

/// Whether a product `inner` deep runs on tiles: bf16 products are asked for on this thread
/// (`scope`), the product is at least one tile deep, and the slab holds its packed blocks.
pub(super) fn fit(inner: usize) -> bool {
    active() && inner >= DEPTH && plan(inner).is_some()
}

/// Whether this thread's products run on tiles (`scope`). An op that hands its products to
/// pool work reads it on its own thread and passes it to `serial`: the workers' own choice is
/// off.
pub(super) fn chosen() -> bool {
    active()
}

/// `dst` (+)= `a·b` on this thread alone: on tiles when `tiles` (the op thread's `chosen`) and
/// the product is at least one tile deep, else `gemm`. The choice depends on the shape alone,
/// not on the thread, so the bits are the same at any thread count.
///
/// # Safety
/// As `super::matmul`.
pub(super) unsafe fn serial(tiles: bool, dst: MatMut, a: Mat, b: Mat, accumulate: bool) {
    let rows = 0..dst.rows;
    if tiles && a.cols >= DEPTH {
        // SAFETY: the caller's contract, for all of dst.
        unsafe { gemm_block(&dst, a, b, accumulate, rows) }
    } else {
        // SAFETY: as above.
        unsafe { super::gemm_block(&dst, a, b, accumulate, rows) }
    }
}

/// How a parallel tile product `[rows, inner]·[inner, cols]` is cut: along the longer side of
/// dst, one block per pool thread, in whole 32-wide blocks. Every block packs again the operand
/// it shares with the others, so fewer blocks pack less; unlike `gemm`'s (`matmul_split`), a
/// tile product's bits do not depend on its blocks (`strip_blocks`), so the count may follow
/// the threads.
pub(super) fn split(rows: usize, cols: usize) -> super::Split {
    let (by, len) = if cols > rows {
        (super::Cut::Columns, cols)
    } else {
        (super::Cut::Rows, rows)
    };
    let threads = crate::ops::pool::threads().max(1);
    let size = pad(len.div_ceil(threads), BLOCK).max(BLOCK);
    super::Split {
        by,
        size,
        blocks: len.div_ceil(size),
        len,
    }
}

/// Rows `r` of `dst = a·b` (or `+=`) with bf16-rounded operands, on the calling thread.
///
/// # Safety
/// As `super::gemm_block`, and `available()` returned true.
pub(super) unsafe fn gemm_block(dst: &MatMut, a: Mat, b: Mat, accumulate: bool, r: Range<usize>) {
    let (m, n, k) = (r.len(), dst.cols, a.cols);
    let Some((kc, nc)) = plan(k) else {
        // SAFETY: the caller's contract (`fit` rules this out; `gemm` is the same product).
        return unsafe { super::gemm_block(dst, a, b, accumulate, r) };
    };
    let kernel = packed_kernel();
    if kernel == Bf16Kernel::Amx {
        cpu::configure();
    }
    gemm_common::gemm::L2_SLAB.with(|slab| {
        let mut slab = slab.borrow_mut();
        initialise(&mut slab);
        let (panel_mem, strip_mem) = slab.split_at_mut(nc * kc * 2);
        for jb in (0..n).step_by(nc) {
            let cols = nc.min(n - jb);
            for kb in (0..k).step_by(kc) {
                let depth = kc.min(k - kb);
                let kp = pad(depth, DEPTH);
                let panels = packed(panel_mem, pad(cols, BLOCK) * kp, cols % BLOCK + kp - depth);
                // SAFETY: inner rows kb.. and columns jb.. of the caller's in-bounds view.
                unsafe { pack_panels(panels, kp, inner_rows(b, kb, depth).columns(jb..jb + cols)) };
                let add = accumulate || kb > 0;
                for strip in (0..m).step_by(STRIP) {
                    let rows = STRIP.min(m - strip);
                    let lhs = packed(strip_mem, pad(rows, BLOCK) * kp, rows % BLOCK + kp - depth);
                    // SAFETY: rows r.start+strip.. and columns kb.. of `a` lie in its view.
                    unsafe { pack_rows(lhs, kp, a.columns(kb..kb + depth), r.start + strip, rows) };
                    let at = r.start + strip;
                    // SAFETY: rows at..at+rows lie in rows `r` of dst, this call's alone;
                    // columns jb..jb+cols in dst; tiles are configured on this thread.
                    unsafe {
                        strip_blocks(dst, lhs, panels, kp, at..at + rows, jb..jb + cols, add)
                    };
                }
            }
        }
    });
}

/// Rows `rows` × columns `cols` of dst from one packed strip of the left-hand rows and the
/// columns' panels, 32×32 at a time: whole blocks straight into dst (loaded first when
/// `add`), edge blocks through a scratch block loaded the same way. So every value is its old
/// value (or zero) plus the same products in the same order, wherever its block falls: the
/// bits do not depend on how the product is cut.
///
/// # Safety
/// `rows` and `cols` lie in dst, no other thread writes those rows, a packed kernel runs here
/// (AMX: tiles configured).
unsafe fn strip_blocks(
    dst: &MatMut,
    lhs: &[u16],
    panels: &[u16],
    kp: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    add: bool,
) {
    let kernel = packed_kernel();
    let mut sums = [0f32; BLOCK * BLOCK];
    // A block of rows at a time across all the panels: its 32 rows stay in the first-level
    // cache and the panels stream in order (twice the rate of the other order, measured).
    for i in (0..rows.len()).step_by(BLOCK) {
        let lhs = &lhs[i * kp..(i + BLOCK) * kp];
        for j in (0..cols.len()).step_by(BLOCK) {
            let panels = &panels[j * kp..(j + BLOCK) * kp];
            let (row, col) = (rows.start + i, cols.start + j);
            let whole = row + BLOCK <= rows.end && col + BLOCK <= cols.end;
            let job = |c, stride| Job {
                c,
                stride,
                add,
                lhs,
                panels,
                kp,
            };
            // SAFETY: the block at (row, col) lies in dst (whole) or `sums` is 32×32; `lhs`
            // and `panels` hold 32 rows / columns of kp values.
            unsafe {
                if whole {
                    let c = dst.ptr.add(row * dst.row_stride + col);
                    cpu::block(kernel, job(c, dst.row_stride * 4));
                } else {
                    let end = (row + BLOCK).min(rows.end);
                    if add {
                        read(dst, &mut sums, row..end, col, cols.end);
                    }
                    cpu::block(kernel, job(sums.as_mut_ptr(), BLOCK * 4));
                    write(dst, &sums, row..end, col, cols.end);
                }
            }
        }
    }
}

/// One 32×32 block of a product: its sums at `c` (rows `stride` bytes apart), added to what they
/// hold when `add`, from 32 packed left-hand rows (`lhs`) and two panels of 16 columns
/// (`panels`), each `kp` inner values deep.
#[derive(Clone, Copy)]
struct Job<'a> {
    c: *mut f32,
    stride: usize,
    add: bool,
    lhs: &'a [u16],
    panels: &'a [u16],
    kp: usize,
}

/// Rows `rows` of dst from column `j` to at most `end` into `sums` (32×32); what lies past
/// them in `sums` feeds only sums that are not written.
///
/// # Safety
/// `rows` lie in dst.
unsafe fn read(dst: &MatMut, sums: &mut [f32], rows: Range<usize>, j: usize, end: usize) {
    let cols = BLOCK.min(end - j);
    for (row, s) in rows.zip(sums.chunks_exact_mut(BLOCK)) {
        // SAFETY: the caller's contract; columns j..j+cols lie in the row.
        let values = unsafe { line(dst.ptr.add(row * dst.row_stride + j).cast_const(), 0, cols) };
        s[..cols].copy_from_slice(values);
    }
}

/// `sums` (32×32) into rows `rows` of dst from column `j` to at most `end`.
///
/// # Safety
/// `rows` lie in dst and no other thread writes them.
unsafe fn write(dst: &MatMut, sums: &[f32], rows: Range<usize>, j: usize, end: usize) {
    let cols = BLOCK.min(end - j);
    for (row, s) in rows.zip(sums.chunks_exact(BLOCK)) {
        // SAFETY: the caller's contract; columns j..j+cols lie in the row.
        let out =
            unsafe { std::slice::from_raw_parts_mut(dst.ptr.add(row * dst.row_stride + j), cols) };
        out.copy_from_slice(&s[..cols]);
    }
}

/// Rows `start..start+len` of `b`.
fn inner_rows(b: Mat, start: usize, len: usize) -> Mat {
    Mat {
        ptr: b.ptr.offset(start as isize * b.row_stride),
        rows: len,
        ..b
    }
}

thread_local! {
    /// Whether this thread's slab has been zeroed: once, before its first tile product.
    static INITIALISED: Cell<bool> = const { Cell::new(false) };
}

/// Zeroes this thread's slab once, so that its bytes are initialised from then on: every later
/// write (the packing here, `gemm`'s) stores whole values.
fn initialise(slab: &mut [MaybeUninit<u8>]) {
    if !INITIALISED.with(Cell::get) {
        slab.fill(MaybeUninit::new(0));
        INITIALISED.with(|c| c.set(true));
    }
}

/// The first `len` u16 of `mem` (initialised: `initialise`) for a packed operand, zeroed first
/// where it has padding (`padding` > 0: a block's edge rows or columns, or a depth short of whole
/// tiles), which must read zero; without padding the packing writes every value.
fn packed(mem: &mut [MaybeUninit<u8>], len: usize, padding: usize) -> &mut [u16] {
    assert!(len * 2 <= mem.len() && mem.as_ptr().align_offset(4) == 0);
    assert!(INITIALISED.with(Cell::get));
    let ptr = mem.as_mut_ptr().cast::<u16>();
    // SAFETY: `len` u16 fit in `mem` (checked), which is 4-aligned (checked) and initialised
    // (`initialise`, checked); any bits are a valid u16.
    let values = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
    if padding > 0 {
        values.fill(0);
    }
    values
}

fn pad(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

thread_local! {
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
}

fn active() -> bool {
    ACTIVE.with(Cell::get)
}

/// Products of an op whose storage is `dtype` on this thread, until the guard drops: on tiles
/// for bf16 (where `available`), `gemm` otherwise. The op's own (parallel) products read it on
/// the op's thread; products inside pool work (attention's) take the op thread's `chosen` along
/// to `serial`.
pub(super) fn scope(dtype: DType) -> Scope {
    scope_if(takes(dtype))
}

/// Whether an op's products with storage `dtype` run on tiles (`scope`).
pub(super) fn takes(dtype: DType) -> bool {
    dtype == DType::BF16 && kernel() != Bf16Kernel::Gemm
}

/// Tile products on this thread while the guard lives, if `on` (and `available()`).
pub(super) fn scope_if(on: bool) -> Scope {
    Scope {
        previous: ACTIVE.with(|c| c.replace(on && available())),
    }
}

/// Restores the thread's previous choice of products when dropped (`scope`).
#[must_use = "the choice lasts only while the guard lives"]
pub(super) struct Scope {
    previous: bool,
}

impl Drop for Scope {
    fn drop(&mut self) {
        ACTIVE.with(|c| c.set(self.previous));
    }
}

/// A value an operand is packed from: f32 (rounded to bf16) or bf16 bits (as they are).
trait Elem: Copy {
    const ZERO: Self;
    fn bits(self) -> u16;
}

impl Elem for f32 {
    const ZERO: f32 = 0.0;
    #[inline(always)]
    fn bits(self) -> u16 {
        bf16_bits(self)
    }
}

impl Elem for u16 {
    const ZERO: u16 = 0;
    #[inline(always)]
    fn bits(self) -> u16 {
        self
    }
}

/// A `Mat` whose values' type is resolved.
#[derive(Clone, Copy)]
struct View<T> {
    ptr: *const T,
    rows: usize,
    cols: usize,
    row_stride: isize,
    col_stride: isize,
}

impl<T> View<T> {
    fn of(m: Mat, ptr: *const T) -> View<T> {
        View {
            ptr,
            rows: m.rows,
            cols: m.cols,
            row_stride: m.row_stride,
            col_stride: m.col_stride,
        }
    }
}

/// Rows `start..start+m` of `a` as bf16 rows of `kp` values. Columns past `a.cols` and rows
/// past `m` are left as they are (`packed` zeroes the padding).
///
/// # Safety
/// `a`'s view is in bounds of a live buffer.
unsafe fn pack_rows(dst: &mut [u16], kp: usize, a: Mat, start: usize, m: usize) {
    let a = Mat {
        ptr: a.ptr.offset(start as isize * a.row_stride),
        rows: m,
        ..a
    };
    // SAFETY: the caller's contract, for the view typed by its values.
    unsafe {
        match a.ptr {
            Ptr::F32(p) => rows_of(dst, kp, View::of(a, p)),
            Ptr::Bf16(p) => rows_of(dst, kp, View::of(a, p)),
        }
    }
}

/// `pack_rows` of all of `a`'s rows.
///
/// # Safety
/// As `pack_rows`.
unsafe fn rows_of<T: Elem>(dst: &mut [u16], kp: usize, a: View<T>) {
    let m = a.rows;
    vmath::widest(
        #[inline(always)]
        || {
            if a.col_stride == 1 {
                for (i, row) in dst.chunks_exact_mut(kp).take(m).enumerate() {
                    // SAFETY: row i of the view, `a.cols` contiguous values.
                    let src = unsafe { line(a.ptr, i as isize * a.row_stride, a.cols) };
                    row.iter_mut().zip(src).for_each(|(d, &x)| *d = x.bits());
                }
                return;
            }
            if a.row_stride == 1 {
                // SAFETY: the caller's contract (a transposed view).
                return unsafe { pack_columns(dst, kp, a) };
            }
            // Neither is contiguous: 16 columns at a time, turned into rows.
            let mut tile = [[0u16; 16]; 16];
            for c0 in (0..a.cols).step_by(16) {
                let cs = 16.min(a.cols - c0);
                for i0 in (0..m).step_by(16) {
                    let is = 16.min(m - i0);
                    for (c, t) in tile.iter_mut().enumerate().take(cs) {
                        let at = (c0 + c) as isize * a.col_stride + i0 as isize * a.row_stride;
                        // SAFETY: column c0+c, rows i0..i0+is of the view.
                        unsafe { strided(a.ptr, at, a.row_stride, is, |i, x| t[i] = x.bits()) };
                    }
                    for i in 0..is {
                        let row = &mut dst[(i0 + i) * kp + c0..][..cs];
                        row.iter_mut().zip(&tile).for_each(|(d, t)| *d = t[i]);
                    }
                }
            }
        },
    )
}

/// `rows_of` a view whose columns are contiguous (a transposed matrix): a row of tiles holds
/// pairs of adjacent columns, so each pair of columns is one vector of `pair`s, and blocks of 16
/// pairs × 16 rows are transposed into the rows.
///
/// # Safety
/// `a`'s rows are in bounds of a live buffer and `a.row_stride == 1`.
#[inline(always)]
unsafe fn pack_columns<T: Elem>(dst: &mut [u16], kp: usize, a: View<T>) {
    let m = a.rows;
    // SAFETY: u16 pairs as u32, as `pack_panels` (align 4, checked; kp is even).
    let (head, dst32, _) = unsafe { dst.align_to_mut::<u32>() };
    assert!(head.is_empty());
    let (pairs, half) = (a.cols / 2, kp / 2);
    let mut tile = [[0u32; 16]; 16];
    for p0 in (0..pairs).step_by(16) {
        let ps = 16.min(pairs - p0);
        for i0 in (0..m).step_by(16) {
            let is = 16.min(m - i0);
            for (p, t) in tile.iter_mut().enumerate().take(ps) {
                let c = (2 * (p0 + p)) as isize * a.col_stride + i0 as isize;
                // SAFETY: rows i0..i0+is of columns c and c+1, contiguous.
                let (lo, hi) = unsafe { (line(a.ptr, c, is), line(a.ptr, c + a.col_stride, is)) };
                pairs_into(&mut t[..is], lo, hi);
            }
            let rows = transposed(&tile);
            for (i, row) in rows.iter().enumerate().take(is) {
                dst32[(i0 + i) * half + p0..][..ps].copy_from_slice(&row[..ps]);
            }
        }
    }
    // An odd last column pairs with the zero padding.
    if a.cols % 2 == 1 {
        let c = (a.cols - 1) as isize * a.col_stride;
        // SAFETY: rows 0..m of the last column, contiguous.
        let last = unsafe { line(a.ptr, c, m) };
        for (i, &x) in last.iter().enumerate() {
            dst[i * kp + a.cols - 1] = x.bits();
        }
    }
}

/// Two values as one bf16 pair (`lo` in the low half): one row of a `tdpbf16ps` panel holds 16.
#[inline(always)]
fn pair<T: Elem>(lo: T, hi: T) -> u32 {
    u32::from(hi.bits()) << 16 | u32::from(lo.bits())
}

/// `out[i] = pair(lo[i], hi[i])` for up to 16 values, a whole 16 as one fixed-size block so
/// that it compiles to a few vector instructions.
#[inline(always)]
fn pairs_into<T: Elem>(out: &mut [u32], lo: &[T], hi: &[T]) {
    if let (Ok(out), Ok(lo), Ok(hi)) = (
        <&mut [u32; 16]>::try_from(&mut *out),
        <&[T; 16]>::try_from(lo),
        <&[T; 16]>::try_from(hi),
    ) {
        for i in 0..16 {
            out[i] = pair(lo[i], hi[i]);
        }
        return;
    }
    for ((d, &l), &h) in out.iter_mut().zip(lo).zip(hi) {
        *d = pair(l, h);
    }
}

/// All of `b` (`kp` ≥ `b.rows` inner values) as panels of 16 columns, each `kp / 2` rows of
/// 16 pairs `(b[2p][col], b[2p+1][col])`: the layout `tdpbf16ps` reads its second operand in.
///
/// # Safety
/// `b`'s view is in bounds of a live buffer.
unsafe fn pack_panels(dst: &mut [u16], kp: usize, b: Mat) {
    // SAFETY: the caller's contract, for the view typed by its values.
    unsafe {
        match b.ptr {
            Ptr::F32(p) => panels_of(dst, kp, View::of(b, p)),
            Ptr::Bf16(p) => panels_of(dst, kp, View::of(b, p)),
        }
    }
}

/// `pack_panels` of a typed view.
///
/// # Safety
/// As `pack_panels`.
unsafe fn panels_of<T: Elem>(dst: &mut [u16], kp: usize, b: View<T>) {
    // SAFETY: u16 pairs as u32 (align 4: the slab is cache-line aligned; checked).
    let (head, dst, _) = unsafe { dst.align_to_mut::<u32>() };
    assert!(head.is_empty());
    let panel = 16 * kp / 2;
    let pairs = b.rows / 2;
    let at = |r: usize, c: usize| {
        // SAFETY: the callers below read rows and columns inside the view.
        unsafe {
            *b.ptr
                .offset(r as isize * b.row_stride + c as isize * b.col_stride)
        }
    };
    vmath::widest(
        #[inline(always)]
        || {
            if b.col_stride == 1 {
                for p in 0..pairs {
                    // SAFETY: rows 2p and 2p+1 of the view, `b.cols` contiguous values each.
                    let (lo, hi) = unsafe {
                        let r = 2 * p as isize * b.row_stride;
                        (
                            line(b.ptr, r, b.cols),
                            line(b.ptr, r + b.row_stride, b.cols),
                        )
                    };
                    for (g, (lo, hi)) in lo.chunks(16).zip(hi.chunks(16)).enumerate() {
                        let out = &mut dst[g * panel + p * 16..][..lo.len()];
                        pairs_into(out, lo, hi);
                    }
                }
            } else {
                // Columns are the contiguous lines: 16 pairs of 16 columns at a time.
                let mut tile = [[0u32; 16]; 16];
                for c0 in (0..b.cols).step_by(16) {
                    let cs = 16.min(b.cols - c0);
                    for p0 in (0..pairs).step_by(16) {
                        let ps = 16.min(pairs - p0);
                        for (c, t) in tile.iter_mut().enumerate().take(cs) {
                            if b.row_stride == 1 {
                                let start = 2 * p0 as isize + (c0 + c) as isize * b.col_stride;
                                // SAFETY: rows 2·p0.. of column c0+c, 2·ps contiguous values.
                                let src = unsafe { line(b.ptr, start, 2 * ps) };
                                for (t, x) in t.iter_mut().zip(src.chunks_exact(2)) {
                                    *t = pair(x[0], x[1]);
                                }
                                continue;
                            }
                            for (p, t) in t.iter_mut().enumerate().take(ps) {
                                let r = 2 * (p0 + p);
                                *t = pair(at(r, c0 + c), at(r + 1, c0 + c));
                            }
                        }
                        let rows = transposed(&tile);
                        for (p, row) in rows.iter().enumerate().take(ps) {
                            let out = &mut dst[(c0 / 16) * panel + (p0 + p) * 16..][..cs];
                            out.copy_from_slice(&row[..cs]);
                        }
                    }
                }
            }
            // An odd last row pairs with the zero padding.
            if b.rows % 2 == 1 {
                for c in 0..b.cols {
                    dst[(c / 16) * panel + pairs * 16 + c % 16] = pair(at(b.rows - 1, c), T::ZERO);
                }
            }
        },
    )
}

/// `len` contiguous values from `ptr + offset`.
///
/// # Safety
/// They lie inside a live buffer.
#[inline(always)]
unsafe fn line<'a, T>(ptr: *const T, offset: isize, len: usize) -> &'a [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(ptr.offset(offset), len) }
}

/// `f(i, ptr[offset + i·stride])` for `i < len`, from one slice where `stride` is 1.
///
/// # Safety
/// Those values lie inside a live buffer.
#[inline(always)]
unsafe fn strided<T: Copy>(
    ptr: *const T,
    offset: isize,
    stride: isize,
    len: usize,
    mut f: impl FnMut(usize, T),
) {
    if stride == 1 {
        // SAFETY: the caller's values lie in a live buffer.
        let values = unsafe { line(ptr, offset, len) };
        values.iter().enumerate().for_each(|(i, &x)| f(i, x));
    } else {
        // SAFETY: as above, one value at a time.
        (0..len).for_each(|i| f(i, unsafe { *ptr.offset(offset + i as isize * stride) }));
    }
}

#[cfg(target_arch = "x86_64")]
mod cpu {
    use super::*;
    use std::arch::asm;

    /// CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
    pub(super) fn has_amx_bf16() -> bool {
        // Leaf 7 is read only where the highest leaf (leaf 0's eax) reaches it.
        if std::arch::x86_64::__cpuid(0).eax < 7 {
            return false;
        }
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0
    }

    /// Linux hands out the tile state (8 KiB per thread) only on request, per process.
    pub(super) fn request_tiles() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with this request only changes the process's permission; a kernel
        // without it returns an error, which we read as "no tiles".
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }

    /// The tile shapes every block uses: 8 tiles of 16 rows × 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    thread_local! {
        static CONFIGURED: Cell<bool> = const { Cell::new(false) };
    }

    /// Loads the tile shapes on this thread (once; the kernel keeps them across switches).
    pub(super) fn configure() {
        if CONFIGURED.with(Cell::get) {
            return;
        }
        let mut c = Config([0; 64]);
        c.0[0] = 1; // palette 1
        for t in 0..8 {
            c.0[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
            c.0[48 + t] = 16; // rows
        }
        // SAFETY: `available()` granted the tile state to the process; the config is valid
        // for palette 1 (≤ 16 rows, ≤ 64 bytes per row).
        unsafe { asm!("ldtilecfg [{}]", in(reg) c.0.as_ptr(), options(nostack)) };
        CONFIGURED.with(|f| f.set(true));
    }

    /// Whether this CPU has AVX-512 BF16 (`vdpbf16ps`) and AVX-512F.
    pub(super) fn has_avx512_bf16() -> bool {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
    }

    /// The block `job` = lhs (32 rows of kp) · the two panels (kp/2 pairs of 16 columns each),
    /// added to what it holds when `add`, on `kernel`.
    ///
    /// # Safety
    /// Sizes as stated, the block's 32 rows of 32 values writable and no other thread's,
    /// `kernel` packed and run by this CPU (AMX: tiles configured on this thread, `configure`).
    pub(super) unsafe fn block(kernel: Bf16Kernel, job: Job) {
        debug_assert!(job.lhs.len() == BLOCK * job.kp && job.panels.len() == BLOCK * job.kp);
        // SAFETY: the caller's contract; `Bf16Kernel::Avx512` runs only where the CPU has it.
        unsafe {
            match kernel {
                Bf16Kernel::Amx => tile_block(job),
                Bf16Kernel::Avx512 => dot_block(job),
                Bf16Kernel::Gemm => unreachable!("gemm products are not packed"),
            }
        }
    }

    /// Rows of a block one pass of `dot_block` keeps in registers: 8 rows × 2 panels are 16
    /// accumulators of the 32 vector registers.
    const ROWS: usize = 8;

    /// `block` on AVX-512 BF16: for each group of 8 rows, 16 sums per `vdpbf16ps`, each value's
    /// pairs added in order (the sums' order does not depend on the block's place).
    ///
    /// # Safety
    /// As `block`, on a CPU with AVX-512F and AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn dot_block(job: Job) {
        use std::arch::x86_64::*;
        let (c, stride, kp) = (job.c, job.stride, job.kp);
        let pairs = kp / 2;
        // Packed operands are 4-aligned (`packed`): a pair is one u32.
        let a = job.lhs.as_ptr().cast::<u32>();
        let (b0, b1) = (
            job.panels.as_ptr().cast::<u32>(),
            job.panels[16 * kp..].as_ptr().cast::<u32>(),
        );
        for g in (0..BLOCK).step_by(ROWS) {
            let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
            // SAFETY: rows g..g+8 of the block at `c`, 32 values each (the caller's contract).
            let row = |r: usize| unsafe { c.byte_add((g + r) * stride) };
            if job.add {
                for (r, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: as above.
                    *acc = unsafe { [_mm512_loadu_ps(row(r)), _mm512_loadu_ps(row(r).add(16))] };
                }
            }
            for p in 0..pairs {
                // SAFETY: pair p of both panels (16 u32 each) and of rows g..g+8 of lhs lie
                // inside the slices (p < kp/2).
                unsafe {
                    let x0: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(b0.add(p * 16).cast()));
                    let x1: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(b1.add(p * 16).cast()));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let pair = *a.add((g + r) * pairs + p) as i32;
                        let y: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                        acc[0] = _mm512_dpbf16_ps(acc[0], y, x0);
                        acc[1] = _mm512_dpbf16_ps(acc[1], y, x1);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                // SAFETY: as above.
                unsafe {
                    _mm512_storeu_ps(row(r), acc[0]);
                    _mm512_storeu_ps(row(r).add(16), acc[1]);
                }
            }
        }
    }

    /// `block` on AMX tiles.
    ///
    /// # Safety
    /// As `block`, tiles configured on this thread.
    unsafe fn tile_block(job: Job) {
        let (lhs, panels, kp) = (job.lhs, job.panels, job.kp);
        let (c, stride) = (job.c, job.stride);
        let (a0, a1) = (lhs.as_ptr(), lhs[16 * kp..].as_ptr());
        let (b0, b1) = (panels.as_ptr(), panels[16 * kp..].as_ptr());
        let (lhs_stride, panel_stride) = (kp * 2, 64usize);
        // SAFETY: every tile load reads 16 rows of 64 bytes inside `lhs` or `panels` (k + 32
        // ≤ kp) or the caller's block at `c`; the stores write that block.
        unsafe {
            let (c01, c10) = (c.add(16), c.byte_add(16 * stride));
            let c11 = c10.add(16);
            if job.add {
                asm!(
                    "tileloadd tmm4, [{c00} + {st}*1]",
                    "tileloadd tmm5, [{c01} + {st}*1]",
                    "tileloadd tmm6, [{c10} + {st}*1]",
                    "tileloadd tmm7, [{c11} + {st}*1]",
                    c00 = in(reg) c, c01 = in(reg) c01, c10 = in(reg) c10, c11 = in(reg) c11,
                    st = in(reg) stride,
                    options(nostack, readonly)
                );
            } else {
                asm!(
                    "tilezero tmm4",
                    "tilezero tmm5",
                    "tilezero tmm6",
                    "tilezero tmm7",
                    options(nostack)
                );
            }
            for k in (0..kp).step_by(DEPTH) {
                asm!(
                    "tileloadd tmm0, [{a0} + {sa}*1]",
                    "tileloadd tmm2, [{b0} + {sb}*1]",
                    "tdpbf16ps tmm4, tmm0, tmm2",
                    "tileloadd tmm3, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm5, tmm0, tmm3",
                    "tileloadd tmm1, [{a1} + {sa}*1]",
                    "tdpbf16ps tmm6, tmm1, tmm2",
                    "tdpbf16ps tmm7, tmm1, tmm3",
                    a0 = in(reg) a0.add(k),
                    a1 = in(reg) a1.add(k),
                    b0 = in(reg) b0.add(k * 16),
                    b1 = in(reg) b1.add(k * 16),
                    sa = in(reg) lhs_stride,
                    sb = in(reg) panel_stride,
                    options(nostack, readonly)
                );
            }
            asm!(
                "tilestored [{c00} + {st}*1], tmm4",
                "tilestored [{c01} + {st}*1], tmm5",
                "tilestored [{c10} + {st}*1], tmm6",
                "tilestored [{c11} + {st}*1], tmm7",
                c00 = in(reg) c, c01 = in(reg) c01, c10 = in(reg) c10, c11 = in(reg) c11,
                st = in(reg) stride,
                options(nostack)
            );
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod cpu {
    pub(super) fn has_amx_bf16() -> bool {
        false
    }
    pub(super) fn request_tiles() -> bool {
        false
    }
    pub(super) fn has_avx512_bf16() -> bool {
        false
    }
    pub(super) fn configure() {
        unreachable!("tiles are x86_64 only")
    }
    pub(super) unsafe fn block(_: super::Bf16Kernel, _: super::Job) {
        unreachable!("tiles are x86_64 only")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every packed kernel this CPU runs gives one 32×32 block as the sums of its bf16 operands'
    /// products, added to the block's values or not, into rows wider than the block; a CPU that
    /// runs none has no packed products (`available`).
    #[test]
    fn each_packed_kernel_sums_the_pairs_of_a_block() {
        let kp = 2 * DEPTH;
        let value = |i: usize| ((i * 7919 % 263) as f32 - 131.0) / 64.0;
        let lhs: Vec<u16> = (0..BLOCK * kp).map(|i| bf16_bits(value(i))).collect();
        let rhs: Vec<f32> = (0..kp * BLOCK).map(|i| value(3 * i + 1)).collect();
        let wide = |b: u16| f32::from_bits(u32::from(b) << 16);
        // The panels as `pack_panels` lays them out, from the same rounded values.
        let mut panels = vec![0u16; BLOCK * kp];
        for c in 0..BLOCK {
            for k in 0..kp {
                let at = (c / 16) * 16 * kp + (k / 2) * 32 + (c % 16) * 2 + k % 2;
                panels[at] = bf16_bits(rhs[k * BLOCK + c]);
            }
        }
        let stride = BLOCK + 8;
        let start: Vec<f32> = (0..BLOCK * stride).map(|i| value(5 * i)).collect();
        let kernels: Vec<_> = [Bf16Kernel::Amx, Bf16Kernel::Avx512]
            .into_iter()
            .filter(|k| k.runs())
            .collect();
        assert_eq!(available(), !kernels.is_empty(), "{kernels:?}");
        for kernel in kernels {
            if kernel == Bf16Kernel::Amx {
                cpu::configure();
            }
            for add in [false, true] {
                let mut c = start.clone();
                let job = Job {
                    c: c.as_mut_ptr(),
                    stride: stride * 4,
                    add,
                    lhs: &lhs,
                    panels: &panels,
                    kp,
                };
                // SAFETY: `c` holds 32 rows of `stride` ≥ 32 values; lhs and panels are 32·kp;
                // the kernel runs here (and AMX is configured on this thread).
                unsafe { cpu::block(kernel, job) };
                for i in 0..BLOCK {
                    for j in 0..stride {
                        let got = c[i * stride + j];
                        if j >= BLOCK {
                            assert_eq!(got, start[i * stride + j], "{kernel:?}: past the block");
                            continue;
                        }
                        let sum: f64 = (0..kp)
                            .map(|k| {
                                let a = wide(lhs[i * kp + k]);
                                let b = wide(bf16_bits(rhs[k * BLOCK + j]));
                                f64::from(a) * f64::from(b)
                            })
                            .sum();
                        let want = sum
                            + if add {
                                f64::from(start[i * stride + j])
                            } else {
                                0.0
                            };
                        let tolerance = 1e-5 * (1.0 + want.abs());
                        assert!(
                            (f64::from(got) - want).abs() < tolerance,
                            "{kernel:?} add {add} ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
