//! LoRA's dropout on an adapter's input (PEFT's `lora_dropout`): each element of `x` is kept
//! with probability `1 − p` and scaled by `1/(1 − p)` (inverted dropout), or zeroed.
//!
//! No mask is stored: an element's fate is a hash of the run's seed, the adapted layer, the
//! sample's index in the data stream, the token's position and the column, so the backward and
//! an activation-checkpointing recompute draw the same mask again, the same sample gets the same
//! mask however a window is cut into micro-batches or ranks, and a resumed run draws what the
//! uninterrupted one drew. Regenerating costs one hash per element in each pass; keeping would
//! cost a mask the size of the adapter's input per adapted layer.

use std::cell::Cell;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

/// The mask of one adapted layer in one forward.
#[derive(Clone, Debug)]
pub struct Dropout {
    /// The probability an element is zeroed, in `(0, 1)`.
    pub p: f32,
    /// The layer's key: the run's seed and the layer's name, mixed (`site_key`).
    pub key: u64,
    /// Each sample's index in the data stream, in the batch's order.
    pub samples: Arc<[u64]>,
    /// Tokens per sample: row `r` is token `r % tokens` of sample `samples[r / tokens]`.
    pub tokens: usize,
    /// Every element kept and none scaled (`force_keep_all`).
    all_ones: bool,
}

thread_local! {
    static KEEP_ALL: Cell<bool> = const { Cell::new(false) };
}

/// Masks made on this thread while the guard lives keep every element unscaled: the dropout
/// path's arithmetic with an all-ones mask, which tests hold to `p = 0`.
#[cfg(test)]
pub(crate) fn force_keep_all(on: bool) -> KeepAllGuard {
    KeepAllGuard {
        previous: KEEP_ALL.with(|c| c.replace(on)),
    }
}

/// Restores the thread's previous choice when dropped.
#[cfg(test)]
#[must_use = "the choice lasts only while the guard lives"]
pub(crate) struct KeepAllGuard {
    previous: bool,
}

#[cfg(test)]
impl Drop for KeepAllGuard {
    fn drop(&mut self) {
        KEEP_ALL.with(|c| c.set(self.previous));
    }
}

/// SplitMix64's finaliser: every input bit moves every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The key of the layer named `module` in a run seeded `seed` (FNV-1a of the name, mixed).
pub(crate) fn site_key(seed: u64, module: &str) -> u64 {
    let name = module.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    mix(mix(seed ^ GOLDEN) ^ name)
}

impl Dropout {
    /// The mask of the layer keyed `key` over rows of `tokens` positions of `samples`.
    pub fn new(p: f32, key: u64, samples: Arc<[u64]>, tokens: usize) -> Dropout {
        Dropout {
            p,
            key,
            samples,
            tokens,
            all_ones: KEEP_ALL.with(Cell::get),
        }
    }

    /// The value a kept element is multiplied by.
    pub fn kept_scale(&self) -> f32 {
        match self.all_ones {
            true => 1.0,
            false => 1.0 / (1.0 - self.p),
        }
    }

    /// The factor of each of `cols` elements of row `row`: 0 or `kept_scale`.
    fn row_factors(&self, row: usize, cols: usize, out: &mut [f32]) {
        let kept = self.kept_scale();
        if self.all_ones {
            out.fill(kept);
            return;
        }
        let tokens = self.tokens.max(1);
        let sample = self.samples.get(row / tokens).copied().unwrap_or(u64::MAX);
        let pos = (row % tokens) as u64;
        let row_key = mix(self.key ^ mix(sample.wrapping_add(GOLDEN) ^ mix(pos ^ !GOLDEN)));
        // 24 bits of the hash as a uniform draw in [0, 1): kept when at least p.
        let threshold = (f64::from(self.p) * f64::from(1u32 << 24)).ceil() as u64;
        for (c, f) in out.iter_mut().enumerate().take(cols) {
            let u = mix(row_key.wrapping_add((c as u64 + 1).wrapping_mul(GOLDEN))) >> 40;
            *f = if u >= threshold { kept } else { 0.0 };
        }
    }

    /// `values` (rows of `cols`, row 0 the batch's first) times the mask, in place.
    pub fn apply_rows(&self, values: &mut [f32], cols: usize) {
        let mut factors = vec![0f32; cols];
        for (r, row) in values.chunks_exact_mut(cols).enumerate() {
            self.row_factors(r, cols, &mut factors);
            row.iter_mut().zip(&factors).for_each(|(v, f)| *v *= f);
        }
    }

    /// A copy of `x` (rows of `cols`) with the mask applied.
    pub fn dropped(&self, x: &[f32], cols: usize) -> Vec<f32> {
        let mut out = x.to_vec();
        self.apply_rows(&mut out, cols);
        out
    }

    /// The mask `[rows, cols]` as a tensor of `dtype` on `device` (made on the host).
    pub fn mask(&self, rows: usize, cols: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let mut values = vec![0f32; rows * cols];
        for (r, row) in values.chunks_exact_mut(cols).enumerate() {
            self.row_factors(r, cols, row);
        }
        Tensor::from_vec(values, (rows, cols), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(p: f32, key: u64, samples: &[u64], tokens: usize, cols: usize) -> Vec<f32> {
        let d = Dropout::new(p, key, samples.into(), tokens);
        d.dropped(&vec![1.0; samples.len() * tokens * cols], cols)
    }

    #[test]
    fn a_mask_drops_about_p_and_keeps_the_mean() {
        for p in [0.1f32, 0.5, 0.9] {
            let v = draw(p, 7, &[0, 1, 2, 3], 64, 128);
            let dropped = v.iter().filter(|x| **x == 0.0).count() as f64 / v.len() as f64;
            let mean = v.iter().map(|x| f64::from(*x)).sum::<f64>() / v.len() as f64;
            assert!((dropped - f64::from(p)).abs() < 0.01, "p {p}: {dropped}");
            assert!((mean - 1.0).abs() < 0.03, "p {p}: mean {mean}");
        }
    }

    #[test]
    fn a_mask_follows_the_sample_not_its_place_in_the_batch() {
        let (tokens, cols) = (8, 16);
        let ab = draw(0.3, 5, &[10, 11], tokens, cols);
        let b = draw(0.3, 5, &[11], tokens, cols);
        assert_eq!(&ab[tokens * cols..], &b[..]);
        assert_ne!(&ab[..tokens * cols], &b[..], "another sample, another mask");
        let other_layer = draw(0.3, 6, &[11], tokens, cols);
        assert_ne!(b, other_layer, "another layer, another mask");
    }

    #[test]
    fn an_all_ones_mask_changes_nothing() {
        let _keep = force_keep_all(true);
        let x: Vec<f32> = (0..64).map(|i| i as f32 * 0.37 - 3.0).collect();
        assert_eq!(Dropout::new(0.5, 1, [3u64].into(), 4).dropped(&x, 16), x);
    }

    #[test]
    fn site_keys_differ_by_layer_and_seed() {
        let a = site_key(1, "model.layers.0.self_attn.q_proj");
        assert_ne!(a, site_key(1, "model.layers.0.self_attn.k_proj"));
        assert_ne!(a, site_key(2, "model.layers.0.self_attn.q_proj"));
        assert_eq!(a, site_key(1, "model.layers.0.self_attn.q_proj"));
    }
}
