//! A transformer block's two residual steps (`ops::step`), each one op:
//! `x + second(attention(first(norm(x))))` and `x + second(act(first(norm(x))))`.
//!
//! Candle's backward adds every gradient that reaches a graph node into a zeroed buffer of the
//! node's dtype, on the calling thread, and its bf16 add converts through calls it cannot
//! inline: as single ops and residual adds a block's gradients crossed sixteen `[N, D]`-sized
//! bf16 adds (and the forward two more), and each weight's gradient two (bf16, then f32 through
//! the cast). Here the step's inner gradients are never graph nodes: the backward chains the
//! single ops' f32 kernels (`linear_backward_rows`, attention's `backward_rows`,
//! `parts_backward_rows`, `norm_backward_rows`, which adds the residual's gradient as it writes) with the
//! gradients between them in f32, and rounds only the input's gradient to the storage dtype:
//! two adds per block remain, where each step's input gradient joins the graph, and those are
//! f32 adds in half precision too, whose residual stream is f32 (`ops::widen_stream`). The
//! weights are not graph inputs either: their gradients go to a `GradSink`, rounded to the
//! storage dtype but kept in f32 (the master weight's dtype, so nothing widens them again).
//!
//! The forward rounds each intermediate to the storage dtype as the single ops do (the second
//! layer's output with the residual added: one rounding, not two), and keeps what the single
//! ops keep but the branch's output, which only the residual add needed: the input (the op's one
//! graph input) and, beside it (booked with `tensors::keep_beside` by `lean::apply`), the norm's
//! output, then `qkv` and attention's output or the MLP's hidden layer (the GELU's input), all in
//! the storage dtype (the input in the stream's).

use candle_core::{DType, Result, Tensor};

use super::attention::Attention;
use super::layer::{
    parts_backward_rows, parts_rows, second_backward_rows, second_rows, LowRank, Part,
};
use super::storage::{self, Operand};
use super::{norm_backward_rows, norm_rows};
use crate::ops::step::{GradSink, Middle, Step, StepWeights};
use crate::ops::NormKind;

const NAME: &str = "gaccwb-block-branch";

/// `x + step(x)` for `x` (`[N, D]`) with `weights`, on the CPU, computed in the weights' dtype.
/// `x` is stored in that dtype or, as the residual stream of a half-precision forward, in f32
/// holding values rounded to it (`ops::widen_stream`); the output and the input's gradient are
/// rounded to the weights' dtype and stored in `x`'s. Without `sink` the weights get no
/// gradient (they are detached).
pub fn branch(
    x: &Tensor,
    step: &Step,
    weights: StepWeights,
    sink: Option<GradSink>,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let op = Op {
        step: step.clone(),
        dtype: weights.gain.dtype(),
        stream: x.dtype(),
    };
    let (y, kept) = op.forward(&x, &weights)?;
    let inputs = weights.graph_inputs(&x, sink.is_some());
    let (arity, x_tracks) = (inputs.len(), x.track_op());
    let inputs: Vec<Tensor> = inputs.into_iter().cloned().collect();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    crate::ops::lean::apply(NAME, &refs, y, kept.clone(), move |inputs, _, dy| {
        let (dx, grads) = op.backward(&inputs[0], &kept, &weights, &dy.contiguous()?)?;
        if let Some(sink) = &sink {
            sink(grads)?;
        }
        let mut out = vec![x_tracks.then_some(dx)];
        out.resize(arity, None);
        Ok(out)
    })
}

struct Op {
    step: Step,
    /// The compute dtype: the weights', to which every value the op stores is rounded.
    dtype: DType,
    /// The residual stream's storage dtype: the compute dtype or f32.
    stream: DType,
}

/// `f` of a contiguous CPU tensor's values as f32 (widened when stored in half precision).
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (guard, layout) = t.storage_and_layout();
    let values = storage::input(storage::cpu(&guard, NAME)?, layout, NAME)?;
    Ok(f(&values))
}

/// `f` of a step's weights (`StepWeights::flat`), read as `Inputs` reads them: matrices as
/// operands (`storage::operand`: bf16 as stored where products run on tiles), vectors (gains,
/// shifts, biases) as f32.
fn with_weights<R>(ts: &[&Tensor], f: impl FnOnce(&[Operand]) -> Result<R>) -> Result<R> {
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let values = guards
        .iter()
        .map(|(g, l)| {
            let s = storage::cpu(g, NAME)?;
            match l.dims().len() {
                2 => storage::operand(s, l, NAME),
                _ => Ok(Operand::F32(storage::input(s, l, NAME)?)),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    f(&values)
}

/// A step's weights, in `StepWeights::flat` order, read by position.
struct Inputs<'a> {
    all: &'a [Operand<'a>],
    w: &'a StepWeights,
}

impl Inputs<'_> {
    /// Vector `i` (read in f32 by `with_weights`).
    fn vector(&self, i: usize) -> &[f32] {
        match &self.all[i] {
            Operand::F32(v) => v,
            Operand::Bf16(_) => unreachable!("vectors are read in f32"),
        }
    }

    fn gain(&self) -> &[f32] {
        self.vector(0)
    }

    fn shift(&self) -> Option<&[f32]> {
        self.w.shift.as_ref().map(|_| self.vector(1))
    }

    /// The first layer's parts and the second layer, as `Part`s.
    fn layers(&self) -> Result<(Vec<Part<'_>>, Part<'_>)> {
        let mut at = 1 + usize::from(self.w.shift.is_some());
        let mut parts = Vec::new();
        for d in self.w.first.iter().chain([&self.w.second]) {
            let w = self.all[at].values();
            at += 1;
            let b = d.b.as_ref().map(|_| self.vector(at));
            at += usize::from(d.b.is_some());
            let adapter = match &d.adapter {
                Some(a) => {
                    let lr = LowRank {
                        a: self.all[at].values(),
                        b: self.all[at + 1].values(),
                        r: a.a.dim(1)?,
                        scale: a.scale as f32,
                        dropout: a.dropout.as_ref(),
                    };
                    at += 2;
                    Some(lr)
                }
                None => None,
            };
            parts.push(Part {
                w,
                b,
                o: d.w.dim(1)?,
                adapter,
            });
        }
        let second = parts
            .pop()
            .ok_or_else(|| candle_core::Error::Msg("a step needs a second layer".into()))?;
        Ok((parts, second))
    }
}

impl Op {
    /// `values` (`[N, D]`) rounded to the compute dtype and stored in the stream's (that dtype,
    /// or f32: `ops::residual_step` takes no other).
    fn to_stream(&self, values: Vec<f32>, n: usize, d: usize) -> Result<Tensor> {
        match self.stream == self.dtype {
            true => storage::tensor(values, self.dtype, (n, d)),
            false => storage::rounded(values, self.dtype, (n, d)),
        }
    }

    fn attention(&self) -> Option<Attention> {
        match &self.step.middle {
            Middle::Attention { shape, rope } => Some(Attention::new(*shape, rope.clone())),
            Middle::Mlp(_) => None,
        }
    }

    /// The output and the intermediates kept for the backward.
    fn forward(&self, x: &Tensor, w: &StepWeights) -> Result<(Tensor, Vec<Tensor>)> {
        let _products = super::tiles::scope(self.dtype);
        let (n, d) = x.dims2()?;
        let store = |v: Vec<f32>, cols: usize| storage::tensor(v, self.dtype, (n, cols));
        let eps = self.step.eps as f32;
        let forward = |x: &[f32], all: &[Operand]| {
            let values = Inputs { all, w };
            let (first, second) = values.layers()?;
            let round = storage::rounding(self.dtype);
            let normed = norm_rows(x, values.gain(), values.shift(), eps, self.step.norm, round);
            let normed = store(normed, d)?;
            let width = w.first_width()?;
            let mid = store(with_f32(&normed, |v| parts_rows(v, d, &first))?, width)?;
            let (second_in, kept) = match self.attention() {
                Some(attention) => {
                    let y = with_f32(&mid, |v| attention.forward_rows(v))?;
                    let y = store(y, second.w.len() / d)?;
                    (y.clone(), vec![normed, mid, y])
                }
                None => (mid.clone(), vec![normed, mid]),
            };
            let act = self.step.activation();
            let cols = second_in.dim(1)?;
            let out = with_f32(&second_in, |v| second_rows(v, cols, &second, act, x))?;
            Ok((self.to_stream(out, n, d)?, kept))
        };
        with_f32(x, |x| with_weights(&w.flat(), |all| forward(x, all)))?
    }

    /// The input's gradient (`to_stream`), and the trainable weights' (in
    /// `StepWeights::trainable` order) rounded to the compute dtype but kept in f32.
    fn backward(
        &self,
        x: &Tensor,
        kept: &[Tensor],
        w: &StepWeights,
        dy: &Tensor,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let _products = super::tiles::scope(self.dtype);
        let (n, d) = x.dims2()?;
        let dt = self.dtype;
        let base = !w.frozen;
        let backward = |dy: &[f32], all: &[Operand]| {
            let values = Inputs { all, w };
            let (first, second) = values.layers()?;
            let second_in = kept.last().unwrap_or(x);
            let cols = second_in.dim(1)?;
            let act = self.step.activation();
            let (d_second_in, second_grads) = with_f32(second_in, |h| {
                second_backward_rows(h, cols, &second, act, dy, base)
            })?;
            let dmid = match self.attention() {
                Some(attention) => {
                    with_f32(&kept[1], |qkv| attention.backward_rows(qkv, &d_second_in))?
                }
                None => d_second_in,
            };
            let (dnormed, first_grads) =
                with_f32(&kept[0], |a| parts_backward_rows(a, d, &first, &dmid, base))?;
            // The residual's gradient, dy, joins the norm's input gradient as it is written.
            let eps = self.step.eps as f32;
            let mut norm = with_f32(x, |x| {
                norm_backward_rows(x, values.gain(), &dnormed, eps, self.step.norm, Some(dy))
            })?;
            let mut grads = Vec::new();
            if base {
                grads.push(storage::rounded(norm[n * d..(n + 1) * d].to_vec(), dt, d)?);
                if self.step.norm == NormKind::Layer {
                    grads.push(storage::rounded(
                        norm[(n + 1) * d..(n + 2) * d].to_vec(),
                        dt,
                        d,
                    )?);
                }
            }
            let denses = w
                .first
                .iter()
                .zip(first_grads)
                .chain([(&w.second, second_grads)]);
            for (dense, packed) in denses {
                for (t, g) in trainable_of(dense, base).into_iter().zip(packed) {
                    grads.push(storage::rounded(g, dt, t.dims())?);
                }
            }
            norm.truncate(n * d);
            Ok((self.to_stream(norm, n, d)?, grads))
        };
        with_f32(dy, |dy| with_weights(&w.flat(), |all| backward(dy, all)))?
    }
}

/// A layer's tensors that get gradients, in the order its kernels return them.
fn trainable_of(d: &crate::ops::step::Dense, base: bool) -> Vec<&Tensor> {
    let mut t = Vec::new();
    if base {
        t.push(&d.w);
        t.extend(&d.b);
    }
    if let Some(a) = &d.adapter {
        t.extend([&a.a, &a.b]);
    }
    t
}
