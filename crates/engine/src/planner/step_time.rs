//! Time per optimizer step, from four rates: the device's compute (published peak × MFU), the
//! host link (PCIe, per direction), the host's AdamW (bytes of optimizer state per second,
//! measured by `gaccwb bench --adamw`) and the link between ranks (ring collectives). Compute,
//! transfers and collectives overlap; the CPU update runs after the last gradient arrives, so
//! a step takes max(compute, PCIe, network) + CPU optimizer, and the bound is the largest term.

use serde::Serialize;

use super::activations::Recompute;
use super::model_states::Placement;
use crate::hf::Arch;

/// One device's rates. Figures are the vendor's published ones (docs/PLANNER.md cites them).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gpu {
    /// The model name `--gpu-model` takes.
    pub name: String,
    /// Dense bf16 tensor-core peak, TFLOP/s.
    pub peak_tflops: f64,
    /// Device memory, GiB as sold (decimal GB on the datasheet, kept here as bytes).
    pub memory_bytes: u64,
    /// Host link, GB/s in each direction; unbounded (absent from JSON) for the host itself.
    #[serde(skip_serializing_if = "is_unbounded")]
    pub pcie_gbps: f64,
    /// Link between ranks, GB/s in each direction (NVLink; PCIe where there is none);
    /// unbounded (absent from JSON) for the host itself.
    #[serde(skip_serializing_if = "is_unbounded")]
    pub link_gbps: f64,
    /// The device is the host (`cpu`): nothing crosses PCIe and the optimizer always runs on
    /// the host.
    pub host: bool,
}

/// A rate with no bound (JSON has no infinity: serde would write `null`).
fn is_unbounded(rate: &f64) -> bool {
    rate.is_infinite()
}

/// The models `--gpu-model` names: (name, peak bf16 dense TFLOPS, memory GB, PCIe GB/s per
/// direction, NVLink GB/s per direction).
const GPUS: [(&str, f64, u64, f64, f64); 4] = [
    ("h100", 989.0, 80, 64.0, 450.0),
    ("h200", 989.0, 141, 64.0, 450.0),
    ("a100", 312.0, 80, 32.0, 300.0),
    ("rtx4090", 165.2, 24, 32.0, 32.0),
];

/// Names `--gpu-model` accepts.
pub fn gpu_names() -> Vec<&'static str> {
    GPUS.iter().map(|g| g.0).collect()
}

/// Bad time-model settings.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum TimeError {
    #[error("--gpu-model {0}: unknown GPU; models: {models}", models = gpu_names().join(", "))]
    /// `--gpu-model` names no known GPU.
    UnknownGpu(String),
    #[error("--mfu {0:?}: expected a fraction from {MIN_MFU} to 1")]
    /// `--mfu` outside [`MIN_MFU`, 1].
    Mfu(f64),
    #[error("--{0} {1:?}: expected a positive number from {MIN_RATE:?} to {MAX_RATE}")]
    /// A rate that is not positive or is out of range: the flag and the value.
    Rate(&'static str, f64),
}

/// A named GPU's published figures.
pub fn gpu(name: &str) -> Result<Gpu, TimeError> {
    let &(name, peak_tflops, gb, pcie_gbps, link_gbps) = GPUS
        .iter()
        .find(|g| g.0 == name)
        .ok_or_else(|| TimeError::UnknownGpu(name.to_string()))?;
    Ok(Gpu {
        name: name.into(),
        peak_tflops,
        memory_bytes: gb * 1_000_000_000,
        pcie_gbps,
        link_gbps,
        host: false,
    })
}

/// A positive, finite rate, or an error naming its flag.
pub fn check_rate(flag: &'static str, value: f64) -> Result<f64, TimeError> {
    if (MIN_RATE..=MAX_RATE).contains(&value) {
        Ok(value)
    } else {
        Err(TimeError::Rate(flag, value))
    }
}

/// The smallest MFU accepted: below it a step's time is beyond any figure worth printing.
pub const MIN_MFU: f64 = 1e-4;
/// The range of a rate flag (TFLOP/s or GB/s): a millionth (an emulator) to a billion.
pub const MIN_RATE: f64 = 1e-6;
/// See [`MIN_RATE`].
pub const MAX_RATE: f64 = 1e9;

/// An MFU in [`MIN_MFU`, 1].
pub fn check_mfu(value: f64) -> Result<f64, TimeError> {
    if (MIN_MFU..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(TimeError::Mfu(value))
    }
}

/// Everything the time model reads besides the architecture.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rates {
    /// The device.
    pub gpu: Gpu,
    /// The share of peak FLOP/s reached.
    pub mfu: f64,
    /// The host's AdamW: optimizer-state bytes per second (16 per parameter: the fp32 weight,
    /// gradient and two moments it walks).
    pub cpu_adam_bytes_per_s: f64,
}

/// One step's work and time on each rank.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepTime {
    /// Tokens one optimizer step trains, all ranks together.
    pub tokens: u64,
    /// FLOPs on each rank per step.
    pub flops: f64,
    /// Seconds of compute.
    pub compute_s: f64,
    /// Host→device and device→host bytes per rank per step.
    pub h2d_bytes: u64,
    /// Device→host bytes per rank per step.
    pub d2h_bytes: u64,
    /// Seconds on the host link.
    pub pcie_s: f64,
    /// Bytes each rank sends over the inter-rank link per step.
    pub network_bytes: u64,
    /// Seconds on the inter-rank link.
    pub network_s: f64,
    /// Optimizer-state bytes the host's AdamW walks per step (all ranks' partitions).
    pub cpu_adam_bytes: u64,
    /// Seconds of host AdamW.
    pub cpu_adam_s: f64,
    /// The step's seconds: the largest term.
    pub step_s: f64,
    /// `compute`, `pcie`, `network` or `cpu_optimizer`: the largest term.
    pub bound: &'static str,
    /// Tokens per second, all ranks together.
    pub tokens_per_s: f64,
}

/// FLOPs per token: 6 per multiplied parameter and 12·L·s·q for attention's two products
/// (forward and backward), plus another forward (2 per parameter, 4·L·s·q) under full
/// recomputation, or the attention core's forward (4·L·s·q) under selective recomputation.
pub fn flops_per_token(arch: &Arch, recompute: Recompute) -> f64 {
    let p = arch.matmul_params() as f64;
    let attention = (arch.layers * arch.seq_len * arch.q_width()) as f64;
    let base = 6.0 * p + 12.0 * attention;
    base + match recompute {
        Recompute::None => 0.0,
        Recompute::Selective => 4.0 * attention,
        Recompute::Full => 2.0 * p + 4.0 * attention,
    }
}

/// Passes over the weights per micro-batch: forward, backward and the recompute's forward.
fn weight_passes(recompute: Recompute) -> u64 {
    if recompute == Recompute::Full {
        3
    } else {
        2
    }
}

/// Host-link bytes per rank per step (h2d, d2h). With gradients offloaded the device keeps no
/// gradient buffer, so each micro-batch's 16-bit gradients go down (K times); the updated
/// 16-bit weights come back once, unless the weights live on the host, where stage 3 fetches
/// them every pass (its partition; the rest arrives over the inter-rank link).
pub fn pcie_bytes(params: u64, z: &Placement, accum: u64, recompute: Recompute) -> (u64, u64) {
    let part = |stage: u8| {
        if z.stage >= stage {
            params.div_ceil(z.ranks)
        } else {
            params
        }
    };
    let o = &z.offload;
    let d2h = if o.gradients { accum * 2 * part(1) } else { 0 };
    let mut h2d = 0;
    if o.parameters {
        h2d += accum * weight_passes(recompute) * 2 * part(3);
    } else if o.optimizer {
        h2d += 2 * part(1);
    }
    if o.gradients && !o.optimizer {
        // The device's optimizer reads its fp32 gradients back.
        h2d += 4 * part(1);
    }
    (h2d, d2h)
}

/// Bytes each rank sends per step in ring collectives over W ranks (an all-reduce sends
/// 2·(W−1)/W of the payload, a reduce-scatter or all-gather (W−1)/W) of the 16-bit gradients
/// and weights: stage 0 all-reduces once per step, stage 1 reduce-scatters once and all-gathers
/// the updated weights, stage 2 reduce-scatters every micro-batch, stage 3 also all-gathers
/// the weights every pass. With gradients offloaded there is no buffer to accumulate into, so
/// the reduction happens every micro-batch at every stage.
pub fn network_bytes(params: u64, z: &Placement, accum: u64, recompute: Recompute) -> u64 {
    if z.ranks == 1 {
        return 0;
    }
    let w = z.ranks as f64;
    let share = |collectives: f64| (collectives * (w - 1.0) / w * 2.0 * params as f64) as u64;
    let reductions = if z.stage >= 2 || z.offload.gradients {
        accum
    } else {
        1
    } as f64;
    match z.stage {
        0 => share(2.0 * reductions),
        1 | 2 => share(reductions + 1.0),
        _ => share(accum as f64 * (weight_passes(recompute) + 1) as f64),
    }
}

/// Time of one optimizer step with micro-batch `b` and `accum` micro-batches per rank.
pub fn step_time(
    arch: &Arch,
    b: u64,
    accum: u64,
    recompute: Recompute,
    z: &Placement,
    rates: &Rates,
) -> StepTime {
    let params = arch.param_count();
    let rank_tokens = b * accum * arch.seq_len;
    let flops = flops_per_token(arch, recompute) * rank_tokens as f64;
    let compute_s = flops / (rates.gpu.peak_tflops * 1e12 * rates.mfu);
    let (h2d, d2h) = if rates.gpu.host {
        (0, 0)
    } else {
        pcie_bytes(params, z, accum, recompute)
    };
    let pcie_s = h2d.max(d2h) as f64 / (rates.gpu.pcie_gbps * 1e9);
    let network = network_bytes(params, z, accum, recompute);
    let network_s = network as f64 / (rates.gpu.link_gbps * 1e9);
    // The host updates every rank's partition: the whole model once (stage 0: once per rank).
    let cpu_adam_bytes = if z.offload.optimizer || rates.gpu.host {
        16 * params * if z.stage == 0 { z.ranks } else { 1 }
    } else {
        0
    };
    let cpu_adam_s = cpu_adam_bytes as f64 / rates.cpu_adam_bytes_per_s;
    let terms = [
        ("compute", compute_s),
        ("pcie", pcie_s),
        ("network", network_s),
        ("cpu_optimizer", cpu_adam_s),
    ];
    let bound = terms
        .iter()
        .max_by(|x, y| x.1.total_cmp(&y.1))
        .map(|t| t.0)
        .unwrap_or("compute");
    let step_s = compute_s.max(pcie_s).max(network_s) + cpu_adam_s;
    let tokens = rank_tokens * z.ranks;
    StepTime {
        tokens,
        flops,
        compute_s,
        h2d_bytes: h2d,
        d2h_bytes: d2h,
        pcie_s,
        network_bytes: network,
        network_s,
        cpu_adam_bytes,
        cpu_adam_s,
        step_s,
        bound,
        tokens_per_s: tokens as f64 / step_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::named;
    use crate::planner::model_states::Offload;

    fn rates() -> Rates {
        Rates {
            gpu: gpu("a100").unwrap(),
            mfu: 0.5,
            cpu_adam_bytes_per_s: 10e9,
        }
    }

    #[test]
    fn flops_follow_six_p_plus_attention() {
        let a = named("llama3-8b").unwrap();
        let p = a.matmul_params() as f64;
        let att = (32 * 8192 * 4096) as f64;
        assert_eq!(flops_per_token(&a, Recompute::None), 6.0 * p + 12.0 * att);
        assert_eq!(
            flops_per_token(&a, Recompute::Full) - flops_per_token(&a, Recompute::None),
            2.0 * p + 4.0 * att
        );
    }

    #[test]
    fn compute_bound_without_offload_on_one_rank() {
        let a = named("gpt2").unwrap();
        let z = Placement::new(0, 1, Offload::default()).unwrap();
        let t = step_time(&a, 8, 4, Recompute::None, &z, &rates());
        assert_eq!((t.h2d_bytes, t.d2h_bytes, t.network_bytes), (0, 0, 0));
        assert_eq!(t.bound, "compute");
        assert_eq!(t.tokens, 8 * 4 * 1024);
        let expected = flops_per_token(&a, Recompute::None) * t.tokens as f64 / (312e12 * 0.5);
        assert!((t.step_s - expected).abs() < 1e-12 * expected);
    }

    #[test]
    fn offload_moves_gradients_every_micro_batch_and_weights_every_pass() {
        let p = 1_000_000;
        let opt = Offload::parse("optimizer").unwrap();
        let z2 = Placement::new(2, 4, opt).unwrap();
        assert_eq!(
            pcie_bytes(p, &z2, 4, Recompute::None),
            (2 * p / 4, 4 * 2 * p / 4)
        );
        let all = Offload::parse("optimizer,parameters").unwrap();
        let z3 = Placement::new(3, 1, all).unwrap();
        assert_eq!(
            pcie_bytes(p, &z3, 4, Recompute::Full),
            (4 * 3 * 2 * p, 4 * 2 * p)
        );
    }

    #[test]
    fn ring_collectives_send_their_share() {
        let p = 800;
        let none = Offload::default();
        let ring = |stage, k| {
            network_bytes(
                p,
                &Placement::new(stage, 8, none).unwrap(),
                k,
                Recompute::None,
            )
        };
        // All-reduce of the 16-bit gradients: 2·(7/8)·1600 bytes.
        assert_eq!(ring(0, 4), 2800);
        assert_eq!(ring(1, 4), 2800);
        assert_eq!(ring(2, 4), 5 * 1400);
        assert_eq!(ring(3, 4), 4 * 3 * 1400);
        assert_eq!(
            network_bytes(p, &Placement::new(3, 1, none).unwrap(), 4, Recompute::None),
            0
        );
    }

    #[test]
    fn on_the_host_nothing_crosses_pcie_and_adamw_always_runs_there() {
        let a = named("gpt2").unwrap();
        let host = Rates {
            gpu: Gpu {
                host: true,
                ..gpu("a100").unwrap()
            },
            ..rates()
        };
        let z = Placement::new(0, 1, Offload::parse("optimizer").unwrap()).unwrap();
        let t = step_time(&a, 2, 1, Recompute::None, &z, &host);
        assert_eq!((t.h2d_bytes, t.d2h_bytes, t.pcie_s), (0, 0, 0.0));
        assert_eq!(t.cpu_adam_bytes, 16 * a.param_count());
        assert_eq!(t.step_s, t.compute_s + t.cpu_adam_bytes as f64 / 10e9);
        let plain = Placement::new(0, 1, Offload::default()).unwrap();
        let t = step_time(&a, 2, 1, Recompute::None, &plain, &host);
        assert_eq!(t.cpu_adam_bytes, 16 * a.param_count());
    }

    #[test]
    fn bad_rates_are_refused() {
        assert_eq!(check_mfu(0.0), Err(TimeError::Mfu(0.0)));
        assert_eq!(check_mfu(1.5), Err(TimeError::Mfu(1.5)));
        assert_eq!(check_mfu(1.0), Ok(1.0));
        assert!(check_rate("pcie-gbps", f64::NAN).is_err());
        assert_eq!(
            gpu("v100").unwrap_err().to_string(),
            "--gpu-model v100: unknown GPU; models: h100, h200, a100, rtx4090"
        );
    }
}
