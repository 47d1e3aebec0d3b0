//! Dense layers as single ops: `x·W + b`, `x·W` (the LM head) and the MLP's second half
//! `act(h)·W + b`, with `act` the GELU (GPT-2) or SwiGLU (`silu(gate)·up`, the LLaMA family, `h`
//! being `[gate | up]`). The activation's output (the largest activation of a block) is not
//! kept: the backward recomputes it from `h`, which the graph keeps anyway as the first
//! linear's output. Products go straight to `gemm`; the backward returns dx, dW and db from one
//! buffer. A step's layers (several weights side by side, adapters, frozen weights) are
//! `layer.rs`.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::{column_sums, filled, for_ranges, for_units, matmul, storage, Mat, MatMut, Values};
use crate::ops::{vmath, Activation};

/// `x·w + b` for `x` `[N, I]`, `w` `[I, O]`, `b` `[O]`.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    act_linear(x, w, Some(b), Activation::None)
}

/// `gelu(h)·w + b` (GELU, tanh approximation) without keeping `gelu(h)`.
pub fn gelu_linear(h: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    act_linear(h, w, Some(b), Activation::Gelu)
}

/// `x·w` (no bias: the LM head).
pub fn project(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    act_linear(x, w, None, Activation::None)
}

/// `act(h)·w (+ b)` without keeping `act(h)`: `h` `[N, I]` (`[N, 2·I]` for SwiGLU), `w` `[I, O]`.
pub fn act_linear(h: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Activation) -> Result<Tensor> {
    let (h, w) = (h.contiguous()?, w.contiguous()?);
    check(&h, &w, b, act)?;
    let op = Linear {
        act,
        bias: b.is_some(),
    };
    match b {
        Some(b) => h.apply_op3(&w, &b.contiguous()?, op),
        None => h.apply_op2(&w, op),
    }
}

fn check(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Activation) -> Result<()> {
    let (_, cols) = x.dims2()?;
    let (wi, o) = w.dims2()?;
    let bias_ok = b.map_or(Ok(true), |b| b.dims1().map(|n| n == o))?;
    if act.input_width(wi) != cols || !bias_ok {
        candle_core::bail!(
            "linear: x [_, {cols}], w [{wi}, {o}], b {:?}, {act:?}",
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
pub(super) fn gelu_and_slope(x: f32) -> (f32, f32) {
    let x2 = x * x;
    let u = SQRT_2_OVER_PI * (x + GELU_C * x2 * x);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x2);
    let s = 1.0 / (1.0 + vmath::exp(-2.0 * u));
    (x * s, s + 2.0 * x * s * (1.0 - s) * du)
}

#[inline(always)]
pub(super) fn gelu_value(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x);
    x / (1.0 + vmath::exp(-2.0 * u))
}

/// σ(x) = 1/(1 + e⁻ˣ).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + vmath::exp(-x))
}

/// `act(h)` into a fresh buffer, in parallel (`h` rows of `2·i` for SwiGLU).
pub(super) fn activated(h: &[f32], act: Activation, i: usize) -> Vec<f32> {
    match act {
        Activation::None => h.to_vec(),
        Activation::Gelu => super::map_range(h.len(), |r, dst| {
            vmath::widest(
                #[inline(always)]
                || {
                    for (g, &x) in dst.iter_mut().zip(&h[r]) {
                        g.write(gelu_value(x));
                    }
                },
            )
        }),
        Activation::SwiGlu => {
            let n = h.len() / (2 * i);
            super::map_range(n * i, |r, dst| {
                vmath::widest(
                    #[inline(always)]
                    || {
                        // Row by row, so the inner loop runs over contiguous values (an index
                        // divided per value kept it scalar: 8% of a SmolLM-135M bf16 step).
                        let mut dst = dst;
                        let mut e = r.start;
                        while e < r.end {
                            let (row, j) = (e / i, e % i);
                            let len = (i - j).min(r.end - e);
                            let gate = &h[row * 2 * i + j..][..len];
                            let up = &h[row * 2 * i + i + j..][..len];
                            let (out, rest) = dst.split_at_mut(len);
                            for ((d, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                                d.write(g * sigmoid(g) * u);
                            }
                            dst = rest;
                            e += len;
                        }
                    },
                )
            })
        }
    }
}

/// `x·w + b` (no bias when `b` is `None`; `act(x)·w + b` with an activation), plus `residual`
/// (`[N, O]`) when given, in f32 (`w` `[I, O]`). The residual is added where the bias is: no
/// extra pass.
pub(super) fn linear_rows(
    x: &[f32],
    w: Values,
    b: Option<&[f32]>,
    o: usize,
    act: Activation,
    residual: Option<&[f32]>,
) -> Vec<f32> {
    let layer = Linear {
        act,
        bias: b.is_some(),
    };
    layer.forward(x, w, b, o, residual)
}

/// `dx`, `dw` and `db` of `linear_rows` at `x` (rows of `cols`) for the output gradient `dy`,
/// in f32, each in its own buffer (`db` only with a bias).
pub(super) fn linear_backward_rows(
    x: &[f32],
    w: Values,
    dy: &[f32],
    cols: usize,
    act: Activation,
    bias: bool,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let back = LinearBackward(Linear { act, bias });
    let sizes = back.sizes(x, w, cols);
    let (mut dw, mut db) = (Vec::new(), None);
    // Each `filled` buffer is written whole by `write` (its contract).
    let dx = filled(sizes.dx, |dx| {
        dw = filled(sizes.dw, |dw| {
            let Some(len) = sizes.db else {
                return back.write(x, w, dy, cols, Out { dx, dw, db: None });
            };
            db = Some(filled(len, |db| {
                back.write(
                    x,
                    w,
                    dy,
                    cols,
                    Out {
                        dx,
                        dw,
                        db: Some(db),
                    },
                )
            }));
        })
    });
    (dx, dw, db)
}

/// Where `LinearBackward::write` puts its gradients: `dx` (n×cols values), `dw` (i×o) and
/// `db` (o, with a bias), none initialised yet.
#[derive(Clone, Copy)]
struct Out {
    dx: super::Shared,
    dw: super::Shared,
    db: Option<super::Shared>,
}

/// The lengths of a linear's gradients (`Out`).
struct Sizes {
    dx: usize,
    dw: usize,
    db: Option<usize>,
}

#[derive(Clone, Copy)]
struct Linear {
    /// The activation applied to the input before the product.
    act: Activation,
    bias: bool,
}

impl Linear {
    /// `act(x)·w (+ b)`.
    fn forward(
        &self,
        x: &[f32],
        w: Values,
        b: Option<&[f32]>,
        o: usize,
        residual: Option<&[f32]>,
    ) -> Vec<f32> {
        let i = w.len() / o;
        let made;
        let input = if self.act == Activation::None {
            x
        } else {
            made = activated(x, self.act, i);
            &made[..]
        };
        let n = input.len() / i;
        // With a bias or a residual, every row starts as the bias plus the residual's row and
        // the product adds to it; with neither, the product writes every value.
        let starts = b.is_some() || residual.is_some();
        filled(n * o, |out| {
            if starts {
                for_units(n, o, |_, rows| {
                    // SAFETY: `for_units` gives each call its own rows, inside `output`'s buffer.
                    let dst = unsafe { out.uninit_rows(&rows, o) };
                    let res = residual.map(|r| &r[rows.start * o..rows.end * o]);
                    for (r, row) in dst.chunks_exact_mut(o).enumerate() {
                        let res = res.map(|res| &res[r * o..(r + 1) * o]);
                        row.iter_mut().enumerate().for_each(|(j, d)| {
                            let bias = b.map_or(0.0, |b| b[j]);
                            d.write(bias + res.map_or(0.0, |res| res[j]));
                        });
                    }
                });
            }
            // SAFETY: `out` holds n×o values (`filled`); input and w are other buffers.
            unsafe {
                matmul(
                    MatMut::new(out.offset(0), n, o, o),
                    Mat::rows(input, i),
                    Mat::of(w, o),
                    starts,
                    true,
                )
            };
        })
    }

    /// Gradients of `x`, `w` (and `b`) from one packed buffer.
    fn backward(&self, x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<Vec<Tensor>> {
        let (n, cols) = x.dims2()?;
        let (i, o) = w.dims2()?;
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &LinearBackward(*self))?;
        let mut grads = vec![
            packed.narrow(0, 0, n * cols)?.reshape((n, cols))?,
            packed.narrow(0, n * cols, i * o)?.reshape((i, o))?,
        ];
        if self.bias {
            grads.push(packed.narrow(0, n * cols + i * o, o)?);
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
        let _products = super::tiles::scope(candle_core::backend::BackendStorage::dtype(xs));
        let x = storage::input(xs, xl, CustomOp2::name(self))?;
        let w = storage::operand(ws, wl, CustomOp2::name(self))?;
        let (n, o) = (xl.dims()[0], wl.dims()[1]);
        let y = self.forward(&x, w.values(), None, o, None);
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
        match self.act {
            Activation::None => "gaccwb-linear",
            Activation::Gelu => "gaccwb-gelu-linear",
            Activation::SwiGlu => "gaccwb-swiglu-linear",
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
        let _products = super::tiles::scope(candle_core::backend::BackendStorage::dtype(xs));
        let x = storage::input(xs, xl, CustomOp3::name(self))?;
        let w = storage::operand(ws, wl, CustomOp3::name(self))?;
        let b = storage::input(bs, bl, CustomOp3::name(self))?;
        let (n, o) = (xl.dims()[0], b.len());
        let y = self.forward(&x, w.values(), Some(&b), o, None);
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
        let _products = super::tiles::scope(candle_core::backend::BackendStorage::dtype(xs));
        let packed = {
            let x = storage::input(xs, xl, self.name())?;
            let w = storage::operand(ws, wl, self.name())?;
            let dy = storage::input(gs, gl, self.name())?;
            self.packed(&x, w.values(), &dy, xl.dims()[1])
        };
        let len = packed.len();
        Ok((storage::stored(packed, xs)?, Shape::from(len)))
    }
}

impl LinearBackward {
    /// The lengths of the gradients for `x` (rows of `cols`) and `w`.
    fn sizes(&self, x: &[f32], w: Values, cols: usize) -> Sizes {
        let i = self.0.act.product_width(cols);
        let o = w.len() / i;
        Sizes {
            dx: x.len(),
            dw: i * o,
            db: self.0.bias.then_some(o),
        }
    }

    /// `[dx; dw; db]` in f32 from the f32 values of `x` (`[N, cols]`), `w` and `dy`: one buffer,
    /// the op's output.
    fn packed(&self, x: &[f32], w: Values, dy: &[f32], cols: usize) -> Vec<f32> {
        let sizes = self.sizes(x, w, cols);
        filled(sizes.dx + sizes.dw + sizes.db.unwrap_or(0), |out| {
            let (dw, db) = (sizes.dx, sizes.dx + sizes.dw);
            let db = sizes.db.map(|_| super::Shared(out.offset(db)));
            let dw = super::Shared(out.offset(dw));
            // `write` fills the three disjoint parts, all of the buffer.
            self.write(x, w, dy, cols, Out { dx: out, dw, db })
        })
    }

    /// The gradients in f32 from the f32 values of `x` (`[N, cols]`), `w` and `dy`, written
    /// whole into `out`.
    fn write(&self, x: &[f32], w: Values, dy: &[f32], cols: usize, out: Out) {
        let act = self.0.act;
        let n = x.len() / cols;
        let i = act.product_width(cols);
        let o = w.len() / i;
        let (input, slope) = match act {
            Activation::None => (None, None),
            Activation::Gelu => {
                let (g, s) = gelu_with_slope(x);
                (Some(g), Some(s))
            }
            Activation::SwiGlu => (Some(activated(x, act, i)), None),
        };
        let input = input.as_deref().unwrap_or(x);
        // SwiGLU's dx is twice the product's width: the product lands apart, then splits.
        let da = (act == Activation::SwiGlu).then(|| {
            // SAFETY: the n×i buffer is written whole by the product; dy and w are others.
            filled(n * i, |out| unsafe {
                matmul(
                    MatMut::new(out.offset(0), n, i, i),
                    Mat::rows(dy, o),
                    Mat::of(w, o).t(),
                    false,
                    true,
                )
            })
        });
        // dx and dw are written by the products (or the SwiGLU split), db by its zeroing and sum.
        // SAFETY: `out`'s dx (n×cols) and dw (i×o) are disjoint buffers of those sizes (its
        // contract); dy, w and input are other buffers.
        unsafe {
            if da.is_none() {
                matmul(
                    MatMut::new(out.dx.offset(0), n, i, i),
                    Mat::rows(dy, o),
                    Mat::of(w, o).t(),
                    false,
                    true,
                );
            }
            matmul(
                MatMut::new(out.dw.offset(0), i, o, o),
                Mat::rows(input, i).t(),
                Mat::rows(dy, o),
                false,
                true,
            );
        }
        if let Some(db) = out.db {
            // SAFETY: the bias gradient's o values are `out.db`'s, this call's alone.
            let values = unsafe { db.uninit_rows(&(0..o), 1) };
            values.iter_mut().for_each(|v| {
                v.write(0.0);
            });
            // SAFETY: the same values, now initialised by the loop above.
            column_sums(dy, o, unsafe { db.rows(&(0..o), 1) });
        }
        if let Some(slope) = slope {
            // dx is written (above): scale it in place.
            for_ranges(slope.len(), |r| {
                // SAFETY: `for_ranges` gives each call its own range of dx, written above.
                let dst = unsafe { out.dx.rows(&r, 1) };
                dst.iter_mut().zip(&slope[r]).for_each(|(d, s)| *d *= s);
            });
        }
        if let Some(da) = &da {
            swiglu_backward(x, da, i, out.dx);
        }
    }
}

/// SwiGLU's input gradient into `out`'s first `n·2i` values: with `s = σ(gate)`,
/// d gate = da·up·s·(1 + gate·(1 − s)), d up = da·gate·s.
pub(super) fn swiglu_backward(x: &[f32], da: &[f32], i: usize, out: super::Shared) {
    let n = da.len() / i;
    for_units(n, 2 * i, |_, rows| {
        // SAFETY: `for_units` gives each call its own rows of dx (rows of 2·i).
        let dst = unsafe { out.uninit_rows(&rows, 2 * i) };
        vmath::widest(
            #[inline(always)]
            || {
                for (r, row) in rows.clone().zip(dst.chunks_exact_mut(2 * i)) {
                    let (gates, ups) = x[r * 2 * i..(r + 1) * 2 * i].split_at(i);
                    let da = &da[r * i..(r + 1) * i];
                    let (dg, du) = row.split_at_mut(i);
                    for j in 0..i {
                        let (g, u) = (gates[j], ups[j]);
                        let s = sigmoid(g);
                        dg[j].write(da[j] * u * s * (1.0 + g * (1.0 - s)));
                        du[j].write(da[j] * g * s);
                    }
                }
            },
        )
    });
}

/// `gelu(h)` and `gelu′(h)`, in parallel.
pub(super) fn gelu_with_slope(h: &[f32]) -> (Vec<f32>, Vec<f32>) {
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
