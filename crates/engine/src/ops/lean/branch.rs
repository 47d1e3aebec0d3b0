//! A residual step (`ops::step`) as one lean op: `x + second(middle(first(norm(x))))` computed
//! with Candle tensor ops on detached tensors, joined to the graph with `x` as its one input. It
//! keeps what the fused CPU step keeps — the norm's output, the first layer's output and, after
//! attention, attention's output — plus the small f32 statistics the lean norm and attention
//! reuse (booked beside the output). The weights are not graph inputs: their gradients go to the
//! step's `GradSink`, in `StepWeights::flat` order, each in its weight's dtype (bias gradients
//! summed in f32).

use candle_core::{DType, Result, Tensor};

use super::apply;
use super::attention::Pass;
use super::linear::{affine_grads, gelu_slope, swiglu, swiglu_grad};
use super::norm::{Norm, Stats};
use crate::ops::step::{Adapter, Dense, GradSink, Middle, Step, StepWeights};
use crate::ops::Activation;

/// `x + step(x)` with `weights` (all of `x`'s dtype and device). Without `sink` the weights get
/// no gradient.
pub fn branch(
    x: &Tensor,
    step: &Step,
    weights: StepWeights,
    sink: Option<GradSink>,
) -> Result<Tensor> {
    let norm = Norm {
        kind: step.norm,
        eps: step.eps,
    };
    let xd = x.detach();
    // The op hangs on its graph inputs; it computes with detached weights, so that neither what
    // it keeps nor the gradients it hands the sink hold the forward's graph (AdamW's moments
    // would chain those from step to step).
    let inputs: Vec<Tensor> = weights
        .graph_inputs(x, sink.is_some())
        .into_iter()
        .cloned()
        .collect();
    let weights = detached(&weights);
    let (normed, stats) = norm.forward(&xd, &weights.gain, weights.shift.as_ref())?;
    let parts = weights
        .first
        .iter()
        .map(|d| dense(&normed, d))
        .collect::<Result<Vec<_>>>()?;
    let mid = Tensor::cat(&parts, 1)?;
    drop(parts);
    let pass = match &step.middle {
        Middle::Attention { shape, rope } => Some(Pass::new(&mid, *shape, rope.as_ref())?),
        Middle::Mlp(_) => None,
    };
    let act = step.activation();
    let (second_in, lse) = match &pass {
        Some(pass) => {
            let (y, lse) = pass.forward(&mid)?;
            (y, Some(lse))
        }
        None => (activated(&mid, act)?, None),
    };
    let y = (dense(&second_in, &weights.second)? + &xd)?;
    // The activation's output is made again in the backward; attention's is kept.
    let attended = pass.as_ref().map(|_| second_in);
    let mut kept = vec![normed.clone(), mid.clone()];
    kept.extend(attended.iter().cloned());
    kept.extend(stats.kept());
    kept.extend(lse.iter().cloned());
    let saved = Saved {
        norm,
        stats,
        normed,
        mid,
        attended,
        lse,
        pass,
        act,
    };
    let (arity, x_tracks) = (inputs.len(), x.track_op());
    let refs: Vec<&Tensor> = inputs.iter().collect();
    apply("lean-block-branch", &refs, y, kept, move |i, _, dy| {
        let (dx, grads) = saved.backward(&i[0], &weights, dy)?;
        if let Some(sink) = &sink {
            sink(grads)?;
        }
        let mut out = vec![x_tracks.then_some(dx)];
        out.resize(arity, None);
        Ok(out)
    })
}

/// `w`'s tensors cut from the graph (the same storage).
fn detached(w: &StepWeights) -> StepWeights {
    let dense = |d: &Dense| Dense {
        w: d.w.detach(),
        b: d.b.as_ref().map(Tensor::detach),
        adapter: d.adapter.as_ref().map(|a| Adapter {
            a: a.a.detach(),
            b: a.b.detach(),
            scale: a.scale,
            dropout: a.dropout.clone(),
        }),
    };
    StepWeights {
        gain: w.gain.detach(),
        shift: w.shift.as_ref().map(Tensor::detach),
        first: w.first.iter().map(dense).collect(),
        second: dense(&w.second),
        frozen: w.frozen,
    }
}

/// `x·w (+ b) (+ scale·(dropout(x)·A)·B)`.
fn dense(x: &Tensor, d: &Dense) -> Result<Tensor> {
    let y = x.matmul(&d.w)?;
    let y = match &d.b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    match &d.adapter {
        Some(a) => y + (a.dropped(x)?.matmul(&a.a)?.matmul(&a.b)? * a.scale)?,
        None => Ok(y),
    }
}

/// `act(h)` in `h`'s dtype.
fn activated(h: &Tensor, act: Activation) -> Result<Tensor> {
    match act {
        Activation::None => Ok(h.clone()),
        Activation::Gelu => h.gelu(),
        Activation::SwiGlu => swiglu(h),
    }
}

/// What the forward left for the backward.
struct Saved {
    norm: Norm,
    stats: Stats,
    normed: Tensor,
    mid: Tensor,
    attended: Option<Tensor>,
    lse: Option<Tensor>,
    pass: Option<Pass>,
    act: Activation,
}

impl Saved {
    /// dx and the weights' gradients for the output gradient `dy`.
    fn backward(&self, x: &Tensor, w: &StepWeights, dy: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let dtype = x.dtype();
        // The second layer, then back through the middle.
        let second_in = match &self.attended {
            Some(y) => y.clone(),
            None => activated(&self.mid, self.act)?,
        };
        let base = !w.frozen;
        let (da, second) = layer_grads(&second_in, &w.second, dy, base)?;
        let dmid = match (&self.pass, &self.attended, &self.lse) {
            (Some(pass), Some(y), Some(lse)) => pass.backward(&self.mid, y, &da, lse)?,
            _ => match self.act {
                Activation::Gelu => {
                    let slope = gelu_slope(self.mid.to_dtype(DType::F32)?)?;
                    (da.to_dtype(DType::F32)? * slope)?.to_dtype(dtype)?
                }
                Activation::SwiGlu => swiglu_grad(&self.mid, &da)?,
                Activation::None => da,
            },
        };
        // The first layer's parts, each reading its columns of dmid.
        let mut dnormed: Option<Tensor> = None;
        let mut first = Vec::new();
        let mut at = 0;
        for d in &w.first {
            let o = d.w.dim(1)?;
            let part = dmid.narrow(1, at, o)?.contiguous()?;
            at += o;
            let (dx, grads) = layer_grads(&self.normed, d, &part, base)?;
            dnormed = Some(match dnormed {
                Some(sum) => (sum + dx)?,
                None => dx,
            });
            first.extend(grads);
        }
        let dnormed = dnormed.ok_or_else(|| candle_core::Error::Msg("empty first layer".into()))?;
        let (dx, dgain, dshift) = self.norm.backward(x, &w.gain, &self.stats, &dnormed)?;
        let mut grads = Vec::new();
        if base {
            grads.push(dgain);
            if let (Some(db), Some(shift)) = (dshift, &w.shift) {
                grads.push(db.to_dtype(shift.dtype())?);
            }
        }
        grads.extend(first);
        grads.extend(second);
        Ok(((dx + dy)?, grads))
    }
}

/// The input's gradient and the layer's trainable gradients for `g`: with `base`, `dw` and `db`
/// (the bias summed in f32); with an adapter, `dA = xᵀ·t` and `dB = (s·x·A)ᵀ·g`, where
/// `t = s·g·Bᵀ` also adds `t·Aᵀ` to the input's gradient (x and `t·Aᵀ` masked under dropout).
fn layer_grads(x: &Tensor, d: &Dense, g: &Tensor, base: bool) -> Result<(Tensor, Vec<Tensor>)> {
    let mut grads = Vec::new();
    let mut dx = match (&d.b, base) {
        (Some(b), true) => {
            let (dx, dw, db) = affine_grads(x, &d.w, b, g)?;
            grads.extend([dw, db]);
            dx
        }
        (None, true) => {
            grads.push(x.t()?.matmul(g)?);
            g.matmul(&d.w.t()?)?
        }
        (_, false) => g.matmul(&d.w.t()?)?,
    };
    if let Some(a) = &d.adapter {
        // Under dropout the adapter saw `m ⊙ x`, its mask drawn again: `t·Aᵀ` reaches x
        // through the same mask.
        let mask = a.mask_for(x)?;
        let dropped;
        let x = match &mask {
            Some(m) => {
                dropped = (x * m)?;
                &dropped
            }
            None => x,
        };
        let t = (g.matmul(&a.b.t()?)? * a.scale)?;
        let back = t.matmul(&a.a.t()?)?;
        let back = match &mask {
            Some(m) => (back * m)?,
            None => back,
        };
        dx = (dx + back)?;
        grads.push(x.t()?.matmul(&t)?);
        let xa = (x.matmul(&a.a)? * a.scale)?;
        grads.push(xa.t()?.matmul(g)?);
    }
    Ok((dx, grads))
}
