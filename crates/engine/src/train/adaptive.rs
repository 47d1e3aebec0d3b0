//! Adaptive accumulation: let the measured critical batch choose K.
//!
//! Rule (at a window boundary, policy `noise-scale`): with r = smoothed B_simple (in sequences)
//! / micro-batch B, the K that would make B·K equal to the critical batch, double K when r has
//! been at or above 2K, or halve it when r has been at or below K/2, for `accum_patience`
//! consecutive measured windows — one step at a time, within [`accum_min`, `accum_max`], never
//! sooner than `accum_patience` windows after the last change of K (whoever made it).

use crate::control::AccumPolicy;
use crate::telemetry::StepEvent;

/// The policy's limits (`train.accum_min`, `accum_max`, `accum_patience`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Limits {
    /// The smallest K the policy chooses.
    pub min: usize,
    /// The largest K the policy chooses.
    pub max: usize,
    /// Windows the noise scale must stay on one side before K moves.
    pub patience: u64,
}

/// What the policy remembers between windows.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct AdaptiveK {
    /// K seen at the last window; a change (by anyone) restarts the count.
    last_k: usize,
    /// Windows since K last changed.
    since_change: u64,
    /// Consecutive measured windows asking for a larger / smaller K.
    above: u64,
    below: u64,
}

impl AdaptiveK {
    /// After a window: the K to switch to at this boundary, if any. The policy chooses the
    /// effective batch B·K; the memory guard chooses how it is split. So K is counted against
    /// `reference_b`, the micro-batch before the guard split it (else the one in force): a guard
    /// split, B halved and K doubled, is no change of K here and moves no limit. With `ranks`
    /// W, the effective batch is W·B·K, so the K that meets the critical batch is W× smaller.
    pub(crate) fn decide(
        &mut self,
        policy: AccumPolicy,
        limits: Limits,
        step: &StepEvent,
        reference_b: usize,
        ranks: usize,
    ) -> Option<usize> {
        let reference_b = reference_b.max(1);
        let k = (step.micro_batch * step.accum_steps / reference_b).max(1);
        if policy != AccumPolicy::NoiseScale || k != self.last_k {
            *self = AdaptiveK {
                last_k: k,
                ..AdaptiveK::default()
            };
            if policy != AccumPolicy::NoiseScale {
                return None;
            }
        }
        if k < limits.min || k > limits.max {
            return Some(k.clamp(limits.min, limits.max));
        }
        self.since_change += 1;
        // Windows without an estimate (overflow, no positive |G|² yet) neither count nor reset.
        let b_simple = step.noise.as_ref().and_then(|n| n.b_simple_seqs)?;
        let wanted = b_simple / (reference_b * ranks.max(1)) as f64;
        let up = wanted >= 2.0 * k as f64 && k * 2 <= limits.max;
        let down = wanted <= k as f64 / 2.0 && k / 2 >= limits.min;
        self.above = if up { self.above + 1 } else { 0 };
        self.below = if down { self.below + 1 } else { 0 };
        if self.since_change < limits.patience {
            return None;
        }
        if self.above >= limits.patience {
            Some(k * 2)
        } else if self.below >= limits.patience {
            Some(k / 2)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::NoiseEvent;

    fn step(k: usize, b_simple_seqs: Option<f64>) -> StepEvent {
        let noise = NoiseEvent {
            g2: 1.0,
            trace: 1.0,
            b_simple_tokens: None,
            b_simple_seqs,
            raw_g2: 1.0,
            raw_trace: 1.0,
            windows: 1,
        };
        StepEvent {
            step: 1,
            loss: 1.0,
            accum_steps: k,
            micro_batch: 4,
            tokens: 100,
            noise: Some(noise),
            ..StepEvent::default()
        }
    }

    const LIMITS: Limits = Limits {
        min: 2,
        max: 16,
        patience: 3,
    };

    #[test]
    fn k_doubles_after_patience_windows_above_and_not_sooner() {
        let mut p = AdaptiveK::default();
        // B_simple 40 sequences / B 4 = 10 ≥ 2·K(2).
        let policy = AccumPolicy::NoiseScale;
        assert_eq!(p.decide(policy, LIMITS, &step(2, Some(40.0)), 4, 1), None);
        assert_eq!(p.decide(policy, LIMITS, &step(2, Some(40.0)), 4, 1), None);
        assert_eq!(
            p.decide(policy, LIMITS, &step(2, Some(40.0)), 4, 1),
            Some(4)
        );
        // At K = 4 the count starts again.
        assert_eq!(p.decide(policy, LIMITS, &step(4, Some(40.0)), 4, 1), None);
        assert_eq!(p.decide(policy, LIMITS, &step(4, Some(40.0)), 4, 1), None);
        assert_eq!(
            p.decide(policy, LIMITS, &step(4, Some(40.0)), 4, 1),
            Some(8)
        );
        // 10 is within [K/2, 2K) for K = 8: stay.
        for _ in 0..5 {
            assert_eq!(p.decide(policy, LIMITS, &step(8, Some(40.0)), 4, 1), None);
        }
    }

    #[test]
    fn ranks_count_in_the_effective_batch() {
        // B_simple 40 sequences: one rank at B 4 wants K 10 (doubles from 2); five ranks at
        // B 4 want K 2 (stay); ten want K 1 (halve from 4).
        let policy = AccumPolicy::NoiseScale;
        let decide = |k, ranks| {
            let mut p = AdaptiveK::default();
            (0..3)
                .map(|_| p.decide(policy, LIMITS, &step(k, Some(40.0)), 4, ranks))
                .last()
                .flatten()
        };
        assert_eq!(decide(2, 1), Some(4));
        assert_eq!(decide(2, 5), None);
        assert_eq!(decide(4, 10), Some(2));
    }

    #[test]
    fn k_halves_within_the_limits_and_the_fixed_policy_does_nothing() {
        let mut p = AdaptiveK::default();
        let policy = AccumPolicy::NoiseScale;
        let low = |k| step(k, Some(4.0));
        assert_eq!(p.decide(policy, LIMITS, &low(8), 4, 1), None);
        assert_eq!(p.decide(policy, LIMITS, &low(8), 4, 1), None);
        assert_eq!(p.decide(policy, LIMITS, &low(8), 4, 1), Some(4));
        for _ in 0..3 {
            p.decide(policy, LIMITS, &low(4), 4, 1);
        }
        // Never below accum_min.
        for _ in 0..5 {
            assert_eq!(p.decide(policy, LIMITS, &low(2), 4, 1), None);
        }
        assert_eq!(p.decide(policy, LIMITS, &step(1, None), 4, 1), Some(2));
        let mut fixed = AdaptiveK::default();
        for _ in 0..5 {
            assert_eq!(
                fixed.decide(AccumPolicy::Fixed, LIMITS, &low(8), 4, 1),
                None
            );
        }
    }

    #[test]
    fn the_policy_is_a_timeline_control_and_its_keys_are_checked() {
        let e = crate::scenario::parse_control_arg("10:set_accum_policy=noise-scale").unwrap();
        assert_eq!(
            e.control,
            crate::control::Control::SetAccumPolicy {
                value: AccumPolicy::NoiseScale
            }
        );
        let mut s = crate::scenario::Scenario::default();
        s.set("train.accum_policy=noise-scale").unwrap();
        let err = s.set("train.accum_min=1").unwrap_err().to_string();
        assert!(err.contains("needs K ≥ 2"), "{err}");
        let err = s.set("train.accum_max=1").unwrap_err().to_string();
        assert!(err.contains("at least train.accum_min"), "{err}");
        let err = s.set("train.noise_ema=1.0").unwrap_err().to_string();
        assert!(err.contains("[0, 1)"), "{err}");
    }

    /// The guard split B=2,K=2 into B=1,K=4: the policy still sees K=2 at its reference B=2,
    /// at `accum_min`, so weak noise cannot shrink B·K below 4; strong noise doubles B·K.
    #[test]
    fn a_guard_split_is_no_change_of_k() {
        let mut p = AdaptiveK::default();
        let policy = AccumPolicy::NoiseScale;
        let split = |b_simple| StepEvent {
            micro_batch: 1,
            ..step(4, Some(b_simple))
        };
        for _ in 0..10 {
            assert_eq!(p.decide(policy, LIMITS, &split(0.5), 2, 1), None);
        }
        let mut p = AdaptiveK::default();
        let asked: Vec<_> = (0..3)
            .map(|_| p.decide(policy, LIMITS, &split(40.0), 2, 1))
            .collect();
        assert_eq!(asked, [None, None, Some(4)], "K=4 at B=2: B·K 8");
    }

    #[test]
    fn an_interrupted_streak_starts_over() {
        let mut p = AdaptiveK::default();
        let policy = AccumPolicy::NoiseScale;
        p.decide(policy, LIMITS, &step(2, Some(40.0)), 4, 1);
        p.decide(policy, LIMITS, &step(2, Some(40.0)), 4, 1);
        p.decide(policy, LIMITS, &step(2, Some(8.0)), 4, 1);
        assert_eq!(p.decide(policy, LIMITS, &step(2, Some(40.0)), 4, 1), None);
        assert_eq!(p.decide(policy, LIMITS, &step(2, Some(40.0)), 4, 1), None);
        assert_eq!(
            p.decide(policy, LIMITS, &step(2, Some(40.0)), 4, 1),
            Some(4)
        );
    }
}
