//! Rotary position embeddings as Hugging Face computes them (`modeling_rope_utils.py`,
//! `modeling_llama.py`): inverse frequencies `1 / θ^(2j/hd)` in f32, optionally rescaled by
//! Llama 3's rule, angles `position · inv_freq` in f32, and the half-split rotation
//! `q·cos + rotate_half(q)·sin` with `rotate_half(x) = (−x₂, x₁)`: element `j` of the first half
//! pairs with element `j + hd/2`, both turned by the same angle (`emb = cat(freqs, freqs)`).
//!
//! The table is built once per sequence length and shared by every layer; the ops read it as
//! `[T, hd/2]` cosines and sines in f32.

use std::sync::{Arc, Mutex, PoisonError};

/// Llama 3's frequency rescaling (`rope_scaling.rope_type = "llama3"`): wavelengths shorter
/// than `original / high_freq_factor` keep their frequency, those longer than
/// `original / low_freq_factor` divide it by `factor`, those between interpolate smoothly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    /// How much longer the new context is.
    pub factor: f64,
    /// The low-frequency edge (`low_freq_factor`).
    pub low_freq_factor: f64,
    /// The high-frequency edge (`high_freq_factor`).
    pub high_freq_factor: f64,
    /// The context the model was first trained on (`original_max_position_embeddings`).
    pub original_max_positions: f64,
}

/// A model's rotary embedding: its base, head width and scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// The base θ (`rope_theta`).
    pub theta: f64,
    /// The width rotated: the head's.
    pub head_dim: usize,
    /// Llama 3's rescaling, when the config asks for it.
    pub scaling: Option<Llama3Scaling>,
}

/// Cosines and sines for positions `0..t`, `[t, head_dim/2]` each, in f32.
#[derive(Debug)]
pub struct RopeTable {
    /// Positions covered.
    pub t: usize,
    /// Half the head width: the number of angles per position.
    pub half: usize,
    /// `cos(position · inv_freq[j])`, row-major `[t, half]`.
    pub cos: Vec<f32>,
    /// `sin(position · inv_freq[j])`, row-major `[t, half]`.
    pub sin: Vec<f32>,
}

impl Rope {
    /// The inverse frequencies, `head_dim / 2` of them, scaled when the config says so; f32
    /// arithmetic as transformers does it.
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.head_dim as f32;
        let base = self.theta as f32;
        let plain = (0..self.head_dim / 2).map(|j| 1.0 / base.powf((2 * j) as f32 / dim));
        match self.scaling {
            None => plain.collect(),
            Some(s) => plain.map(|f| s.rescale(f)).collect(),
        }
    }

    /// The table for positions `0..t`.
    pub fn table(&self, t: usize) -> RopeTable {
        let inv = self.inv_freq();
        let half = inv.len();
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for p in 0..t {
            for &f in &inv {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeTable { t, half, cos, sin }
    }
}

impl Llama3Scaling {
    /// One inverse frequency after Llama 3's rule (`_compute_llama3_parameters`).
    fn rescale(&self, inv_freq: f32) -> f32 {
        let factor = self.factor as f32;
        let (low, high) = (self.low_freq_factor as f32, self.high_freq_factor as f32);
        let original = self.original_max_positions as f32;
        let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
        if wavelen < original / high {
            inv_freq
        } else if wavelen > original / low {
            inv_freq / factor
        } else {
            let smooth = (original / wavelen - low) / (high - low);
            (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
        }
    }
}

/// The tables a model made so far, by length: built once per length, shared by every layer and
/// micro-batch.
#[derive(Default, Debug)]
pub(crate) struct RopeCache {
    tables: Mutex<Vec<Arc<RopeTable>>>,
}

impl RopeCache {
    /// `rope`'s table for `t` positions.
    pub(crate) fn table(&self, rope: &Rope, t: usize) -> Arc<RopeTable> {
        let mut tables = self.tables.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = tables.iter().find(|table| table.t == t) {
            return found.clone();
        }
        let made = Arc::new(rope.table(t));
        tables.push(made.clone());
        made
    }
}

impl RopeTable {
    /// Row `p` of `x` (`half·2` values, the head at position `p`) turned by its angles into
    /// `out`; `inverse` turns the other way (the backward of the rotation is its transpose).
    #[inline(always)]
    pub fn rotate(&self, p: usize, x: &[f32], out: &mut [f32], inverse: bool) {
        let h = self.half;
        let (cos, sin) = (&self.cos[p * h..(p + 1) * h], &self.sin[p * h..(p + 1) * h]);
        let (x1, x2) = x.split_at(h);
        let (o1, o2) = out.split_at_mut(h);
        let s = if inverse { -1.0 } else { 1.0 };
        for j in 0..h {
            let (c, sn) = (cos[j], s * sin[j]);
            o1[j] = x1[j] * c - x2[j] * sn;
            o2[j] = x2[j] * c + x1[j] * sn;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama3() -> Rope {
        Rope {
            theta: 10_000.0,
            head_dim: 16,
            scaling: Some(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 64.0,
            }),
        }
    }

    #[test]
    fn llama3_scaling_keeps_short_divides_long_and_blends_between() {
        let scaled = llama3().inv_freq();
        let plain = Rope {
            scaling: None,
            ..llama3()
        }
        .inv_freq();
        let wavelen = |f: f32| 2.0 * std::f32::consts::PI / f;
        let (mut kept, mut divided, mut blended) = (0, 0, 0);
        for (&s, &p) in scaled.iter().zip(&plain) {
            if wavelen(p) < 16.0 {
                assert_eq!(s, p);
                kept += 1;
            } else if wavelen(p) > 64.0 {
                assert!((s - p / 8.0).abs() <= 1e-7 * p);
                divided += 1;
            } else {
                assert!(s < p && s > p / 8.0);
                blended += 1;
            }
        }
        assert!(kept > 0 && divided > 0 && blended > 0);
    }

    #[test]
    fn rotation_and_its_inverse_compose_to_identity() {
        let table = llama3().table(5);
        let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 2.0).collect();
        let (mut y, mut back) = (vec![0.0; 16], vec![0.0; 16]);
        table.rotate(4, &x, &mut y, false);
        table.rotate(4, &y, &mut back, true);
        assert_ne!(x, y);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() < 1e-5);
        }
        // Position 0 turns nothing.
        table.rotate(0, &x, &mut y, false);
        assert_eq!(x, y);
    }
}
