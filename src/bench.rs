//! Training throughput: tokens per second of the project's own optimizer step.
//!
//! Every sample is full length (every position counted), so tokens/s is positions processed per
//! second and a run does the same work as `benches/torch_reference.py` at the same shapes.
//! Candle sizes its matmul and element-wise thread pools once per process from
//! `RAYON_NUM_THREADS`, so the thread count is fixed before the first tensor op (see `main`).

use std::time::Instant;

use candle_core::Device;
use serde::Serialize;

use crate::control::Dtype;
use crate::ops::fused::{head_clock, Reading};
use crate::scenario::{DataSource, Scenario};
use crate::telemetry::PhaseMs;
use crate::train::Trainer;

/// One shape to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Case {
    pub micro_batch: usize,
    pub accum_steps: usize,
}

/// The cases `gaccwb bench` runs by default: accumulation cost at B=8, and a larger micro-batch.
pub const DEFAULT_CASES: [Case; 3] = [
    Case {
        micro_batch: 8,
        accum_steps: 1,
    },
    Case {
        micro_batch: 8,
        accum_steps: 4,
    },
    Case {
        micro_batch: 32,
        accum_steps: 1,
    },
];

/// Timed optimizer steps of one case.
#[derive(Clone, Debug, Serialize)]
pub struct Measurement {
    pub micro_batch: usize,
    pub accum_steps: usize,
    /// The compute dtype the steps ran in.
    pub dtype: Dtype,
    pub threads: usize,
    /// Positions per optimizer step (B·K·seq_len).
    pub tokens_per_step: u64,
    /// Wall time of each timed step, in seconds.
    pub step_s: Vec<f64>,
    /// The trainer's forward, backward and optimizer time of each timed step.
    pub phase_ms: Vec<PhaseMs>,
    /// The fused head's share of each timed step's forward and backward (`None` in a step the
    /// fused head did not run: the lean or plain ops).
    pub head_ms: Vec<Option<HeadMs>>,
}

/// Time in the fused LM head and loss (`ops::fused::head_clock`), part of the forward and the
/// backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct HeadMs {
    /// Logits and loss, ms.
    pub forward: f64,
    /// dlogits, dx and dW, ms.
    pub backward: f64,
}

impl HeadMs {
    /// What a head clock counted over one step, if the fused head ran in it.
    fn of(step: Reading) -> Option<HeadMs> {
        (step.calls > 0).then_some(HeadMs {
            forward: step.forward.as_secs_f64() * 1e3,
            backward: step.backward.as_secs_f64() * 1e3,
        })
    }
}

impl Measurement {
    /// Tokens/s of each timed step, ascending.
    pub fn tokens_per_s_sorted(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .step_s
            .iter()
            .map(|s| self.tokens_per_step as f64 / s)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    }

    /// Median tokens/s over the timed steps.
    pub fn median_tokens_per_s(&self) -> f64 {
        median(&self.tokens_per_s_sorted())
    }

    /// Median optimizer steps per second.
    pub fn median_steps_per_s(&self) -> f64 {
        self.median_tokens_per_s() / self.tokens_per_step as f64
    }

    /// Median forward, backward and optimizer time over the timed steps, each phase on its own.
    pub fn median_phase_ms(&self) -> PhaseMs {
        let of =
            |f: fn(&PhaseMs) -> f64| median_of(&self.phase_ms.iter().map(f).collect::<Vec<_>>());
        PhaseMs {
            forward: of(|p| p.forward),
            backward: of(|p| p.backward),
            optimizer: of(|p| p.optimizer),
        }
    }

    /// Median head forward and backward time, each on its own; `None` unless the fused head ran
    /// in every timed step.
    pub fn median_head_ms(&self) -> Option<HeadMs> {
        let head: Vec<HeadMs> = self.head_ms.iter().copied().collect::<Option<_>>()?;
        let of = |f: fn(&HeadMs) -> f64| median_of(&head.iter().map(f).collect::<Vec<_>>());
        (!head.is_empty()).then(|| HeadMs {
            forward: of(|h| h.forward),
            backward: of(|h| h.backward),
        })
    }
}

/// Median of an ascending slice (0 when empty).
pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// `base` with the case's shape, fixed-length synthetic samples and no validation.
pub fn case_scenario(base: &Scenario, case: Case) -> Scenario {
    let mut s = base.clone();
    s.data.source = DataSource::Synthetic;
    s.data.path = None;
    s.data.min_doc_len = s.model.seq_len;
    s.data.max_doc_len = s.model.seq_len;
    s.train.micro_batch = case.micro_batch;
    s.train.accum_steps = case.accum_steps;
    s.train.base_batch = 0;
    s.train.eval_every = 0;
    s.train.steps = 0;
    s
}

/// Threads of the CPU path in this process (`ops::pool::cpu_threads`).
pub fn threads() -> usize {
    crate::ops::cpu_threads()
}

/// Run `warmup` untimed then `steps` timed optimizer steps of `scenario` as given.
pub fn measure(
    scenario: Scenario,
    device: &Device,
    warmup: usize,
    steps: usize,
) -> anyhow::Result<Measurement> {
    let mut m = measure_interleaved(vec![scenario], device, warmup, steps)?;
    Ok(m.remove(0))
}

/// `measure` for several scenarios at once, one step of each in turn: every scenario sees the
/// same machine over the same seconds, so a load that comes and goes (a shared host) falls on
/// all of them alike, and their ratios hold where absolute rates do not.
pub fn measure_interleaved(
    scenarios: Vec<Scenario>,
    device: &Device,
    warmup: usize,
    steps: usize,
) -> anyhow::Result<Vec<Measurement>> {
    let mut trainers = scenarios
        .into_iter()
        .map(|s| Trainer::new(s, device.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut step_s = vec![Vec::with_capacity(steps); trainers.len()];
    let mut phase_ms = vec![Vec::with_capacity(steps); trainers.len()];
    let mut head_ms = vec![Vec::with_capacity(steps); trainers.len()];
    let mut tokens_per_step = vec![0; trainers.len()];
    for i in 0..warmup + steps {
        for (j, trainer) in trainers.iter_mut().enumerate() {
            let (t0, head0) = (Instant::now(), head_clock());
            let step = match trainer.train_step(|| true) {
                Ok(step) => step,
                Err(crate::train::Interrupt::Failed(e)) => return Err(e.into()),
                Err(crate::train::Interrupt::Stop) => anyhow::bail!("benchmark step interrupted"),
            };
            let elapsed = t0.elapsed().as_secs_f64();
            let head = HeadMs::of(head_clock().since(head0));
            if i >= warmup {
                step_s[j].push(elapsed);
                phase_ms[j].push(step.phase_ms);
                head_ms[j].push(head);
                tokens_per_step[j] = step.tokens;
            }
        }
    }
    Ok(trainers
        .iter()
        .zip(step_s)
        .zip(phase_ms)
        .zip(head_ms)
        .zip(tokens_per_step)
        .map(
            |((((trainer, step_s), phase_ms), head_ms), tokens_per_step)| Measurement {
                micro_batch: trainer.knobs().micro_batch,
                accum_steps: trainer.knobs().accum_steps,
                dtype: trainer.knobs().dtype,
                threads: threads(),
                tokens_per_step,
                step_s,
                phase_ms,
                head_ms,
            },
        )
        .collect())
}

/// Tokens/s of one case on fixed-length samples.
pub fn measure_case(
    base: &Scenario,
    case: Case,
    device: &Device,
    warmup: usize,
    steps: usize,
) -> anyhow::Result<Measurement> {
    measure(case_scenario(base, case), device, warmup, steps)
}

/// This host's rates for the planner (`gaccwb bench --adamw`): the fused AdamW kernel in bytes
/// of optimizer state per second (16 per parameter: the f32 weight, gradient and two moments it
/// walks) and the fused ops' f32 matrix product in FLOP/s.
#[derive(Clone, Debug, Serialize)]
pub struct HostRates {
    pub threads: usize,
    /// Parameters each AdamW step updated.
    pub adamw_params: usize,
    /// Wall time of each timed AdamW step, in seconds.
    pub adamw_step_s: Vec<f64>,
    /// 16 · parameters / the median step time.
    pub adamw_bytes_per_s: f64,
    /// The product's side (`n×n · n×n`).
    pub matmul_n: usize,
    pub matmul_s: Vec<f64>,
    /// 2·n³ / the median product time.
    pub matmul_flops_per_s: f64,
}

/// Median of unsorted times.
fn median_of(times: &[f64]) -> f64 {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    median(&sorted)
}

/// `steps` timed calls of `f` after one untimed one.
fn timed(steps: usize, mut f: impl FnMut() -> candle_core::Result<()>) -> anyhow::Result<Vec<f64>> {
    f()?;
    (0..steps)
        .map(|_| {
            let t0 = Instant::now();
            f()?;
            Ok(t0.elapsed().as_secs_f64())
        })
        .collect()
}

/// Time per call of `f` on a GPU, `steps` samples: a GPU's call returns once queued, so each
/// sample runs enough calls to take `GPU_SAMPLE_S` (one product there can take less than its
/// launch) and waits for the last to end.
fn timed_on_gpu(
    steps: usize,
    device: &Device,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> anyhow::Result<Vec<f64>> {
    let mut run = |calls: usize| -> anyhow::Result<f64> {
        let t0 = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        device.synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    run(1)?;
    let one = run(1)?;
    let calls = ((GPU_SAMPLE_S / one.max(1e-9)).ceil() as usize).clamp(1, 10_000);
    (0..steps).map(|_| Ok(run(calls)? / calls as f64)).collect()
}

/// Seconds one timed sample of GPU products takes at least.
const GPU_SAMPLE_S: f64 = 0.02;

/// Measures the fused AdamW over `params` f32 parameters (in 8 tensors, so the pool can split
/// them) and one `n×n` product, `steps` times each.
pub fn measure_host_rates(params: usize, n: usize, steps: usize) -> anyhow::Result<HostRates> {
    use crate::ops::fused::{adamw_update_all, project, AdamWJob, AdamWStep};
    use candle_core::{DType, Tensor};
    let device = Device::Cpu;
    let chunk = params.div_ceil(8);
    let filled = |value: f64| Tensor::full(value as f32, chunk, &device);
    let w: Vec<Tensor> = (0..8)
        .map(|_| filled(0.5))
        .collect::<candle_core::Result<_>>()?;
    let m: Vec<Tensor> = (0..8)
        .map(|_| filled(0.0))
        .collect::<candle_core::Result<_>>()?;
    let v: Vec<Tensor> = (0..8)
        .map(|_| filled(0.0))
        .collect::<candle_core::Result<_>>()?;
    let g = filled(1e-3)?;
    let step = AdamWStep {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        step_size: 1e-4,
        inv_bc2: 1.0,
        decay: 1.0,
    };
    let adamw_step_s = timed(steps, || {
        let jobs: Vec<AdamWJob> = (0..8)
            .map(|i| AdamWJob {
                w: &w[i],
                m: &m[i],
                v: &v[i],
                g: g.clone(),
                step,
            })
            .collect();
        adamw_update_all(&jobs, None).map(drop)
    })?;
    let a = Tensor::ones((n, n), DType::F32, &device)?;
    let matmul_s = timed(steps, || project(&a, &a).map(drop))?;
    let updated = 8 * chunk;
    Ok(HostRates {
        threads: threads(),
        adamw_params: updated,
        adamw_bytes_per_s: 16.0 * updated as f64 / median_of(&adamw_step_s),
        adamw_step_s,
        matmul_n: n,
        matmul_flops_per_s: 2.0 * (n as f64).powi(3) / median_of(&matmul_s),
        matmul_s,
    })
}

/// One product shape, `[m, k] · [k, n]`, and the rate the fused ops' product of that dtype ran
/// it at.
#[derive(Clone, Debug, Serialize)]
pub struct ProductRate {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// The operands' storage dtype (`f32`, `bf16`, `f16`).
    pub dtype: &'static str,
    /// 2·m·k·n / the median of the timed products.
    pub flops_per_s: f64,
    /// What the products ran on (`ops::fused::Bf16Kernel::name`; f32 and f16: `gemm`; a GPU:
    /// `cublas`).
    pub kernel: &'static str,
}

/// The product the step's products take, of `dtype` operands at each shape on `device`, `steps`
/// timed products after one untimed one. On the CPU the fused ops' (`ops::fused::project`): bf16
/// on AMX tiles or AVX-512 BF16 dot products where the CPU has them (`ops::fused::bf16_kernel`),
/// else widened into f32 `gemm`. On a GPU Candle's `matmul` (cuBLAS).
pub fn measure_products(
    shapes: &[(usize, usize, usize)],
    dtype: Dtype,
    steps: usize,
    device: &Device,
) -> anyhow::Result<Vec<ProductRate>> {
    use candle_core::Tensor;
    shapes
        .iter()
        .map(|&(m, k, n)| {
            let a = Tensor::ones((m, k), dtype.candle(), device)?;
            let b = Tensor::ones((k, n), dtype.candle(), device)?;
            let s = match device {
                Device::Cpu => timed(steps, || crate::ops::fused::project(&a, &b).map(drop))?,
                _ => timed_on_gpu(steps, device, || a.matmul(&b).map(drop))?,
            };
            Ok(ProductRate {
                m,
                k,
                n,
                dtype: dtype.name(),
                flops_per_s: 2.0 * (m * k * n) as f64 / median_of(&s),
                kernel: product_kernel(dtype, device),
            })
        })
        .collect()
}

/// What the step's products of `dtype` run on: on the CPU `gemm` (f32 FMAs, bf16 and f16
/// widened) unless bf16 has AMX tiles or AVX-512 BF16 dot products (`ops::fused::bf16_kernel`);
/// on a GPU cuBLAS.
pub fn product_kernel(dtype: Dtype, device: &Device) -> &'static str {
    use crate::ops::fused::{bf16_kernel, Bf16Kernel};
    match (device, dtype) {
        (Device::Cpu, Dtype::Bf16) => bf16_kernel().name(),
        (Device::Cpu, _) => Bf16Kernel::Gemm.name(),
        _ => "cublas",
    }
}

/// Whether `dtype`'s products run on f32 FMAs on `device` (`gemm` on the CPU), so that the f32
/// FMA peak bounds their rate.
pub fn on_fmas(dtype: Dtype, device: &Device) -> bool {
    fma_kernel(product_kernel(dtype, device))
}

/// Whether products on `kernel` (`product_kernel`'s names) are f32 FMAs.
fn fma_kernel(kernel: &str) -> bool {
    kernel == crate::ops::fused::Bf16Kernel::Gemm.name()
}

impl ProductRate {
    /// Whether this product ran on f32 FMAs, so that the f32 FMA peak bounds it.
    pub fn on_fmas(&self) -> bool {
        fma_kernel(self.kernel)
    }
}

/// The f32 FMA peak of the step's threads (`ops::peak`) on the CPU; `None` on a GPU or a CPU
/// without AVX2 or AVX-512F.
pub fn measure_fma_peak(device: &Device) -> Option<crate::ops::peak::FmaPeak> {
    const SAMPLES: usize = 5;
    device
        .is_cpu()
        .then(|| crate::ops::peak::fma_peak(threads(), SAMPLES))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::ModelConfig;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn a_case_counts_every_position() {
        let base = Scenario {
            model: ModelConfig {
                vocab: 32,
                d_model: 16,
                layers: 1,
                heads: 2,
                seq_len: 8,
                path: None,
                adapter: None,
            },
            ..Default::default()
        };
        let case = Case {
            micro_batch: 3,
            accum_steps: 2,
        };
        let m = measure_case(&base, case, &Device::Cpu, 1, 2).unwrap();
        assert_eq!(m.tokens_per_step, 3 * 2 * 8);
        assert_eq!(m.step_s.len(), 2);
        assert!(m.median_tokens_per_s() > 0.0);
    }

    /// A one-layer model of `vocab` tokens, d_model 16, T 8, B 2.
    fn tiny(vocab: usize) -> Scenario {
        let mut s = Scenario {
            model: ModelConfig {
                vocab,
                d_model: 16,
                layers: 1,
                heads: 2,
                seq_len: 8,
                path: None,
                adapter: None,
            },
            ..Default::default()
        };
        s.train.micro_batch = 2;
        s
    }

    #[test]
    fn interleaved_scenarios_are_measured_each_in_its_own_dtype() {
        let base = tiny(32);
        let mut half = base.clone();
        half.train.dtype = Dtype::Bf16;
        let m = measure_interleaved(vec![base, half], &Device::Cpu, 1, 3).unwrap();
        assert_eq!(
            m.iter().map(|m| m.dtype).collect::<Vec<_>>(),
            [Dtype::F32, Dtype::Bf16]
        );
        assert!(m.iter().all(|m| m.step_s.len() == 3));
    }

    #[test]
    fn the_fused_head_is_timed_inside_the_forward_and_backward() {
        let mut base = tiny(256);
        base.train.accum_steps = 2;
        let mut m = measure_interleaved(vec![base], &Device::Cpu, 1, 2)
            .unwrap()
            .remove(0);
        for (phase, head) in m.phase_ms.iter().zip(&m.head_ms) {
            let head = head.expect("the fused head ran");
            assert!(
                head.forward > 0.0 && head.forward < phase.forward,
                "{head:?} {phase:?}"
            );
            assert!(
                head.backward > 0.0 && head.backward < phase.backward,
                "{head:?} {phase:?}"
            );
        }
        assert!(m.median_head_ms().is_some());
        // A step the fused head did not run in (the lean ops) has no head time, nor its median.
        assert_eq!(HeadMs::of(Reading::default()), None);
        m.head_ms[0] = None;
        assert_eq!(m.median_head_ms(), None);
    }

    #[test]
    fn gpu_samples_are_per_call() {
        let mut calls = 0;
        let s = timed_on_gpu(3, &Device::Cpu, || {
            calls += 1;
            std::thread::sleep(std::time::Duration::from_millis(2));
            Ok(())
        })
        .unwrap();
        assert_eq!(s.len(), 3);
        // Each sample is its calls' time over their number: never below one call's sleep.
        assert!(s.iter().all(|&t| t >= 0.002), "{s:?}");
        assert_eq!((calls - 2) % 3, 0, "{calls} calls");
    }

    #[test]
    fn host_rates_count_what_they_timed() {
        let r = measure_host_rates(1000, 16, 3).unwrap();
        assert_eq!(r.adamw_params, 8 * 125);
        assert_eq!((r.adamw_step_s.len(), r.matmul_s.len()), (3, 3));
        let adamw = 16.0 * 1000.0 / median_of(&r.adamw_step_s);
        assert_eq!(r.adamw_bytes_per_s, adamw);
        assert_eq!(r.matmul_flops_per_s, 2.0 * 4096.0 / median_of(&r.matmul_s));
    }

    #[test]
    fn product_rates_keep_their_shapes_in_order() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let r = measure_products(&[(4, 32, 16), (16, 32, 4)], dtype, 2, &Device::Cpu).unwrap();
            let shapes: Vec<_> = r.iter().map(|p| (p.m, p.k, p.n, p.dtype)).collect();
            let name = dtype.name();
            assert_eq!(shapes, [(4, 32, 16, name), (16, 32, 4, name)]);
            assert!(r.iter().all(|p| p.flops_per_s > 0.0));
        }
    }
}
