//! A transformer block's two residual steps, each one op: `x + proj(attention(qkv(norm(x))))`
//! and `x + proj(gelu(fc(norm(x))))`.
//!
//! Candle's backward adds every gradient that reaches a graph node into a zeroed buffer of the
//! node's dtype, on the calling thread, and its bf16 add converts through calls it cannot
//! inline: as single ops and residual adds a block's gradients crossed sixteen `[N, D]`-sized
//! bf16 adds (and the forward two more), and each weight's gradient two (bf16, then f32 through
//! the cast). Here the step's inner gradients are never graph nodes: the backward chains the
//! single ops' f32 kernels (`linear_backward_rows`, attention's `backward_rows`,
//! `layer_norm_backward_rows`, which adds the residual's gradient as it writes) with the
//! gradients between them in f32, and rounds only the input's gradient to the storage dtype:
//! two adds per block remain, where each step's input gradient joins the graph. The weights
//! are not graph inputs either: their gradients go to a `GradSink`.
//!
//! The forward rounds each intermediate to the storage dtype as the single ops do (the second
//! layer's output with the residual added: one rounding, not two), and keeps what the single
//! ops keep but the branch's output, which only the residual add needed: the input (the op's one
//! graph input) and, beside it (booked with `tensors::keep_beside` by `lean::apply`), the norm's
//! output, then `qkv` and attention's output or the MLP's hidden layer (the GELU's input), all in
//! the storage dtype.

use std::borrow::Cow;

use candle_core::{DType, Result, Tensor};

use super::attention::Attention;
use super::linear::{linear_backward_rows, linear_rows};
use super::{layer_norm_backward_rows, layer_norm_rows, storage};

const NAME: &str = "gaccwb-block-branch";

/// Takes a branch's six weight gradients (in the order of its weights) during the backward.
/// Each is summed in f32 and rounded once to the storage dtype, as a single op's is: the value
/// the weight's cast received from Candle's graph, so an f32 master weight and a half-precision
/// one under offload get the same gradient.
pub type GradSink = Box<dyn Fn(Vec<Tensor>) -> Result<()> + Send + Sync>;

/// Which branch.
#[derive(Clone, Copy, Debug)]
pub enum Branch {
    /// Causal self-attention over `batch` sequences of `t` tokens with `heads` heads.
    Attention {
        /// Sequences.
        batch: usize,
        /// Tokens per sequence.
        t: usize,
        /// Heads.
        heads: usize,
    },
    /// The 4× GELU MLP.
    Mlp,
}

/// `x + branch(x)` for the branch `kind` of `x` (`[N, D]`) with `weights` = norm gain and bias,
/// first layer's weight and bias, second layer's weight and bias (weights `[in, out]`), all of
/// `x`'s dtype on the CPU. Without `sink` the weights get no gradient (they are detached).
pub fn branch(
    x: &Tensor,
    kind: Branch,
    weights: [Tensor; 6],
    eps: f64,
    sink: Option<GradSink>,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let op = Op {
        kind,
        eps: eps as f32,
        dtype: x.dtype(),
    };
    let (y, kept) = op.forward(&x, &weights)?;
    crate::ops::lean::apply(NAME, &[&x], y, kept.clone(), move |inputs, _, dy| {
        let (dx, grads) = op.backward(&inputs[0], &kept, &weights, &dy.contiguous()?)?;
        if let Some(sink) = &sink {
            sink(grads)?;
        }
        Ok(vec![Some(dx)])
    })
}

#[derive(Clone, Copy)]
struct Op {
    kind: Branch,
    eps: f32,
    dtype: DType,
}

/// `f` of a contiguous CPU tensor's values as f32 (widened when stored in half precision).
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (guard, layout) = t.storage_and_layout();
    let values = storage::input(storage::cpu(&guard, NAME)?, layout, NAME)?;
    Ok(f(&values))
}

/// `f` of several tensors' values as f32.
fn with_all_f32<R>(ts: &[Tensor], f: impl FnOnce(&[Cow<[f32]>]) -> R) -> Result<R> {
    let guards: Vec<_> = ts.iter().map(Tensor::storage_and_layout).collect();
    let values = guards
        .iter()
        .map(|(g, l)| storage::input(storage::cpu(g, NAME)?, l, NAME))
        .collect::<Result<Vec<_>>>()?;
    Ok(f(&values))
}

/// The `shape`-sized part of a packed gradient from `at`, rounded once to `dtype`.
fn part(packed: &[f32], at: usize, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let len = shape.iter().product::<usize>();
    storage::tensor(packed[at..at + len].to_vec(), dtype, shape)
}

impl Op {
    /// `x` and the weights, the tensors a branch reads, in one list.
    fn with_weights(x: &Tensor, w: &[Tensor; 6]) -> Vec<Tensor> {
        std::iter::once(x.clone())
            .chain(w.iter().cloned())
            .collect()
    }

    /// The output and the intermediates kept for the backward.
    fn forward(&self, x: &Tensor, w: &[Tensor; 6]) -> Result<(Tensor, Vec<Tensor>)> {
        let (n, d) = x.dims2()?;
        let store = |v: Vec<f32>, cols: usize| storage::tensor(v, self.dtype, (n, cols));
        with_all_f32(&Self::with_weights(x, w), |v| {
            let (x, w) = (&v[0][..], &v[1..]);
            let normed = store(layer_norm_rows(x, &w[0], &w[1], self.eps), d)?;
            let width = w[3].len();
            let mid = with_f32(&normed, |v| linear_rows(v, &w[2], &w[3], false, None))?;
            let mid = store(mid, width)?;
            let (second_in, gelu, kept) = match self.kind {
                Branch::Attention { batch, t, heads } => {
                    let attention = Attention::new(batch, t, heads, d);
                    let y = store(with_f32(&mid, |v| attention.forward_rows(v))?, d)?;
                    (y.clone(), false, vec![normed, mid, y])
                }
                Branch::Mlp => (mid.clone(), true, vec![normed, mid]),
            };
            let out = with_f32(&second_in, |v| linear_rows(v, &w[4], &w[5], gelu, Some(x)))?;
            Ok((store(out, d)?, kept))
        })?
    }

    /// The input's gradient and the weights' (in their order), in the storage dtype.
    fn backward(
        &self,
        x: &Tensor,
        kept: &[Tensor],
        w: &[Tensor; 6],
        dy: &Tensor,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let (n, d) = x.dims2()?;
        let width = w[3].elem_count();
        with_all_f32(&Self::with_weights(dy, w), |v| {
            let (dy, wv) = (&v[0][..], &v[1..]);
            // Each layer's packed [input's gradient; weight's; bias's], the second layer first.
            let (second, first) = match self.kind {
                Branch::Attention { batch, t, heads } => {
                    let attention = Attention::new(batch, t, heads, d);
                    let second =
                        with_f32(&kept[2], |y| linear_backward_rows(y, &wv[4], dy, d, false))?;
                    let dqkv = with_f32(&kept[1], |qkv| {
                        attention.backward_rows(qkv, &second[..n * d])
                    })?;
                    let first = with_f32(&kept[0], |a| {
                        linear_backward_rows(a, &wv[2], &dqkv, d, false)
                    })?;
                    (second, first)
                }
                Branch::Mlp => {
                    let second = with_f32(&kept[1], |h| {
                        linear_backward_rows(h, &wv[4], dy, width, true)
                    })?;
                    let first = with_f32(&kept[0], |m| {
                        linear_backward_rows(m, &wv[2], &second[..n * width], d, false)
                    })?;
                    (second, first)
                }
            };
            // The residual's gradient, dy, joins the norm's input gradient as it is written.
            let mut norm = with_f32(x, |x| {
                layer_norm_backward_rows(x, &wv[0], &first[..n * d], self.eps, Some(dy))
            })?;
            // Each packed gradient ends with the layer's weight, then its bias.
            let second_w = second.len() - w[4].elem_count() - d;
            let dt = self.dtype;
            let grads = vec![
                part(&norm, n * d, &[d], dt)?,
                part(&norm, n * d + d, &[d], dt)?,
                part(&first, n * d, w[2].dims(), dt)?,
                part(&first, n * d + w[2].elem_count(), &[width], dt)?,
                part(&second, second_w, w[4].dims(), dt)?,
                part(&second, second.len() - d, &[d], dt)?,
            ];
            norm.truncate(n * d);
            Ok((storage::tensor(norm, self.dtype, (n, d))?, grads))
        })?
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex, PoisonError};

    use candle_core::Var;

    use super::*;
    use crate::ops::fused;
    use crate::ops::tests::{random, rel_err};

    const EPS: f64 = 1e-5;

    /// The output, the input's gradient and the six weights' gradients of `sum(out · r)`.
    type Results = (Tensor, Tensor, Vec<Tensor>);

    fn through_branch(x: &Tensor, kind: Branch, ws: &[Tensor; 6], r: &Tensor) -> Results {
        let x = Var::from_tensor(x).unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let into = got.clone();
        let sink: GradSink = Box::new(move |g| {
            *into.lock().unwrap_or_else(PoisonError::into_inner) = g;
            Ok(())
        });
        let y = branch(x.as_tensor(), kind, ws.clone(), EPS, Some(sink)).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * r).unwrap();
        let store = loss.sum_all().unwrap().backward().unwrap();
        let dx = store.get(x.as_tensor()).unwrap().clone();
        let grads = got.lock().unwrap_or_else(PoisonError::into_inner).clone();
        (y, dx, grads)
    }

    /// The same step through the single fused ops and a residual add, the weights graph inputs.
    fn through_single_ops(x: &Tensor, kind: Branch, ws: &[Tensor; 6], r: &Tensor) -> Results {
        let x = Var::from_tensor(x).unwrap();
        let vars = ws.clone().map(|w| Var::from_tensor(&w).unwrap());
        let w = vars.each_ref().map(|v| v.as_tensor());
        let normed = fused::layer_norm(x.as_tensor(), w[0], w[1], EPS).unwrap();
        let mid = fused::linear(&normed, w[2], w[3]).unwrap();
        let y = match kind {
            Branch::Attention { batch, t, heads } => {
                let att = fused::causal_attention(&mid, batch, t, heads).unwrap();
                fused::linear(&att, w[4], w[5]).unwrap()
            }
            Branch::Mlp => fused::gelu_linear(&mid, w[4], w[5]).unwrap(),
        };
        let y = (x.as_tensor() + y).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * r).unwrap();
        let store = loss.sum_all().unwrap().backward().unwrap();
        let dx = store.get(x.as_tensor()).unwrap().clone();
        let grads = w.iter().map(|w| store.get(w).unwrap().clone()).collect();
        (y, dx, grads)
    }

    fn assert_close(name: &str, got: &Results, want: &Results, bound: f64) {
        let pairs = [
            (&got.0, &want.0, "output"),
            (&got.1, &want.1, "input gradient"),
        ];
        let weights = got
            .2
            .iter()
            .zip(&want.2)
            .map(|(g, w)| (g, w, "weight gradient"));
        assert_eq!(got.2.len(), 6, "{name}: six weight gradients");
        for (i, (g, w, what)) in pairs.into_iter().chain(weights).enumerate() {
            assert_eq!(g.dims(), w.dims(), "{name}: {what} {i}");
            let e = rel_err(g, w);
            assert!(
                e <= bound,
                "{name}: {what} {i} rel. error {e:e} > {bound:e}"
            );
        }
    }

    /// A branch's six weights: norm gain and bias, the first layer `d → hidden`, the second
    /// `second_in → d`.
    fn weights(d: usize, hidden: usize, second_in: usize) -> [Tensor; 6] {
        [
            random(&[d], 1.0, 3).affine(0.5, 1.0).unwrap(),
            random(&[d], 0.5, 4),
            random(&[d, hidden], 0.3, 5),
            random(&[hidden], 0.3, 6),
            random(&[second_in, d], 0.3, 7),
            random(&[d], 0.3, 8),
        ]
    }

    #[test]
    fn residual_steps_match_the_single_fused_ops() {
        // 300 rows: several parallel units. In f32 the step computes what the single ops and
        // the residual add do, in another order of additions at most; in bf16 it keeps its inner
        // gradients in f32, so it stays as near the f32 result as rounding its stored values
        // to bf16 allows.
        let (batch, t, heads, d) = (3, 100, 2, 16);
        let x = random(&[batch * t, d], 2.0, 1)
            .broadcast_add(&random(&[batch * t, 1], 3.0, 2))
            .unwrap();
        let r = random(&[batch * t, d], 1.0, 9);
        let attention = Branch::Attention { batch, t, heads };
        let kinds = [
            (attention, weights(d, 3 * d, d), "attention"),
            (Branch::Mlp, weights(d, 4 * d, 4 * d), "mlp"),
        ];
        for (kind, ws, name) in kinds {
            let want = through_single_ops(&x, kind, &ws, &r);
            assert_close(name, &through_branch(&x, kind, &ws, &r), &want, 1e-5);
            let half = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
            let (xh, wh) = (half(&x), ws.each_ref().map(half));
            let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let want = through_single_ops(&f32s(&xh), kind, &wh.each_ref().map(f32s), &r);
            let got = through_branch(&xh, kind, &wh, &r);
            assert_eq!((got.0.dtype(), got.1.dtype()), (DType::BF16, DType::BF16));
            assert_close(&format!("{name} bf16"), &got, &want, 1e-2);
        }
    }
}
