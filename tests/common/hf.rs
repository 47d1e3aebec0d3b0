//! Tiny Hugging Face checkpoints and the figures transformers produced on them
//! (`benches/hf_parity.py` wrote `tests/fixtures/hf/models/`; docs/PARITY.md).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gaccwb::model::hf::ModelDir;
use gaccwb::model::{Gpt, ParamGrads};
use gaccwb::ops::WeightLayout;
use serde_json::Value;

pub const CASES: [&str; 7] = [
    "gpt2-tied",
    "gpt2-untied",
    "gpt2-hub-layout",
    "llama-gqa-llama3",
    "llama-tied",
    "qwen2-bias",
    "mistral-window",
];

/// The fixtures: beside the working directory when it is the repository (a prebuilt test binary
/// on another machine), else in the source tree the binary was built from.
pub fn fixtures() -> PathBuf {
    let here = Path::new("tests/fixtures/hf/models");
    if here.is_dir() {
        return here.to_path_buf();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join(here)
}

pub struct Case {
    pub name: &'static str,
    pub dir: ModelDir,
    pub reference: Value,
    /// Where the model and the batch live.
    pub device: Device,
}

impl Case {
    pub fn open(name: &'static str) -> Case {
        Case::on(name, &Device::Cpu)
    }

    pub fn on(name: &'static str, device: &Device) -> Case {
        let path = fixtures().join(name);
        let text = std::fs::read_to_string(path.join("reference.json")).unwrap();
        Case {
            name,
            dir: ModelDir::open(&path).unwrap(),
            reference: serde_json::from_str(&text).unwrap(),
            device: device.clone(),
        }
    }

    pub fn model(&self) -> Gpt {
        self.dir
            .load(16, &self.device, None, &mut |_, _| {})
            .unwrap()
    }

    /// The batch as (inputs `[B, T−1]`, targets `[B·(T−1)]`, mask).
    pub fn batch(&self) -> (Tensor, Tensor, Tensor) {
        let rows: Vec<Vec<u32>> =
            serde_json::from_value(self.reference["batch"]["input_ids"].clone()).unwrap();
        let t = rows[0].len();
        let inputs: Vec<u32> = rows.iter().flat_map(|r| r[..t - 1].to_vec()).collect();
        let targets: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
        let n = targets.len();
        (
            Tensor::from_vec(inputs, (rows.len(), t - 1), &self.device).unwrap(),
            Tensor::from_vec(targets, n, &self.device).unwrap(),
            Tensor::ones(n, DType::F32, &self.device).unwrap(),
        )
    }

    pub fn number(&self, pointer: &str) -> f64 {
        self.reference
            .pointer(pointer)
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("{}: no {pointer}", self.name))
    }
}

/// The mean loss of the batch (as transformers' `labels = input_ids`) and its graph's root.
pub fn loss(model: &Gpt, case: &Case, dtype: DType) -> (f64, Tensor, ParamGrads) {
    let (inputs, targets, mask) = case.batch();
    let forward = model.forward(&inputs, dtype, true).unwrap();
    let n = targets.dim(0).unwrap() as f64;
    let sum = forward.nll_sum(&targets, &mask).unwrap();
    let mean = (sum.to_dtype(DType::F32).unwrap() / n).unwrap();
    let value = f64::from(mean.to_scalar::<f32>().unwrap());
    (value, mean, forward.recomputed)
}

/// Every parameter's gradient, in the model's order.
pub fn gradients(model: &Gpt, root: &Tensor, held: &ParamGrads) -> Vec<Tensor> {
    let store = root.backward().unwrap();
    model
        .params
        .iter()
        .map(|p| {
            held.get(&store, &p.var)
                .unwrap()
                .unwrap_or_else(|| panic!("{} got no gradient", p.name))
        })
        .collect()
}

pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

pub fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
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
pub fn reference_grad(case: &Case, model: &Gpt, index: usize) -> Tensor {
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
