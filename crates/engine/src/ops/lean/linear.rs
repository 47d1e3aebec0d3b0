//! `x·W + b` and the MLP's output layer `gelu(h)·W + b` as one node each. Candle's composite
//! `x.matmul(w) + b` keeps the product as a node of its own (the bias add's input), and the MLP
//! kept the GELU's output too; these keep their input only and recompute the GELU.

use candle_core::{DType, Result, Tensor};

use super::apply;

/// `x·w + b` for `x` `[N, I]`, `w` `[I, O]`, `b` `[O]`; the bias gradient summed in f32.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let y = affine(&x.detach(), &w.detach(), &b.detach())?;
    apply("lean-linear", &[x, w, b], y, Vec::new(), |i, _, g| {
        let (dx, dw, db) = affine_grads(&i[0], &i[1], &i[2], g)?;
        Ok(vec![Some(dx), Some(dw), Some(db)])
    })
}

/// `gelu(h)·w + b` (tanh GELU) keeping `h`: the backward makes the GELU and its slope again.
pub fn gelu_linear(h: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let y = affine(&h.detach().gelu()?, &w.detach(), &b.detach())?;
    apply("lean-gelu-linear", &[h, w, b], y, Vec::new(), |i, _, g| {
        let h = &i[0];
        let (da, dw, db) = affine_grads(&h.gelu()?, &i[1], &i[2], g)?;
        let slope = gelu_slope(h.to_dtype(DType::F32)?)?;
        let dh = (da.to_dtype(DType::F32)? * slope)?;
        Ok(vec![Some(dh.to_dtype(h.dtype())?), Some(dw), Some(db)])
    })
}

pub(super) fn affine(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.matmul(w)?.broadcast_add(b)
}

/// Gradients of `x·w + b` for the incoming `g`: `g·wᵀ`, `xᵀ·g` and `b`'s, summed over the rows
/// in f32 and rounded once to `b`'s dtype.
pub(super) fn affine_grads(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dx = g.matmul(&w.t()?)?;
    let dw = x.t()?.matmul(g)?;
    let db = g.to_dtype(DType::F32)?.sum(0)?.to_dtype(b.dtype())?;
    Ok((dx, dw, db))
}

/// d gelu(x)/dx for the tanh approximation: with u = x·(a + b·x²) (a = √(2/π), b = 0.044715·a),
/// 0.5·(1 + tanh u) + (1.5·u − a·x)·(1 − tanh² u), Candle's `Gelu` backward rearranged so that at
/// most four tensors of `x`'s size are live at once (each Candle op makes a new one).
pub(super) fn gelu_slope(x: Tensor) -> Result<Tensor> {
    const A: f64 = 0.797885;
    const B: f64 = 0.0356774;
    let sq = x.sqr()?;
    let u = sq.affine(B, A)?;
    drop(sq);
    let u = (u * &x)?;
    let ax = x.affine(A / 1.5, 0.0)?;
    drop(x);
    let outer = (&u - ax)?.affine(1.5, 0.0)?;
    let t = u.tanh()?;
    drop(u);
    let sech2 = t.sqr()?.affine(-1.0, 1.0)?;
    let product = (outer * sech2)?;
    product + t.affine(0.5, 0.5)?
}

/// `silu(gate)·up` of `h` `[N, 2·F]` = `[gate | up]`, in `h`'s dtype (computed in f32).
pub(super) fn swiglu(h: &Tensor) -> Result<Tensor> {
    let f = h.dim(1)? / 2;
    let h32 = h.to_dtype(DType::F32)?;
    let gate = h32.narrow(1, 0, f)?;
    (gate.silu()? * h32.narrow(1, f, f)?)?.to_dtype(h.dtype())
}

/// The gradient of `swiglu(h)` for `da` `[N, F]`: `[d gate | d up]` with `s = σ(gate)`,
/// d gate = da·up·s·(1 + gate·(1 − s)), d up = da·gate·s; in `h`'s dtype.
pub(super) fn swiglu_grad(h: &Tensor, da: &Tensor) -> Result<Tensor> {
    let f = h.dim(1)? / 2;
    let h32 = h.to_dtype(DType::F32)?;
    let (gate, up) = (h32.narrow(1, 0, f)?, h32.narrow(1, f, f)?);
    let da = da.to_dtype(DType::F32)?;
    let s = candle_nn::ops::sigmoid(&gate)?;
    let slope = (&s * (gate.broadcast_mul(&s.affine(-1.0, 1.0)?)? + 1.0)?)?;
    let dgate = ((&da * up)? * slope)?;
    let dup = ((da * gate)? * s)?;
    Tensor::cat(&[dgate, dup], 1)?.to_dtype(h.dtype())
}
