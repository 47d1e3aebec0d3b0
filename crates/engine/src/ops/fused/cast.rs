//! f32 to bf16 as one op: Candle's `to_dtype` rounds through `half`'s scalar, branching
//! conversion on one thread; this rounds with `storage`'s branch-free one on the CPU pool. A
//! bf16 step casts every f32 master weight this way in its forward (7% of a GPT-2-small step
//! went to Candle's conversion). The bits are the same; the gradient comes back widened (exact).
//! The widening is an op too (`widen`): the residual stream's, and the cast's backward.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::{f32_slice, storage};

/// `t` (bf16 or f16, on the CPU) widened to f32 (exact); its gradient comes back rounded to
/// `t`'s dtype. The residual stream's entry (`ops::widen_stream`), where the gradient is already
/// a value of that dtype, so the rounding is exact too.
pub fn widen(t: &Tensor) -> Result<Tensor> {
    t.contiguous()?.apply_op1(ToF32)
}

struct ToF32;

impl CustomOp1 for ToF32 {
    fn name(&self) -> &'static str {
        "gaccwb-to-f32"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let values = storage::input(s, l, self.name())?.into_owned();
        Ok((CpuStorage::F32(values), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        Ok(Some(match arg.dtype() {
            DType::BF16 => grad.apply_op1_no_bwd(&ToBf16)?,
            dtype => grad.to_dtype(dtype)?,
        }))
    }
}

/// `t` (f32, on the CPU) rounded to bf16.
pub fn to_bf16(t: &Tensor) -> Result<Tensor> {
    t.contiguous()?.apply_op1(ToBf16)
}

struct ToBf16;

impl CustomOp1 for ToBf16 {
    fn name(&self) -> &'static str {
        "gaccwb-to-bf16"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let values = f32_slice(s, l, self.name())?;
        Ok((storage::to_bf16(values), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&ToF32)?))
    }
}
