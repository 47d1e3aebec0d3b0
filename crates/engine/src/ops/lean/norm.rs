//! The norms over the last dimension, keeping their input (in its own dtype) and f32 statistics
//! per row: layer norm a mean and a reciprocal standard deviation (the composite version keeps
//! an f32 copy of the input and five f32 intermediates: 26 bytes an element in bf16 against 2
//! here), RMS norm a reciprocal root mean square.
//!
//! Backward, in f32 with x̂ the normalised row and g = dy·γ:
//! layer norm dx = r·(g − mean(g) − x̂·mean(g·x̂)), dγ = Σ dy·x̂, dβ = Σ dy;
//! RMS norm dx = r·(g − x̂·mean(g·x̂)), dγ = Σ dy·x̂ (sums over the rows).

use candle_core::{DType, Result, Tensor, D};

use super::apply;
use crate::ops::NormKind;

/// `(x − mean)/√(var + eps)·gain + bias` over the last dimension, computed in f32, returned in
/// `x`'s dtype.
pub fn layer_norm(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let norm = Norm {
        kind: NormKind::Layer,
        eps,
    };
    let (y, stats) = norm.forward(&x.detach(), &gain.detach(), Some(&bias.detach()))?;
    apply(
        "lean-layer-norm",
        &[x, gain, bias],
        y,
        stats.kept(),
        move |i, _, dy| {
            let (dx, dgain, dbias) = norm.backward(&i[0], &i[1], &stats, dy)?;
            Ok(vec![
                Some(dx),
                Some(dgain),
                dbias.map(|b| b.to_dtype(i[2].dtype())).transpose()?,
            ])
        },
    )
}

/// `gain · n` with `n = x/√(mean(x²) + eps)` computed in f32 and rounded to `x`'s dtype before
/// the gain (transformers' `LlamaRMSNorm` order), keeping `x` and an f32 reciprocal root mean
/// square per row.
pub fn rms_norm(x: &Tensor, gain: &Tensor, eps: f64) -> Result<Tensor> {
    let norm = Norm {
        kind: NormKind::Rms,
        eps,
    };
    let (y, stats) = norm.forward(&x.detach(), &gain.detach(), None)?;
    apply(
        "lean-rms-norm",
        &[x, gain],
        y,
        stats.kept(),
        move |i, _, dy| {
            let (dx, dgain, _) = norm.backward(&i[0], &i[1], &stats, dy)?;
            Ok(vec![Some(dx), Some(dgain)])
        },
    )
}

/// A norm's form and epsilon.
#[derive(Clone, Copy)]
pub(super) struct Norm {
    pub(super) kind: NormKind,
    pub(super) eps: f64,
}

/// The per-row f32 statistics a norm's backward reuses.
pub(super) struct Stats {
    /// The row means (layer norm).
    mean: Option<Tensor>,
    /// The reciprocal standard deviations (or root mean squares).
    rstd: Tensor,
}

impl Stats {
    /// The tensors to book beside the output.
    pub(super) fn kept(&self) -> Vec<Tensor> {
        self.mean.iter().chain([&self.rstd]).cloned().collect()
    }

    /// `x` normalised by these statistics, in f32 (without gain).
    fn normalised(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?;
        let centred = match &self.mean {
            Some(mean) => x.broadcast_sub(mean)?,
            None => x,
        };
        centred.broadcast_mul(&self.rstd)
    }
}

impl Norm {
    /// The norm of detached `x` in `x`'s dtype and its statistics.
    pub(super) fn forward(
        &self,
        x: &Tensor,
        gain: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<(Tensor, Stats)> {
        let x32 = x.to_dtype(DType::F32)?;
        let (mean, centred) = match self.kind {
            NormKind::Layer => {
                let mean = x32.mean_keepdim(D::Minus1)?;
                let centred = x32.broadcast_sub(&mean)?;
                (Some(mean), centred)
            }
            NormKind::Rms => (None, x32),
        };
        let rstd = (centred.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        let normed = centred.broadcast_mul(&rstd)?;
        drop(centred);
        let y = match self.kind {
            NormKind::Layer => {
                let y = normed.broadcast_mul(&gain.to_dtype(DType::F32)?)?;
                let y = match bias {
                    Some(b) => y.broadcast_add(&b.to_dtype(DType::F32)?)?,
                    None => y,
                };
                y.to_dtype(x.dtype())?
            }
            NormKind::Rms => normed.to_dtype(x.dtype())?.broadcast_mul(gain)?,
        };
        Ok((y, Stats { mean, rstd }))
    }

    /// dx (with `x`'s dtype), dγ (with `gain`'s) and, for layer norm, dβ (f32) for the
    /// output gradient `dy`.
    pub(super) fn backward(
        &self,
        x: &Tensor,
        gain: &Tensor,
        stats: &Stats,
        dy: &Tensor,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let d = x.dim(D::Minus1)?;
        let rows = x.elem_count() / d.max(1);
        let normed = stats.normalised(x)?;
        let dy = dy.to_dtype(DType::F32)?;
        let g = dy.broadcast_mul(&gain.to_dtype(DType::F32)?)?;
        let gx_mean = (&g * &normed)?.mean_keepdim(D::Minus1)?;
        let centred = match self.kind {
            NormKind::Layer => g.broadcast_sub(&g.mean_keepdim(D::Minus1)?)?,
            NormKind::Rms => g,
        };
        let dx = centred
            .sub(&normed.broadcast_mul(&gx_mean)?)?
            .broadcast_mul(&stats.rstd)?;
        let column_sum = |t: &Tensor| t.reshape((rows, d))?.sum(0);
        let dgain = column_sum(&(&dy * &normed)?)?
            .reshape(gain.shape())?
            .to_dtype(gain.dtype())?;
        let dbias = match self.kind {
            NormKind::Layer => Some(column_sum(&dy)?),
            NormKind::Rms => None,
        };
        Ok((dx.to_dtype(x.dtype())?, dgain, dbias))
    }
}
