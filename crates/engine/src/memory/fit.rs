//! Memory before allocation: does a configuration fit the memory this machine has free?
//!
//! The estimator's predicted step peak is set against a budget. On the CPU the budget is the
//! kernel's `MemAvailable` (what can be allocated without swapping); elsewhere it is unknown
//! here and the check passes (a CUDA allocation failure is an error Candle returns). A knob
//! change is checked by its growth: the running configuration already holds its memory.

use super::estimate::{estimate, Config};
use crate::scenario::ModelConfig;

/// Rough bytes beyond which the estimator's own integer arithmetic could overflow; no machine
/// comes near it, so such a configuration is refused before the estimator runs.
const ABSURD_BYTES: f64 = (1u64 << 60) as f64;

/// Bytes the kernel says can be allocated now (`/proc/meminfo` MemAvailable), if known.
pub(crate) fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A lower bound on the step's bytes in f64 (weights, AdamW moments, gradients, attention
/// scores), cheap and overflow-free.
fn rough_bytes(model: &ModelConfig, micro_batch: usize) -> f64 {
    let (d, layers) = (model.d_model as f64, model.layers as f64);
    let (b, seq, heads) = (micro_batch as f64, model.seq_len as f64, model.heads as f64);
    let params = 12.0 * d * d * layers;
    4.0 * (4.0 * params + b * heads * seq * seq * layers)
}

/// Why a configuration cannot run in the memory there is, with the estimator's figures.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum FitError {
    /// Beyond any machine, judged before the estimator runs.
    #[error("this configuration needs more than {limit_gib} GiB; no machine holds it")]
    Absurd {
        /// The bound it exceeds, in GiB.
        limit_gib: u64,
    },
    /// The step's estimated peak is over the memory available.
    #[error(
        "the estimated step peak is {:.1} GiB ({shape}) but only {:.1} GiB of memory is \
         available; lower train.micro_batch or model.seq_len, or train a smaller model \
         (model.d_model, model.layers, or a smaller --model; `gaccwb estimate` shows the figures)",
        gib_f(*peak),
        gib_f(*budget)
    )]
    Peak {
        /// Estimated peak bytes.
        peak: u64,
        /// Bytes available.
        budget: u64,
        /// The sizes that decide it.
        shape: Shape,
    },
    /// A change's growth over what is already held is more than the memory still available.
    #[error(
        "it would raise the estimated step peak from {:.1} GiB to {:.1} GiB ({shape}), \
         {:.1} GiB more than the {:.1} GiB still available",
        gib_f(*held),
        gib_f(*peak),
        gib_f(peak.saturating_sub(*held)),
        gib_f(*budget)
    )]
    Growth {
        /// Estimated peak bytes before the change.
        held: u64,
        /// Estimated peak bytes after it.
        peak: u64,
        /// Bytes still available.
        budget: u64,
        /// The sizes that decide it.
        shape: Shape,
    },
}

/// The sizes a memory verdict names, so the user knows which to lower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Model width.
    pub d_model: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Samples per micro-batch.
    pub micro_batch: usize,
    /// Tokens per sample.
    pub seq_len: usize,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "d_model {} × {} layers, micro-batch {} × seq_len {}",
            self.d_model, self.layers, self.micro_batch, self.seq_len
        )
    }
}

/// Why `cfg` cannot run in `budget` bytes, with the estimator's figures; `Ok` when it fits or
/// the budget is unknown.
pub fn check_fits(cfg: &Config, budget: Option<u64>) -> Result<(), FitError> {
    check_growth(None, cfg, budget)
}

/// `check_fits` for a change from `current` (already allocated) to `next`: only the growth
/// must fit in `budget`.
pub(crate) fn check_growth(
    current: Option<&Config>,
    next: &Config,
    budget: Option<u64>,
) -> Result<(), FitError> {
    if rough_bytes(&next.model, next.micro_batch) > ABSURD_BYTES {
        return Err(FitError::Absurd {
            limit_gib: gib(ABSURD_BYTES as u64),
        });
    }
    let Some(budget) = budget else {
        return Ok(());
    };
    let peak = estimate(next).peak();
    let held = current.map_or(0, |c| estimate(c).peak());
    if peak.saturating_sub(held) <= budget {
        return Ok(());
    }
    let m = &next.model;
    let shape = Shape {
        d_model: m.d_model,
        layers: m.layers,
        micro_batch: next.micro_batch,
        seq_len: m.seq_len,
    };
    Err(match current {
        None => FitError::Peak {
            peak,
            budget,
            shape,
        },
        Some(_) => FitError::Growth {
            held,
            peak,
            budget,
            shape,
        },
    })
}

fn gib(bytes: u64) -> u64 {
    bytes >> 30
}

fn gib_f(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;

    fn tiny() -> Config {
        let mut s = Scenario::default();
        s.model.d_model = 32;
        s.model.layers = 2;
        s.model.heads = 2;
        s.model.seq_len = 16;
        s.train.micro_batch = 4;
        Config::from_scenario(&s, true).unwrap()
    }

    #[test]
    fn reads_mem_available_from_meminfo() {
        let text = "MemTotal: 100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(text), Some(2 << 20));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn a_model_larger_than_the_budget_is_refused_with_figures() {
        let cfg = tiny();
        let peak = estimate(&cfg).peak();
        assert!(check_fits(&cfg, Some(peak)).is_ok());
        assert!(check_fits(&cfg, None).is_ok());
        let e = check_fits(&cfg, Some(peak / 2)).unwrap_err();
        assert!(matches!(e, FitError::Peak { .. }), "{e}");
        let e = e.to_string();
        assert!(e.contains("GiB") && e.contains("d_model 32"), "{e}");
    }

    #[test]
    fn absurd_models_are_refused_before_the_estimator_runs() {
        let mut cfg = tiny();
        cfg.model.d_model = 1 << 17;
        cfg.model.layers = 1 << 12;
        cfg.model.seq_len = 1 << 16;
        cfg.micro_batch = 1 << 16;
        let e = check_fits(&cfg, None).unwrap_err();
        assert!(e.to_string().contains("no machine"), "{e}");
    }

    #[test]
    fn a_knob_change_is_judged_by_its_growth() {
        let cfg = tiny();
        let mut bigger = cfg.clone();
        bigger.micro_batch *= 8;
        let growth = estimate(&bigger).peak() - estimate(&cfg).peak();
        assert!(check_growth(Some(&cfg), &bigger, Some(growth)).is_ok());
        let e = check_growth(Some(&cfg), &bigger, Some(growth - 1)).unwrap_err();
        assert!(e.to_string().contains("still available"), "{e}");
    }
}
