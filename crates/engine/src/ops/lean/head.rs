//! The LM head and the token NLL as one op, `Σ mask·−log softmax(x·W)[target]`, that never
//! holds the `[N, V]` logits: rows go through in chunks of `chunk_rows(V)`, each chunk's logits
//! made, reduced to its rows' losses and dropped.
//! The backward makes each chunk's logits again and turns them into
//! `dlogits = g·mask·(softmax − onehot)`: one chunk of logits exists at a time, forward or
//! backward. Softmax and sums run in f32; the products in the compute dtype.

use candle_core::{DType, Result, Tensor, D};

use super::apply;
use crate::ops::WeightLayout;

/// Logits one chunk holds: 2M floats (8 MiB), 256 rows at V = 8192: the rule the CPU's fused
/// head chunked by before it cut the vocabulary too. Measured there on `text-bpe` at two
/// threads (docs/TOKENIZER.md): 64, 256 and 1024 rows ran at the same speed within noise, 16
/// rows 35% slower; 1024 rows added 21 MiB to the peak.
const CHUNK_ELEMENTS: usize = 1 << 21;

/// Rows per chunk at vocabulary `v`: at least 128, since each chunk's products read all of W
/// again (a huge vocabulary's W is tens of MB) and dW is read and written once per chunk.
pub fn chunk_rows(v: usize) -> usize {
    (CHUNK_ELEMENTS / v.max(1)).max(128)
}

/// Sum over counted rows of `−log softmax(x·w)[target]` (f32 scalar): `x` `[N, D]`, `w`
/// `[D, V]` (or `[V, D]` with `WeightLayout::OutIn`, a tied head), `targets` `[N]` u32, `mask`
/// `[N]` f32. Gradients flow to `x` and `w`.
pub fn linear_nll_sum(
    x: &Tensor,
    w: &Tensor,
    layout: WeightLayout,
    targets: &Tensor,
    mask: &Tensor,
) -> Result<Tensor> {
    let (n, d) = x.dims2()?;
    // The `[D, V]` matrix the logits multiply by: a view of a tied head's `[V, D]`.
    let as_in_out = move |w: &Tensor| match layout {
        WeightLayout::InOut => Ok(w.clone()),
        WeightLayout::OutIn => w.t(),
    };
    let (wd, v) = as_in_out(w)?.dims2()?;
    if n == 0 || wd != d || targets.dims1()? != n || mask.dims1()? != n {
        candle_core::bail!(
            "linear nll: x {:?}, w {:?}, targets {:?}, mask {:?}",
            x.dims(),
            w.dims(),
            targets.dims(),
            mask.dims()
        );
    }
    let labels = Labels {
        targets: targets.detach(),
        mask: mask.detach().to_dtype(DType::F32)?,
        rows: chunk_rows(v),
        n,
    };
    let (xd, wd) = (x.detach(), as_in_out(&w.detach())?);
    // A frozen head (LoRA) takes part in no graph: its gradient is never computed.
    let weight_grad = w.track_op();
    let mut total = Tensor::zeros((), DType::F32, x.device())?;
    for (start, len) in labels.chunks() {
        let logits = xd
            .narrow(0, start, len)?
            .matmul(&wd)?
            .to_dtype(DType::F32)?;
        let lse = logits.log_sum_exp(D::Minus1)?;
        let picked = logits
            .gather(&labels.targets.narrow(0, start, len)?.unsqueeze(1)?, 1)?
            .squeeze(1)?;
        let rows = ((lse - picked)? * labels.mask.narrow(0, start, len)?)?;
        total = (total + rows.sum_all()?)?;
    }
    apply(
        "lean-linear-nll",
        &[x, w],
        total,
        Vec::new(),
        move |i, _, g| {
            let (x, w) = (&i[0], &as_in_out(&i[1])?);
            let vocab = Tensor::arange(0u32, v as u32, x.device())?.unsqueeze(0)?;
            let mut dx = Vec::new();
            let mut dw: Option<Tensor> = None;
            for (start, len) in labels.chunks() {
                let xc = x.narrow(0, start, len)?;
                let logits = xc.matmul(w)?.to_dtype(DType::F32)?;
                let softmax = candle_nn::ops::softmax_last_dim(&logits)?;
                drop(logits);
                let targets = labels.targets.narrow(0, start, len)?.unsqueeze(1)?;
                let onehot = targets.broadcast_eq(&vocab)?.to_dtype(DType::F32)?;
                let weight = labels
                    .mask
                    .narrow(0, start, len)?
                    .broadcast_mul(g)?
                    .unsqueeze(1)?;
                let dlogits = (softmax - onehot)?
                    .broadcast_mul(&weight)?
                    .to_dtype(x.dtype())?;
                dx.push(dlogits.matmul(&w.t()?)?);
                if weight_grad {
                    let part = xc.t()?.matmul(&dlogits)?.to_dtype(DType::F32)?;
                    dw = Some(match dw {
                        None => part,
                        Some(sum) => (sum + part)?,
                    });
                }
            }
            let dw = match (dw, weight_grad) {
                (_, false) => None,
                (Some(dw), true) => Some(dw.to_dtype(w.dtype())?),
                (None, true) => Some(w.zeros_like()?),
            };
            let dw = match (dw, layout) {
                (Some(dw), WeightLayout::OutIn) => Some(dw.t()?.contiguous()?),
                (dw, _) => dw,
            };
            Ok(vec![Some(Tensor::cat(&dx, 0)?), dw])
        },
    )
}

/// The batch's targets and mask, which ride in the op (no gradient), and the chunking.
struct Labels {
    targets: Tensor,
    mask: Tensor,
    rows: usize,
    n: usize,
}

impl Labels {
    /// `(first row, rows)` of each chunk, in order.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.n)
            .step_by(self.rows)
            .map(|s| (s, self.rows.min(self.n - s)))
    }
}
