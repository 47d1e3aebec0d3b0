//! Dynamic loss scaling for f16, with PyTorch GradScaler's rules: start at 2^16, halve and skip
//! the step on a non-finite gradient, double after `growth_interval` consecutive clean steps.
//! The scale never backs off below `FLOOR`: gradients that still overflow there are not a
//! scaling problem, and after `FLOOR_PATIENCE` such windows in a row the run should end
//! (`exhausted`) instead of halving towards zero.

#[derive(Clone, Debug, PartialEq)]
/// The f16 loss scale and the counters that move it.
pub struct LossScaler {
    /// The factor the loss is multiplied by before backward.
    pub scale: f64,
    /// Clean steps in a row after which the scale doubles.
    pub growth_interval: u64,
    /// Consecutive clean steps since the last change of scale.
    pub clean_steps: u64,
    /// Consecutive overflows with the scale already at the floor.
    pub floor_overflows: u64,
}

impl LossScaler {
    /// The factor applied on overflow.
    pub const BACKOFF: f64 = 0.5;
    /// The factor applied after `growth_interval` clean steps.
    pub const GROWTH: f64 = 2.0;
    /// The smallest scale backing off reaches (1: no scaling at all).
    pub const FLOOR: f64 = 1.0;
    /// Overflows in a row at the floor that end the run.
    pub const FLOOR_PATIENCE: u64 = 3;

    /// A scaler starting at `scale`, growing after `growth_interval` clean steps.
    pub fn new(scale: f64, growth_interval: u64) -> Self {
        LossScaler {
            scale,
            growth_interval,
            clean_steps: 0,
            floor_overflows: 0,
        }
    }

    /// Update after a window whose unscaled gradient was finite (`true`) or overflowed (`false`).
    pub fn update(&mut self, finite: bool) {
        if finite {
            self.floor_overflows = 0;
            self.clean_steps += 1;
            if self.clean_steps >= self.growth_interval {
                self.scale *= Self::GROWTH;
                self.clean_steps = 0;
            }
        } else if self.scale <= Self::FLOOR {
            self.floor_overflows += 1;
            self.clean_steps = 0;
        } else {
            self.scale = (self.scale * Self::BACKOFF).max(Self::FLOOR);
            self.clean_steps = 0;
        }
    }

    /// True once the gradients overflowed `FLOOR_PATIENCE` windows in a row at the floor: the
    /// model itself produces non-finite gradients and no scale will help.
    pub fn exhausted(&self) -> bool {
        self.floor_overflows >= Self::FLOOR_PATIENCE
    }

    /// Why the run cannot go on, for the end event.
    pub fn exhausted_reason(&self) -> String {
        format!(
            "gradients overflowed {} windows in a row at the loss-scale floor ({}): they are \
             non-finite without any scaling (try bf16 or f32, a lower LR, or clipping)",
            self.floor_overflows,
            Self::FLOOR
        )
    }

    /// Force a scale (a demo of overflow); the growth count restarts.
    pub fn force(&mut self, scale: f64) {
        self.scale = scale;
        self.clean_steps = 0;
        self.floor_overflows = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_after_interval_and_backs_off_on_overflow() {
        let mut s = LossScaler::new(65536.0, 3);
        s.update(true);
        s.update(true);
        assert_eq!(s.scale, 65536.0);
        s.update(true);
        assert_eq!(s.scale, 131072.0);
        s.update(true);
        s.update(false);
        assert_eq!(s.scale, 65536.0);
        assert_eq!(s.clean_steps, 0);
    }

    #[test]
    fn backs_off_to_the_floor_and_is_exhausted_after_repeated_overflow_there() {
        let mut s = LossScaler::new(4.0, 2000);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale, LossScaler::FLOOR);
        assert!(!s.exhausted(), "reaching the floor is not yet a failure");
        for _ in 1..LossScaler::FLOOR_PATIENCE {
            s.update(false);
            assert!(!s.exhausted());
        }
        // A clean window at the floor resets the count.
        s.update(true);
        assert_eq!(s.floor_overflows, 0);
        for _ in 0..LossScaler::FLOOR_PATIENCE {
            s.update(false);
        }
        assert_eq!(s.scale, LossScaler::FLOOR, "never below the floor");
        assert!(s.exhausted());
        assert!(s.exhausted_reason().contains("loss-scale floor"));
    }
}
