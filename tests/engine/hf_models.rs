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
use gaccwb::train::adamw::{AdamW, Hyper};
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
        let p = perplexity::perplexity(&model, &ids, seq_len, 8, DType::F32, &Device::Cpu).unwrap();
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
    use gaccwb::ops::rope::{Llama3Scaling, Rope};
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

#[test]
fn a_broken_model_directory_is_refused_naming_the_file_and_the_fix() {
    let expect = |dir: &Path, parts: &[&str]| {
        let e = load_error(dir);
        for part in parts {
            assert!(e.contains(part), "`{part}` not in: {e}");
        }
    };
    let dir = copy_of("llama-tied");
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    expect(dir.path(), &["no config.json"]);

    let dir = copy_of("llama-tied");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    expect(dir.path(), &["no model.safetensors"]);

    // A sharded model whose second shard is missing.
    let dir = copy_of("llama-tied");
    let names: Vec<String> = weights(dir.path()).into_keys().collect();
    std::fs::rename(
        dir.path().join("model.safetensors"),
        dir.path().join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    let map: serde_json::Map<String, Value> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let shard = if i == 0 { 2 } else { 1 };
            (
                n.clone(),
                Value::from(format!("model-0000{shard}-of-00002.safetensors")),
            )
        })
        .collect();
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    expect(
        dir.path(),
        &["model-00002-of-00002.safetensors", "missing shard"],
    );

    // The config and the tensors disagree on a width.
    let dir = copy_of("llama-tied");
    edit_config(dir.path(), |c| {
        c.insert("intermediate_size".into(), Value::from(40));
    });
    expect(
        dir.path(),
        &["model.safetensors", "mlp.gate_proj.weight", "shape"],
    );

    // A tensor missing, one that is no weight of the family, one stored as integers.
    let dir = copy_of("llama-tied");
    let mut w = weights(dir.path());
    w.remove("model.norm.weight");
    write_weights(dir.path(), &w);
    expect(dir.path(), &["model.norm.weight", "missing"]);
    let mut w = weights(dir.path());
    w.insert(
        "model.norm.weight".into(),
        Tensor::ones(32, DType::F32, &Device::Cpu).unwrap(),
    );
    w.insert(
        "model.layers.0.extra.weight".into(),
        Tensor::ones(4, DType::F32, &Device::Cpu).unwrap(),
    );
    write_weights(dir.path(), &w);
    expect(
        dir.path(),
        &[
            "model.layers.0.extra.weight",
            "not a weight of a llama model",
        ],
    );
    let mut w = weights(dir.path());
    w.remove("model.layers.0.extra.weight");
    w.insert(
        "model.norm.weight".into(),
        Tensor::ones(32, DType::U32, &Device::Cpu).unwrap(),
    );
    write_weights(dir.path(), &w);
    expect(dir.path(), &["model.norm.weight", "dtype"]);

    // A header that is not safetensors.
    let dir = copy_of("llama-tied");
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\xff\xff\xff\x7f garbage",
    )
    .unwrap();
    expect(
        dir.path(),
        &["model.safetensors", "not a valid safetensors file"],
    );
}

/// Changes a fixture's config.json.
type Edit = fn(&mut serde_json::Map<String, Value>);

#[test]
fn families_and_features_the_engine_does_not_train_are_refused_with_the_alternative() {
    let cases: [(&str, Edit, &str); 6] = [
        (
            "gpt2-tied",
            |c| {
                c.insert("model_type".into(), Value::from("t5"));
            },
            "t5",
        ),
        (
            "llama-tied",
            |c| {
                c.insert("num_local_experts".into(), Value::from(8));
            },
            "mixture-of-experts",
        ),
        (
            "llama-tied",
            |c| {
                c.insert(
                    "rope_parameters".into(),
                    serde_json::json!({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
                );
            },
            "yarn",
        ),
        // A config naming yarn in `rope_scaling` while `rope_parameters` says default.
        (
            "llama-tied",
            |c| {
                c.insert(
                    "rope_scaling".into(),
                    serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
                );
            },
            "yarn",
        ),
        (
            "llama-tied",
            |c| {
                c.insert("hidden_act".into(), Value::from("gelu"));
            },
            "hidden_act",
        ),
        (
            "gpt2-tied",
            |c| {
                c.insert("activation_function".into(), Value::from("relu"));
            },
            "activation_function",
        ),
    ];
    for (fixture, edit, word) in cases {
        let dir = copy_of(fixture);
        edit_config(dir.path(), edit);
        let e = load_error(dir.path());
        assert!(e.contains("config.json") && e.contains(word), "{e}");
    }
}

#[test]
fn weights_beyond_the_device_memory_are_refused_before_loading() {
    let dir = ModelDir::open(&fixtures().join("llama-tied")).unwrap();
    let e = dir
        .load(16, &Device::Cpu, Some((4096, "host")), &mut |_, _| {
            panic!("nothing is read")
        })
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("parameters × 4 bytes") && e.contains("host"),
        "{e}"
    );
}

#[test]
fn a_sliding_window_shorter_than_the_sequence_is_refused() {
    let mut s = gaccwb::scenario::Scenario::default();
    s.model.path = Some(fixtures().join("mistral-window"));
    s.model.seq_len = 64;
    let e = gaccwb::model::hf::prepare(&mut s).unwrap_err().to_string();
    assert!(
        e.contains("sliding window") && e.contains("model.seq_len"),
        "{e}"
    );
    s.model.seq_len = 16;
    let (_, spec) = gaccwb::model::hf::prepare(&mut s).unwrap().unwrap();
    assert_eq!(spec.arch.family, "mistral");
    assert_eq!(
        (s.model.d_model, s.model.vocab, s.model.seq_len),
        (32, 360, 16)
    );
}

#[test]
fn a_model_not_in_the_cache_says_where_it_looked_and_how_to_fetch_it() {
    let cache = tempfile::tempdir().unwrap();
    std::env::set_var("HF_HUB_CACHE", cache.path());
    let e = gaccwb::model::hf::resolve("SomeOrg/no-such-model@v2")
        .unwrap_err()
        .to_string();
    assert!(e.contains("models--SomeOrg--no-such-model"), "{e}");
    assert!(
        e.contains("hf download SomeOrg/no-such-model --revision v2"),
        "{e}"
    );
    // A cache laid out as huggingface_hub lays it out resolves offline.
    let repo = cache.path().join("models--SomeOrg--tiny");
    let snapshot = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    std::fs::copy(
        fixtures().join("llama-tied/config.json"),
        snapshot.join("config.json"),
    )
    .unwrap();
    assert_eq!(
        gaccwb::model::hf::resolve("SomeOrg/tiny").unwrap(),
        snapshot
    );
    std::env::remove_var("HF_HUB_CACHE");
}

/// The loss of `model` on the fixture batch of `case`, in f32.
fn batch_loss(model: &Gpt, case: &Case) -> f64 {
    loss(model, case, DType::F32).0
}

#[test]
fn a_saved_model_loads_back_to_the_same_loss_and_never_into_its_source() {
    use gaccwb::model::save::save;
    use gaccwb::safe_write::Overwrite;
    for name in ["gpt2-tied", "gpt2-untied", "llama-gqa-llama3", "qwen2-bias"] {
        let case = Case::open(name);
        let model = case.model();
        let weights: Vec<Tensor> = model.vars().map(|v| v.as_tensor().clone()).collect();
        let out = tempfile::tempdir().unwrap();
        let saved = save(&model, &weights, out.path(), &Overwrite::ours()).unwrap();
        assert_eq!(
            saved.tensors,
            model.params.len(),
            "{name}: a tied matrix is saved once"
        );
        for file in ["config.json", "model.safetensors", "tokenizer.json"] {
            assert!(out.path().join(file).is_file(), "{name}: {file}");
        }
        let back = ModelDir::open(out.path())
            .unwrap()
            .load(16, &Device::Cpu, None, &mut |_, _| {});
        assert_eq!(
            batch_loss(&back.unwrap(), &case),
            batch_loss(&model, &case),
            "{name}"
        );
        let into_source = case.dir.dir.join("saved");
        let e = save(&model, &weights, &into_source, &Overwrite::ours()).unwrap_err();
        assert!(
            e.to_string()
                .contains("the directory the model was read from"),
            "{e}"
        );
        assert!(
            !into_source.exists(),
            "{name}: nothing written into the source"
        );
    }
}

#[test]
fn a_shape_built_from_its_config_alone_saves_that_config_and_loads_back() {
    use gaccwb::model::save::save;
    use gaccwb::safe_write::Overwrite;
    let shape = tempfile::tempdir().unwrap();
    let config = shape.path().join("config.json");
    std::fs::copy(fixtures().join("llama-tied/config.json"), &config).unwrap();
    let mut s = gaccwb::scenario::Scenario::default();
    s.model.path = Some(config.clone());
    s.model.seq_len = 16;
    gaccwb::model::hf::prepare(&mut s).unwrap();
    let model = gaccwb::model::open(&s, &Device::Cpu, None, &mut |_, _| {}).unwrap();
    let weights: Vec<Tensor> = model.vars().map(|v| v.as_tensor().clone()).collect();
    let out = tempfile::tempdir().unwrap();
    save(&model, &weights, out.path(), &Overwrite::ours()).unwrap();
    let saved = std::fs::read(out.path().join("config.json")).unwrap();
    assert_eq!(
        saved,
        std::fs::read(&config).unwrap(),
        "the shape's own config"
    );
    let back = ModelDir::open(out.path())
        .unwrap()
        .load(16, &Device::Cpu, None, &mut |_, _| {})
        .unwrap();
    assert_eq!(back.param_count(), model.param_count());
}

#[test]
fn this_engines_gpt_saves_as_gpt2_and_loads_back_as_one() {
    use gaccwb::model::save::save;
    use gaccwb::safe_write::Overwrite;
    let cfg = gaccwb::scenario::ModelConfig {
        vocab: 360,
        d_model: 32,
        layers: 2,
        heads: 4,
        seq_len: 16,
        path: None,
        adapter: None,
    };
    let gpt = Gpt::new(&cfg, 7, &Device::Cpu).unwrap();
    let weights: Vec<Tensor> = gpt.vars().map(|v| v.as_tensor().clone()).collect();
    let out = tempfile::tempdir().unwrap();
    save(&gpt, &weights, out.path(), &Overwrite::ours()).unwrap();
    let back = ModelDir::open(out.path()).unwrap();
    assert_eq!(back.spec().unwrap().arch.family, "gpt2");
    let back = back.load(16, &Device::Cpu, None, &mut |_, _| {}).unwrap();
    let case = Case::open("gpt2-untied");
    assert_eq!(batch_loss(&back, &case), batch_loss(&gpt, &case));
}

/// A scenario fine-tuning fixture `name` on the built-in docs, cut by its tokenizer: T 16,
/// B 2, K 2, `steps` steps, and the knobs `sets` (`section.key=value`).
fn finetune(name: &str, steps: u64, sets: &[&str]) -> gaccwb::scenario::Scenario {
    let mut s = gaccwb::presets::resolve("finetune").unwrap();
    s.model.path = Some(fixtures().join(name));
    s.model.seq_len = 16;
    s.train.steps = steps;
    s.train.decay_steps = steps;
    s.train.micro_batch = 2;
    s.train.accum_steps = 2;
    s.train.eval_every = 0;
    s.train.lr = 1e-3;
    for set in sets {
        s.set(set).unwrap();
    }
    s
}

/// The loss of each step of `trainer` run for its steps.
fn losses(trainer: &mut gaccwb::train::Trainer) -> Vec<f64> {
    let steps = trainer.scenario().train.steps;
    (0..steps)
        .map(|_| match trainer.train_step(|| true) {
            Ok(step) => step.loss,
            Err(_) => panic!("a step failed"),
        })
        .collect()
}

#[test]
fn every_knob_trains_a_hugging_face_model() {
    // (knobs, how near each step's loss stays to the plain f32 run's: 0 is the same bits; the
    // adaptive K policy changes the batches, so only finite losses are asked of it).
    let knobs: [(&[&str], Option<f64>); 7] = [
        (&["train.dtype=bf16"], Some(0.03)),
        (&["train.dtype=f16"], Some(0.01)),
        (&["train.dtype=bf16", "train.offload=true"], Some(0.03)),
        (
            &["train.offload=true", "train.offload_grads=host"],
            Some(0.0),
        ),
        (&["train.checkpointing=blocks"], Some(0.0)),
        (&["train.clip=0.5"], None),
        (
            &["train.noise=true", "train.accum_policy=noise-scale"],
            None,
        ),
    ];
    // GPT-2's LayerNorm and GELU; Qwen2's RMS norm, SwiGLU, grouped rotary attention, biases.
    for name in ["gpt2-tied", "qwen2-bias"] {
        let mut trainer = gaccwb::train::Trainer::new(finetune(name, 3, &[]), Device::Cpu).unwrap();
        assert_eq!(
            trainer.model().spec.arch.family,
            name.split('-').next().unwrap()
        );
        let plain = losses(&mut trainer);
        for (sets, near) in knobs {
            let s = finetune(name, 3, sets);
            let got = losses(&mut gaccwb::train::Trainer::new(s, Device::Cpu).unwrap());
            assert!(
                got.iter().all(|l| l.is_finite()),
                "{name} {sets:?}: {got:?}"
            );
            match near {
                Some(0.0) => assert_eq!(got, plain, "{name} {sets:?}: the same bits"),
                Some(bound) => {
                    for (a, b) in got.iter().zip(&plain) {
                        assert!(
                            rel(*a, *b) <= bound,
                            "{name} {sets:?}: {got:?} vs {plain:?}"
                        );
                    }
                }
                None => {}
            }
        }
    }
}

#[test]
fn a_fine_tune_resumes_bit_identically() {
    use gaccwb::checkpoint;
    let dir = tempfile::tempdir().unwrap();
    for name in ["gpt2-tied", "llama-gqa-llama3"] {
        let straight =
            losses(&mut gaccwb::train::Trainer::new(finetune(name, 4, &[]), Device::Cpu).unwrap());
        let mut first = gaccwb::train::Trainer::new(finetune(name, 2, &[]), Device::Cpu).unwrap();
        let head = losses(&mut first);
        let saved = dir.path().join(name);
        checkpoint::save(&first, &saved).unwrap();
        let mut resumed = checkpoint::resume(&saved, Device::Cpu, |s| s.train.steps = 4).unwrap();
        let tail: Vec<f64> = (0..2)
            .map(|_| resumed.train_step(|| true).ok().unwrap().loss)
            .collect();
        let joined: Vec<u64> = head.iter().chain(&tail).map(|l| l.to_bits()).collect();
        let expected: Vec<u64> = straight.iter().map(|l| l.to_bits()).collect();
        assert_eq!(joined, expected, "{name}: losses step for step");
    }
}

/// Fixture `case` with the PEFT adapter in its folder `adapter`, as a run would build it.
fn adapted(case: &str, adapter: &str) -> (Gpt, gaccwb::scenario::Scenario) {
    let mut s = gaccwb::scenario::Scenario::default();
    s.model.path = Some(fixtures().join(case));
    s.model.adapter = Some(fixtures().join(case).join(adapter));
    s.model.seq_len = 16;
    gaccwb::model::hf::prepare(&mut s).unwrap();
    let model = gaccwb::model::open(&s, &Device::Cpu, None, &mut |_, _| {}).unwrap();
    (model, s)
}

#[test]
fn peft_adapters_give_peft_loss_gradients_and_steps_with_no_base_gradient() {
    for (name, folder) in [
        ("llama-gqa-llama3", "lora"),
        ("llama-gqa-llama3", "lora-rslora"),
        ("gpt2-tied", "lora"),
        ("gpt2-tied", "lora-rslora"),
    ] {
        let (model, _) = adapted(name, folder);
        let mut case = Case::open(name);
        let dir = fixtures().join(name).join(folder);
        case.reference =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let what = format!("{name}/{folder}");
        let (value, root, held) = loss(&model, &case, DType::F32);
        let want = case.number("/loss");
        assert!(
            rel(value, want) <= 1e-5,
            "{what}: loss {value} vs PEFT {want}"
        );
        let store = root.backward().unwrap();
        // No frozen weight has a gradient anywhere: not in the graph's store, not beside it.
        for p in &model.frozen {
            assert!(
                store.get(p.var.as_tensor()).is_none(),
                "{what}: {} in the store",
                p.name
            );
            assert!(
                held.get(&store, &p.var).is_none(),
                "{what}: {} beside it",
                p.name
            );
        }
        let grads =
            candle_core::safetensors::load(dir.join("grads.safetensors"), &Device::Cpu).unwrap();
        for p in &model.params {
            let got = held
                .get(&store, &p.var)
                .unwrap_or_else(|| panic!("{what}: {} has no gradient", p.name));
            let peft = &grads[&format!("base_model.model.{}", p.name)];
            let e = rel_l2(&got, &peft.t().unwrap().contiguous().unwrap());
            assert!(e <= 1e-4, "{what}: gradient of {} off by {e:e}", p.name);
        }
        let adamw = case.reference["adamw"].clone();
        assert_trajectory(&what, &model, &case, &adamw);
    }
}

/// `gaccwb eval --json` with `args`: its mean NLL.
fn eval_nll(args: &[&str]) -> f64 {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gaccwb"))
        .arg("eval")
        .args(args)
        .args(["--json", "--device", "cpu"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "eval {args:?} failed: {stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["nll"].as_f64().unwrap()
}

#[test]
fn eval_reports_transformers_perplexity_and_that_of_an_adapted_model() {
    let case = Case::open("llama-gqa-llama3");
    let eval = &case.reference["eval"];
    let seq_len = eval["seq_len"].as_u64().unwrap().to_string();
    let dir = fixtures().join(case.name);
    let text = fixtures().join("eval.txt");
    let common = [
        "--model",
        dir.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--seq-len",
        &seq_len,
    ];
    let base = eval_nll(&common);
    let want = eval["nll"].as_f64().unwrap();
    assert!(
        rel(base, want) <= 1e-4,
        "eval nll {base} vs transformers {want}"
    );
    // With the adapter: the adapted model (whose loss is PEFT's) over the same windows.
    let lora = dir.join("lora");
    let adapted = eval_nll(&[&common[..], &["--adapter", lora.to_str().unwrap()]].concat());
    let (model, _) = self::adapted(case.name, "lora");
    let tokenizer = TextTokenizer::load_file(case.dir.tokenizer.as_ref().unwrap()).unwrap();
    let ids = tokenizer
        .encode(&std::fs::read_to_string(&text).unwrap())
        .unwrap();
    let seq = seq_len.parse().unwrap();
    let p = perplexity::perplexity(&model, &ids, seq, 8, DType::F32, &Device::Cpu).unwrap();
    assert!(
        rel(adapted, p.nll) <= 1e-6 && rel(adapted, base) > 1e-3,
        "eval --adapter nll {adapted}: the adapted model's {}, the base's {base}",
        p.nll
    );
}

#[test]
fn a_lora_fine_tune_books_its_frozen_base_and_trains_with_every_knob() {
    use gaccwb::telemetry::Phase;
    let lora = ["train.lora_rank=4", "train.lora_alpha=8"];
    let name = "llama-gqa-llama3";
    let mut trainer = gaccwb::train::Trainer::new(finetune(name, 2, &lora), Device::Cpu).unwrap();
    let plain = losses(&mut trainer);
    // The ledger: gradients and AdamW's state for the adapters alone, the base in `frozen`.
    let adapters: u64 = trainer.model().param_count();
    let base: u64 = trainer
        .model()
        .frozen
        .iter()
        .map(|p| p.var.elem_count() as u64)
        .sum();
    assert!(
        adapters > 0 && base > 5 * adapters,
        "{adapters} adapter, {base} base"
    );
    let events = trainer.take_memory_events();
    let optimizer = events
        .iter()
        .rfind(|e| e.phase == Phase::Optimizer)
        .expect("an optimizer phase measured");
    let c = optimizer.categories;
    assert_eq!(c.parameters, 4 * adapters, "parameters: the f32 adapters");
    assert_eq!(c.frozen, 4 * base, "frozen: the f32 base");
    assert_eq!(c.gradients, 4 * adapters, "gradients: the adapters' buffer");
    assert_eq!(
        c.optimizer_state,
        8 * adapters,
        "AdamW: two moments per adapter weight"
    );
    // Every knob trains: half precision and offload near the f32 losses, checkpointing and
    // offloaded moments to the same bits, and a resumed LoRA run continues the same steps.
    let knobs: [(&[&str], f64); 5] = [
        (&["train.dtype=bf16"], 0.03),
        (&["train.dtype=bf16", "train.offload=true"], 0.03),
        (&["train.offload=true"], 0.0),
        (&["train.checkpointing=blocks"], 0.0),
        (&["train.clip=0.5", "train.noise=true"], 0.05),
    ];
    for (sets, bound) in knobs {
        let all: Vec<&str> = lora.iter().chain(sets).copied().collect();
        let mut t = gaccwb::train::Trainer::new(finetune(name, 2, &all), Device::Cpu).unwrap();
        let got = losses(&mut t);
        for (a, b) in got.iter().zip(&plain) {
            assert!(rel(*a, *b) <= bound, "{sets:?}: {got:?} vs {plain:?}");
        }
        if sets.contains(&"train.dtype=bf16") {
            let c = t.take_memory_events().last().unwrap().categories;
            assert_eq!(c.frozen, 2 * base, "{sets:?}: the base frozen in bf16");
        }
    }
}

#[test]
fn a_lora_fine_tune_resumes_bit_identically() {
    let lora = [
        "train.lora_rank=4",
        "train.lora_targets=[\"q_proj\",\"v_proj\"]",
    ];
    resumes_bit_identically("qwen2-bias", &lora);
}

#[test]
fn a_lora_fine_tune_with_dropout_resumes_bit_identically() {
    let lora = ["train.lora_rank=4", "train.lora_dropout=0.25"];
    resumes_bit_identically("llama-gqa-llama3", &lora);
}

/// Two steps, a checkpoint, two more from it: the losses of four straight steps, bit for bit.
fn resumes_bit_identically(name: &str, lora: &[&str]) {
    use gaccwb::checkpoint;
    let straight =
        losses(&mut gaccwb::train::Trainer::new(finetune(name, 4, lora), Device::Cpu).unwrap());
    let mut first = gaccwb::train::Trainer::new(finetune(name, 2, lora), Device::Cpu).unwrap();
    let head = losses(&mut first);
    let dir = tempfile::tempdir().unwrap();
    checkpoint::save(&first, dir.path()).unwrap();
    let mut resumed = checkpoint::resume(dir.path(), Device::Cpu, |s| s.train.steps = 4).unwrap();
    assert_eq!(resumed.model().frozen.len(), first.model().frozen.len());
    let tail: Vec<f64> = (0..2)
        .map(|_| resumed.train_step(|| true).ok().unwrap().loss)
        .collect();
    let joined: Vec<u64> = head.iter().chain(&tail).map(|l| l.to_bits()).collect();
    let expected: Vec<u64> = straight.iter().map(|l| l.to_bits()).collect();
    assert_eq!(joined, expected, "{name} {lora:?}: losses step for step");
}

/// The PEFT fixture's adapter (B not zero) on `case` under `train.lora_dropout = p`.
fn adapted_with_dropout(case: &str, p: f64) -> Gpt {
    let mut s = gaccwb::scenario::Scenario::default();
    s.model.path = Some(fixtures().join(case));
    s.model.adapter = Some(fixtures().join(case).join("lora"));
    s.model.seq_len = 16;
    s.train.lora_dropout = p;
    gaccwb::model::hf::prepare(&mut s).unwrap();
    assert_eq!(
        s.train.lora_dropout, p,
        "the run's dropout over the adapter's 0"
    );
    gaccwb::model::open(&s, &Device::Cpu, None, &mut |_, _| {}).unwrap()
}

/// The training loss of `case`'s batch with the masks of samples `samples`, and the logits'
/// bits of an evaluation forward.
fn train_and_eval(model: &Gpt, case: &Case, samples: &[u64]) -> (f64, Vec<u32>) {
    let (inputs, targets, mask) = case.batch();
    let checkpointing = gaccwb::telemetry::Checkpointing::None;
    let f = model
        .forward_training(&inputs, DType::F32, checkpointing, samples)
        .unwrap();
    let loss = f
        .nll_sum(&targets, &mask)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let eval = model.forward(&inputs, DType::F32, false).unwrap();
    let logits = eval.logits().unwrap().flatten_all().unwrap();
    let bits = logits
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    (f64::from(loss), bits)
}

#[test]
fn lora_dropout_changes_training_only_and_draws_the_same_masks_again() {
    let name = "llama-gqa-llama3";
    let case = Case::open(name);
    let samples = [7, 8];
    let (plain, dropped) = (
        adapted_with_dropout(name, 0.0),
        adapted_with_dropout(name, 0.3),
    );
    let (loss0, eval0) = train_and_eval(&plain, &case, &samples);
    let (loss, eval) = train_and_eval(&dropped, &case, &samples);
    assert_eq!(eval, eval0, "evaluation draws no mask");
    // The fixture's adapter moves this loss by 0.1%; its dropout by a good share of that.
    assert!(
        rel(loss, loss0) > 1e-4,
        "training applies it: {loss} vs {loss0}"
    );
    let again = train_and_eval(&dropped, &case, &samples).0;
    assert_eq!(
        again.to_bits(),
        loss.to_bits(),
        "the same samples, the same masks"
    );
    let other = train_and_eval(&dropped, &case, &[9, 10]).0;
    assert!(rel(other, loss) > 1e-5, "other samples, other masks");
}

#[test]
fn lora_dropout_moves_training_and_a_recompute_draws_the_same_masks() {
    let lora = ["train.lora_rank=4", "train.lora_dropout=0.3"];
    let name = "llama-gqa-llama3";
    let run = |sets: &[&str]| {
        let all: Vec<&str> = lora.iter().chain(sets).copied().collect();
        losses(&mut gaccwb::train::Trainer::new(finetune(name, 3, &all), Device::Cpu).unwrap())
    };
    let plain = run(&[]);
    let without = losses(
        &mut gaccwb::train::Trainer::new(finetune(name, 3, &lora[..1]), Device::Cpu).unwrap(),
    );
    // Step 1 starts with B = 0 (the adapters add nothing); from step 2 on the masks show
    // (by 1e-5 of the loss at this learning rate: reruns agree to the bit).
    assert_eq!(plain[0].to_bits(), without[0].to_bits());
    for step in 1..3 {
        let e = rel(plain[step], without[step]);
        assert!(e > 1e-6, "step {}: {plain:?} vs {without:?}", step + 1);
    }
    let bits = |l: &[f64]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&run(&[])), bits(&plain), "a rerun, the same bits");
    let recomputed = run(&["train.checkpointing=blocks"]);
    assert_eq!(
        bits(&recomputed),
        bits(&plain),
        "a recompute draws the same masks"
    );
}

#[test]
fn lora_dropout_draws_a_samples_mask_however_the_window_is_cut() {
    use gaccwb::train::{relative_error, window_gradients, Knobs};
    let name = "llama-gqa-llama3";
    let errors: Vec<f64> = ["0", "0.3"]
        .iter()
        .map(|p| {
            let dropout = format!("train.lora_dropout={p}");
            let sets = ["train.lora_rank=4", &dropout];
            let mut t = gaccwb::train::Trainer::new(finetune(name, 2, &sets), Device::Cpu).unwrap();
            // One step first, so that B is not zero and A gets gradients.
            t.train_step(|| true).ok().unwrap();
            // The next window, drawn from the trainer's data stream as its step would.
            let (start, n) = (t.cursor(), t.knobs().effective_batch() as u64);
            let samples: Vec<_> = (start..start + n)
                .map(|i| t.corpus().sample(gaccwb::data::Split::Train, i))
                .collect();
            let grads = |micro_batch, accum_steps| {
                let knobs = Knobs {
                    micro_batch,
                    accum_steps,
                    ..t.knobs().clone()
                };
                let w = window_gradients(t.model(), &samples, &knobs, 1.0, &Device::Cpu, || true);
                w.ok().unwrap().grads
            };
            relative_error(&grads(2, 2), &grads(4, 1)).unwrap()
        })
        .collect();
    eprintln!("B2 K2 against B4 K1, relative error, p = 0 and 0.3: {errors:?}");
    assert!(errors[1] < 1e-5, "{errors:?}");
}

#[test]
fn a_trained_adapter_saves_as_peft_does_and_merges_to_the_same_model() {
    let case = "llama-gqa-llama3";
    let dir = fixtures().join(case);
    let out = tempfile::tempdir().unwrap();
    let train = |save: &Path, merge: bool| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_gaccwb"));
        cmd.args([
            "run",
            "finetune",
            "--headless",
            "--steps",
            "2",
            "--device",
            "cpu",
        ])
        .args(["--set", "model.seq_len=16", "--set", "train.lr=1e-2"])
        .arg("--model")
        .arg(&dir)
        .arg("--adapter")
        .arg(dir.join("lora"))
        .args(["--set", "train.lora_dropout=0.1"])
        .arg("--save-model")
        .arg(save);
        if merge {
            cmd.arg("--merge");
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let (adapter, merged) = (out.path().join("adapter"), out.path().join("merged"));
    train(&adapter, false);
    train(&merged, true);
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        assert!(adapter.join(file).is_file(), "{file}");
    }
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["lora_dropout"], 0.1, "the run's dropout, saved");
    let names =
        candle_core::safetensors::load(adapter.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    assert!(names
        .keys()
        .all(|n| n.starts_with("base_model.model.") && n.contains(".lora_")));
    let text = fixtures().join("eval.txt");
    let common = ["--data", text.to_str().unwrap(), "--seq-len", "16"];
    let with_adapter = eval_nll(
        &[
            &[
                "--model",
                dir.to_str().unwrap(),
                "--adapter",
                adapter.to_str().unwrap(),
            ][..],
            &common,
        ]
        .concat(),
    );
    let whole = eval_nll(&[&["--model", merged.to_str().unwrap()][..], &common].concat());
    let base = eval_nll(&[&["--model", dir.to_str().unwrap()][..], &common].concat());
    assert!(
        rel(whole, with_adapter) <= 1e-6 && rel(with_adapter, base) > 1e-3,
        "merged {whole}, adapter {with_adapter}, base {base}"
    );
}
