//! This engine's verdict for a budget: what each memory lever can reach, and what blocks; the
//! named GPT shapes it can estimate, and byte figures in human units. The memory guard
//! (`train::oom_guard`) refuses a run with the same verdict.
//!
//! Every figure comes from the analytic estimator (`estimate.rs`) for this architecture: pre-LN
//! GPT blocks with biases, learned positions, and an untied output head (the published GPT-2 and
//! GPT-3 models tie the head to the token embedding; here it is a separate `d_model × vocab`
//! matrix, so it is counted on top of the published parameter count).

use serde::Serialize;

use super::estimate::{estimate, largest_micro_batch, Config, Row};
use crate::control::Dtype;
use crate::scenario::ModelConfig;
use crate::telemetry::Categories;

/// The named shapes this engine's blocks can build (the GPT ones).
pub(crate) fn shape_names() -> Vec<&'static str> {
    crate::hf::shape_names()
        .into_iter()
        .filter(|n| crate::hf::named(n).is_some_and(|a| a.engine_model().is_some()))
        .collect()
}

/// A shape `gaccwb estimate` cannot work with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// `--shape` names no published shape.
    #[error("unknown shape `{name}`; shapes: {}", shape_names().join(", "))]
    Unknown {
        /// The name given.
        name: String,
    },
    /// A size is zero.
    #[error("{key} must be at least 1 (got 0)")]
    Zero {
        /// The field, as a preset spells it.
        key: &'static str,
    },
    /// The heads do not divide the width.
    #[error("model.d_model ({d_model}) must be divisible by model.heads ({heads})")]
    HeadsDoNotDivide {
        /// Model width.
        d_model: usize,
        /// Attention heads.
        heads: usize,
    },
}

/// The model of a named shape this engine can build, or an error listing the names.
pub fn named_shape(name: &str) -> Result<ModelConfig, ShapeError> {
    crate::hf::named(name)
        .and_then(|a| a.engine_model())
        .ok_or_else(|| ShapeError::Unknown {
            name: name.to_string(),
        })
}

/// The checks a shape needs to be estimated at all (the trainer's own limits, such as the byte
/// vocabulary, are not among them): positive sizes, heads dividing d_model, B and K positive.
pub fn check_shape(s: &crate::scenario::Scenario) -> Result<(), ShapeError> {
    let (m, t) = (&s.model, &s.train);
    let sizes = [
        ("model.vocab", m.vocab),
        ("model.d_model", m.d_model),
        ("model.layers", m.layers),
        ("model.heads", m.heads),
        ("model.seq_len", m.seq_len),
        ("train.micro_batch", t.micro_batch),
        ("train.accum_steps", t.accum_steps),
    ];
    if let Some(&(key, _)) = sizes.iter().find(|(_, v)| *v == 0) {
        return Err(ShapeError::Zero { key });
    }
    if !m.d_model.is_multiple_of(m.heads) {
        return Err(ShapeError::HeadsDoNotDivide {
            d_model: m.d_model,
            heads: m.heads,
        });
    }
    Ok(())
}

/// Bytes in binary units: `1023 B`, `1.00 KiB`, …, `12.50 TiB`; above that still TiB.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    // Move up while the value would print as 1024.00 or more in this unit.
    while unit + 1 < UNITS.len() && value >= 1024.0 - 0.005 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// One way to cut memory, taken as far as it goes, and the peak it reaches.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Lever {
    /// What was changed, cumulatively: "K at micro-batch 1", "+ offload", "+ bf16".
    pub name: String,
    /// B.
    pub micro_batch: usize,
    /// K.
    pub accum_steps: usize,
    /// The precision.
    pub dtype: Dtype,
    /// Whether the optimizer state is offloaded.
    pub offload: bool,
    /// Predicted peak in the measured memory (device, or everything on the CPU).
    pub peak: u64,
    /// Whether the peak fits the budget.
    pub fits: bool,
}

/// What stops a configuration from fitting.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Blocker {
    /// A ledger category name (`parameters`, `activations`, …).
    pub category: String,
    /// Its bytes at its peak phase.
    pub bytes: u64,
    /// The category alone is larger than the budget.
    pub alone_exceeds: bool,
}

/// The answer for one budget.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    /// The budget, bytes.
    pub budget: u64,
    /// The predicted peak as configured.
    pub configured_peak: u64,
    /// Whether that fits.
    pub configured_fits: bool,
    /// The largest micro-batch dividing the effective batch that fits, with its K.
    pub largest_fitting: Option<Row>,
    /// The levers in order, each on top of the previous ones.
    pub levers: Vec<Lever>,
    /// When not even the last lever fits: the largest category at its peak phase.
    pub blocker: Option<Blocker>,
}

impl Verdict {
    /// The verdict for `cfg` at effective batch `effective` against `budget` bytes.
    pub fn new(cfg: &Config, effective: usize, budget: u64) -> Verdict {
        let configured_peak = estimate(cfg).peak();
        let levers = levers(cfg, effective, budget);
        #[allow(clippy::expect_used)] // `levers` always offers K at micro-batch 1
        let best = levers
            .iter()
            .min_by_key(|l| l.peak)
            .expect("at least one lever");
        let blocker = (!best.fits).then(|| blocker(&lever_config(cfg, best), budget));
        Verdict {
            budget,
            configured_peak,
            configured_fits: configured_peak <= budget,
            largest_fitting: largest_micro_batch(cfg, effective, budget),
            levers,
            blocker,
        }
    }

    /// The lever that reaches the least memory.
    pub fn best(&self) -> Option<&Lever> {
        self.levers.iter().min_by_key(|l| l.peak)
    }

    /// One line for an error message: the configured peak, the least any lever reaches and
    /// what blocks there (`gaccwb estimate` prints the whole verdict).
    pub fn summary(&self) -> String {
        let mut out = format!(
            "the configured micro-batch needs {}",
            human_bytes(self.configured_peak)
        );
        if let Some(l) = self.best() {
            out += &format!(
                "; the least any lever reaches is {} ({}: B={} K={} {} offload {})",
                human_bytes(l.peak),
                l.name,
                l.micro_batch,
                l.accum_steps,
                l.dtype.name(),
                if l.offload { "on" } else { "off" }
            );
        }
        if let Some(b) = &self.blocker {
            out += &format!(
                ", where {} {} {}",
                b.category,
                if b.alone_exceeds {
                    "alone need"
                } else {
                    "is the largest, at"
                },
                human_bytes(b.bytes)
            );
        }
        out
    }
}

/// Micro-batch 1 with K = the effective batch; then offload on; then 16-bit compute. A lever is
/// offered only where it lowers the peak below the one before it (offload does nothing in one
/// memory; 16-bit compute weights can cost more than they save).
fn levers(cfg: &Config, effective: usize, budget: u64) -> Vec<Lever> {
    let mut steps = vec![("K at micro-batch 1".to_string(), cfg.dtype, cfg.offload)];
    if !cfg.offload {
        steps.push(("+ offload".into(), cfg.dtype, true));
    }
    if cfg.dtype == Dtype::F32 {
        steps.push(("+ bf16".into(), Dtype::Bf16, true));
    }
    steps
        .into_iter()
        .map(|(name, dtype, offload)| {
            let c = Config {
                micro_batch: 1,
                accum_steps: effective.max(1),
                dtype,
                offload,
                ..cfg.clone()
            };
            let peak = estimate(&c).peak();
            Lever {
                name,
                micro_batch: 1,
                accum_steps: c.accum_steps,
                dtype,
                offload,
                peak,
                fits: peak <= budget,
            }
        })
        .fold(Vec::new(), |mut kept: Vec<Lever>, lever| {
            if kept.last().is_none_or(|before| lever.peak < before.peak) {
                kept.push(lever);
            }
            kept
        })
}

fn lever_config(cfg: &Config, l: &Lever) -> Config {
    Config {
        micro_batch: l.micro_batch,
        accum_steps: l.accum_steps,
        dtype: l.dtype,
        offload: l.offload,
        ..cfg.clone()
    }
}

/// What blocks `cfg`: the weights when they alone exceed the budget, else the largest resident
/// category in its peak phase.
fn blocker(cfg: &Config, budget: u64) -> Blocker {
    let e = estimate(cfg);
    #[allow(clippy::expect_used)] // an estimate has four phases
    let (_, peak_phase) = e
        .phases()
        .into_iter()
        .max_by_key(|(_, c)| e.resident(c))
        .expect("four phases");
    let resident = Categories {
        offloaded: if e.unified { peak_phase.offloaded } else { 0 },
        ..peak_phase
    };
    // The weights first: when they alone exceed the budget no lever but a smaller model helps.
    #[allow(clippy::expect_used)] // there are eight categories
    let (i, bytes) = if resident.parameters > budget {
        (0, resident.parameters)
    } else {
        resident
            .values()
            .into_iter()
            .enumerate()
            .max_by_key(|(_, v)| *v)
            .expect("eight categories")
    };
    Blocker {
        category: Categories::NAMES[i].to_string(),
        bytes,
        alone_exceeds: bytes > budget,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::estimate::param_count;

    /// An independent count for GPT-2/3 blocks: per layer 12·d² weights (qkv 3d², proj d²,
    /// MLP 8d²) and 13·d biases and norm gains (qkv 3d, proj d, fc 4d, out d, two norms 4d);
    /// token and position embeddings; the final norm; and this project's untied head V·d.
    fn published_plus_head(m: &ModelConfig) -> (u64, u64) {
        let (v, d, t, l) = (
            m.vocab as u64,
            m.d_model as u64,
            m.seq_len as u64,
            m.layers as u64,
        );
        let tied = l * (12 * d * d + 13 * d) + v * d + t * d + 2 * d;
        (tied, tied + v * d)
    }

    #[test]
    fn named_shapes_count_the_published_parameters_plus_an_untied_head() {
        // Hugging Face's parameter counts of the tied GPT-2 checkpoints.
        let published = [
            ("gpt2", 124_439_808u64),
            ("gpt2-medium", 354_823_168),
            ("gpt2-large", 774_030_080),
            ("gpt2-xl", 1_557_611_200),
        ];
        for (name, count) in published {
            let m = named_shape(name).unwrap();
            let (tied, untied) = published_plus_head(&m);
            assert_eq!(tied, count, "{name}");
            assert_eq!(param_count(&m), untied, "{name}");
        }
        let gpt3 = named_shape("gpt3-175b").unwrap();
        let (tied, untied) = published_plus_head(&gpt3);
        assert!((174.0e9..176.0e9).contains(&(tied as f64)), "{tied}");
        assert_eq!(param_count(&gpt3), untied);
        let unknown = named_shape("gpt4").unwrap_err().to_string();
        assert!(unknown.contains("gpt2-medium"), "{unknown}");
        assert!(!unknown.contains("llama"), "not this engine's: {unknown}");
    }

    #[test]
    fn the_engine_architecture_counts_what_the_estimator_counts() {
        let gpt2 = crate::hf::named("gpt2").unwrap();
        let untied = crate::hf::Arch {
            tied: false,
            ..gpt2.clone()
        };
        let m = gpt2
            .engine_model()
            .expect("GPT-2 is the engine's architecture");
        assert_eq!(param_count(&m), untied.param_count());
        assert_eq!(untied.param_count() - gpt2.param_count(), 768 * 50257);
        assert!(crate::hf::named("llama3-8b")
            .unwrap()
            .engine_model()
            .is_none());
    }

    #[test]
    fn human_units_at_the_edges() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1), "1 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.00 KiB");
        assert_eq!(human_bytes((1 << 20) - 1), "1.00 MiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
        assert_eq!(human_bytes(1 << 40), "1.00 TiB");
        assert_eq!(human_bytes(5 << 50), "5120.00 TiB");
    }

    /// Offload in bf16 leaves the device no f32 weights: with the gradients accumulating there
    /// their f32 buffer blocks; with them on the host the backward's bf16 gradients do, as many
    /// bytes as the bf16 weights by the backward's end, and what is in flight at its peak.
    #[test]
    fn gpt3_on_forty_gigabytes_is_blocked_by_its_model_states() {
        let model = named_shape("gpt3-175b").unwrap();
        let cfg = Config {
            arch: crate::hf::Arch::engine(&model),
            model,
            micro_batch: 1,
            accum_steps: 4,
            dtype: Dtype::Bf16,
            offload: true,
            pitfall: false,
            unified: false,
            fused: false,
            scales_gradients: false,
            offload_grads: crate::control::OffloadGrads::Device,
            workspace: 0,
            threads: 1,
            checkpointing: crate::control::Checkpointing::None,
            lora: None,
        };
        let v = Verdict::new(&cfg, 4, 40 << 30);
        assert!(!v.configured_fits && v.largest_fitting.is_none());
        let b = v.blocker.unwrap();
        assert_eq!(b.category, "gradients");
        assert!(b.alone_exceeds);
        assert_eq!(b.bytes, param_count(&cfg.model) * 4);
        let host = Config {
            offload_grads: crate::control::OffloadGrads::Host,
            ..cfg
        };
        let b = Verdict::new(&host, 4, 40 << 30).blocker.unwrap();
        assert_eq!(b.category, "gradients_transient");
        let weights = param_count(&host.model) * 2;
        assert!(
            b.bytes > weights && b.bytes < weights + weights * 3 / 100,
            "{} B against the weights' {weights} B",
            b.bytes
        );
    }

    #[test]
    fn levers_only_lower_the_peak_down_to_micro_batch_one() {
        let model = ModelConfig {
            vocab: 256,
            d_model: 32,
            layers: 2,
            heads: 2,
            seq_len: 32,
            ..ModelConfig::default()
        };
        let cfg = Config {
            arch: crate::hf::Arch::engine(&model),
            model,
            micro_batch: 8,
            accum_steps: 2,
            dtype: Dtype::F32,
            offload: false,
            pitfall: false,
            unified: false,
            fused: false,
            scales_gradients: false,
            offload_grads: crate::control::OffloadGrads::Device,
            workspace: 0,
            threads: 1,
            checkpointing: crate::control::Checkpointing::None,
            lora: None,
        };
        let v = Verdict::new(&cfg, 16, u64::MAX);
        assert!(v.configured_fits && v.blocker.is_none());
        assert_eq!(v.largest_fitting.unwrap().micro_batch, 16);
        assert_eq!(v.levers.len(), 3);
        assert!(v.levers[0].peak < v.configured_peak);
        assert!(
            v.levers[1].peak < v.levers[0].peak,
            "offload frees the moments on a GPU"
        );
    }

    #[test]
    fn bf16_is_offered_on_the_cpu_where_its_halved_activations_outweigh_its_casts() {
        // Long sequences on the CPU: at micro-batch 1 the activations still dominate, and the
        // fused ops keep them in 2 bytes (offload moves nothing in one memory, so it is skipped).
        let model = ModelConfig {
            vocab: 256,
            d_model: 128,
            layers: 4,
            heads: 4,
            seq_len: 1024,
            ..ModelConfig::default()
        };
        let cfg = Config {
            arch: crate::hf::Arch::engine(&model),
            model,
            micro_batch: 8,
            accum_steps: 1,
            dtype: Dtype::F32,
            offload: false,
            offload_grads: Default::default(),
            pitfall: false,
            unified: true,
            fused: true,
            scales_gradients: false,
            workspace: 0,
            threads: 1,
            checkpointing: crate::control::Checkpointing::None,
            lora: None,
        };
        let v = Verdict::new(&cfg, 8, u64::MAX);
        let names: Vec<&str> = v.levers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["K at micro-batch 1", "+ bf16"], "{:?}", v.levers);
        let (f32_peak, bf16_peak) = (v.levers[0].peak, v.levers[1].peak);
        assert!(bf16_peak < f32_peak, "bf16 {bf16_peak} vs f32 {f32_peak}");
        // Because the CPU keeps every activation in 2 bytes: half of f32's (the loss's two f32
        // scalars aside), with no f32 row statistics beside them, but for the residual stream:
        // each step's output in f32. The f32 lever's embedding writes the stream itself (one f32
        // [N, D]); the bf16 lever offloads (its weights in bf16, so its embedding is not the
        // fused one): the token rows and their sum with the positions in 2 bytes each, the
        // widened copy (4) and the last step's narrowed one (2).
        let activations = |l: &Lever| estimate(&lever_config(&cfg, l)).backward.activations;
        let (a32, a16) = (activations(&v.levers[0]), activations(&v.levers[1]));
        let half = lever_config(&cfg, &v.levers[1]);
        let nd = (half.micro_batch * half.model.seq_len) as u64 * half.arch.hidden;
        let stream = 2 * half.arch.layers * nd * 4;
        // The head keeps its f32 logits for its backward where its products run on `gemm`;
        // on bf16 tiles it makes them again.
        let rows = v.levers[0].micro_batch * half.model.seq_len;
        let logits = crate::ops::fused::head_kept(rows, half.model.vocab, false) as u64 * 4;
        let tiles = crate::ops::fused::bf16_kernel() != crate::ops::fused::Bf16Kernel::Gemm;
        let logits16 = crate::ops::fused::head_kept(rows, half.model.vocab, tiles) as u64 * 4;
        assert_eq!(
            a16 - 8 - logits16,
            (a32 - 8 - stream - 4 * nd - logits) / 2 + stream + 10 * nd,
            "bf16 {a16} vs f32 {a32}"
        );
    }

    #[test]
    fn a_lever_that_raises_the_peak_is_not_offered() {
        let model = named_shape("gpt3-175b").unwrap();
        let knobs = crate::control::Knobs::from_scenario(&crate::scenario::Scenario::default());
        let mut cfg = Config::from_knobs(&model, &knobs, true).unwrap();
        cfg.micro_batch = 1;
        let (with, alone) = (
            estimate(&Config {
                dtype: Dtype::Bf16,
                offload: true,
                ..cfg.clone()
            }),
            estimate(&Config {
                offload: true,
                ..cfg.clone()
            }),
        );
        assert!(
            with.peak() > alone.peak(),
            "the case: bf16 costs more than it saves here"
        );
        // At K = 1 the optimizer step is the peak, where bf16 adds its weights to the f32 master.
        let v = Verdict::new(&cfg, 1, 40 << 30);
        assert!(
            v.levers.iter().all(|l| l.dtype == Dtype::F32),
            "{:?}",
            v.levers
        );
        assert!(v.levers.windows(2).all(|w| w[1].peak < w[0].peak));
    }
}
