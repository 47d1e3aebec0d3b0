//! Time per optimizer step, from four rates: the device's compute (published peak × MFU), the
//! host link (PCIe, per direction), the host's AdamW (bytes of optimizer state per second,
//! measured by `gaccwb bench --adamw`) and the link between ranks (ring collectives). Compute,
//! transfers and collectives overlap; the CPU update runs after the last gradient arrives, so
//! a step takes max(compute, PCIe, network) + CPU optimizer, and the bound is the largest term.

use serde::Serialize;

use super::activations::Recompute;
use super::lora::Lora;
use super::model_states::{Placement, Weights};
use super::plan::Setup;
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
    /// Host link, GB/s in each direction.
    pub pcie_gbps: f64,
    /// Link between ranks, GB/s in each direction (NVLink; PCIe where there is none).
    pub link_gbps: f64,
    /// The device is the host (`cpu`): nothing crosses PCIe and the optimizer always runs on
    /// the host.
    pub host: bool,
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
pub(crate) fn gpu_names() -> Vec<&'static str> {
    GPUS.iter().map(|g| g.0).collect()
}

/// Bad time-model settings.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum TimeError {
    #[error("--gpu-model {0}: unknown GPU; models: {models}", models = gpu_names().join(", "))]
    /// `--gpu-model` names no known GPU.
    UnknownGpu(String),
    #[error("--mfu {}: expected a fraction from {MIN_MFU} to 1", shown(.0))]
    /// `--mfu` outside (0, 1].
    Mfu(f64),
    #[error("--{flag} {value}: expected a number from {MIN_RATE:e} to {MAX_RATE:e}", flag = .0, value = shown(.1))]
    /// A rate that is not positive, or beyond any device: the flag and the value.
    Rate(&'static str, f64),
    #[error("--gpu-model cpu with --ranks {0} needs --link-gbps (the rate between the processes on this host)")]
    /// Ranks on the host with no rate between them.
    HostLink(u64),
    #[error("--offload with --gpu-model cpu: on the host, device and host memory are one; offload moves nothing (leave it out)")]
    /// Offload asked for where there is nothing to offload to.
    OffloadOnHost,
}

/// A number as a person wrote it: plain when short, else in scientific notation (`1e-300`, not
/// 300 digits).
pub(crate) fn shown(x: &f64) -> String {
    let plain = x.to_string();
    if plain.len() <= 12 {
        plain
    } else {
        format!("{x:e}")
    }
}

/// The smallest rate a flag takes (TFLOP/s or GB/s).
pub(crate) const MIN_RATE: f64 = 1e-6;
/// The largest rate a flag takes (a million TFLOP/s or GB/s: beyond any machine).
pub(crate) const MAX_RATE: f64 = 1e6;
/// The smallest MFU taken (0.1%): below it no step time means anything.
pub(crate) const MIN_MFU: f64 = 1e-3;

/// Where the host's rates (AdamW, and the `cpu` device's product rate) come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HostSource {
    /// A flag (`--cpu-adam-gbps`).
    Flag,
    /// Timed on this host (cached after the first `gaccwb estimate`).
    Measured,
    /// The development machine's figures, neither given nor measured.
    Assumed,
}

/// A named GPU's published figures.
pub(crate) fn gpu(name: &str) -> Result<Gpu, TimeError> {
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

/// A rate from [`MIN_RATE`] to [`MAX_RATE`], or an error naming its flag.
pub(crate) fn check_rate(flag: &'static str, value: f64) -> Result<f64, TimeError> {
    if (MIN_RATE..=MAX_RATE).contains(&value) {
        Ok(value)
    } else {
        Err(TimeError::Rate(flag, value))
    }
}

/// An MFU from [`MIN_MFU`] to 1.
pub(crate) fn check_mfu(value: f64) -> Result<f64, TimeError> {
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
    /// Where the host's rates come from.
    pub host_source: HostSource,
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

/// FLOPs per token: 6 per multiplied parameter (forward 2, the input's gradient 2, the
/// weight's gradient 2) and 12 per query·key position for attention's two products (forward and
/// backward: 12·s·q per layer, 12·w·q in a sliding layer of window w < s), plus another forward
/// (2 per parameter, 4 per position) under full recomputation, or the attention core's forward
/// (4 per position) under selective recomputation. Under LoRA the frozen base needs no weight
/// gradient: 4 per base parameter, 6 per adapter parameter.
pub fn flops_per_token(arch: &Arch, recompute: Recompute, lora: Option<&Lora>) -> f64 {
    let p = arch.matmul_params() as f64;
    let adapters = lora.map_or(0.0, |l| l.active_adapter_params(arch) as f64);
    let sliding = arch.sliding_layers();
    let positions = ((arch.layers - sliding) * arch.seq_len + sliding * arch.sliding_span()) as f64;
    let attention = positions * arch.q_width() as f64;
    let matmuls = match lora {
        None => 6.0 * p,
        Some(_) => 4.0 * p + 6.0 * adapters,
    };
    matmuls
        + 12.0 * attention
        + match recompute {
            Recompute::None => 0.0,
            Recompute::Selective => 4.0 * attention,
            Recompute::Full => 2.0 * (p + adapters) + 4.0 * attention,
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
/// them (the frozen base too) every pass (its partition; the rest arrives over the inter-rank
/// link).
pub(crate) fn pcie_bytes(
    w: &Weights,
    z: &Placement,
    accum: u64,
    recompute: Recompute,
) -> (u64, u64) {
    let part = |bytes: u64, stage: u8| {
        if z.stage >= stage {
            bytes.div_ceil(z.ranks)
        } else {
            bytes
        }
    };
    let o = &z.offload;
    let d2h = if o.gradients {
        accum * part(2 * w.trained, 1)
    } else {
        0
    };
    let mut h2d = 0;
    if o.parameters {
        h2d += accum * weight_passes(recompute) * part(2 * w.trained + w.frozen_bytes, 3);
    } else if o.optimizer {
        h2d += part(2 * w.trained, 1);
    }
    if o.gradients && !o.optimizer {
        // The device's optimizer reads its fp32 gradients back.
        h2d += part(4 * w.trained, 1);
    }
    (h2d, d2h)
}

/// Bytes each rank sends per step in ring collectives over W ranks (an all-reduce sends
/// 2·(W−1)/W of the payload, a reduce-scatter or all-gather (W−1)/W): the 16-bit gradients of the
/// trained parameters and the weights: stage 0 all-reduces once per step, stage 1 reduce-scatters
/// once and all-gathers the updated weights, stage 2 reduce-scatters every micro-batch, stage 3
/// also all-gathers the weights (the frozen base too) every pass. With gradients offloaded there
/// is no buffer to accumulate into, so the reduction happens every micro-batch at every stage.
pub(crate) fn network_bytes(w: &Weights, z: &Placement, accum: u64, recompute: Recompute) -> u64 {
    if z.ranks == 1 {
        return 0;
    }
    let ranks = z.ranks as f64;
    let ring =
        |collectives: f64, bytes: u64| (collectives * (ranks - 1.0) / ranks * bytes as f64) as u64;
    let gradients = 2 * w.trained;
    let reductions = if z.stage >= 2 || z.offload.gradients {
        accum
    } else {
        1
    } as f64;
    match z.stage {
        0 => ring(2.0 * reductions, gradients),
        1 | 2 => ring(reductions + 1.0, gradients),
        _ => {
            let passes = weight_passes(recompute) as f64;
            ring(accum as f64 * passes, gradients + w.frozen_bytes) + ring(accum as f64, gradients)
        }
    }
}

/// Time of one optimizer step of `setup` (micro-batch B, K micro-batches per rank) whose model
/// states are `w`.
pub(crate) fn step_time(arch: &Arch, setup: &Setup, w: &Weights, rates: &Rates) -> StepTime {
    let (accum, recompute, z) = (setup.accum_steps, setup.recompute, &setup.placement);
    let rank_tokens = setup.micro_batch * accum * arch.seq_len;
    let flops = flops_per_token(arch, recompute, setup.lora.as_ref()) * rank_tokens as f64;
    let compute_s = flops / (rates.gpu.peak_tflops * 1e12 * rates.mfu);
    let (h2d, d2h) = if rates.gpu.host {
        (0, 0)
    } else {
        pcie_bytes(w, z, accum, recompute)
    };
    // Nothing to move takes no time, whatever the link (the CPU's is 0 GB/s: none exists).
    let over = |bytes: u64, gbps: f64| match bytes {
        0 => 0.0,
        b => b as f64 / (gbps * 1e9),
    };
    let pcie_s = over(h2d.max(d2h), rates.gpu.pcie_gbps);
    let network = network_bytes(w, z, accum, recompute);
    let network_s = over(network, rates.gpu.link_gbps);
    // The host updates every rank's partition: the trained parameters once (stage 0: once per
    // rank).
    let cpu_adam_bytes = if z.offload.optimizer || rates.gpu.host {
        16 * w.trained * if z.stage == 0 { z.ranks } else { 1 }
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
    use crate::hf::{named, Sliding};
    use crate::planner::lora::BaseDtype;
    use crate::planner::model_states::Offload;

    fn setup(b: u64, k: u64, recompute: Recompute, placement: Placement) -> Setup {
        Setup {
            micro_batch: b,
            accum_steps: k,
            attention: crate::planner::activations::Attention::Flash,
            recompute,
            placement,
            lora: None,
        }
    }

    fn full(a: &Arch) -> Weights {
        Weights::full(a.param_count(), a.largest_module_params())
    }

    fn rates() -> Rates {
        Rates {
            gpu: gpu("a100").unwrap(),
            mfu: 0.5,
            cpu_adam_bytes_per_s: 10e9,
            host_source: HostSource::Flag,
        }
    }

    #[test]
    fn flops_follow_six_p_plus_attention() {
        let a = named("llama3-8b").unwrap();
        let p = a.matmul_params() as f64;
        let att = (32 * 8192 * 4096) as f64;
        assert_eq!(
            flops_per_token(&a, Recompute::None, None),
            6.0 * p + 12.0 * att
        );
        assert_eq!(
            flops_per_token(&a, Recompute::Full, None) - flops_per_token(&a, Recompute::None, None),
            2.0 * p + 4.0 * att
        );
    }

    #[test]
    fn compute_bound_without_offload_on_one_rank() {
        let a = named("gpt2").unwrap();
        let z = Placement::new(0, 1, Offload::default()).unwrap();
        let t = step_time(&a, &setup(8, 4, Recompute::None, z), &full(&a), &rates());
        assert_eq!((t.h2d_bytes, t.d2h_bytes, t.network_bytes), (0, 0, 0));
        assert_eq!(t.bound, "compute");
        assert_eq!(t.tokens, 8 * 4 * 1024);
        let expected =
            flops_per_token(&a, Recompute::None, None) * t.tokens as f64 / (312e12 * 0.5);
        assert!((t.step_s - expected).abs() < 1e-12 * expected);
    }

    #[test]
    fn offload_moves_gradients_every_micro_batch_and_weights_every_pass() {
        let p = 1_000_000;
        let opt = Offload::parse("optimizer").unwrap();
        let z2 = Placement::new(2, 4, opt).unwrap();
        assert_eq!(
            pcie_bytes(&Weights::full(p, 0), &z2, 4, Recompute::None),
            (2 * p / 4, 4 * 2 * p / 4)
        );
        let all = Offload::parse("optimizer,parameters").unwrap();
        let z3 = Placement::new(3, 1, all).unwrap();
        assert_eq!(
            pcie_bytes(&Weights::full(p, 0), &z3, 4, Recompute::Full),
            (4 * 3 * 2 * p, 4 * 2 * p)
        );
    }

    #[test]
    fn ring_collectives_send_their_share() {
        let p = 800;
        let none = Offload::default();
        let ring = |stage, k| {
            network_bytes(
                &Weights::full(p, 0),
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
            network_bytes(
                &Weights::full(p, 0),
                &Placement::new(3, 1, none).unwrap(),
                4,
                Recompute::None
            ),
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
        let t = step_time(&a, &setup(2, 1, Recompute::None, z), &full(&a), &host);
        assert_eq!((t.h2d_bytes, t.d2h_bytes, t.pcie_s), (0, 0, 0.0));
        assert_eq!(t.cpu_adam_bytes, 16 * a.param_count());
        assert_eq!(t.step_s, t.compute_s + t.cpu_adam_bytes as f64 / 10e9);
        let plain = Placement::new(0, 1, Offload::default()).unwrap();
        let t = step_time(&a, &setup(2, 1, Recompute::None, plain), &full(&a), &host);
        assert_eq!(t.cpu_adam_bytes, 16 * a.param_count());
    }

    #[test]
    fn lora_computes_no_weight_gradient_for_the_base_and_updates_adapters_only() {
        let a = named("llama3-8b").unwrap();
        let lora = Lora::new(&a, 16, None, 0.0, BaseDtype::Bf16).unwrap();
        let (p, att) = (a.matmul_params() as f64, (32 * 8192 * 4096) as f64);
        assert_eq!(
            flops_per_token(&a, Recompute::None, Some(&lora)),
            4.0 * p + 6.0 * 41_943_040.0 + 12.0 * att
        );
        let w = Weights {
            trained: 41_943_040,
            frozen_bytes: 2 * a.param_count(),
            gathered: 0,
        };
        let z = Placement::new(0, 1, Offload::parse("optimizer").unwrap()).unwrap();
        let s = Setup {
            lora: Some(lora),
            ..setup(1, 8, Recompute::None, z)
        };
        let t = step_time(&a, &s, &w, &rates());
        assert_eq!(t.cpu_adam_bytes, 16 * 41_943_040);
        assert_eq!(
            (t.h2d_bytes, t.d2h_bytes),
            (2 * 41_943_040, 8 * 2 * 41_943_040)
        );
    }

    #[test]
    fn a_sliding_window_shortens_attention_in_its_layers() {
        let mut a = named("mistral-7b").unwrap();
        a.seq_len = 8192;
        let dense = flops_per_token(&a, Recompute::None, None);
        a.sliding = Some(Sliding {
            window: 4096,
            layers: 16,
        });
        let fewer = (16 * (8192 - 4096) * 4096) as f64;
        assert_eq!(
            dense - flops_per_token(&a, Recompute::None, None),
            12.0 * fewer
        );
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
