//! LoRA on the reference stack: adapters `B·A` of rank r beside the linear layers a user names,
//! the base frozen at 16 bits or quantised (LLM.int8, QLoRA's NF4). Only the adapters have
//! gradients and AdamW state; the frozen base costs its bytes alone.
//!
//! Adapter parameters: r·(inputs + outputs) per adapted linear layer (A is r × inputs, B outputs
//! × r, PEFT's layout, no bias), for every copy of it (every layer, every expert).
//!
//! Base bytes per parameter of a quantised linear layer (embeddings, norms, the head and the
//! routers stay 16-bit, as bitsandbytes leaves every module but a linear layer unquantised and
//! `transformers` keeps the head out):
//! - `int8`: 1 byte, and one fp32 scale per output row (LLM.int8(), Dettmers et al. 2022,
//!   vector-wise quantisation);
//! - `nf4`: half a byte, and the quantisation constants of QLoRA's double quantisation (Dettmers
//!   et al. 2023, "QLoRA", §3): one 8-bit constant per block of 64 weights and one fp32 constant
//!   per 256 of those blocks, 8/64 + 32/(64·256) = 0.127 bits per parameter.

use serde::Serialize;

use crate::hf::{Arch, Linear, Place};

/// How the frozen base is stored.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, strum::EnumString, strum::Display,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum BaseDtype {
    /// 16-bit weights, as trained.
    #[default]
    Bf16,
    /// 8-bit weights with a scale per output row (LLM.int8()).
    Int8,
    /// 4-bit NormalFloat with double-quantised block constants (QLoRA).
    Nf4,
}

/// A LoRA fine-tune.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Lora {
    /// The adapters' rank r.
    pub rank: u64,
    /// The linear layers adapted, by module name.
    pub targets: Vec<String>,
    /// Dropout on each adapter's input (PEFT's `lora_dropout`).
    pub dropout: f64,
    /// How the frozen base is stored.
    pub base: BaseDtype,
}

/// Bad LoRA settings.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum LoraError {
    #[error(
        "--lora-targets {name}: {family} has no linear layer of that name; its layers: {layers}"
    )]
    /// A target the family does not have.
    UnknownTarget {
        /// The name given.
        name: String,
        /// The family.
        family: String,
        /// The names it has.
        layers: String,
    },
    #[error("--lora-dropout {0}: expected a probability in [0, 1)")]
    /// A dropout outside [0, 1).
    Dropout(f64),
    #[error("--{0} needs --lora-rank (a LoRA fine-tune); without it every weight is trained")]
    /// A LoRA option without a rank.
    NoRank(&'static str),
}

/// The names of every linear layer of `arch`, each once, in block order.
pub(crate) fn layer_names(arch: &Arch) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Vec::new();
    for (l, _) in arch.linear_copies() {
        if !names.contains(&l.name) {
            names.push(l.name);
        }
    }
    names
}

/// PEFT's `all-linear` without the head, and without the routers: every projection of the
/// attention and of the MLP (each expert's and the shared expert's).
pub(crate) fn default_targets(arch: &Arch) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for (l, _) in arch.linear_copies() {
        if l.place != Place::Router && !names.iter().any(|n| n == l.name) {
            names.push(l.name.to_string());
        }
    }
    names
}

impl Lora {
    /// A LoRA of `rank` on `targets` (`None`: the default targets), refused when a target is not
    /// a linear layer of `arch` or the dropout is not a probability.
    pub fn new(
        arch: &Arch,
        rank: u64,
        targets: Option<Vec<String>>,
        dropout: f64,
        base: BaseDtype,
    ) -> Result<Lora, LoraError> {
        if !(0.0..1.0).contains(&dropout) {
            return Err(LoraError::Dropout(dropout));
        }
        let names = layer_names(arch);
        let targets = targets.unwrap_or_else(|| default_targets(arch));
        if let Some(bad) = targets.iter().find(|t| !names.contains(&t.as_str())) {
            return Err(LoraError::UnknownTarget {
                name: bad.clone(),
                family: arch.family.clone(),
                layers: names.join(", "),
            });
        }
        Ok(Lora {
            rank,
            targets,
            dropout,
            base,
        })
    }

    /// Whether `l` carries an adapter.
    pub fn adapts(&self, l: &Linear) -> bool {
        self.targets.iter().any(|t| t == l.name)
    }

    /// Adapter parameters of every adapted layer: r·(inputs + outputs) per copy.
    pub fn adapter_params(&self, arch: &Arch) -> u64 {
        arch.linear_copies()
            .iter()
            .filter(|(l, _)| self.adapts(l))
            .map(|(l, n)| n * self.rank * (l.inputs + l.outputs))
            .sum()
    }

    /// Adapter parameters one token is multiplied by (the routed experts' only).
    pub fn active_adapter_params(&self, arch: &Arch) -> u64 {
        let routed = |l: &Linear, n: u64| match (l.place, arch.experts) {
            (Place::Expert, Some(e)) => n / e.count * e.per_token,
            _ => n,
        };
        arch.linear_copies()
            .iter()
            .filter(|(l, _)| self.adapts(l))
            .map(|(l, n)| routed(l, *n) * self.rank * (l.inputs + l.outputs))
            .sum()
    }

    /// Bytes of the frozen base: the linear layers at the base dtype (with their constants), the
    /// rest (embeddings, norms, biases, head, routers) at 16 bits.
    pub fn base_bytes(&self, arch: &Arch) -> u64 {
        let quantised: u64 = arch
            .linear_copies()
            .iter()
            .filter(|(l, _)| l.place != Place::Router)
            .map(|(l, n)| {
                n * (matrix_bytes(self.base, l) + 2 * (l.params() - l.inputs * l.outputs))
            })
            .sum();
        let quantised_params: u64 = arch
            .linear_copies()
            .iter()
            .filter(|(l, _)| l.place != Place::Router)
            .map(|(l, n)| n * l.params())
            .sum();
        quantised + 2 * (arch.param_count() - quantised_params)
    }
}

/// Bytes of one linear layer's weight matrix stored as `base`.
fn matrix_bytes(base: BaseDtype, l: &Linear) -> u64 {
    let n = l.inputs * l.outputs;
    match base {
        BaseDtype::Bf16 => 2 * n,
        BaseDtype::Int8 => n + 4 * l.outputs,
        BaseDtype::Nf4 => n.div_ceil(2) + n.div_ceil(64) + 4 * n.div_ceil(64 * 256),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::named;

    #[test]
    fn llama3_8b_rank_16_on_all_seven_projections() {
        let a = named("llama3-8b").unwrap();
        let lora = Lora::new(&a, 16, None, 0.0, BaseDtype::Bf16).unwrap();
        assert_eq!(
            lora.targets,
            [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj"
            ]
        );
        // Per layer: q and o 16·(4096+4096), k and v 16·(4096+1024), gate, up and down
        // 16·(4096+14336); 32 layers.
        let per_layer = 2 * 16 * 8192 + 2 * 16 * 5120 + 3 * 16 * 18432;
        assert_eq!(32 * per_layer, 41_943_040);
        assert_eq!(lora.adapter_params(&a), 41_943_040);
        assert_eq!(lora.active_adapter_params(&a), 41_943_040);
        let qv = Lora::new(
            &a,
            8,
            Some(vec!["q_proj".into(), "v_proj".into()]),
            0.0,
            BaseDtype::Bf16,
        )
        .unwrap();
        assert_eq!(qv.adapter_params(&a), 32 * 8 * (8192 + 5120));
    }

    #[test]
    fn the_base_costs_its_dtype_and_its_constants() {
        let a = named("llama3-8b").unwrap();
        let p = a.param_count();
        let bf16 = Lora::new(&a, 16, None, 0.0, BaseDtype::Bf16).unwrap();
        assert_eq!(bf16.base_bytes(&a), 2 * p);
        // Outside the linear layers: both embeddings and the norms, at 16 bits.
        let linear: u64 = a.linear_copies().iter().map(|(l, n)| n * l.params()).sum();
        let rest = 2 * (p - linear);
        let nf4 = Lora {
            base: BaseDtype::Nf4,
            ..bf16.clone()
        }
        .base_bytes(&a);
        // 4 bits and 0.127 bits of constants per quantised weight (rounding per matrix aside).
        let bits = (nf4 - rest) as f64 * 8.0 / linear as f64;
        assert!((bits - 4.127).abs() < 1e-3, "{bits}");
        let int8 = Lora {
            base: BaseDtype::Int8,
            ..bf16
        }
        .base_bytes(&a);
        let rows: u64 = a.linear_copies().iter().map(|(l, n)| n * l.outputs).sum();
        assert_eq!(int8, rest + linear + 4 * rows);
    }

    #[test]
    fn targets_are_the_familys_own_names() {
        let a = named("gpt2").unwrap();
        assert_eq!(default_targets(&a), ["c_attn", "c_proj", "c_fc"]);
        let e = Lora::new(&a, 4, Some(vec!["q_proj".into()]), 0.0, BaseDtype::Bf16).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--lora-targets q_proj: gpt2 has no linear layer of that name; its layers: c_attn, c_proj, c_fc"
        );
        assert_eq!(
            Lora::new(&a, 4, None, 1.0, BaseDtype::Bf16).unwrap_err(),
            LoraError::Dropout(1.0)
        );
    }
}
