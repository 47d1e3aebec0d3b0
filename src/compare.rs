//! `gaccwb compare`: the same preset under several configurations, one after another from the
//! same seed on the same samples, side by side in one table.
//!
//! A grid spec lists configurations separated by `;`, each a comma-separated list of items:
//! `B=4` (micro-batch), `K=8` (accumulation steps), `offload`, `f32` / `bf16` / `f16`, `ckpt`
//! (checkpointing every block) or `ckpt=every-2`, or any `section.key=value` that `--set` takes.

use std::fmt;

use candle_core::Device;
use serde::Serialize;

use crate::memory::{step_figures, StepFigure};
use crate::scenario::{nearest, Scenario};
use crate::telemetry::Categories;
use crate::train::Trainer;

/// The short items a grid entry accepts (besides `section.key=value`).
const SHORT_KEYS: &[&str] = &["B", "K", "offload", "f32", "bf16", "f16", "ckpt"];

/// A bad grid spec: which entry, where in the spec, and why.
#[derive(Debug)]
pub struct GridError {
    /// 1-based entry number.
    pub entry: usize,
    /// 1-based character column of the bad item in the spec.
    pub column: usize,
    pub message: String,
}

impl fmt::Display for GridError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "--grid entry {} (column {}): {}",
            self.entry, self.column, self.message
        )
    }
}

impl std::error::Error for GridError {}

/// One configuration of the grid: its label (the entry as written) and its scenario.
pub struct Config {
    pub label: String,
    pub scenario: Scenario,
}

/// The grid's configurations applied to `base`.
pub fn parse_grid(spec: &str, base: &Scenario) -> Result<Vec<Config>, GridError> {
    let mut configs = Vec::new();
    let mut offset = 0;
    for (i, entry) in spec.split(';').enumerate() {
        let mut scenario = base.clone();
        let mut item_offset = offset;
        for raw in entry.split(',') {
            let column = item_offset + raw.len() - raw.trim_start().len() + 1;
            item_offset += raw.len() + 1;
            let item = raw.trim();
            if item.is_empty() {
                continue;
            }
            let fail = |message: String| GridError {
                entry: i + 1,
                column,
                message,
            };
            let assignment = assignment(item).map_err(fail)?;
            scenario.set(&assignment).map_err(|e| fail(e.to_string()))?;
        }
        scenario.validate().map_err(|e| GridError {
            entry: i + 1,
            column: offset + 1,
            message: e.to_string(),
        })?;
        let label = entry.trim().to_string();
        if !label.is_empty() {
            configs.push(Config { label, scenario });
        }
        offset += entry.len() + 1;
    }
    if configs.is_empty() {
        return Err(GridError {
            entry: 1,
            column: 1,
            message: "no configuration; e.g. \"B=32,K=1; B=4,K=8\"".into(),
        });
    }
    Ok(configs)
}

/// The `--set` assignment a grid item stands for.
fn assignment(item: &str) -> Result<String, String> {
    let (key, value) = match item.split_once('=') {
        Some((k, v)) => (k.trim(), Some(v.trim())),
        None => (item, None),
    };
    let need = || value.ok_or_else(|| format!("`{key}` needs a value, e.g. {key}=4"));
    Ok(match key {
        "B" => format!("train.micro_batch={}", need()?),
        "K" => format!("train.accum_steps={}", need()?),
        "offload" => format!("train.offload={}", value.unwrap_or("true")),
        "f32" | "bf16" | "f16" => format!("train.dtype=\"{key}\""),
        "ckpt" => format!("train.checkpointing=\"{}\"", value.unwrap_or("blocks")),
        k if k.contains('.') => item.to_string(),
        k => {
            let hint = nearest(k, SHORT_KEYS)
                .map(|n| format!("did you mean `{n}`? "))
                .unwrap_or_default();
            return Err(format!(
                "unknown key `{k}`; {hint}accepted: {}, or section.key=value",
                SHORT_KEYS.join(", ")
            ));
        }
    })
}

/// What one configuration measured.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub config: String,
    pub micro_batch: usize,
    pub accum_steps: usize,
    pub effective_batch: usize,
    /// Highest measured peak over the steps (bytes).
    pub measured_peak: u64,
    /// The largest category of `measured_ledger`.
    pub largest_category: String,
    /// By category, the bytes of the step with the highest peak, at its fullest phase
    /// (`memory::figure`), counting only what lies in the measured memory.
    pub measured_ledger: Categories,
    pub predicted_peak: u64,
    pub tokens_per_s: f64,
    pub steps_per_s: f64,
    pub train_loss: f64,
    pub val_loss: Option<f64>,
}

/// Train `config` for `steps` optimizer steps with a fresh trainer.
pub fn run_one(config: &Config, steps: u64, device: &Device) -> anyhow::Result<Row> {
    let mut trainer = Trainer::new(config.scenario.clone(), device.clone())?;
    let predicted_peak = trainer.memory_estimate().peak();
    let mut peak: Option<StepFigure> = None;
    let (mut tokens, mut seconds, mut loss) = (0u64, 0f64, f64::NAN);
    for _ in 0..steps {
        let step = match trainer.train_step(|| true) {
            Ok(s) => s,
            Err(crate::train::Interrupt::Failed(e)) => return Err(e.into()),
            Err(crate::train::Interrupt::Stop) => anyhow::bail!("stopped"),
        };
        tokens += step.tokens;
        seconds += step.step_ms / 1e3;
        loss = step.loss;
        for figure in step_figures(&trainer.memory.take_events()) {
            if peak.as_ref().is_none_or(|p| figure.peak > p.peak) {
                peak = Some(figure);
            }
        }
    }
    let val_loss = if trainer.corpus.has_validation() {
        Some(trainer.evaluate()?)
    } else {
        None
    };
    let k = &trainer.knobs;
    let (measured_peak, ledger) = match &peak {
        Some(p) => (p.peak, p.measured_ledger()),
        None => (0, Categories::default()),
    };
    Ok(Row {
        config: config.label.clone(),
        micro_batch: k.micro_batch,
        accum_steps: k.accum_steps,
        effective_batch: k.effective_batch(),
        measured_peak,
        largest_category: largest_category(&ledger),
        measured_ledger: ledger,
        predicted_peak,
        tokens_per_s: tokens as f64 / seconds.max(f64::MIN_POSITIVE),
        steps_per_s: steps as f64 / seconds.max(f64::MIN_POSITIVE),
        train_loss: loss,
        val_loss,
    })
}

fn largest_category(c: &Categories) -> String {
    Categories::NAMES
        .iter()
        .zip(c.values())
        .max_by_key(|(_, v)| *v)
        .map(|(n, _)| n.to_string())
        .unwrap_or_default()
}

/// The table `gaccwb compare` prints.
pub fn table(rows: &[Row]) -> String {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut out = format!(
        "{:<28} {:>4} {:>3} {:>5} {:>10} {:<20} {:>10} {:>9} {:>8} {:>8} {:>8}\n",
        "configuration",
        "B",
        "K",
        "B·K",
        "peak MiB",
        "largest",
        "pred. MiB",
        "tok/s",
        "steps/s",
        "loss",
        "val"
    );
    for r in rows {
        let val = r.val_loss.map_or("-".into(), |v| format!("{v:.4}"));
        out += &format!(
            "{:<28} {:>4} {:>3} {:>5} {:>10.2} {:<20} {:>10.2} {:>9.0} {:>8.2} {:>8.4} {:>8}\n",
            r.config,
            r.micro_batch,
            r.accum_steps,
            r.effective_batch,
            mib(r.measured_peak),
            r.largest_category,
            mib(r.predicted_peak),
            r.tokens_per_s,
            r.steps_per_s,
            r.train_loss,
            val
        );
    }
    out
}

/// The rows as CSV (header first).
pub fn csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "config,micro_batch,accum_steps,effective_batch,measured_peak,largest_category,\
         predicted_peak,tokens_per_s,steps_per_s,train_loss,val_loss\n",
    );
    for r in rows {
        out += &format!(
            "\"{}\",{},{},{},{},{},{},{:.3},{:.4},{},{}\n",
            r.config.replace('"', "\"\""),
            r.micro_batch,
            r.accum_steps,
            r.effective_batch,
            r.measured_peak,
            r.largest_category,
            r.predicted_peak,
            r.tokens_per_s,
            r.steps_per_s,
            r.train_loss,
            r.val_loss.map_or(String::new(), |v| v.to_string())
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grid_maps_short_items_onto_the_scenario() {
        let base = Scenario::default();
        let c = parse_grid("B=32,K=1; B=4,K=8,offload,bf16; B=4,ckpt", &base).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c[1].label, "B=4,K=8,offload,bf16");
        let t = &c[1].scenario.train;
        assert_eq!((t.micro_batch, t.accum_steps, t.offload), (4, 8, true));
        assert_eq!(t.dtype, crate::telemetry::Dtype::Bf16);
        assert_eq!(
            c[2].scenario.train.checkpointing,
            crate::telemetry::Checkpointing::Blocks
        );
    }

    #[test]
    fn a_bad_entry_is_named_with_its_position_and_a_suggestion() {
        let e = parse_grid("B=32,K=1; B=4,offlaod", &Scenario::default())
            .err()
            .unwrap();
        assert_eq!((e.entry, e.column), (2, 15), "{e}");
        assert!(e.message.contains("did you mean `offload`"), "{e}");
        let e = parse_grid("B=4; train.acum_steps=2", &Scenario::default())
            .err()
            .unwrap();
        assert_eq!(e.entry, 2);
        assert!(e.to_string().contains("accum_steps"), "{e}");
    }
}
