//! The fused ops' storage dtypes: f32, bf16 and f16, with f32 arithmetic (but bf16 products on
//! AMX tiles or AVX-512 BF16 dot products where the CPU has them: `tiles`, bf16 operands and
//! f32 sums). An op reads a
//! half-precision input by widening it into an f32 buffer of its own (freed when the op
//! returns), runs the f32 kernel, and rounds its result once to the storage dtype; a bf16 weight
//! matrix that only tile products read is borrowed as stored (`operand`). Gradients
//! come out of the same kernels, so a weight's or a bias's gradient is summed over every row in
//! f32 and rounded once, never accumulated in the half type.

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor};
use half::bf16;
use half::slice::HalfFloatSliceExt;

use crate::ops::vmath;

/// The values a contiguous layout covers, as f32: borrowed when stored in f32, widened into a
/// new buffer when stored in bf16 or f16.
pub(super) fn input<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<Cow<'a, [f32]>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: input must be contiguous")
    };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[a..b]),
        CpuStorage::BF16(v) => Cow::Owned(par_convert(&v[a..b], |src, dst| {
            vmath::widest(
                #[inline(always)]
                || {
                    for (d, s) in dst.iter_mut().zip(src) {
                        d.write(f32::from_bits(u32::from(s.to_bits()) << 16));
                    }
                },
            )
        })),
        CpuStorage::F16(v) => Cow::Owned(par_convert(&v[a..b], |src, dst| {
            // SAFETY: f32 has no invalid bit pattern; every value is written before it is read.
            let dst = unsafe { assume_written(dst) };
            src.convert_to_f32_slice(dst)
        })),
        other => candle_core::bail!(
            "{op}: expects f32, bf16 or f16 storage, got {:?}",
            other.dtype()
        ),
    })
}

/// An op's matrix input as its products read it (`operand`).
pub(super) enum Operand<'a> {
    F32(Cow<'a, [f32]>),
    Bf16(&'a [bf16]),
}

impl Operand<'_> {
    pub(super) fn values(&self) -> super::Values<'_> {
        match self {
            Operand::F32(v) => super::Values::F32(v),
            Operand::Bf16(v) => super::Values::Bf16(v),
        }
    }
}

/// A matrix an op only multiplies by: stored bf16 borrowed as it is where this thread's
/// products run on tiles (`tiles::chosen`), which read bf16 (no f32 copy made, and half the
/// bytes packed), else `input`'s f32 values.
pub(super) fn operand<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<Operand<'a>> {
    match s {
        CpuStorage::BF16(v) if super::tiles::chosen() => {
            let Some((a, b)) = l.contiguous_offsets() else {
                candle_core::bail!("{op}: input must be contiguous")
            };
            Ok(Operand::Bf16(&v[a..b]))
        }
        _ => Ok(Operand::F32(input(s, l, op)?)),
    }
}

/// `values` stored in the dtype of `like` (the op's input), each rounded once (to nearest,
/// ties to even).
pub(super) fn stored(values: Vec<f32>, like: &CpuStorage) -> Result<CpuStorage> {
    in_dtype(values, like.dtype())
}

/// `values` as a CPU tensor of `shape` stored in `dtype`, each rounded once.
pub(super) fn tensor(values: Vec<f32>, dtype: DType, shape: impl Into<Shape>) -> Result<Tensor> {
    let dev = &Device::Cpu;
    match in_dtype(values, dtype)? {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, dev),
        other => candle_core::bail!("fused ops store f32, bf16 or f16, not {:?}", other.dtype()),
    }
}

/// `values` rounded to `dtype` as `tensor` would store them, kept in f32 (exact): a weight's
/// gradient for a `GradSink`, which widens it to the f32 master anyway (Candle's widening of a
/// bf16 tensor is a scalar loop: 2% of a bf16 GPT-2-small step).
pub(super) fn rounded(
    mut values: Vec<f32>,
    dtype: DType,
    shape: impl Into<Shape>,
) -> Result<Tensor> {
    round_in_place(&mut values, dtype);
    Tensor::from_vec(values, shape, &Device::Cpu)
}

/// The CPU storage of a tensor's guard, for `input`.
pub(super) fn cpu<'a>(s: &'a Storage, op: &str) -> Result<&'a CpuStorage> {
    match s {
        Storage::Cpu(c) => Ok(c),
        _ => candle_core::bail!("{op}: expects a CPU tensor"),
    }
}

pub(super) fn in_dtype(values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(values),
        DType::BF16 => to_bf16(&values),
        DType::F16 => CpuStorage::F16(par_convert(&values, |src, dst| {
            // SAFETY: f16 has no invalid bit pattern; every value is written before it is read.
            let dst = unsafe { assume_written(dst) };
            dst.convert_from_f32_slice(src)
        })),
        other => candle_core::bail!("fused ops store f32, bf16 or f16, not {other:?}"),
    })
}

/// `values` rounded to bf16 (ties to even), converted on the CPU pool.
pub(super) fn to_bf16(values: &[f32]) -> CpuStorage {
    CpuStorage::BF16(par_convert(values, |src, dst| {
        vmath::widest(
            #[inline(always)]
            || {
                for (d, &s) in dst.iter_mut().zip(src) {
                    d.write(bf16::from_bits(bf16_bits(s)));
                }
            },
        )
    }))
}

/// `values` rounded to `dtype` and back in place, as storing them would do (`rounding`; nothing
/// for f32), on the CPU pool: value by value, so the bits do not depend on the threads.
pub(crate) fn round_in_place(values: &mut [f32], dtype: DType) {
    if dtype == DType::F32 {
        return;
    }
    let shared = super::Shared(values.as_mut_ptr());
    super::for_ranges(values.len(), |range| {
        // SAFETY: `for_ranges` gives each call its own range of the values.
        round_part(unsafe { shared.rows(&range, 1) }, dtype)
    });
}

/// `round_in_place` on the calling thread.
fn round_part(values: &mut [f32], dtype: DType) {
    match dtype {
        DType::BF16 => vmath::widest(
            #[inline(always)]
            || {
                for v in values.iter_mut() {
                    *v = f32::from_bits(u32::from(bf16_bits(*v)) << 16);
                }
            },
        ),
        DType::F16 => values
            .iter_mut()
            .for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        _ => {}
    }
}

/// The rounding of a value to `dtype` and back, as storing it would do (the identity for f32).
pub(super) fn rounding(dtype: DType) -> fn(f32) -> f32 {
    match dtype {
        DType::BF16 => |x| f32::from_bits(u32::from(bf16_bits(x)) << 16),
        DType::F16 => |x| half::f16::from_f32(x).to_f32(),
        _ => |x| x,
    }
}

/// The bf16 nearest to `x` (ties to even; a NaN stays a quiet NaN), branch-free so that a loop
/// of it vectorises (`half`'s `bf16::from_f32` branches). The same bits as `bf16::from_f32`.
#[inline(always)]
pub(super) fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x0040;
    (if x.is_nan() { nan } else { rounded }) as u16
}

/// `dst` as initialised values, for converters that only write.
/// SAFETY: the caller writes every element before anything reads it, and `T` has no invalid
/// bit pattern.
unsafe fn assume_written<T>(dst: &mut [MaybeUninit<T>]) -> &mut [T] {
    std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<T>(), dst.len())
}

/// A pointer whose disjoint ranges are written from several threads.
struct Out<T>(*mut T);
// SAFETY: written only through disjoint ranges (`slice`), one thread each, while the buffer lives.
unsafe impl<T: Send> Send for Out<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Send> Sync for Out<T> {}

impl<T> Out<T> {
    /// Elements `r` of the buffer, not initialised yet.
    /// SAFETY: `r` lies inside the buffer's capacity and no other thread touches it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, r: &Range<usize>) -> &mut [MaybeUninit<T>] {
        std::slice::from_raw_parts_mut(self.0.add(r.start).cast::<MaybeUninit<T>>(), r.len())
    }
}

/// `src` converted element-wise by `convert(src range, dst range)`, which writes every element
/// of its `dst` range; ranges in parallel. No zeroing pass.
fn par_convert<S: Sync, D: Send>(
    src: &[S],
    convert: impl Fn(&[S], &mut [MaybeUninit<D>]) + Sync,
) -> Vec<D> {
    let mut out = Vec::<D>::with_capacity(src.len());
    let dst = Out(out.as_mut_ptr());
    super::for_ranges(src.len(), |r| {
        // SAFETY: `for_ranges` hands out disjoint ranges of `0..src.len()`, `out`'s capacity.
        convert(&src[r.clone()], unsafe { dst.slice(&r) })
    });
    // SAFETY: the ranges cover `0..src.len()` and `convert` wrote each element of its range.
    unsafe { out.set_len(src.len()) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn widening_is_exact_and_narrowing_rounds_to_nearest() {
        let values = vec![1.0f32, 1.0 + 1.0 / 256.0, -3.5e-3, 65504.0, 1.0e-8];
        for dtype in [DType::BF16, DType::F16] {
            let s = in_dtype(values.clone(), dtype).unwrap();
            let back = input(&s, &Layout::contiguous(values.len()), "test").unwrap();
            for (&v, &b) in values.iter().zip(back.iter()) {
                let want = match dtype {
                    DType::BF16 => bf16::from_f32(v).to_f32(),
                    _ => f16::from_f32(v).to_f32(),
                };
                assert_eq!(b, want, "{dtype:?} {v}");
            }
        }
        // Ties, infinities, NaN and subnormals round as `half` rounds them.
        for x in [
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            1.0e-40,
            -0.0,
        ] {
            assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{x}");
        }
        // One large enough to take several parallel ranges.
        let many: Vec<f32> = (0..5000).map(|i| i as f32 * 0.37).collect();
        let s = in_dtype(many.clone(), DType::BF16).unwrap();
        let back = input(&s, &Layout::contiguous(many.len()), "test").unwrap();
        assert!(many
            .iter()
            .zip(back.iter())
            .all(|(&v, &b)| b == bf16::from_f32(v).to_f32()));
    }
}
