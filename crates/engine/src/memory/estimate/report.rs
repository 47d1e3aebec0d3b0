//! What `gaccwb estimate` prints for this engine: the predicted ledger per phase, the
//! micro-batch table at a fixed effective batch and the verdict for a budget.

use serde::Serialize;

use super::{
    estimate, largest_micro_batch, micro_batch_table, model_states, Config, Estimate, Row,
};
use crate::memory::planner::{aligned, human_bytes, Verdict};
use crate::telemetry::{Categories, OffloadGrads};

/// What `gaccwb estimate` prints.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The preset's name.
    pub preset: String,
    /// The configuration estimated.
    pub config: Config,
    /// Trainable parameters.
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
            params: cfg.arch.param_count(),
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

    /// Model states per parameter, device and host, beside DeepSpeed's way of counting them.
    fn model_states_line(&self) -> String {
        let m = model_states(&self.config);
        let per = |b: u64| b as f64 / self.params.max(1) as f64;
        format!(
            "model states (weights, gradient buffer, optimizer state): {} on the device ({:.2} \
             bytes/parameter), {} in host memory ({:.2} bytes/parameter)\n\n",
            human_bytes(m.device),
            per(m.device),
            human_bytes(m.host),
            per(m.host),
        )
    }

    /// The report as the terminal shows it.
    pub fn render(&self) -> String {
        let c = &self.config;
        let a = &c.arch;
        let head = match a.tied {
            true => "head tied to the token embedding".to_string(),
            false => format!("untied head {} of them", a.hidden * a.vocab),
        };
        let mut out = format!(
            "{}: {} d_model={} layers={} heads={} seq_len={} vocab={} ({} parameters, {head})\n\
             B={} K={} {} offload {}; {}\n",
            self.preset,
            a.family,
            a.hidden,
            a.layers,
            a.heads,
            c.model.seq_len,
            a.vocab,
            self.params,
            c.micro_batch,
            c.accum_steps,
            c.dtype.name(),
            match (c.offload, c.offload_grads) {
                (false, _) => "off",
                (true, OffloadGrads::Device) => "on (gradients accumulate on the device)",
                (true, OffloadGrads::Host) => "on (gradients accumulate in host memory)",
            },
            if c.unified {
                "CPU: host and device are one memory"
            } else {
                "GPU: offloaded bytes live in host memory"
            },
        );
        if let Some(why) = &self.not_trainable_here {
            out += &format!("This shape cannot be trained here ({why}); the estimate is for this engine's stack (the reference stack is the usual one).\n");
        }
        out += "\n";
        let phases = self.estimate.phases();
        let mut rows = vec![["predicted", "forward", "backward", "optimizer", "step"]
            .map(String::from)
            .to_vec()];
        for (i, name) in Categories::NAMES.iter().enumerate().take(7) {
            let mut row = vec![name.to_string()];
            row.extend(phases.iter().map(|(_, cats)| human_bytes(cats.values()[i])));
            rows.push(row);
        }
        let mut total = vec!["total".to_string()];
        total.extend(
            phases
                .iter()
                .map(|(_, cats)| human_bytes(self.estimate.resident(cats))),
        );
        rows.push(total);
        out += &aligned(&rows, &[false, true, true, true, true]);
        out += &format!(
            "peak {} (allocator workspace and CUDA context not included)\n",
            human_bytes(self.peak)
        );
        out += &self.model_states_line();
        out += &format!("At effective batch {}:\n", self.effective_batch);
        let mut rows = vec![["B", "K", "activations", "grad transient", "peak"]
            .map(String::from)
            .to_vec()];
        rows.extend(self.table.iter().map(|r| {
            vec![
                r.micro_batch.to_string(),
                r.accum_steps.to_string(),
                human_bytes(r.activations),
                human_bytes(r.gradients_transient),
                human_bytes(r.peak),
            ]
        }));
        out += &aligned(&rows, &[true; 5]);
        out += "\n";
        out += &self.verdict.render(self.effective_batch);
        out
    }
}
