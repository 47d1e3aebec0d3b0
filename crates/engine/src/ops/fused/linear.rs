//! Dense layers as single ops: `x·W + b`, `x·W` (the LM head) and `gelu(h)·W + b` (the MLP's
//! second half). The GELU output (the largest activation of a block, N×4D) is not kept: the
//! backward recomputes it from `h`, which the graph keeps anyway as the first linear's output.
//! Products go straight to `gemm`; the backward returns dx, dW and db from one buffer.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::{column_sums, filled, for_ranges, for_units, matmul, storage, Mat, MatMut};
use crate::ops::vmath;

/// `x·w + b` for `x` `[N, I]`, `w` `[I, O]`, `b` `[O]`.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(x, w, b, false)
}

/// `gelu(h)·w + b` (GELU, tanh approximation) without keeping `gelu(h)`.
pub fn gelu_linear(h: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(h, w, b, true)
}

/// `x·w` (no bias: the LM head).
pub fn project(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    check(&x, &w, None)?;
    x.apply_op2(
        &w,
        Linear {
            gelu_input: false,
            bias: false,
        },
    )
}

fn apply(x: &Tensor, w: &Tensor, b: &Tensor, gelu_input: bool) -> Result<Tensor> {
    let (x, w, b) = (x.contiguous()?, w.contiguous()?, b.contiguous()?);
    check(&x, &w, Some(&b))?;
    let op = Linear {
        gelu_input,
        bias: true,
    };
    x.apply_op3(&w, &b, op)
}

fn check(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<()> {
    let (_, i) = x.dims2()?;
    let (wi, o) = w.dims2()?;
    let bias_ok = b.map_or(Ok(true), |b| b.dims1().map(|n| n == o))?;
    if wi != i || !bias_ok {
        candle_core::bail!(
            "linear: x [_, {i}], w [{wi}, {o}], b {:?}",
            b.map(|b| b.dims())
        );
    }
    Ok(())
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
    super::map_range(h.len(), |r, dst| {
        vmath::widest(
            #[inline(always)]
            || {
                for (g, &x) in dst.iter_mut().zip(&h[r]) {
                    g.write(gelu_value(x));
                }
            },
        )
    })
}

/// `x·w + b` (`gelu(x)·w + b` with `gelu_input`), plus `residual` (`[N, O]`) when given, in
/// f32 (`w` `[I, O]` with `O = b.len()`). The residual is added where the bias is: no extra pass.
pub(super) fn linear_rows(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    gelu_input: bool,
    residual: Option<&[f32]>,
) -> Vec<f32> {
    let layer = Linear {
        gelu_input,
        bias: true,
    };
    layer.forward(x, w, Some(b), b.len(), residual)
}

/// `[dx; dw; db]` of `linear_rows` at `x` (rows of `i`) for the output gradient `dy`, in f32.
pub(super) fn linear_backward_rows(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    i: usize,
    gelu_input: bool,
) -> Vec<f32> {
    let layer = Linear {
        gelu_input,
        bias: true,
    };
    LinearBackward(layer).packed(x, w, dy, i)
}

#[derive(Clone, Copy)]
struct Linear {
    /// The input is `h` and the layer multiplies `gelu(h)`.
    gelu_input: bool,
    bias: bool,
}

impl Linear {
    /// `input·w (+ b)` with `input` = `x` or `gelu(x)`.
    fn forward(
        &self,
        x: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        o: usize,
        residual: Option<&[f32]>,
    ) -> Vec<f32> {
        let i = w.len() / o;
        let n = x.len() / i;
        let gelu;
        let input = if self.gelu_input {
            gelu = gelu_of(x);
            &gelu[..]
        } else {
            x
        };
        // With a bias, every row starts as the bias (plus the residual's row) and the product
        // adds to it; without, the product writes every value.
        filled(n * o, |out| {
            if let Some(b) = b {
                for_units(n, o, |_, rows| {
                    // SAFETY: `for_units` gives each call its own rows, inside `output`'s buffer.
                    let dst = unsafe { out.uninit_rows(&rows, o) };
                    let res = residual.map(|r| &r[rows.start * o..rows.end * o]);
                    for (r, row) in dst.chunks_exact_mut(o).enumerate() {
                        let res = res.map(|res| &res[r * o..(r + 1) * o]);
                        row.iter_mut().enumerate().for_each(|(j, d)| {
                            d.write(b[j] + res.map_or(0.0, |res| res[j]));
                        });
                    }
                });
            }
            // SAFETY: `out` holds n×o values (`filled`); input and w are other buffers.
            unsafe {
                matmul(
                    MatMut::new(out.offset(0), n, o, o),
                    Mat::rows(input, i),
                    Mat::rows(w, o),
                    b.is_some(),
                    true,
                )
            };
        })
    }

    /// Gradients of `x`, `w` (and `b`) from one packed buffer.
    fn backward(&self, x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<Vec<Tensor>> {
        let (n, i) = x.dims2()?;
        let o = w.dim(1)?;
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &LinearBackward(*self))?;
        let mut grads = vec![
            packed.narrow(0, 0, n * i)?.reshape((n, i))?,
            packed.narrow(0, n * i, i * o)?.reshape((i, o))?,
        ];
        if self.bias {
            grads.push(packed.narrow(0, n * i + i * o, o)?);
        }
        Ok(grads)
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "gaccwb-project"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = storage::input(xs, xl, CustomOp2::name(self))?;
        let w = storage::input(ws, wl, CustomOp2::name(self))?;
        let (n, o) = (xl.dims()[0], wl.dims()[1]);
        let y = self.forward(&x, &w, None, o, None);
        drop((x, w));
        Ok((storage::stored(y, xs)?, Shape::from((n, o))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.backward(x, w, grad)?.into_iter();
        Ok((g.next(), g.next()))
    }
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
        let x = storage::input(xs, xl, CustomOp3::name(self))?;
        let w = storage::input(ws, wl, CustomOp3::name(self))?;
        let b = storage::input(bs, bl, CustomOp3::name(self))?;
        let (n, o) = (xl.dims()[0], b.len());
        let y = self.forward(&x, &w, Some(&b), o, None);
        drop((x, w, b));
        Ok((storage::stored(y, xs)?, Shape::from((n, o))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.backward(x, w, grad)?.into_iter();
        Ok((g.next(), g.next(), g.next()))
    }
}

struct LinearBackward(Linear);

impl CustomOp3 for LinearBackward {
    fn name(&self) -> &'static str {
        "gaccwb-linear-backward"
    }

    /// dx = dy·wᵀ (times gelu′(h) for a GELU input), dw = inputᵀ·dy, db = Σ_rows dy (when the
    /// layer has a bias).
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let packed = {
            let x = storage::input(xs, xl, self.name())?;
            let w = storage::input(ws, wl, self.name())?;
            let dy = storage::input(gs, gl, self.name())?;
            self.packed(&x, &w, &dy, xl.dims()[1])
        };
        let len = packed.len();
        Ok((storage::stored(packed, xs)?, Shape::from(len)))
    }
}

impl LinearBackward {
    /// `[dx; dw; db]` in f32 from the f32 values of `x` (`[N, i]`), `w` and `dy`.
    fn packed(&self, x: &[f32], w: &[f32], dy: &[f32], i: usize) -> Vec<f32> {
        let n = x.len() / i;
        let o = w.len() / i;
        let bias = if self.0.bias { o } else { 0 };
        let (input, slope) = if self.0.gelu_input {
            let (g, s) = gelu_with_slope(x);
            (g, Some(s))
        } else {
            (Vec::new(), None)
        };
        let input = if slope.is_some() { &input[..] } else { x };
        // dx and dw are written by the products, db by its zeroing and sum.
        filled(n * i + i * o + bias, |out| {
            // SAFETY: `out` packs dx (n×i) then dw (i×o) first, so the two destinations are
            // disjoint and inside it; dy, w and input are other buffers.
            unsafe {
                matmul(
                    MatMut::new(out.offset(0), n, i, i),
                    Mat::rows(dy, o),
                    Mat::rows(w, o).t(),
                    false,
                    true,
                );
                matmul(
                    MatMut::new(out.offset(n * i), i, o, o),
                    Mat::rows(input, i).t(),
                    Mat::rows(dy, o),
                    false,
                    true,
                );
            }
            if self.0.bias {
                // SAFETY: rows n·i+i·o .. +o of `out` (the bias gradient) are this closure's alone.
                let db = unsafe { out.uninit_rows(&(n * i + i * o..n * i + i * o + o), 1) };
                db.iter_mut().for_each(|v| {
                    v.write(0.0);
                });
                // SAFETY: the same rows, now initialised by the loop above.
                let db = unsafe { out.rows(&(n * i + i * o..n * i + i * o + o), 1) };
                column_sums(dy, o, db);
            }
            if let Some(slope) = slope {
                // dx is written (above): scale it in place.
                for_ranges(slope.len(), |r| {
                    // SAFETY: `for_ranges` gives each call its own range of dx, written above.
                    let dst = unsafe { out.rows(&r, 1) };
                    dst.iter_mut().zip(&slope[r]).for_each(|(d, s)| *d *= s);
                });
            }
        })
    }
}

/// `gelu(h)` and `gelu′(h)`, in parallel.
fn gelu_with_slope(h: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut slope = Vec::new();
    // Both buffers are written over every range `for_ranges` covers: all of them.
    let gelu = filled(h.len(), |gp| {
        slope = filled(h.len(), |sp| {
            for_ranges(h.len(), |r| {
                // SAFETY: `for_ranges` gives each call its own range of both `h.len()` buffers.
                let (g, s) = unsafe { (gp.uninit_rows(&r, 1), sp.uninit_rows(&r, 1)) };
                vmath::widest(
                    #[inline(always)]
                    || {
                        for ((g, s), &x) in g.iter_mut().zip(s.iter_mut()).zip(&h[r.clone()]) {
                            let (value, slope) = gelu_and_slope(x);
                            g.write(value);
                            s.write(slope);
                        }
                    },
                )
            })
        })
    });
    (gelu, slope)
}
