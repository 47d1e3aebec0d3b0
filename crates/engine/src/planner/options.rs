//! `gaccwb estimate`'s reference-stack options, checked and turned into what `plan` reads: the
//! architecture (a named shape, a `config.json`, or the preset's model) and the sequence length
//! it is trained at, the setup (micro-batch, K, attention, recomputation, ZeRO, LoRA) and the
//! rates (a GPU's published figures, overridden flag by flag; the host's measured or given).
//! Every refusal is one line naming the flag, file or field.

use std::path::PathBuf;

use super::activations::{Attention, Recompute};
use super::lora::{BaseDtype, Lora, LoraError};
use super::model_states::{Offload, Placement, PlacementError};
use super::plan::Setup;
use super::step_time::{check_mfu, check_rate, gpu, Gpu, HostSource, Rates, TimeError};
use crate::hf::config::{self, HfConfigError};
use crate::hf::{self, Arch, Positions};

/// The default MFU: Llama 3's reported 38–43% bf16 MFU on 16k H100s, rounded down.
pub(crate) const DEFAULT_MFU: f64 = 0.4;

/// The host AdamW rate assumed when it is neither given (`--cpu-adam-gbps`) nor measured: the
/// median of three runs of `gaccwb bench --adamw` (optimized build, 2 threads) on the shared
/// 2-core development machine (docs/PLANNER.md). A server runs it faster.
pub(crate) const ASSUMED_CPU_ADAM_GBPS: f64 = 1.071;

/// The `cpu` device's f32 product rate assumed likewise (10.3 GFLOP/s).
pub(crate) const ASSUMED_CPU_TFLOPS: f64 = 0.0103;

/// The sequence length planned when neither `--seq-len` nor `--set model.seq_len` gives one: a
/// fine-tune's, not the model's longest context (Llama 3.1's 131,072 tokens would plan for
/// samples nobody trains on). Activations grow with it linearly (FlashAttention), so the figures
/// at another length are a flag away. The model's own context is used when shorter.
pub(crate) const DEFAULT_SEQ_LEN: u64 = 4096;

/// The host's rates: AdamW's bytes of optimizer state per second and the f32 product rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostFigures {
    /// GB/s of optimizer state.
    pub adamw_gbps: f64,
    /// TFLOP/s of the f32 product (the `cpu` device's peak).
    pub cpu_tflops: f64,
    /// Where they come from.
    pub source: HostSource,
}

impl Default for HostFigures {
    fn default() -> HostFigures {
        HostFigures {
            adamw_gbps: ASSUMED_CPU_ADAM_GBPS,
            cpu_tflops: ASSUMED_CPU_TFLOPS,
            source: HostSource::Assumed,
        }
    }
}

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
    /// The host's rates when the flags do not give them (measured, or assumed).
    pub host: HostFigures,
    /// `--lora-rank`: adapters of this rank instead of training every weight (0: off).
    pub lora_rank: Option<u64>,
    /// `--lora-targets`: comma-separated module names (default: every projection).
    pub lora_targets: Option<String>,
    /// `--lora-dropout`: dropout on the adapters' inputs.
    pub lora_dropout: Option<f64>,
    /// `--base-dtype`: bf16, int8 or nf4.
    pub base_dtype: Option<String>,
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
    #[error(transparent)]
    /// Bad LoRA settings.
    Lora(#[from] LoraError),
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
/// `--tied`; then the sequence length: `seq_len` (`--seq-len` or `--set model.seq_len`), else
/// for a published model the shorter of its context and `DEFAULT_SEQ_LEN` (4,096), else the
/// preset's.
/// A learned position table keeps its rows (the model's, whatever length is trained).
pub fn resolve_arch(o: &Options, fallback: Arch) -> Result<Arch, OptionsError> {
    let mut a = match (&o.config, &o.shape) {
        (Some(_), Some(_)) => return Err(OptionsError::ShapeAndConfig),
        (Some(path), None) => config::read_config(path)?,
        (None, Some(name)) => hf::named(name).ok_or_else(|| OptionsError::Shape(name.clone()))?,
        (None, None) => fallback.clone(),
    };
    a.tied |= o.tied;
    let published = o.config.is_some() || o.shape.is_some();
    a.seq_len = match o.seq_len {
        Some(0) => return Err(OptionsError::SeqLen),
        Some(s) => s,
        None if published => a.max_context.min(DEFAULT_SEQ_LEN),
        None => fallback.seq_len,
    };
    if !published && a.positions == Positions::Learned {
        // The preset's model is this engine's: its table has a row per position it trains on.
        a.positions_table = a.seq_len;
    }
    Ok(a)
}

/// Refuses shapes whose byte counts would not fit in 64 bits (a rough upper bound of every
/// term, in floating point): `tokens` samples per step on a rank.
pub fn check_size(a: &Arch, tokens: u64) -> Result<(), OptionsError> {
    let (s, b) = (a.seq_len as f64, tokens as f64);
    // In floating point: a hostile config's widths must not overflow before the check.
    let routed = a.experts.map_or(0.0, |e| {
        e.per_token as f64 * (a.hidden as f64 + e.intermediate as f64 + e.shared as f64)
            + e.count as f64
    });
    let per_layer = 8.0 * s * b * ((a.hidden + a.intermediate + 2 * a.q_width()) as f64 + routed)
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

/// The LoRA the flags ask for on `arch`, or `None` (no `--lora-rank`, or 0).
pub fn resolve_lora(o: &Options, arch: &Arch) -> Result<Option<Lora>, OptionsError> {
    let rank = o.lora_rank.unwrap_or(0);
    if rank == 0 {
        let given = [
            ("lora-targets", o.lora_targets.is_some()),
            ("lora-dropout", o.lora_dropout.is_some()),
            ("base-dtype", o.base_dtype.is_some()),
        ];
        return match given.into_iter().find(|(_, g)| *g) {
            Some((flag, _)) => Err(LoraError::NoRank(flag).into()),
            None => Ok(None),
        };
    }
    let targets = o.lora_targets.as_ref().map(|t| {
        t.split(',')
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect()
    });
    let base = choice(
        "base-dtype",
        &o.base_dtype,
        BaseDtype::Bf16,
        "bf16, int8, nf4",
    )?;
    Ok(Some(Lora::new(
        arch,
        rank,
        targets,
        o.lora_dropout.unwrap_or(0.0),
        base,
    )?))
}

/// The setup for micro-batch `b` and `k` micro-batches per step of `arch`.
pub fn resolve_setup(o: &Options, arch: &Arch, b: u64, k: u64) -> Result<Setup, OptionsError> {
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
        lora: resolve_lora(o, arch)?,
    })
}

/// The device: a named GPU (default h100) or `cpu` (this host: no PCIe, the optimizer on the
/// host, nothing to offload to), each figure overridable; the host's rates from the flags, else
/// `o.host`.
pub fn resolve_rates(o: &Options) -> Result<Rates, OptionsError> {
    let name = o.gpu_model.as_deref().unwrap_or("h100");
    let on_host = name == "cpu";
    let mut g = if on_host {
        Gpu {
            name: "cpu".into(),
            peak_tflops: o.host.cpu_tflops,
            memory_bytes: 0,
            pcie_gbps: 0.0,
            link_gbps: 0.0,
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
    if on_host && o.ranks > 1 && o.link_gbps.is_none() {
        return Err(TimeError::HostLink(o.ranks).into());
    }
    if on_host
        && o.offload
            .as_deref()
            .is_some_and(|t| Offload::parse(t).is_ok_and(|o| o != Offload::default()))
    {
        return Err(TimeError::OffloadOnHost.into());
    }
    let (cpu_adam, host_source) = match o.cpu_adam_gbps {
        Some(v) => (check_rate("cpu-adam-gbps", v)?, HostSource::Flag),
        None => (o.host.adamw_gbps, o.host.source),
    };
    Ok(Rates {
        gpu: g,
        mfu: check_mfu(o.mfu.unwrap_or(DEFAULT_MFU))?,
        cpu_adam_bytes_per_s: cpu_adam * 1e9,
        host_source,
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
                .and_then(|a| resolve_setup(&o, &a, 1, 1))
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
            (
                Options {
                    gpu_model: Some("cpu".into()),
                    offload: Some("optimizer".into()),
                    ..opts()
                },
                "--offload with --gpu-model cpu",
            ),
            (
                Options {
                    gpu_model: Some("cpu".into()),
                    ranks: 2,
                    ..opts()
                },
                "--gpu-model cpu with --ranks 2 needs --link-gbps",
            ),
            (
                Options {
                    base_dtype: Some("nf4".into()),
                    ..opts()
                },
                "--base-dtype needs --lora-rank",
            ),
            (
                Options {
                    lora_rank: Some(8),
                    base_dtype: Some("fp8".into()),
                    ..opts()
                },
                "--base-dtype fp8: expected one of bf16, int8, nf4",
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

    #[test]
    fn a_published_model_is_planned_at_a_fine_tunes_length_not_its_context() {
        let named = |shape: &str| Options {
            shape: Some(shape.into()),
            ..opts()
        };
        let fallback = || hf::named("gpt2").unwrap();
        // Mistral's context is 32768; GPT-2's 1024 is shorter than the default.
        let mistral = resolve_arch(&named("mistral-7b"), fallback()).unwrap();
        assert_eq!(
            (mistral.seq_len, mistral.max_context),
            (DEFAULT_SEQ_LEN, 32768)
        );
        let gpt2 = resolve_arch(&named("gpt2"), fallback()).unwrap();
        assert_eq!(gpt2.seq_len, 1024);
        // A shorter length keeps the learned table's rows: the model is the same model.
        let short = Options {
            seq_len: Some(256),
            ..named("gpt2")
        };
        let a = resolve_arch(&short, fallback()).unwrap();
        assert_eq!((a.seq_len, a.param_count()), (256, 124_439_808));
    }
}
