//! Dynamic loss scaling for f16, with PyTorch GradScaler's rules: start at 2^16, halve and skip
//! the step on a non-finite gradient, double after `growth_interval` consecutive clean steps.

#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    pub scale: f64,
    pub growth_interval: u64,
    /// Consecutive clean steps since the last change of scale.
    pub clean_steps: u64,
}

impl LossScaler {
    pub const BACKOFF: f64 = 0.5;
    pub const GROWTH: f64 = 2.0;

    pub fn new(scale: f64, growth_interval: u64) -> Self {
        LossScaler {
            scale,
            growth_interval,
            clean_steps: 0,
        }
    }

    /// Update after a window whose unscaled gradient was finite (`true`) or overflowed (`false`).
    pub fn update(&mut self, finite: bool) {
        if finite {
            self.clean_steps += 1;
            if self.clean_steps >= self.growth_interval {
                self.scale *= Self::GROWTH;
                self.clean_steps = 0;
            }
        } else {
            self.scale *= Self::BACKOFF;
            self.clean_steps = 0;
        }
    }

    /// Force a scale (a demo of overflow); the growth count restarts.
    pub fn force(&mut self, scale: f64) {
        self.scale = scale;
        self.clean_steps = 0;
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
}
