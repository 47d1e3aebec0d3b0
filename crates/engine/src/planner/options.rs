//! `gaccwb estimate`'s reference-stack options, checked and turned into what `plan` reads: the
//! architecture (a named shape, a `config.json`, or the preset's model), the setup (micro-batch,
//! K, attention, recomputation, ZeRO) and the rates (a GPU's published figures, overridden flag by
//! flag). Every refusal is one line naming the flag, file or field.

use std::path::PathBuf;

use super::activations::{Attention, Recompute};
use super::model_states::{Offload, Placement, PlacementError};
use super::plan::Setup;
use super::step_time::{check_mfu, check_rate, gpu, Gpu, Rates, TimeError};
use crate::hf::config::{self, HfConfigError};
use crate::hf::{self, Arch, Positions};

/// The default MFU: Llama 3's reported 38–43% bf16 MFU on 16k H100s, rounded down.
pub const DEFAULT_MFU: f64 = 0.4;

/// The host AdamW rate used when `--cpu-adam-gbps` is not given: the median of three runs of
/// `gaccwb bench --adamw` (optimized build, 2 threads) on the shared 2-core development machine
/// (docs/PLANNER.md). A server runs it faster; measure yours.
pub const DEFAULT_CPU_ADAM_GBPS: f64 = 1.071;

/// The `cpu` device's f32 product rate when `--peak-tflops` is not given: the median of the
/// same three runs (10.3 GFLOP/s).
pub const DEFAULT_CPU_TFLOPS: f64 = 0.0103;

/// What the command line gave.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `--config`: a Hugging Face `config.json`.
    pub config: Option<PathBuf>,
    /// `--shape`: a named shape.
    pub shape: Option<String>,
    /// `--tied`: the head shares the token embedding.
    pub tied: bool,
    /// `--seq-len`: the context to plan for.
    pub seq_len: Option<u64>,
    /// `--zero`: the ZeRO stage.
    pub zero: u8,
    /// `--ranks`: data-parallel ranks.
    pub ranks: u64,
    /// Comma-separated offload targets.
    pub offload: Option<String>,
    /// `--attention`: flash or full.
    pub attention: Option<String>,
    /// `--recompute`: none, selective or full.
    pub recompute: Option<String>,
    /// `--gpu-model`: the device the times are for.
    pub gpu_model: Option<String>,
    /// `--peak-tflops`: overrides the device's peak.
    pub peak_tflops: Option<f64>,
    /// `--pcie-gbps`: overrides the host link's rate.
    pub pcie_gbps: Option<f64>,
    /// `--link-gbps`: overrides the inter-rank link's rate.
    pub link_gbps: Option<f64>,
    /// `--mfu`: the share of peak reached.
    pub mfu: Option<f64>,
    /// `--cpu-adam-gbps`: the host AdamW's rate.
    pub cpu_adam_gbps: Option<f64>,
}

/// Why the options were refused.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    #[error(transparent)]
    /// The `config.json` was refused.
    Config(#[from] HfConfigError),
    #[error(transparent)]
    /// Bad ZeRO settings.
    Placement(#[from] PlacementError),
    #[error(transparent)]
    /// Bad time-model settings.
    Time(#[from] TimeError),
    #[error("--shape {0}: unknown shape; shapes: {shapes}", shapes = hf::shape_names().join(", "))]
    /// `--shape` names no known shape.
    Shape(String),
    #[error("--shape and --config both name a model; give one")]
    /// Both `--shape` and `--config` were given.
    ShapeAndConfig,
    #[error("--{flag} {value}: expected one of {expected}")]
    /// A flag's value is none of its choices.
    Choice {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: String,
        /// The choices.
        expected: &'static str,
    },
    #[error("--seq-len 0: at least one token")]
    /// `--seq-len 0`.
    SeqLen,
    #[error("the model is too large to plan (about {0} bytes); check its sizes and --seq-len")]
    /// Sizes whose byte counts overflow.
    TooLarge(String),
}

/// The architecture: `--config`, else `--shape`, else `fallback` (the preset's model); then
/// `--tied` and `--seq-len`.
pub fn resolve_arch(o: &Options, fallback: Arch) -> Result<Arch, OptionsError> {
    let mut a = match (&o.config, &o.shape) {
        (Some(_), Some(_)) => return Err(OptionsError::ShapeAndConfig),
        (Some(path), None) => config::load(path)?,
        (None, Some(name)) => hf::named(name).ok_or_else(|| OptionsError::Shape(name.clone()))?,
        (None, None) => fallback,
    };
    a.tied |= o.tied;
    match o.seq_len {
        Some(0) => return Err(OptionsError::SeqLen),
        Some(s) => {
            a.seq_len = s;
            if a.positions == Positions::Learned {
                // A learned table has a row per position the model sees.
                a.positions_table = s;
            }
        }
        None => {}
    }
    Ok(a)
}

/// Refuses shapes whose byte counts would not fit in 64 bits (a rough upper bound of every
/// term, in floating point): `tokens` samples per step on a rank.
pub fn check_size(a: &Arch, tokens: u64) -> Result<(), OptionsError> {
    let (s, b) = (a.seq_len as f64, tokens as f64);
    let per_layer = 8.0 * s * b * (a.hidden + a.intermediate + a.q_width()) as f64
        + 8.0 * a.heads as f64 * s * s * b;
    let bytes =
        a.layers as f64 * per_layer + 8.0 * s * b * a.vocab as f64 + 32.0 * a.param_count_f64();
    if bytes < 2f64.powi(62) {
        Ok(())
    } else {
        Err(OptionsError::TooLarge(format!("{bytes:.3e}")))
    }
}

fn choice<T: std::str::FromStr>(
    flag: &'static str,
    value: &Option<String>,
    default: T,
    expected: &'static str,
) -> Result<T, OptionsError> {
    match value {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| OptionsError::Choice {
            flag,
            value: v.clone(),
            expected,
        }),
    }
}

/// The setup for micro-batch `b` and `k` micro-batches per step.
pub fn resolve_setup(o: &Options, b: u64, k: u64) -> Result<Setup, OptionsError> {
    let offload = Offload::parse(o.offload.as_deref().unwrap_or("none"))?;
    Ok(Setup {
        micro_batch: b,
        accum_steps: k,
        attention: choice("attention", &o.attention, Attention::Flash, "full, flash")?,
        recompute: choice(
            "recompute",
            &o.recompute,
            Recompute::None,
            "none, selective, full",
        )?,
        placement: Placement::new(o.zero, o.ranks, offload)?,
    })
}

/// The device: a named GPU (default h100) or `cpu` (this host: no PCIe, the optimizer on the
/// host), each figure overridable.
pub fn resolve_rates(o: &Options) -> Result<Rates, OptionsError> {
    let name = o.gpu_model.as_deref().unwrap_or("h100");
    let mut g = if name == "cpu" {
        Gpu {
            name: "cpu".into(),
            peak_tflops: DEFAULT_CPU_TFLOPS,
            memory_bytes: 0,
            pcie_gbps: f64::INFINITY,
            link_gbps: f64::INFINITY,
            host: true,
        }
    } else {
        gpu(name)?
    };
    if let Some(v) = o.peak_tflops {
        g.peak_tflops = check_rate("peak-tflops", v)?;
    }
    if let Some(v) = o.pcie_gbps {
        g.pcie_gbps = check_rate("pcie-gbps", v)?;
    }
    if let Some(v) = o.link_gbps {
        g.link_gbps = check_rate("link-gbps", v)?;
    }
    let cpu_adam = check_rate(
        "cpu-adam-gbps",
        o.cpu_adam_gbps.unwrap_or(DEFAULT_CPU_ADAM_GBPS),
    )?;
    Ok(Rates {
        gpu: g,
        mfu: check_mfu(o.mfu.unwrap_or(DEFAULT_MFU))?,
        cpu_adam_bytes_per_s: cpu_adam * 1e9,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> Options {
        Options {
            ranks: 1,
            ..Options::default()
        }
    }

    #[test]
    fn refusals_are_one_line_naming_the_flag() {
        let fallback = || hf::named("gpt2").unwrap();
        let bad = |o: Options| {
            resolve_arch(&o, fallback())
                .and_then(|_| resolve_setup(&o, 1, 1))
                .and_then(|_| resolve_rates(&o))
                .unwrap_err()
                .to_string()
        };
        let cases = [
            (Options { ranks: 0, ..opts() }, "--ranks 0"),
            (
                Options {
                    mfu: Some(0.0),
                    ..opts()
                },
                "--mfu 0",
            ),
            (
                Options {
                    mfu: Some(1.01),
                    ..opts()
                },
                "--mfu 1.01",
            ),
            (
                Options {
                    gpu_model: Some("v100".into()),
                    ..opts()
                },
                "--gpu-model v100",
            ),
            (
                Options {
                    offload: Some("nvme".into()),
                    ..opts()
                },
                "--offload nvme",
            ),
            (
                Options {
                    attention: Some("sparse".into()),
                    ..opts()
                },
                "--attention sparse: expected one of full, flash",
            ),
            (
                Options {
                    shape: Some("gpt5".into()),
                    ..opts()
                },
                "--shape gpt5",
            ),
            (
                Options {
                    pcie_gbps: Some(-1.0),
                    ..opts()
                },
                "--pcie-gbps -1",
            ),
        ];
        for (o, start) in cases {
            let e = bad(o);
            assert!(e.starts_with(start) && !e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn tied_and_seq_len_apply_to_any_source() {
        let o = Options {
            shape: Some("llama3-8b".into()),
            tied: true,
            seq_len: Some(4096),
            ..opts()
        };
        let a = resolve_arch(&o, hf::named("gpt2").unwrap()).unwrap();
        assert!(a.tied);
        assert_eq!(a.seq_len, 4096);
        assert_eq!(a.param_count(), 8_030_261_248 - 128256 * 4096);
    }
}
