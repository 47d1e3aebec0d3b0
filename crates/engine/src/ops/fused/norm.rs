//! The norms before each residual branch, in f32 over the last dimension:
//!
//! - layer norm, `(x − mean)/√(var + eps)·γ + β`, rounded once to the storage dtype;
//! - RMS norm as transformers' `LlamaRMSNorm` computes it: `n = x·rsqrt(mean(x²) + eps)` rounded
//!   to the storage dtype first, then `γ·n` (in half precision the order shows).
//!
//! Backward, in f32 with x̂ the normalised row (without its gain) and g = dy·γ:
//! layer norm dx = r·(g − mean(g) − x̂·mean(g·x̂)), dγ = Σ dy·x̂, dβ = Σ dy;
//! RMS norm dx = r·(g − x̂·mean(g·x̂)), dγ = Σ dy·x̂ (sums over the rows, by unit, in unit order).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::{for_units, last_dim, output, storage, unit_rows, Shared};
use crate::ops::{vmath, NormKind};

/// `y = (x - mean) / sqrt(var + eps) * gain + bias` over the last dimension.
pub fn layer_norm(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &gain.contiguous()?,
        &bias.contiguous()?,
        Norm {
            kind: NormKind::Layer,
            eps: eps as f32,
        },
    )
}

/// `y = gain · (x / sqrt(mean(x²) + eps))` over the last dimension, `LlamaRMSNorm`'s order.
pub fn rms_norm(x: &Tensor, gain: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(
        &gain.contiguous()?,
        Norm {
            kind: NormKind::Rms,
            eps: eps as f32,
        },
    )
}

#[derive(Clone, Copy)]
struct Norm {
    kind: NormKind,
    eps: f32,
}

/// The norm of the rows of `x` (rows of `g.len()`), in f32; `round` is the storage dtype's
/// rounding, which RMS norm applies before its gain.
pub(super) fn norm_rows(
    x: &[f32],
    g: &[f32],
    b: Option<&[f32]>,
    eps: f32,
    kind: NormKind,
    round: fn(f32) -> f32,
) -> Vec<f32> {
    let d = g.len();
    let n = x.len() / d;
    output(n * d, |out| {
        for_units(n, d, |_, rows| {
            // SAFETY: `for_units` gives each call its own rows, inside `output`'s buffer.
            let dst = unsafe { out.rows(&rows, d) };
            let src = &x[rows.start * d..rows.end * d];
            let mut centred = vec![0f32; d];
            vmath::widest(
                #[inline(always)]
                || {
                    for (yr, xr) in dst.chunks_exact_mut(d).zip(src.chunks_exact(d)) {
                        match kind {
                            NormKind::Layer => {
                                let (_, rstd) = row_stats(xr, eps, &mut centred);
                                match b {
                                    Some(b) => {
                                        for (((y, &c), &g), &b) in
                                            yr.iter_mut().zip(&centred).zip(g).zip(b)
                                        {
                                            *y = c * rstd * g + b;
                                        }
                                    }
                                    None => {
                                        for ((y, &c), &g) in yr.iter_mut().zip(&centred).zip(g) {
                                            *y = c * rstd * g;
                                        }
                                    }
                                }
                            }
                            NormKind::Rms => {
                                let r = rms_rstd(xr, eps);
                                for ((y, &x), &g) in yr.iter_mut().zip(xr).zip(g) {
                                    *y = g * round(x * r);
                                }
                            }
                        }
                    }
                },
            )
        })
    })
}

/// Mean and 1/std of one row (two passes, like the composite version).
#[inline(always)]
fn row_stats(row: &[f32], eps: f32, centred: &mut [f32]) -> (f32, f32) {
    let d = row.len() as f32;
    let mean = vmath::sum(row) / d;
    centred
        .iter_mut()
        .zip(row)
        .for_each(|(c, &v)| *c = v - mean);
    let var = vmath::dot(centred, centred) / d;
    (mean, 1.0 / (var + eps).sqrt())
}

/// 1/√(mean(x²) + eps) of one row.
#[inline(always)]
fn rms_rstd(row: &[f32], eps: f32) -> f32 {
    1.0 / (vmath::dot(row, row) / row.len() as f32 + eps).sqrt()
}

impl Norm {
    fn forward(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        g: &[f32],
        b: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let x = storage::input(xs, xl, self.name())?;
        let d = last_dim(xl.shape())?.1;
        if g.len() != d || b.is_some_and(|b| b.len() != d) {
            candle_core::bail!("{}: gain/bias of {} for rows of {d}", self.name(), g.len());
        }
        Ok(norm_rows(
            &x,
            g,
            b,
            self.eps,
            self.kind,
            storage::rounding(xs.dtype()),
        ))
    }

    fn name(&self) -> &'static str {
        match self.kind {
            NormKind::Layer => "gaccwb-layer-norm",
            NormKind::Rms => "gaccwb-rms-norm",
        }
    }

    /// `[dx; dgain]` (and `dbias` for layer norm) of the norm at `x` for the gradient `grad`.
    fn backward(&self, x: &Tensor, gain: &Tensor, grad: &Tensor) -> Result<Vec<Tensor>> {
        let d = gain.elem_count();
        let n = x.elem_count() / d;
        // One pass yields [dx; dgain; dbias] stacked as rows.
        let packed = x.apply_op3_no_bwd(gain, &grad.contiguous()?, &NormBackward(*self))?;
        let mut grads = vec![packed.narrow(0, 0, n)?.reshape(x.shape())?];
        // A frozen gain and bias (LoRA) take part in no graph: no gradient for them.
        if gain.track_op() {
            grads.push(packed.narrow(0, n, 1)?.reshape(d)?);
            if self.kind == NormKind::Layer {
                grads.push(packed.narrow(0, n + 1, 1)?.reshape(d)?);
            }
        }
        Ok(grads)
    }
}

impl CustomOp3 for Norm {
    fn name(&self) -> &'static str {
        Norm::name(self)
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = storage::input(gs, gl, Norm::name(self))?;
        let b = storage::input(bs, bl, Norm::name(self))?;
        let y = self.forward(xs, xl, &g, Some(&b))?;
        Ok((storage::stored(y, xs)?, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gain: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.backward(x, gain, grad)?.into_iter();
        Ok((g.next(), g.next(), g.next()))
    }
}

impl CustomOp2 for Norm {
    fn name(&self) -> &'static str {
        Norm::name(self)
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = storage::input(gs, gl, Norm::name(self))?;
        let y = self.forward(xs, xl, &g, None)?;
        Ok((storage::stored(y, xs)?, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gain: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.backward(x, gain, grad)?.into_iter();
        Ok((g.next(), g.next()))
    }
}

struct NormBackward(Norm);

/// `[dx; dgain]` and, for layer norm, `dbias` (`n + 1` or `n + 2` rows of `g.len()`) of the
/// norm at `x` for the output gradient `dy`, in f32; `residual` (`[n, d]`), when given, is
/// added to dx as it is written.
pub(super) fn norm_backward_rows(
    x: &[f32],
    g: &[f32],
    dy: &[f32],
    eps: f32,
    kind: NormKind,
    residual: Option<&[f32]>,
) -> Vec<f32> {
    let d = g.len();
    let n = x.len() / d;
    let stats = match kind {
        NormKind::Layer => 2,
        NormKind::Rms => 1,
    };
    let units = n.div_ceil(unit_rows(d));
    // Per-unit partial sums of dgain (and dbias), added in unit order (deterministic).
    let mut partial = vec![0f32; units * 2 * d];
    let partial_ptr = Shared(partial.as_mut_ptr());
    let mut out = output((n + stats) * d, |out| {
        for_units(n, d, |unit, rows| {
            // SAFETY: `for_units` gives each call its own rows, inside `output`'s buffer.
            let dx = unsafe { out.rows(&rows, d) };
            // SAFETY: unit `unit` is this call's alone; `partial` holds `units` rows of 2·d.
            let acc = unsafe { partial_ptr.rows(&(unit..unit + 1), 2 * d) };
            let (dg, db) = acc.split_at_mut(d);
            let xs = &x[rows.start * d..rows.end * d];
            let dys = &dy[rows.start * d..rows.end * d];
            let (mut xhat, mut dxhat) = (vec![0f32; d], vec![0f32; d]);
            vmath::widest(
                #[inline(always)]
                || {
                    for ((dxr, xr), dyr) in dx
                        .chunks_exact_mut(d)
                        .zip(xs.chunks_exact(d))
                        .zip(dys.chunks_exact(d))
                    {
                        let rstd = match kind {
                            NormKind::Layer => row_stats(xr, eps, &mut xhat).1,
                            NormKind::Rms => {
                                xhat.copy_from_slice(xr);
                                rms_rstd(xr, eps)
                            }
                        };
                        xhat.iter_mut().for_each(|v| *v *= rstd);
                        for (((dh, &dy), &g), ((dg, db), &xh)) in dxhat
                            .iter_mut()
                            .zip(dyr)
                            .zip(g)
                            .zip(dg.iter_mut().zip(db.iter_mut()).zip(&xhat))
                        {
                            *dh = dy * g;
                            *dg += dy * xh;
                            *db += dy;
                        }
                        let m1 = match kind {
                            NormKind::Layer => vmath::sum(&dxhat) / d as f32,
                            NormKind::Rms => 0.0,
                        };
                        let m2 = vmath::dot(&dxhat, &xhat) / d as f32;
                        for ((dx, &dh), &xh) in dxr.iter_mut().zip(&dxhat).zip(&xhat) {
                            *dx = rstd * (dh - m1 - xh * m2);
                        }
                    }
                    // The unit's rows are still in cache.
                    if let Some(r) = residual {
                        let r = &r[rows.start * d..rows.end * d];
                        dx.iter_mut().zip(r).for_each(|(dx, &r)| *dx += r);
                    }
                },
            )
        })
    });
    let sums = &mut out[n * d..];
    for unit in partial.chunks_exact(2 * d) {
        for i in 0..d {
            sums[i] += unit[i];
            if stats == 2 {
                sums[d + i] += unit[d + i];
            }
        }
    }
    out
}

impl CustomOp3 for NormBackward {
    fn name(&self) -> &'static str {
        "gaccwb-norm-backward"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        dys: &CpuStorage,
        dyl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = storage::input(xs, xl, self.name())?;
        let g = storage::input(gs, gl, self.name())?;
        let dy = storage::input(dys, dyl, self.name())?;
        let (n, d) = last_dim(xl.shape())?;
        let out = norm_backward_rows(&x, &g, &dy, self.0.eps, self.0.kind, None);
        let rows = out.len() / d;
        debug_assert!(rows > n);
        Ok((storage::stored(out, xs)?, Shape::from((rows, d))))
    }
}
