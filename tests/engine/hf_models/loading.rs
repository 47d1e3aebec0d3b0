//! Loading and saving Hugging Face model directories: what is refused, with what message, and
//! what round-trips.

use super::*;

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

#[test]
fn a_saved_model_loads_back_to_the_same_loss_and_never_into_its_source() {
    use gaccwb::model::save;
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
    use gaccwb::model::save;
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
    use gaccwb::model::save;
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
