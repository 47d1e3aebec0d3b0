//! Hugging Face models against transformers: every family's loss, every parameter's gradient,
//! three AdamW steps, bf16 and perplexity, held to figures transformers produced on the same
//! tiny checkpoints (`benches/hf_parity.py` wrote `tests/fixtures/hf/models/`; docs/PARITY.md).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gaccwb::model::hf::ModelDir;
use gaccwb::model::{perplexity, Gpt, ParamGrads};
use gaccwb::ops::WeightLayout;
use gaccwb::tokenizer::TextTokenizer;
use gaccwb::train::adamw::{AdamW, Hyper};
use serde_json::Value;

const CASES: [&str; 7] = [
    "gpt2-tied",
    "gpt2-untied",
    "gpt2-hub-layout",
    "llama-gqa-llama3",
    "llama-tied",
    "qwen2-bias",
    "mistral-window",
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/models")
}

struct Case {
    name: &'static str,
    dir: ModelDir,
    reference: Value,
}

impl Case {
    fn open(name: &'static str) -> Case {
        let path = fixtures().join(name);
        let text = std::fs::read_to_string(path.join("reference.json")).unwrap();
        Case {
            name,
            dir: ModelDir::open(&path).unwrap(),
            reference: serde_json::from_str(&text).unwrap(),
        }
    }

    fn model(&self) -> Gpt {
        self.dir
            .load(16, &Device::Cpu, None, &mut |_, _| {})
            .unwrap()
    }

    /// The batch as (inputs `[B, T−1]`, targets `[B·(T−1)]`, mask).
    fn batch(&self) -> (Tensor, Tensor, Tensor) {
        let rows: Vec<Vec<u32>> =
            serde_json::from_value(self.reference["batch"]["input_ids"].clone()).unwrap();
        let t = rows[0].len();
        let inputs: Vec<u32> = rows.iter().flat_map(|r| r[..t - 1].to_vec()).collect();
        let targets: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
        let n = targets.len();
        (
            Tensor::from_vec(inputs, (rows.len(), t - 1), &Device::Cpu).unwrap(),
            Tensor::from_vec(targets, n, &Device::Cpu).unwrap(),
            Tensor::ones(n, DType::F32, &Device::Cpu).unwrap(),
        )
    }

    fn number(&self, pointer: &str) -> f64 {
        self.reference
            .pointer(pointer)
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("{}: no {pointer}", self.name))
    }
}

/// The mean loss of the batch (as transformers' `labels = input_ids`) and its graph's root.
fn loss(model: &Gpt, case: &Case, dtype: DType) -> (f64, Tensor, ParamGrads) {
    let (inputs, targets, mask) = case.batch();
    let forward = model.forward(&inputs, dtype, true).unwrap();
    let n = targets.dim(0).unwrap() as f64;
    let sum = forward.nll_sum(&targets, &mask).unwrap();
    let mean = (sum.to_dtype(DType::F32).unwrap() / n).unwrap();
    let value = f64::from(mean.to_scalar::<f32>().unwrap());
    (value, mean, forward.recomputed)
}

/// Every parameter's gradient, in the model's order.
fn gradients(model: &Gpt, root: &Tensor, held: &ParamGrads) -> Vec<Tensor> {
    let store = root.backward().unwrap();
    model
        .params
        .iter()
        .map(|p| {
            held.get(&store, &p.var)
                .unwrap_or_else(|| panic!("{} got no gradient", p.name))
        })
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let norm = |t: &Tensor| {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    (norm(&(&a - &b).unwrap()) / norm(&b).max(f64::MIN_POSITIVE)).sqrt()
}

/// transformers' gradient of parameter `name`, in the engine's layout.
fn reference_grad(case: &Case, model: &Gpt, index: usize) -> Tensor {
    let grads = candle_core::safetensors::load(
        fixtures().join(case.name).join("grads.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let p = &model.params[index];
    let names = model.spec.naming();
    let found = grads
        .get(&p.name)
        .or_else(|| grads.get(&p.name.replacen(names.optional_prefix, "", 1)))
        .unwrap_or_else(|| panic!("{}: transformers has no gradient for {}", case.name, p.name));
    let is_head = model.head.as_ref().is_some_and(|h| h.id() == p.var.id());
    let linear = p.var.rank() == 2 && p.name != names.embed && p.name != names.positions;
    let stored = match (is_head, linear) {
        (true, _) => names.head_stored,
        (false, true) => names.stored,
        _ => WeightLayout::InOut,
    };
    match stored {
        WeightLayout::OutIn => found.t().unwrap().contiguous().unwrap(),
        WeightLayout::InOut => found.clone(),
    }
}

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

#[test]
fn three_adamw_steps_follow_transformers_trajectory() {
    for name in CASES {
        let case = Case::open(name);
        let Some(adamw) = case.reference.get("adamw") else {
            continue;
        };
        let model = case.model();
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
            let (value, root, held) = loss(&model, &case, DType::F32);
            let e = rel(value, losses[step]);
            assert!(
                e <= 1e-4,
                "{name}: loss before step {} is {value}, transformers {}",
                step + 1,
                losses[step]
            );
            let mut grads = gradients(&model, &root, &held);
            let norm = gaccwb::train::global_norm(&grads).unwrap();
            assert!(
                rel(norm, norms[step]) <= 1e-4,
                "{name}: step {} norm {norm} vs {}",
                step + 1,
                norms[step]
            );
            if norm > clip {
                grads = grads.iter().map(|g| (g * (clip / norm)).unwrap()).collect();
            }
            opt.step(&model.params, &grads, lr).unwrap();
        }
        let (last, _, _) = loss(&model, &case, DType::F32);
        assert!(
            rel(last, losses[3]) <= 1e-4,
            "{name}: loss after 3 steps {last} vs {}",
            losses[3]
        );
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
