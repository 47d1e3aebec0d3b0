//! Fine-tuning a Hugging Face model with every knob, resuming it, and LoRA over it: PEFT's
//! adapters, dropout and the saved adapter.

use super::*;

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
                held.get(&store, &p.var).unwrap().is_none(),
                "{what}: {} beside it",
                p.name
            );
        }
        let grads =
            candle_core::safetensors::load(dir.join("grads.safetensors"), &Device::Cpu).unwrap();
        for p in &model.params {
            let got = held
                .get(&store, &p.var)
                .unwrap()
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
    let p = perplexity(&model, &ids, seq, 8, DType::F32, &Device::Cpu).unwrap();
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
    let checkpointing = gaccwb::control::Checkpointing::None;
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
    use gaccwb::control::Knobs;
    use gaccwb::train::{relative_error, window_gradients};
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
