//! Learning rate: linear warm-up, then cosine decay to `min_ratio` × peak, times the LR rule's
//! factor for the current effective batch.

use std::f64::consts::PI;

/// Schedule multiplier (0..=1) after `step` applied optimizer steps.
pub(crate) fn schedule(step: u64, warmup: u64, decay_steps: u64, min_ratio: f64) -> f64 {
    if step < warmup {
        return (step + 1) as f64 / warmup as f64;
    }
    if decay_steps <= warmup {
        return 1.0;
    }
    let progress = ((step - warmup) as f64 / (decay_steps - warmup) as f64).min(1.0);
    min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + (PI * progress).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_then_decays_to_the_floor() {
        assert_eq!(schedule(0, 10, 100, 0.1), 0.1);
        assert_eq!(schedule(9, 10, 100, 0.1), 1.0);
        assert_eq!(schedule(10, 10, 100, 0.1), 1.0);
        assert!((schedule(55, 10, 100, 0.1) - 0.55).abs() < 1e-12);
        assert!((schedule(100, 10, 100, 0.1) - 0.1).abs() < 1e-12);
        assert!((schedule(500, 10, 100, 0.1) - 0.1).abs() < 1e-12);
        assert_eq!(schedule(500, 10, 0, 0.1), 1.0);
    }
}
