//! Perplexity as transformers reports it with `labels = input_ids`: a text's token ids cut into
//! consecutive, non-overlapping windows of `T` tokens (a last, shorter window of at least two
//! tokens counts too), each window predicting its tokens 2..len from the ones before. The mean
//! NLL is over predicted tokens (`len − 1` per window), accumulated in f64.

use candle_core::{DType, Device, Result, Tensor};
use serde::Serialize;

use super::Gpt;

/// A text's mean negative log-likelihood per predicted token, and their count.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Perplexity {
    /// Predicted tokens.
    pub tokens: u64,
    /// Mean NLL per predicted token, in nats.
    pub nll: f64,
    /// `exp(nll)`.
    pub ppl: f64,
}

/// The perplexity of `model` on `ids` in windows of `seq_len` tokens, `batch` windows per
/// forward, computed in `dtype` (the loss in f32).
pub fn perplexity(
    model: &Gpt,
    ids: &[u32],
    seq_len: usize,
    batch: usize,
    dtype: DType,
    device: &Device,
) -> Result<Perplexity> {
    if seq_len < 2 {
        candle_core::bail!("perplexity needs windows of at least 2 tokens, got {seq_len}");
    }
    let windows: Vec<&[u32]> = ids.chunks(seq_len).filter(|w| w.len() >= 2).collect();
    let (mut total, mut tokens) = (0f64, 0u64);
    let full: Vec<&[u32]> = windows
        .iter()
        .filter(|w| w.len() == seq_len)
        .copied()
        .collect();
    let short = windows.iter().find(|w| w.len() < seq_len).copied();
    for group in full.chunks(batch.max(1)) {
        total += window_nll(model, group, dtype, device)?;
        tokens += group.iter().map(|w| w.len() as u64 - 1).sum::<u64>();
    }
    if let Some(last) = short {
        total += window_nll(model, &[last], dtype, device)?;
        tokens += last.len() as u64 - 1;
    }
    if tokens == 0 {
        candle_core::bail!("the text has fewer than 2 tokens: nothing to predict");
    }
    let nll = total / tokens as f64;
    Ok(Perplexity {
        tokens,
        nll,
        ppl: nll.exp(),
    })
}

/// The summed NLL of windows of one length: each predicts its tokens 2..len from the ones
/// before (its last token is never an input).
fn window_nll(model: &Gpt, windows: &[&[u32]], dtype: DType, device: &Device) -> Result<f64> {
    let len = windows[0].len();
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for w in windows {
        inputs.extend_from_slice(&w[..len - 1]);
        targets.extend_from_slice(&w[1..]);
    }
    let n = targets.len();
    let inputs = Tensor::from_vec(inputs, (windows.len(), len - 1), device)?;
    let targets = Tensor::from_vec(targets, n, device)?;
    let mask = Tensor::ones(n, DType::F32, device)?;
    let forward = model.forward(&inputs, dtype, false)?;
    let sum = forward.nll_sum(&targets, &mask)?;
    Ok(f64::from(sum.to_dtype(DType::F32)?.to_scalar::<f32>()?))
}
