//! A residual step's two layers, in f32 rows: the first as several weights whose outputs sit
//! side by side (q | k | v, gate | up: one product per weight into its columns, no weight copied
//! together), the second after the step's activation and with the residual added. Each weight
//! may carry a low-rank adapter (LoRA: `scale·(x·A)·B` added to its output), and the base
//! weights may be frozen: then no gradient is computed for them, only for the adapters.
//!
//! Backward of one weight `y = x·W + b + s·(x·A)·B` for `dy`, with `t = s·dy·Bᵀ`:
//! dx = dy·Wᵀ + t·Aᵀ, dW = xᵀ·dy, db = Σ dy, dA = xᵀ·t, dB = (s·x·A)ᵀ·dy.

use std::borrow::Cow;

use super::linear::{
    activated, gelu_with_slope, linear_backward_rows, linear_rows, swiglu_backward,
};
use super::{column_sums, filled, for_ranges, matmul, Mat, MatMut, Values};
use crate::ops::dropout::Dropout;
use crate::ops::Activation;

/// An adapter's factors as the kernels read them.
pub(super) struct LowRank<'a> {
    /// `A`, `[i, r]`.
    pub a: Values<'a>,
    /// `B`, `[r, o]`.
    pub b: Values<'a>,
    /// The rank.
    pub r: usize,
    /// `alpha / r`.
    pub scale: f32,
    /// The dropout on its input (training only).
    pub dropout: Option<&'a Dropout>,
}

/// One weight of a layer: `w` `[i, o]`, its bias `[o]` and its adapter, when it has them.
pub(super) struct Part<'a> {
    /// The weight's values.
    pub w: Values<'a>,
    /// The bias's values.
    pub b: Option<&'a [f32]>,
    /// Its output width.
    pub o: usize,
    /// Its low-rank adapter.
    pub adapter: Option<LowRank<'a>>,
}

/// `values` × `s`, in place.
fn scale(values: &mut [f32], s: f32) {
    values.iter_mut().for_each(|v| *v *= s);
}

/// `s·(dropout(x)·A)`, `[n, r]`: the adapter's input side, scaled, its dropout mask drawn
/// (both passes use it).
fn low_rank_input(x: &[f32], i: usize, lr: &LowRank) -> Vec<f32> {
    match lr.dropout {
        Some(d) => low_rank_product(&d.dropped(x, i), i, lr),
        None => low_rank_product(x, i, lr),
    }
}

/// `s·(x·A)`, `[n, r]`, for an input already dropped.
fn low_rank_product(x: &[f32], i: usize, lr: &LowRank) -> Vec<f32> {
    let n = x.len() / i;
    // SAFETY: the n×r buffer is written whole by the product; x and A are other buffers.
    let mut xa = filled(n * lr.r, |out| unsafe {
        matmul(
            MatMut::new(out.offset(0), n, lr.r, lr.r),
            Mat::rows(x, i),
            Mat::of(lr.a, lr.r),
            false,
            true,
        )
    });
    scale(&mut xa, lr.scale);
    xa
}

/// `[x·w₁ + b₁ | x·w₂ + b₂ | …]` (`[N, Σo]`, each plus its adapter's term) for `x` rows of `i`,
/// in f32. One part without an adapter is `linear_rows`, to the bit.
pub(super) fn parts_rows(x: &[f32], i: usize, parts: &[Part]) -> Vec<f32> {
    let width: usize = parts.iter().map(|p| p.o).sum();
    let n = x.len() / i;
    // Every row starts as the biases (zero where a part has none); the products add to it.
    filled(n * width, |out| {
        super::for_units(n, width, |_, rows| {
            // SAFETY: `for_units` gives each call its own rows, inside the buffer.
            let dst = unsafe { out.uninit_rows(&rows, width) };
            for row in dst.chunks_exact_mut(width) {
                let mut cols = row.iter_mut();
                for p in parts {
                    for (j, d) in cols.by_ref().take(p.o).enumerate() {
                        d.write(p.b.map_or(0.0, |b| b[j]));
                    }
                }
            }
        });
        let mut at = 0;
        for p in parts {
            let xa = p.adapter.as_ref().map(|lr| low_rank_input(x, i, lr));
            // SAFETY: columns at..at+o of the n×width buffer, initialised above; x, w and the
            // adapter's buffers are other buffers.
            unsafe {
                let dst = || MatMut::new(out.offset(at), n, p.o, width);
                matmul(dst(), Mat::rows(x, i), Mat::of(p.w, p.o), true, true);
                if let (Some(lr), Some(xa)) = (&p.adapter, &xa) {
                    matmul(dst(), Mat::rows(xa, lr.r), Mat::of(lr.b, p.o), true, true);
                }
            }
            at += p.o;
        }
    })
}

/// The gradients of `parts_rows` at `x` (rows of `i`) for `dy` (`[N, Σo]`): dx, then each
/// part's trainable gradients in order: with `base`, `dw` and `db` (where it has a bias); with
/// an adapter, `dA` and `dB`. In f32.
pub(super) fn parts_backward_rows(
    x: &[f32],
    i: usize,
    parts: &[Part],
    dy: &[f32],
    base: bool,
) -> (Vec<f32>, Vec<Vec<Vec<f32>>>) {
    let width: usize = parts.iter().map(|p| p.o).sum();
    let n = x.len() / i;
    let mut at = 0;
    let dys: Vec<Mat> = parts
        .iter()
        .map(|p| {
            let view = Mat::new(dy[at..].as_ptr(), n, p.o, width);
            at += p.o;
            view
        })
        .collect();
    // t = s·dy·Bᵀ per adapted part, `[n, r]`.
    let ts: Vec<Option<Vec<f32>>> = parts
        .iter()
        .zip(&dys)
        .map(|(p, dyp)| {
            p.adapter.as_ref().map(|lr| {
                // SAFETY: the n×r buffer is written whole; dy and B are other buffers.
                let mut t = filled(n * lr.r, |out| unsafe {
                    matmul(
                        MatMut::new(out.offset(0), n, lr.r, lr.r),
                        *dyp,
                        Mat::of(lr.b, p.o).t(),
                        false,
                        true,
                    )
                });
                scale(&mut t, lr.scale);
                t
            })
        })
        .collect();
    // dx = Σ dyₚ·wₚᵀ + tₚ·Aₚᵀ, the parts in order.
    let dx = filled(n * i, |out| {
        for (k, ((p, dyp), t)) in parts.iter().zip(&dys).zip(&ts).enumerate() {
            // SAFETY: `out` holds n×i values; the first product writes every one, the others
            // add; dy, w, t and A are other buffers.
            unsafe {
                let dst = || MatMut::new(out.offset(0), n, i, i);
                matmul(dst(), *dyp, Mat::of(p.w, p.o).t(), k > 0, true);
                match (&p.adapter, t) {
                    (Some(lr), Some(t)) if lr.dropout.is_some() => {
                        add_masked_back(out.rows(&(0..n), i), t, lr, i);
                    }
                    (Some(lr), Some(t)) => matmul(
                        dst(),
                        Mat::rows(t, lr.r),
                        Mat::of(lr.a, lr.r).t(),
                        true,
                        true,
                    ),
                    _ => {}
                }
            }
        }
    });
    let mut biases = vec![0f32; width];
    if base && parts.iter().any(|p| p.b.is_some()) {
        column_sums(dy, width, &mut biases);
    }
    let product = |rows: usize, cols: usize, a: Mat, b: Mat| {
        // SAFETY: the rows×cols buffer is written whole by the product.
        filled(rows * cols, |out| unsafe {
            matmul(
                MatMut::new(out.offset(0), rows, cols, cols),
                a,
                b,
                false,
                true,
            )
        })
    };
    let mut at = 0;
    let grads = parts
        .iter()
        .zip(&dys)
        .zip(&ts)
        .map(|((p, dyp), t)| {
            let mut g = Vec::new();
            if base {
                g.push(product(i, p.o, Mat::rows(x, i).t(), *dyp));
                if p.b.is_some() {
                    g.push(biases[at..at + p.o].to_vec());
                }
            }
            if let (Some(lr), Some(t)) = (&p.adapter, t) {
                // The input the adapter saw: its mask drawn again under dropout.
                let dropped = lr.dropout.map(|d| d.dropped(x, i));
                let x = dropped.as_deref().unwrap_or(x);
                g.push(product(i, lr.r, Mat::rows(x, i).t(), Mat::rows(t, lr.r)));
                let xa = low_rank_product(x, i, lr);
                g.push(product(lr.r, p.o, Mat::rows(&xa, lr.r).t(), *dyp));
            }
            at += p.o;
            g
        })
        .collect();
    (dx, grads)
}

/// `dx += (t·Aᵀ) ⊙ mask`: the adapter's share of its input's gradient (rows of `i`) under
/// dropout, through the mask its forward drew (`[n, i]`, made again here).
fn add_masked_back(dx: &mut [f32], t: &[f32], lr: &LowRank, i: usize) {
    let n = dx.len() / i;
    // SAFETY: the n×i buffer is written whole by the product; t and A are other buffers.
    let mut back = filled(n * i, |out| unsafe {
        matmul(
            MatMut::new(out.offset(0), n, i, i),
            Mat::rows(t, lr.r),
            Mat::of(lr.a, lr.r).t(),
            false,
            true,
        )
    });
    if let Some(d) = lr.dropout {
        d.apply_rows(&mut back, i);
    }
    dx.iter_mut().zip(&back).for_each(|(d, b)| *d += b);
}

/// The second layer: `act(h)·w (+ b)` plus its adapter's term and `residual`, for `h` rows of
/// `cols`. Without an adapter `linear_rows` (the activation fused into the product).
pub(super) fn second_rows(
    h: &[f32],
    cols: usize,
    layer: &Part,
    act: Activation,
    residual: &[f32],
) -> Vec<f32> {
    let Some(lr) = &layer.adapter else {
        return linear_rows(h, layer.w, layer.b, layer.o, act, Some(residual));
    };
    let input = activated_input(h, cols, act);
    let i = act.product_width(cols);
    let mut out = linear_rows(
        &input,
        layer.w,
        layer.b,
        layer.o,
        Activation::None,
        Some(residual),
    );
    let xa = low_rank_input(&input, i, lr);
    let n = xa.len() / lr.r;
    // SAFETY: `out` is n×o; xa and B are other buffers.
    unsafe {
        matmul(
            MatMut::rows(&mut out, layer.o),
            Mat::rows(&xa, lr.r),
            Mat::of(lr.b, layer.o),
            true,
            true,
        )
    };
    debug_assert_eq!(out.len(), n * layer.o);
    out
}

/// `act(h)`, or `h` itself when there is no activation.
fn activated_input(h: &[f32], cols: usize, act: Activation) -> Cow<'_, [f32]> {
    match act {
        Activation::None => Cow::Borrowed(h),
        _ => Cow::Owned(activated(h, act, act.product_width(cols))),
    }
}

/// The gradients of `second_rows` for `dy`: the gradient of `h` (rows of `cols`), and the
/// layer's trainable gradients as `parts_backward_rows` orders them.
pub(super) fn second_backward_rows(
    h: &[f32],
    cols: usize,
    layer: &Part,
    act: Activation,
    dy: &[f32],
    base: bool,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let n = h.len() / cols;
    let i = act.product_width(cols);
    if base && layer.adapter.is_none() {
        // The activation's backward fused in.
        let (dh, dw, db) = linear_backward_rows(h, layer.w, dy, cols, act, layer.b.is_some());
        return (dh, [dw].into_iter().chain(db).collect());
    }
    let (input, slope) = match act {
        Activation::Gelu => {
            let (g, s) = gelu_with_slope(h);
            (Cow::Owned(g), Some(s))
        }
        _ => (activated_input(h, cols, act), None),
    };
    let (mut d_act, mut grads) =
        parts_backward_rows(&input, i, std::slice::from_ref(layer), dy, base);
    let dh = match act {
        Activation::None => d_act,
        Activation::Gelu => {
            if let Some(slope) = slope {
                let shared = super::Shared(d_act.as_mut_ptr());
                for_ranges(slope.len(), |r| {
                    // SAFETY: `for_ranges` gives each call its own range of d_act.
                    let dst = unsafe { shared.rows(&r, 1) };
                    dst.iter_mut().zip(&slope[r]).for_each(|(d, s)| *d *= s);
                });
            }
            d_act
        }
        Activation::SwiGlu => filled(n * cols, |out| swiglu_backward(h, &d_act, i, out)),
    };
    (dh, grads.pop().unwrap_or_default())
}
