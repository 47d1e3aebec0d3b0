//! The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch
//! Training", App. A.1), measured for free from a window of K micro-batches.
//!
//! A window computes K micro-batch gradients g_k (each the mean over its own B_small counted
//! tokens) and their token-weighted sum, the window gradient G_big over B_big tokens, all at the
//! same weights: two batch sizes, which is what the unbiased estimator needs. With
//! |G_small|² = mean_k |g_k|² and E|g_B|² = |G|² + tr(Σ)/B:
//!
//! - `|G|² ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)`
//! - `tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)`
//! - `B_simple = tr(Σ) / |G|²`
//!
//! Single windows are noisy and can be negative, so the numerator and the denominator are
//! smoothed separately (EMA with bias correction) and the ratio of the smoothed values is
//! reported. The measurement only reads gradients that exist anyway: it never changes training.

use std::time::Instant;

use crate::telemetry::NoiseEvent;
use candle_core::{Result, Tensor};

/// One micro-batch's gradient, as the estimator sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MicroNorm {
    /// |g_k|² of the unscaled gradient of the micro-batch's mean loss over its counted tokens.
    pub sq_norm: f64,
    /// Counted tokens of the micro-batch.
    pub tokens: u64,
    /// Sequences of the micro-batch.
    pub seqs: usize,
}

/// The squared norms of one window: what the estimator needs, nothing more.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WindowNorms {
    /// Each micro-batch's squared gradient norm and size.
    pub micro: Vec<MicroNorm>,
    /// |G_big|² of the (correct) window gradient: the token-mean over the whole window.
    pub window_sq_norm: f64,
    /// Wall time spent computing these norms (the measurement's whole cost).
    pub cost_ms: f64,
}

/// Unbiased single-window estimates of |G|² and tr(Σ), with batch sizes in one unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Raw {
    /// Estimated squared norm of the true gradient, |G|².
    pub g2: f64,
    /// Estimated trace of the per-sample gradient covariance, tr(Σ).
    pub trace: f64,
}

/// The two-batch-size estimator. `None` when the two sizes coincide (K = 1).
pub(crate) fn estimate(small_sq: f64, b_small: f64, big_sq: f64, b_big: f64) -> Option<Raw> {
    if !(b_big > b_small && b_small > 0.0) {
        return None;
    }
    Some(Raw {
        g2: (b_big * big_sq - b_small * small_sq) / (b_big - b_small),
        trace: (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big),
    })
}

impl WindowNorms {
    /// Add a micro-batch from the gradient tensors as the window computed them:
    /// `grads = ∇(Σ token losses) × factor`, so g_k = grads / (factor · tokens).
    pub fn push(&mut self, grads: &[Tensor], factor: f64, tokens: u64, seqs: usize) -> Result<()> {
        let t = Instant::now();
        let norm = super::global_norm(grads)? / (factor * tokens.max(1) as f64);
        self.micro.push(MicroNorm {
            sq_norm: norm * norm,
            tokens,
            seqs,
        });
        self.cost_ms += t.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// Set |G_big|² from the window's accumulated gradient, which is `G_big × scale`.
    pub fn finish(&mut self, window: &[Tensor], scale: f64) -> Result<()> {
        let t = Instant::now();
        let norm = super::global_norm(window)? / scale;
        self.window_sq_norm = norm * norm;
        self.cost_ms += t.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// Every norm is finite and every micro-batch counted tokens (an overflowed fp16 window is not).
    pub fn usable(&self) -> bool {
        self.micro.len() >= 2
            && self.window_sq_norm.is_finite()
            && self
                .micro
                .iter()
                .all(|m| m.sq_norm.is_finite() && m.tokens > 0)
    }

    fn small_sq(&self) -> f64 {
        self.micro.iter().map(|m| m.sq_norm).sum::<f64>() / self.micro.len().max(1) as f64
    }

    /// Batch sizes measured in counted tokens (documents vary in length).
    pub fn estimate_tokens(&self) -> Option<Raw> {
        let total: u64 = self.micro.iter().map(|m| m.tokens).sum();
        let b_small = total as f64 / self.micro.len().max(1) as f64;
        estimate(self.small_sq(), b_small, self.window_sq_norm, total as f64)
    }

    /// Batch sizes measured in sequences (samples).
    pub fn estimate_seqs(&self) -> Option<Raw> {
        let total: usize = self.micro.iter().map(|m| m.seqs).sum();
        let b_small = total as f64 / self.micro.len().max(1) as f64;
        estimate(self.small_sq(), b_small, self.window_sq_norm, total as f64)
    }
}

/// Exponential moving average with bias correction (the first values are not pulled to 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Ema {
    beta: f64,
    sum: f64,
    weight: f64,
}

impl Ema {
    /// An empty average that forgets at rate `beta` per update.
    pub(crate) fn new(beta: f64) -> Ema {
        Ema {
            beta,
            sum: 0.0,
            weight: 0.0,
        }
    }

    /// Fold in one value.
    pub(crate) fn update(&mut self, x: f64) {
        self.sum = self.beta * self.sum + (1.0 - self.beta) * x;
        self.weight = self.beta * self.weight + (1.0 - self.beta);
    }

    /// The bias-corrected mean; `None` before the first value.
    pub(crate) fn value(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.sum / self.weight)
    }
}

/// Smooths the per-window estimates; lives with the trainer.
#[derive(Clone, Debug, PartialEq)]
pub struct NoiseTracker {
    g2_tokens: Ema,
    trace_tokens: Ema,
    g2_seqs: Ema,
    trace_seqs: Ema,
    windows: u64,
}

impl NoiseTracker {
    /// `beta` is `train.noise_ema`.
    pub fn new(beta: f64) -> NoiseTracker {
        NoiseTracker {
            g2_tokens: Ema::new(beta),
            trace_tokens: Ema::new(beta),
            g2_seqs: Ema::new(beta),
            trace_seqs: Ema::new(beta),
            windows: 0,
        }
    }

    /// Fold in a window; `None` for K = 1, for an overflowed (skipped) window, or when the window
    /// was not measured.
    pub fn observe(&mut self, norms: Option<&WindowNorms>, skipped: bool) -> Option<NoiseEvent> {
        let norms = norms.filter(|n| !skipped && n.usable())?;
        let tokens = norms.estimate_tokens()?;
        let seqs = norms.estimate_seqs()?;
        self.g2_tokens.update(tokens.g2);
        self.trace_tokens.update(tokens.trace);
        self.g2_seqs.update(seqs.g2);
        self.trace_seqs.update(seqs.trace);
        self.windows += 1;
        Some(NoiseEvent {
            g2: self.g2_tokens.value()?,
            trace: self.trace_tokens.value()?,
            b_simple_tokens: ratio(&self.trace_tokens, &self.g2_tokens),
            b_simple_seqs: ratio(&self.trace_seqs, &self.g2_seqs),
            raw_g2: tokens.g2,
            raw_trace: tokens.trace,
            windows: self.windows,
        })
    }
}

/// Smoothed numerator over smoothed denominator, when both are positive.
fn ratio(trace: &Ema, g2: &Ema) -> Option<f64> {
    let (t, g) = (trace.value()?, g2.value()?);
    (g > 0.0 && t > 0.0).then_some(t / g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn gaussian(rng: &mut ChaCha8Rng) -> f64 {
        // Box–Muller.
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    fn sq(v: &[f64]) -> f64 {
        v.iter().map(|x| x * x).sum()
    }

    /// Gradients known exactly: each sample's gradient is G + ε with ε ~ N(0, diag(σ²)), so
    /// tr(Σ) = Σσ² and |G|² are known. Windows of K micro-batches of B samples, the micro-batch
    /// gradient the mean of its samples, the window gradient the mean of the micro-batches.
    #[test]
    fn the_smoothed_estimate_recovers_a_known_noise_scale() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let dim = 50;
        let g: Vec<f64> = (0..dim).map(|i| 0.2 + 0.01 * i as f64).collect();
        let sigma: Vec<f64> = (0..dim).map(|i| 0.5 + 0.02 * i as f64).collect();
        let true_b = sq(&sigma) / sq(&g);
        let (k, b) = (8usize, 4usize);
        let mut tracker = NoiseTracker::new(0.99);
        let mut last = None;
        for _ in 0..2000 {
            let mut norms = WindowNorms::default();
            let mut window = vec![0.0; dim];
            for _ in 0..k {
                let mut micro = vec![0.0; dim];
                for _ in 0..b {
                    for d in 0..dim {
                        micro[d] += (g[d] + sigma[d] * gaussian(&mut rng)) / b as f64;
                    }
                }
                for d in 0..dim {
                    window[d] += micro[d] / k as f64;
                }
                norms.micro.push(MicroNorm {
                    sq_norm: sq(&micro),
                    tokens: b as u64,
                    seqs: b,
                });
            }
            norms.window_sq_norm = sq(&window);
            last = tracker.observe(Some(&norms), false);
        }
        let e = last.expect("every window is usable");
        let b_simple = e.b_simple_seqs.unwrap();
        let rel = (b_simple - true_b).abs() / true_b;
        println!("true B_simple {true_b:.3}, smoothed estimate {b_simple:.3} ({rel:.1e} relative)");
        assert!(rel < 0.10, "estimate {b_simple} vs true {true_b}");
        assert!((e.g2 - sq(&g)).abs() / sq(&g) < 0.10);
        assert!((e.trace - sq(&sigma)).abs() / sq(&sigma) < 0.10);
    }

    #[test]
    fn one_micro_batch_or_an_overflow_gives_no_estimate() {
        let micro = MicroNorm {
            sq_norm: 2.0,
            tokens: 10,
            seqs: 2,
        };
        let mut tracker = NoiseTracker::new(0.9);
        let single = WindowNorms {
            micro: vec![micro],
            window_sq_norm: 2.0,
            cost_ms: 0.0,
        };
        assert_eq!(tracker.observe(Some(&single), false), None);
        let overflowed = WindowNorms {
            micro: vec![micro, micro],
            window_sq_norm: f64::INFINITY,
            cost_ms: 0.0,
        };
        assert_eq!(tracker.observe(Some(&overflowed), false), None);
        let fine = WindowNorms {
            window_sq_norm: 1.5,
            ..overflowed
        };
        assert_eq!(tracker.observe(Some(&fine), true), None);
        assert_eq!(tracker.observe(None, false), None);
        assert_eq!(tracker.observe(Some(&fine), false).unwrap().windows, 1);
    }

    #[test]
    fn the_estimator_matches_the_formulas() {
        // |G|² = 1, tr(Σ) = 8: E|g_B|² = 1 + 8/B at B = 2 and B = 8.
        let raw = estimate(5.0, 2.0, 2.0, 8.0).unwrap();
        assert!((raw.g2 - 1.0).abs() < 1e-12 && (raw.trace - 8.0).abs() < 1e-12);
        assert_eq!(estimate(5.0, 2.0, 5.0, 2.0), None);
    }

    #[test]
    fn the_ema_is_bias_corrected() {
        let mut e = Ema::new(0.95);
        assert_eq!(e.value(), None);
        e.update(4.0);
        assert!((e.value().unwrap() - 4.0).abs() < 1e-12);
        e.update(4.0);
        assert!((e.value().unwrap() - 4.0).abs() < 1e-12);
    }
}
