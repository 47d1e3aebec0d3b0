//! The reference stack's activations: Korthikanti et al. 2022 ("Reducing Activation
//! Recomputation in Large Transformer Models"), per layer s·b·h·(34 + 5·a·s/h) bytes for a 16-bit
//! GPT block with full attention and dropout, counted term by term so that the same rules give
//! SwiGLU, grouped-query attention, RMSNorm and no dropout, FlashAttention (no s² term), selective
//! recomputation (the attention core recomputed) and full recomputation (only each layer's input
//! kept). The derivation is in docs/PLANNER.md; `per_layer` follows it line by line.

use serde::Serialize;

use crate::hf::{Arch, Mlp};

/// Bytes of a 16-bit element.
const HALF: u64 = 2;

/// How attention is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, strum::EnumString, strum::Display)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Attention {
    /// softmax(QKᵀ)·V materialised: the a·s² scores are kept for backward.
    Full,
    /// A fused kernel (FlashAttention) keeps only the output and each row's log-sum-exp.
    Flash,
}

/// What the backward recomputes instead of keeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, strum::EnumString, strum::Display)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Recompute {
    /// Nothing recomputed: every activation is kept.
    None,
    /// The attention core (QKᵀ, softmax, dropout, ·V): none of its s² tensors are kept.
    Selective,
    /// Every layer: only its input is kept, and one layer is rebuilt at a time in the backward.
    Full,
}

/// Activation bytes of one micro-batch under the reference stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Activations {
    /// What one layer keeps for its backward.
    pub per_layer: u64,
    /// Outside the layers: the embedding's dropout mask, the final norm's and the head's inputs
    /// and the fp32 logits the cross-entropy keeps.
    pub outside_layers: u64,
    /// What the full recomputation rebuilds at once in the backward (one layer, nothing kept);
    /// 0 otherwise.
    pub recompute_working: u64,
    /// The sum: the micro-batch's activations at the backward's start.
    pub total: u64,
}

/// Per-layer bytes kept for backward, 16-bit activations, micro-batch `b`.
///
/// With s tokens, h the hidden width, q = heads·head_dim, k = kv_heads·head_dim, f the MLP's
/// inner width and a the heads (the paper's terms after `=`, at q = k = h, f = 4h):
/// - two norms' inputs: 2·2sbh = 4sbh;
/// - attention: the QKV input 2sbh, Q 2sbq and K 2sbk for QKᵀ, the softmax output 2as²b, with
///   dropout its mask as²b and output 2as²b, V 2sbk, the output projection's input 2sbq, with
///   dropout its mask sbh = 11sbh + 5as²b;
/// - MLP, GELU: its input 2sbh, the GELU's input 2sbf and the second matrix's input 2sbf, with
///   dropout its mask sbh = 19sbh; SwiGLU: its input 2sbh, the gate and up outputs, the SiLU
///   output and the product, 4·2sbf.
///
/// FlashAttention keeps no s² tensor but a log-sum-exp per head and row (fp32, 4asb); selective
/// recomputation keeps neither (Q, K, V are kept and the core is recomputed from them).
pub fn per_layer(arch: &Arch, b: u64, attention: Attention, recompute: Recompute) -> u64 {
    if recompute == Recompute::Full {
        return HALF * arch.seq_len * b * arch.hidden;
    }
    let (s, h, a) = (arch.seq_len, arch.hidden, arch.heads);
    let (q, k, f) = (arch.q_width(), arch.kv_width(), arch.intermediate);
    let sb = s * b;
    let mask = u64::from(arch.dropout);
    let norms = 2 * HALF * sb * h;
    let linear_terms = HALF * sb * (h + q + k + k + q) + mask * sb * h;
    let core = match (attention, recompute) {
        (_, Recompute::Selective) => 0,
        (Attention::Flash, _) => 4 * a * sb,
        (Attention::Full, _) => (HALF + mask * (1 + HALF)) * a * s * sb,
    };
    let mlp = match arch.mlp {
        Mlp::Gelu => HALF * sb * (h + 2 * f),
        Mlp::SwiGlu => HALF * sb * (h + 4 * f),
    } + mask * sb * h;
    norms + linear_terms + core + mlp
}

/// Outside the layers: with dropout the embedding's mask sbh; the final norm's input 2sbh; the
/// head's input 2sbh; the logits in fp32 for the cross-entropy 4sbv.
pub fn outside_layers(arch: &Arch, b: u64) -> u64 {
    let sb = arch.seq_len * b;
    u64::from(arch.dropout) * sb * arch.hidden + 2 * HALF * sb * arch.hidden + 4 * sb * arch.vocab
}

/// Every term for micro-batch `b`.
pub fn activations(arch: &Arch, b: u64, attention: Attention, recompute: Recompute) -> Activations {
    let per_layer = per_layer(arch, b, attention, recompute);
    let outside_layers = outside_layers(arch, b);
    let recompute_working = match recompute {
        Recompute::Full => per_layer_kept(arch, b, attention),
        _ => 0,
    };
    Activations {
        per_layer,
        outside_layers,
        recompute_working,
        total: arch.layers * per_layer + outside_layers + recompute_working,
    }
}

/// One layer rebuilt with nothing recomputed inside it.
fn per_layer_kept(arch: &Arch, b: u64, attention: Attention) -> u64 {
    per_layer(arch, b, attention, Recompute::None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::named;

    /// The paper's per-layer formula, s·b·h·(34 + 5·a·s/h), kept in integers: 34·sbh + 5·a·s²·b.
    fn paper(arch: &Arch, b: u64) -> u64 {
        let (s, h, a) = (arch.seq_len, arch.hidden, arch.heads);
        34 * s * b * h + 5 * a * s * s * b
    }

    #[test]
    fn the_papers_formula_at_gpt2_and_gpt3_175b() {
        for name in ["gpt2", "gpt3-175b"] {
            let arch = named(name).unwrap();
            for b in [1, 4] {
                let sbh = arch.seq_len * b * arch.hidden;
                assert_eq!(
                    per_layer(&arch, b, Attention::Full, Recompute::None),
                    paper(&arch, b),
                    "{name} b={b}"
                );
                // Selective recomputation: the paper's 34·sbh.
                assert_eq!(
                    per_layer(&arch, b, Attention::Full, Recompute::Selective),
                    34 * sbh
                );
                // FlashAttention: 34·sbh and a log-sum-exp per head and row.
                assert_eq!(
                    per_layer(&arch, b, Attention::Flash, Recompute::None),
                    34 * sbh + 4 * arch.heads * arch.seq_len * b
                );
                // Full recomputation: 2·sbh.
                assert_eq!(
                    per_layer(&arch, b, Attention::Full, Recompute::Full),
                    2 * sbh
                );
            }
        }
        // The figures at gpt3-175b, micro-batch 1, over 96 layers: 256.5 and 76.5 GiB.
        let gpt3 = named("gpt3-175b").unwrap();
        let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
        let full = 96 * per_layer(&gpt3, 1, Attention::Full, Recompute::None);
        let selective = 96 * per_layer(&gpt3, 1, Attention::Full, Recompute::Selective);
        assert_eq!(format!("{:.1}", gib(full)), "256.5");
        assert_eq!(format!("{:.1}", gib(selective)), "76.5");
    }

    #[test]
    fn swiglu_and_grouped_query_attention_without_dropout() {
        let llama = named("llama3-8b").unwrap();
        let (s, h, a, f) = (8192u64, 4096u64, 32u64, 14336u64);
        let k = 8 * 128;
        // norms 4sbh; QKV input 2sbh, Q 2sbh, K and V 2sbk each, output input 2sbh; scores 2as²;
        // MLP input 2sbh and four 2sbf.
        let expected = 4 * s * h + 2 * s * (3 * h + 2 * k) + 2 * a * s * s + 2 * s * h + 8 * s * f;
        assert_eq!(
            per_layer(&llama, 1, Attention::Full, Recompute::None),
            expected
        );
        let flash = per_layer(&llama, 1, Attention::Flash, Recompute::None);
        assert_eq!(flash, expected - 2 * a * s * s + 4 * a * s);
        let whole = activations(&llama, 1, Attention::Flash, Recompute::Full);
        assert_eq!(whole.recompute_working, flash);
        assert_eq!(
            whole.total,
            32 * 2 * s * h + flash + 4 * s * h + 4 * s * 128256
        );
    }
}
