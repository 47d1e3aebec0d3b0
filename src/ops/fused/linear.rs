//! `x·W + b` as one op, and `gelu(h)·W + b` as one op: the MLP's second half. The GELU output
//! (the largest activation of a block, N×4D) is not kept: the backward recomputes it from `h`,
//! which the graph keeps anyway as the first linear's output. Matrices go straight to `gemm`
//! (no zero-filled outputs, no separate bias pass over the result in the backward).

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::{column_sums, f32_slice, for_ranges, for_units, matmul, uninit, Mat, MatMut, Shared};
use crate::ops::vmath;

/// `x·w + b` for `x` `[N, I]`, `w` `[I, O]`, `b` `[O]`.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(x, w, b, Linear { gelu_input: false })
}

/// `gelu(h)·w + b` (GELU, tanh approximation) without keeping `gelu(h)`.
pub fn gelu_linear(h: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(h, w, b, Linear { gelu_input: true })
}

fn apply(x: &Tensor, w: &Tensor, b: &Tensor, op: Linear) -> Result<Tensor> {
    let (x, w, b) = (x.contiguous()?, w.contiguous()?, b.contiguous()?);
    let (_, i) = x.dims2()?;
    let (wi, o) = w.dims2()?;
    if wi != i || b.dims1()? != o {
        candle_core::bail!("linear: x [_, {i}], w [{wi}, {o}], b {:?}", b.dims());
    }
    x.apply_op3(&w, &b, op)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// GELU(x) = x·σ(2u), u = √(2/π)(x + 0.044715x³) (the same function as 0.5x(1 + tanh u)),
/// and its derivative σ + 2x·σ(1−σ)·u′, from one exp.
#[inline(always)]
pub fn gelu_and_slope(x: f32) -> (f32, f32) {
    let x2 = x * x;
    let u = SQRT_2_OVER_PI * (x + GELU_C * x2 * x);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x2);
    let s = 1.0 / (1.0 + vmath::exp(-2.0 * u));
    (x * s, s + 2.0 * x * s * (1.0 - s) * du)
}

#[inline(always)]
pub fn gelu_value(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x);
    x / (1.0 + vmath::exp(-2.0 * u))
}

/// `gelu(h)` into a fresh buffer, in parallel.
fn gelu_of(h: &[f32]) -> Vec<f32> {
    let mut g = uninit(h.len());
    let out = Shared(g.as_mut_ptr());
    for_ranges(h.len(), |r| {
        let dst = unsafe { out.rows(&r, 1) };
        vmath::widest(
            #[inline(always)]
            || {
                for (g, &x) in dst.iter_mut().zip(&h[r.clone()]) {
                    *g = gelu_value(x);
                }
            },
        )
    });
    g
}

#[derive(Clone, Copy)]
struct Linear {
    /// The input is `h` and the layer multiplies `gelu(h)`.
    gelu_input: bool,
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        if self.gelu_input {
            "gaccwb-gelu-linear"
        } else {
            "gaccwb-linear"
        }
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(xs, xl, self.name())?;
        let w = f32_slice(ws, wl, self.name())?;
        let b = f32_slice(bs, bl, self.name())?;
        let (i, o) = (w.len() / b.len(), b.len());
        let n = x.len() / i;
        let gelu;
        let input = if self.gelu_input {
            gelu = gelu_of(x);
            &gelu[..]
        } else {
            x
        };
        let mut y = uninit(n * o);
        let out = Shared(y.as_mut_ptr());
        for_units(n, o, |_, rows| {
            let dst = unsafe { out.rows(&rows, o) };
            dst.chunks_exact_mut(o)
                .for_each(|row| row.copy_from_slice(b));
        });
        matmul(
            MatMut::rows(&mut y, o),
            Mat::rows(input, i),
            Mat::rows(w, o),
            true,
            true,
        );
        Ok((CpuStorage::F32(y), Shape::from((n, o))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, i) = x.dims2()?;
        let o = b.elem_count();
        let op = LinearBackward(*self);
        // One pass yields [dx | dw | db] in one buffer.
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &op)?;
        let dx = packed.narrow(0, 0, n * i)?.reshape((n, i))?;
        let dw = packed.narrow(0, n * i, i * o)?.reshape((i, o))?;
        let db = packed.narrow(0, n * i + i * o, o)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

struct LinearBackward(Linear);

impl CustomOp3 for LinearBackward {
    fn name(&self) -> &'static str {
        "gaccwb-linear-backward"
    }

    /// dx = dy·wᵀ (times gelu′(h) for a GELU input), dw = inputᵀ·dy, db = Σ_rows dy.
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(xs, xl, self.name())?;
        let w = f32_slice(ws, wl, self.name())?;
        let dy = f32_slice(gs, gl, self.name())?;
        let (n, i) = (xl.dims()[0], xl.dims()[1]);
        let o = w.len() / i;
        let mut packed = uninit(n * i + i * o + o);
        let (dx, rest) = packed.split_at_mut(n * i);
        let (dw, db) = rest.split_at_mut(i * o);
        let (input, slope) = if self.0.gelu_input {
            let (g, s) = gelu_with_slope(x);
            (g, Some(s))
        } else {
            (Vec::new(), None)
        };
        let input = if slope.is_some() { &input[..] } else { x };
        matmul(
            MatMut::rows(dx, i),
            Mat::rows(dy, o),
            Mat::rows(w, o).t(),
            false,
            true,
        );
        matmul(
            MatMut::rows(dw, o),
            Mat::rows(input, i).t(),
            Mat::rows(dy, o),
            false,
            true,
        );
        column_sums(dy, o, db);
        if let Some(slope) = slope {
            let out = Shared(dx.as_mut_ptr());
            for_ranges(slope.len(), |r| {
                let dst = unsafe { out.rows(&r, 1) };
                dst.iter_mut().zip(&slope[r]).for_each(|(d, s)| *d *= s);
            });
        }
        Ok((CpuStorage::F32(packed), Shape::from(n * i + i * o + o)))
    }
}

/// `gelu(h)` and `gelu′(h)`, in parallel.
fn gelu_with_slope(h: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut g, mut s) = (uninit(h.len()), uninit(h.len()));
    let (gp, sp) = (Shared(g.as_mut_ptr()), Shared(s.as_mut_ptr()));
    for_ranges(h.len(), |r| {
        let (g, s) = unsafe { (gp.rows(&r, 1), sp.rows(&r, 1)) };
        vmath::widest(
            #[inline(always)]
            || {
                for ((g, s), &x) in g.iter_mut().zip(s.iter_mut()).zip(&h[r.clone()]) {
                    (*g, *s) = gelu_and_slope(x);
                }
            },
        )
    });
    (g, s)
}
