//! What `gaccwb estimate` reports for this engine: the predicted ledger per phase, the
//! micro-batch table at a fixed effective batch and the verdict for a budget (the command line
//! renders it).

use serde::Serialize;

use super::{estimate, largest_micro_batch, micro_batch_table, Config, Estimate, Row};
use crate::memory::verdict::Verdict;

/// What `gaccwb estimate` prints.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The preset's name.
    pub preset: String,
    /// The configuration estimated.
    pub config: Config,
    /// Trained parameters (the adapters' under LoRA).
    pub params: u64,
    /// The predicted ledger per phase.
    pub estimate: Estimate,
    /// The predicted peak.
    pub peak: u64,
    /// B·K, held fixed across the table.
    pub effective_batch: usize,
    /// Every split of the effective batch.
    pub table: Vec<Row>,
    /// The budget judged against, bytes.
    pub budget: u64,
    /// The largest micro-batch that fits the budget.
    pub largest_fitting: Option<Row>,
    /// Why this shape cannot be trained by this program (the estimate still holds for it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_trainable_here: Option<String>,
    /// What blocks, and what each lever reaches, for `budget`.
    pub verdict: Verdict,
}

impl Report {
    /// The report for `cfg` at effective batch `effective` against `budget` bytes.
    pub fn new(preset: &str, cfg: &Config, effective: usize, budget: u64) -> Report {
        let estimate = estimate(cfg);
        Report {
            preset: preset.to_string(),
            config: cfg.clone(),
            params: cfg.trained_params(),
            peak: estimate.peak(),
            estimate,
            effective_batch: effective,
            table: micro_batch_table(cfg, effective),
            budget,
            largest_fitting: largest_micro_batch(cfg, effective, budget),
            not_trainable_here: None,
            verdict: Verdict::new(cfg, effective, budget),
        }
    }
}
