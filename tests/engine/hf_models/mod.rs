//! Hugging Face models against transformers: every family's loss, every parameter's gradient,
//! three AdamW steps, bf16 and perplexity, held to figures transformers produced on the same
//! tiny checkpoints (`benches/hf_parity.py` wrote `tests/fixtures/hf/models/`; docs/PARITY.md).

use crate::common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::hf::*;
use gaccwb::model::hf::ModelDir;
use gaccwb::model::{perplexity, Gpt};
use gaccwb::tokenizer::TextTokenizer;
use gaccwb::train::{AdamW, Hyper};
use serde_json::Value;

#[test]
fn every_family_computes_transformers_loss_and_gradients_in_f32() {
    for name in CASES {
        let case = Case::open(name);
        let model = case.model();
        let (value, root, held) = loss(&model, &case, DType::F32);
        let want = case.number("/loss");
        assert!(
            rel(value, want) <= 1e-5,
            "{name}: loss {value} vs transformers {want}"
        );
        if case.reference.get("grads").is_none() {
            continue;
        }
        let grads = gradients(&model, &root, &held);
        for (i, g) in grads.iter().enumerate() {
            let want = reference_grad(&case, &model, i);
            let e = rel_l2(g, &want);
            let p = &model.params[i].name;
            assert!(
                e <= 1e-4,
                "{name}: gradient of {p} off by {e:e} (relative L2)"
            );
        }
    }
}

/// Three AdamW steps on `model` (clipped, decay on matrices only, the batch of `case` each
/// time) follow the losses and norms transformers recorded in `adamw`.
fn assert_trajectory(what: &str, model: &Gpt, case: &Case, adamw: &Value) {
    let betas = &adamw["betas"];
    let hyper = Hyper {
        beta1: betas[0].as_f64().unwrap(),
        beta2: betas[1].as_f64().unwrap(),
        eps: adamw["eps"].as_f64().unwrap(),
        weight_decay: adamw["weight_decay"].as_f64().unwrap(),
    };
    let (lr, clip) = (
        adamw["lr"].as_f64().unwrap(),
        adamw["clip"].as_f64().unwrap(),
    );
    let losses: Vec<f64> = serde_json::from_value(adamw["losses"].clone()).unwrap();
    let norms: Vec<f64> = serde_json::from_value(adamw["grad_norms"].clone()).unwrap();
    let mut opt = AdamW::new(&model.params, hyper).unwrap();
    for step in 0..3 {
        let (value, root, held) = loss(model, case, DType::F32);
        let e = rel(value, losses[step]);
        assert!(
            e <= 1e-4,
            "{what}: loss before step {} is {value}, transformers {}",
            step + 1,
            losses[step]
        );
        let mut grads = gradients(model, &root, &held);
        let norm = gaccwb::train::global_norm(&grads).unwrap();
        assert!(
            rel(norm, norms[step]) <= 1e-4,
            "{what}: step {} norm {norm} vs {}",
            step + 1,
            norms[step]
        );
        if norm > clip {
            grads = grads.iter().map(|g| (g * (clip / norm)).unwrap()).collect();
        }
        opt.step(&model.params, &grads, lr).unwrap();
    }
    let (last, _, _) = loss(model, case, DType::F32);
    assert!(
        rel(last, losses[3]) <= 1e-4,
        "{what}: loss after 3 steps {last} vs {}",
        losses[3]
    );
}

#[test]
fn three_adamw_steps_follow_transformers_trajectory() {
    for name in CASES {
        let case = Case::open(name);
        if let Some(adamw) = case.reference.get("adamw") {
            assert_trajectory(name, &case.model(), &case, adamw);
        }
    }
}

#[test]
fn bf16_forward_stays_within_two_percent_of_transformers() {
    for name in CASES {
        let case = Case::open(name);
        let model = case.model();
        let (value, _, _) = loss(&model, &case, DType::BF16);
        let want = case.number("/loss");
        assert!(
            rel(value, want) <= 0.02,
            "{name}: bf16 loss {value} vs f32 {want}"
        );
        if case.reference.get("bf16").is_some() {
            let autocast = case.number("/bf16/autocast");
            assert!(
                rel(value, autocast) <= 0.02,
                "{name}: bf16 {value} vs autocast {autocast}"
            );
        }
    }
}

#[test]
fn perplexity_equals_transformers_over_the_eval_text() {
    let text = std::fs::read_to_string(fixtures().join("eval.txt")).unwrap();
    for name in CASES {
        let case = Case::open(name);
        let Some(eval) = case.reference.get("eval") else {
            continue;
        };
        let tokenizer = TextTokenizer::load_file(case.dir.tokenizer.as_ref().unwrap()).unwrap();
        let ids = tokenizer.encode(&text).unwrap();
        let want: Vec<u32> = serde_json::from_value(eval["ids"].clone()).unwrap();
        assert_eq!(
            ids, want,
            "{name}: tokenizer.json cuts the text as transformers does"
        );
        let model = case.model();
        let seq_len = eval["seq_len"].as_u64().unwrap() as usize;
        let p = perplexity(&model, &ids, seq_len, 8, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            p.tokens,
            eval["tokens"].as_u64().unwrap(),
            "{name}: predicted tokens"
        );
        let (nll, ppl) = (eval["nll"].as_f64().unwrap(), eval["ppl"].as_f64().unwrap());
        assert!(rel(p.nll, nll) <= 1e-4, "{name}: nll {} vs {nll}", p.nll);
        assert!(rel(p.ppl, ppl) <= 1e-4, "{name}: ppl {} vs {ppl}", p.ppl);
    }
}

fn ops_fixture() -> Value {
    let text = std::fs::read_to_string(fixtures().join("ops.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn rms_norm_rounds_before_its_gain_as_transformers_does() {
    use gaccwb::ops::{fused, lean};
    let f = &ops_fixture()["rms_norm_bf16"];
    let [rows, d]: [usize; 2] = serde_json::from_value(f["shape"].clone()).unwrap();
    let bf16 = |v: Vec<f32>, shape: &[usize]| {
        Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let x = bf16(floats(&f["input"]), &[rows, d]);
    let gain = bf16(floats(&f["weight"]), &[d]);
    let eps = f["eps"].as_f64().unwrap();
    let want = floats(&f["output"]);
    let wrong = floats(&f["wrong_order"]);
    assert_ne!(want, wrong, "the fixture's two orders differ");
    for (path, y) in [
        ("fused", fused::rms_norm(&x, &gain, eps).unwrap()),
        ("lean", lean::rms_norm(&x, &gain, eps).unwrap()),
    ] {
        let got: Vec<f32> = y
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, want, "{path}: transformers' bf16 output, to the bit");
    }
}

#[test]
fn rotary_frequencies_and_rotation_are_transformers_half_split() {
    use gaccwb::ops::{Llama3Scaling, Rope};
    let f = ops_fixture();
    let rope = Rope {
        theta: 10_000.0,
        head_dim: 16,
        scaling: Some(Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 64.0,
        }),
    };
    let close = |a: &[f32], b: &[f32], what: &str| {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6 * y.abs(), "{what}: {x} vs {y}");
        }
    };
    close(
        &rope.inv_freq(),
        &floats(&f["rope_llama3_inv_freq"]["scaled"]),
        "scaled",
    );
    let plain = Rope {
        scaling: None,
        ..rope.clone()
    };
    close(
        &plain.inv_freq(),
        &floats(&f["rope_llama3_inv_freq"]["unscaled"]),
        "unscaled",
    );
    let tensors =
        candle_core::safetensors::load(fixtures().join("ops.safetensors"), &Device::Cpu).unwrap();
    let q = &tensors["rope.q"];
    let t = q.dim(2).unwrap();
    let turned = gaccwb::ops::composite::rotate(q, &rope.table(t)).unwrap();
    let err = |a: &Tensor, b: &Tensor| rel_l2(a, b);
    assert!(err(&turned, &tensors["rope.half_split"]) < 1e-6);
    assert!(
        err(&turned, &tensors["rope.interleaved"]) > 1e-2,
        "interleaved is another rotation"
    );
}

/// A copy of fixture `name` in a temporary directory, for a test to break.
fn copy_of(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
        }
    }
    tmp
}

/// The error loading `dir` at 16 tokens gives.
fn load_error(dir: &Path) -> String {
    match ModelDir::open(dir).and_then(|d| d.load(16, &Device::Cpu, None, &mut |_, _| {})) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Map<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
}

/// `tensors` (name → tensor) written as `model.safetensors` in `dir`.
fn write_weights(dir: &Path, tensors: &std::collections::HashMap<String, Tensor>) {
    candle_core::safetensors::save(tensors, dir.join("model.safetensors")).unwrap();
}

fn weights(dir: &Path) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

/// The loss of `model` on the fixture batch of `case`, in f32.
fn batch_loss(model: &Gpt, case: &Case) -> f64 {
    loss(model, case, DType::F32).0
}

mod finetune;
mod loading;
