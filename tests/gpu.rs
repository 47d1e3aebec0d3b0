//! On a GPU (`cargo test --features cuda --test gpu -- --include-ignored`): the CUDA path against
//! the CPU's fused kernels. Every test is ignored by default, with the reason, so a CUDA build on a
//! machine without a GPU counts them as ignored in its summary instead of passing them; run with
//! `--include-ignored`, a test fails when no CUDA device answers (CI compiles these; a lent GPU
//! runs them through `scripts/gpu-smoke.sh`).
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::{accumulating, TestModel, TINY};
use gaccwb::control::{Dtype, Knobs};
use gaccwb::data::Split;
use gaccwb::memory::gpu::sources_for;
use gaccwb::model::Gpt;
use gaccwb::ops;
use gaccwb::telemetry::MemorySource;
use gaccwb::train::{relative_error, window_gradients, AdamW, Hyper, Trainer};

/// `cuda:0`; a test asked to run without one fails, naming why.
fn gpu(test: &str) -> Device {
    Device::new_cuda(0).unwrap_or_else(|e| panic!("{test}: no CUDA device answers: {e}"))
}

/// Relative L2 error of one tensor against a reference on another device.
fn rel(a: &Tensor, reference: &Tensor) -> f64 {
    let a = a.to_device(&Device::Cpu).unwrap();
    let r = reference.to_device(&Device::Cpu).unwrap();
    relative_error(&[a], &[r]).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda --test gpu -- --include-ignored"]
fn one_window_of_f32_gradients_matches_the_cpu() {
    let cuda = gpu("one_window_of_f32_gradients_matches_the_cpu");
    let s = accumulating();
    let cpu = Trainer::new(s.clone(), Device::Cpu).unwrap();
    let samples: Vec<_> = (0..8)
        .map(|i| cpu.corpus().sample(Split::Train, i))
        .collect();
    let knobs = Knobs::from_scenario(&s);
    let on = |model: &Gpt, device: &Device| {
        let w = window_gradients(model, &samples, &knobs, 1.0, device, || true);
        let Ok(w) = w else { panic!("window failed") };
        w
    };
    let gpu_model = Gpt::new(&s.model, s.train.seed, &cuda).unwrap();
    let (a, b) = (on(cpu.model(), &Device::Cpu), on(&gpu_model, &cuda));
    assert!(
        (a.loss - b.loss).abs() / a.loss < 1e-5,
        "loss {} vs {}",
        a.loss,
        b.loss
    );
    let mut worst = 0f64;
    for (p, (g_cpu, g_gpu)) in cpu.model().params.iter().zip(a.grads.iter().zip(&b.grads)) {
        let e = rel(g_gpu, g_cpu);
        worst = worst.max(e);
        assert!(
            e <= 1e-4,
            "{}: cuda gradient off the CPU's by {e:e}",
            p.name
        );
    }
    println!("f32 window gradients, cuda:0 vs CPU fused: worst rel. error {worst:.2e}");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda --test gpu -- --include-ignored"]
fn lean_ops_match_the_plain_composite_ops_on_the_gpu() {
    let cuda = gpu("lean_ops_match_the_plain_composite_ops_on_the_gpu");
    let s = accumulating();
    let cpu = Trainer::new(s.clone(), Device::Cpu).unwrap();
    let samples: Vec<_> = (0..4)
        .map(|i| cpu.corpus().sample(Split::Train, i))
        .collect();
    let model = Gpt::new(&s.model, s.train.seed, &cuda).unwrap();
    let grads = |dtype: Dtype, plain: bool| {
        let mut knobs = Knobs::from_scenario(&s);
        knobs.dtype = dtype;
        let _plain = ops::force_plain(plain);
        let w = window_gradients(&model, &samples, &knobs, 1.0, &cuda, || true);
        let Ok(w) = w else { panic!("window failed") };
        w.grads
    };
    let plain = grads(Dtype::F32, true);
    // f32: the lean ops against the plain ones within 1e-5; bf16 and f16 against f32 within the
    // precision tests' bounds (2%, 0.5%).
    for (dtype, bound) in [(Dtype::F32, 1e-5), (Dtype::Bf16, 0.02), (Dtype::F16, 0.005)] {
        let lean = grads(dtype, false);
        for (p, (g, r)) in model.params.iter().zip(lean.iter().zip(&plain)) {
            let e = rel(g, r);
            assert!(e <= bound, "{dtype:?} {}: lean gradient {e:e} off", p.name);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda --test gpu -- --include-ignored"]
fn one_adamw_step_matches_the_cpu() {
    let cuda = gpu("one_adamw_step_matches_the_cpu");
    let s = accumulating();
    let hyper = Hyper {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let step = |device: &Device| {
        let model = Gpt::new(&s.model, 5, device).unwrap();
        let grads: Vec<Tensor> = model
            .params
            .iter()
            .map(|p| {
                let n = p.var.elem_count();
                let g: Vec<f32> = (0..n).map(|j| (j % 13) as f32 / 13.0 - 0.4).collect();
                Tensor::from_vec(g, p.var.shape(), device).unwrap()
            })
            .collect();
        let mut opt = AdamW::new(&model.params, hyper).unwrap();
        opt.step(&model.params, &grads, 1e-2).unwrap();
        model
    };
    let (cpu, gpu) = (step(&Device::Cpu), step(&cuda));
    for (p, q) in cpu.params.iter().zip(&gpu.params) {
        let e = rel(q.var.as_tensor(), p.var.as_tensor());
        assert!(
            e <= 1e-5,
            "{}: weights after one step differ by {e:e}",
            p.name
        );
    }
}

/// ZeRO on a GPU updates its pieces by Candle ops on the device, then assembles the weights:
/// one process under ZeRO-1 (its shard is every element, the moments cut into 1-D pieces)
/// takes the steps ZeRO-0 takes, and ends on the same weights.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda --test gpu -- --include-ignored"]
fn zero_1_takes_zero_0s_steps_on_the_gpu() {
    let cuda = gpu("zero_1_takes_zero_0s_steps_on_the_gpu");
    let run = |zero: u8| {
        let mut s = accumulating();
        (s.train.steps, s.train.zero) = (3, zero);
        let mut t = Trainer::new(s, cuda.clone()).unwrap();
        t.join(gaccwb::dist::Group::solo()).unwrap();
        let losses: Vec<f64> = (0..3)
            .map(|_| match t.train_step(|| true) {
                Ok(step) => step.loss,
                Err(_) => panic!("zero {zero}: step {} failed on cuda:0", t.step()),
            })
            .collect();
        (losses, t)
    };
    let ((plain, a), (sharded, b)) = (run(0), run(1));
    for (x, y) in plain.iter().zip(&sharded) {
        assert!((x - y).abs() <= 1e-6 * x.abs(), "loss {x} vs {y}");
    }
    let mut worst = 0f64;
    for (p, q) in a.model().params.iter().zip(&b.model().params) {
        let e = rel(q.var.as_tensor(), p.var.as_tensor());
        worst = worst.max(e);
        assert!(
            e <= 1e-6,
            "{}: ZeRO-1 weights off ZeRO-0's by {e:e}",
            p.name
        );
    }
    println!("ZeRO-1 against ZeRO-0 on cuda:0, 3 steps: worst weight rel. error {worst:.2e}");
}

/// `steps` steps of a built-in preset on `device` with 2 heads.
fn preset_run(name: &str, device: &Device, steps: u64) -> Trainer {
    // The width and sample length of `fp16-overflow` and `offload`, whose runs this checks.
    let model = TestModel {
        d_model: 64,
        seq_len: 64,
        ..TINY
    };
    let mut s = model.onto(gaccwb::presets::resolve(name).unwrap());
    s.train.steps = steps;
    let mut t = Trainer::new(s, device.clone()).unwrap();
    for _ in 0..steps {
        let due: Vec<_> = t
            .scenario()
            .timeline
            .iter()
            .filter(|e| e.step == t.step())
            .map(|e| e.control.clone())
            .collect();
        for c in &due {
            t.apply_control(c).unwrap();
        }
        let Ok(step) = t.train_step(|| true) else {
            panic!("{name}: step {} failed on {device:?}", t.step());
        };
        assert!(step.loss.is_finite(), "{name}: loss {}", step.loss);
    }
    t
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda --test gpu -- --include-ignored"]
fn fp16_overflow_preset_skips_and_recovers_on_the_gpu() {
    let cuda = gpu("fp16_overflow_preset_skips_and_recovers_on_the_gpu");
    let t = preset_run("fp16-overflow", &cuda, 30);
    println!(
        "fp16-overflow on cuda:0: {} overflows in {} steps, scale {}",
        t.overflow_count(),
        t.step(),
        t.scaler().scale
    );
    assert!(t.lr_step() > 0, "no step was applied");
    assert!(t.overflow_exhausted().is_none());
    for p in &t.model().params {
        let max = p.var.abs().unwrap().max_all().unwrap();
        assert!(max.to_scalar::<f32>().unwrap().is_finite(), "{}", p.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda --test gpu -- --include-ignored"]
fn offload_preset_keeps_host_state_and_trains_on_the_gpu() {
    let cuda = gpu("offload_preset_keeps_host_state_and_trains_on_the_gpu");
    let mut t = preset_run("offload", &cuda, 6);
    t.apply_control(&gaccwb::control::Control::SetOffload { value: true })
        .unwrap();
    let Ok(step) = t.train_step(|| true) else {
        panic!("offloaded step failed");
    };
    assert!(step.loss.is_finite());
    assert!(
        t.optimizer().m.iter().all(|m| m.device().is_cpu()),
        "moments on the host"
    );
    let master = t
        .optimizer()
        .master
        .as_ref()
        .expect("host master copies on a GPU run");
    for (p, m) in t.model().params.iter().zip(master) {
        assert!(m.device().is_cpu());
        let e = rel(p.var.as_tensor(), m);
        assert!(
            e == 0.0,
            "{}: device weights and host master differ by {e:e}",
            p.name
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda --test gpu -- --include-ignored"]
fn half_precision_offload_keeps_only_bf16_weights_on_the_gpu() {
    let cuda = gpu("half_precision_offload_keeps_only_bf16_weights_on_the_gpu");
    for grads in ["device", "host"] {
        let mut s = accumulating();
        s.set("train.dtype=bf16").unwrap();
        s.set("train.offload=true").unwrap();
        s.set(&format!("train.offload_grads={grads}")).unwrap();
        let mut on_gpu = Trainer::new(s.clone(), cuda.clone()).unwrap();
        let mut on_cpu = Trainer::new(s, Device::Cpu).unwrap();
        for _ in 0..3 {
            let (Ok(a), Ok(b)) = (on_gpu.train_step(|| true), on_cpu.train_step(|| true)) else {
                panic!("{grads}: a step failed");
            };
            assert!(a.loss.is_finite(), "{grads}");
            assert_eq!(
                a.host_device_bytes, b.host_device_bytes,
                "{grads}: bytes counted"
            );
        }
        assert!(
            on_gpu.optimizer().m.iter().all(|m| m.device().is_cpu()),
            "{grads}"
        );
        let (gpu_master, cpu_master) = (on_gpu.master_weights(), on_cpu.master_weights());
        for ((p, g), c) in on_gpu
            .model()
            .params
            .iter()
            .zip(&gpu_master)
            .zip(&cpu_master)
        {
            assert!(
                !p.var.device().is_cpu(),
                "{grads} {}: device weights",
                p.name
            );
            assert_eq!(p.var.dtype(), DType::BF16, "{grads} {}", p.name);
            assert!(
                g.device().is_cpu() && g.dtype() == DType::F32,
                "{grads} {}",
                p.name
            );
            // The device's weights are the host master's cast, exactly.
            let cast = g
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let device = p.var.to_dtype(DType::F32).unwrap();
            assert_eq!(rel(&device, &cast), 0.0, "{grads} {}", p.name);
            // Three steps of bf16 kernels on two devices: close, not equal. Matrices only: a
            // bias or gain starts at 0 or 1 and AdamW moves it by about ±lr a step whatever its
            // gradient's size, so where that gradient is near zero the two devices' bf16 sums
            // may differ in sign and the parameter by O(lr) (measured on an H200: qkv bias
            // 31% relative after 3 steps, with every matrix within 1e-2).
            if p.decay {
                let e = rel(g, c);
                assert!(
                    e <= 1e-2,
                    "{grads} {}: master differs from the CPU's by {e:e}",
                    p.name
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda --test gpu -- --include-ignored"]
fn nvml_sees_at_least_what_the_pool_holds() {
    let cuda = gpu("nvml_sees_at_least_what_the_pool_holds");
    // Hold some memory so the pool is not empty.
    let _held = Tensor::zeros((64, 1024, 1024), candle_core::DType::F32, &cuda).unwrap();
    cuda.synchronize().unwrap();
    let readings = sources_for(&cuda)
        .into_iter()
        .map(|mut s| (s.source(), s.sample()))
        .collect::<Vec<_>>();
    let find = |source: MemorySource| {
        readings
            .iter()
            .find(|(s, _)| *s == source)
            .map(|(_, r)| r.clone())
    };
    let nvml = match find(MemorySource::Nvml) {
        Some(Ok(e)) => e,
        other => panic!("a machine with a CUDA device answers NVML: {other:?}"),
    };
    let pool = find(MemorySource::CudaPool)
        .expect("a CUDA device has a pool source")
        .expect("the pool answers");
    let (nvml_used, pool_used) = (nvml.used.unwrap(), pool.used.unwrap());
    println!(
        "NVML used {nvml_used} B (process {:?}), pool used {pool_used} B reserved {:?}",
        nvml.process_used, pool.reserved
    );
    assert!(pool_used >= 256 << 20, "the pool holds the 256 MiB tensor");
    assert!(
        nvml_used >= pool_used,
        "NVML counts the pool and the context"
    );
    if let Some(process) = nvml.process_used {
        assert!(
            process >= pool_used,
            "the process's NVML figure includes its pool"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda --test gpu -- --include-ignored"]
fn every_hugging_face_family_computes_transformers_loss_and_gradients_on_the_gpu() {
    use common::hf::{gradients, loss, reference_grad, rel_l2, Case, CASES};
    let cuda = gpu("every_hugging_face_family_computes_transformers_loss_and_gradients_on_the_gpu");
    let mut worst = 0f64;
    for name in CASES {
        let case = Case::on(name, &cuda);
        let model = case.model();
        let (value, root, held) = loss(&model, &case, DType::F32);
        let want = case.number("/loss");
        assert!(
            (value - want).abs() / want <= 1e-5,
            "{name}: loss {value} on cuda:0 vs transformers {want}"
        );
        // bf16 on the lean ops: within the CPU test's 2% of transformers' f32 loss.
        let (half, _, _) = loss(&model, &case, DType::BF16);
        assert!(
            (half - want).abs() / want <= 0.02,
            "{name}: bf16 loss {half} on cuda:0 vs transformers' f32 {want}"
        );
        if case.reference.get("grads").is_none() {
            continue;
        }
        for (i, g) in gradients(&model, &root, &held).iter().enumerate() {
            let g = g.to_device(&Device::Cpu).unwrap();
            let e = rel_l2(&g, &reference_grad(&case, &model, i));
            worst = worst.max(e);
            let p = &model.params[i].name;
            assert!(
                e <= 1e-4,
                "{name}: gradient of {p} on cuda:0 off transformers' by {e:e}"
            );
        }
    }
    println!("Hugging Face families on cuda:0 vs transformers: worst gradient rel. L2 {worst:.2e}");
}
