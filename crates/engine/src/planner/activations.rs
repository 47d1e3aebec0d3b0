//! The reference stack's activations: Korthikanti et al. 2022 ("Reducing Activation
//! Recomputation in Large Transformer Models"), per layer s·b·h·(34 + 5·a·s/h) bytes for a 16-bit
//! GPT block with full attention and dropout, counted term by term so that the same rules give
//! SwiGLU/GeGLU, grouped-query attention, RMSNorm, q/k and post-norms, soft-capping, experts,
//! no dropout, FlashAttention (no s² term), selective recomputation (the attention core
//! recomputed), full recomputation (only each layer's input kept) and LoRA (a frozen layer keeps
//! no input for a weight gradient; an adapter keeps its own). The derivation is in
//! docs/PLANNER.md; the functions below follow it line by line.

use serde::Serialize;

use super::lora::Lora;
use crate::hf::{Arch, Experts, Mlp, Place, Role};

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
    /// What the largest layer keeps for its backward (with full recomputation: its input).
    pub per_layer: u64,
    /// What all the layers keep together.
    pub layers: u64,
    /// Of `layers`, what the LoRA adapters add (their inputs' dropout copies and masks, A's
    /// outputs); 0 without LoRA.
    pub adapters: u64,
    /// Outside the layers: the embedding's dropout mask, the final norm's and (trained) the
    /// head's inputs, the fp32 logits the cross-entropy keeps and a soft-cap's tanh.
    pub outside_layers: u64,
    /// What the full recomputation rebuilds at once in the backward (the largest layer, nothing
    /// recomputed); 0 otherwise.
    pub recompute_working: u64,
    /// The sum: the micro-batch's activations at the backward's start.
    pub total: u64,
}

/// What is trained, for what the backward must keep.
#[derive(Clone, Copy, Debug)]
struct Trained<'a> {
    arch: &'a Arch,
    lora: Option<&'a Lora>,
}

impl Trained<'_> {
    /// Whether the inputs of the linear layers of `role` at `place` are kept: they are for a
    /// weight gradient, so in a full fine-tune always, under LoRA when one of them is adapted.
    fn keeps(&self, role: Role, place: Place) -> bool {
        self.lora.is_none_or(|lora| {
            self.arch
                .linears()
                .iter()
                .any(|l| l.role == role && l.place == place && lora.adapts(l))
        })
    }

    /// Bytes LoRA's adapters at `place` keep for `tokens` tokens through each: A's output (r
    /// wide), and with dropout each adapter's own dropped input and its mask (1 byte).
    fn adapters(&self, place: Place, tokens: u64) -> u64 {
        let Some(lora) = self.lora else { return 0 };
        let dropout = u64::from(lora.dropout > 0.0);
        self.arch
            .linears()
            .iter()
            .filter(|l| l.place == place && lora.adapts(l))
            .map(|l| tokens * (HALF * lora.rank + dropout * (HALF + 1) * l.inputs))
            .sum()
    }
}

/// One attention block's bytes over `n` = s·b tokens.
///
/// With h the hidden width, q = heads·head_dim, k = kv_heads·head_dim and a the heads (the
/// paper's terms after `=`, at q = k = h): the QKV input 2nh (kept for a weight gradient), Q 2nq
/// and K 2nk for QKᵀ, V 2nk, the output projection's input 2nq (for its weight gradient, or
/// because FlashAttention keeps its output), with dropout its mask nh = 11nh; the scores: the
/// softmax output 2a·n·s, with dropout its mask and output 3a·n·s (the paper's 5as²b),
/// with a soft cap the tanh's output 2a·n·s; FlashAttention instead a log-sum-exp per head and
/// row (fp32, 4an); selective recomputation none. q/k norms keep their inputs, 2n(q + k).
fn attention_bytes(t: &Trained, n: u64, attention: Attention, recompute: Recompute) -> u64 {
    let a = t.arch;
    let (h, q, k, heads) = (a.hidden, a.q_width(), a.kv_width(), a.heads);
    let mask = u64::from(a.dropout);
    let qkv_in = u64::from(t.keeps(Role::Qkv, Place::Attention)) * HALF * n * h;
    let out_in = u64::from(attention == Attention::Flash || t.keeps(Role::Out, Place::Attention))
        * HALF
        * n
        * q;
    let qk_norms = u64::from(a.qk_norm) * HALF * n * (q + k);
    let kept = qkv_in + HALF * n * (q + 2 * k) + out_in + qk_norms + mask * n * h;
    let core = match (attention, recompute) {
        (_, Recompute::Selective) => 0,
        (Attention::Flash, _) => 4 * heads * n,
        (Attention::Full, _) => {
            let softcap = u64::from(a.attention_softcap) * HALF;
            (HALF + mask * (1 + HALF) + softcap) * heads * n * a.seq_len
        }
    };
    kept + core + t.adapters(Place::Attention, n)
}

/// One dense MLP's bytes over `n` tokens. GELU: its input 2nh (for a weight gradient), the GELU's
/// input 2nf, the second matrix's input 2nf (for a weight gradient), with dropout its mask nh
/// (the paper's 19nh at f = 4h). Gated: its input 2nh, the gate and up outputs and the
/// activation's output 3·2nf, the product 2nf (the down projection's input).
fn dense_mlp_bytes(t: &Trained, n: u64, place: Place, f: u64) -> u64 {
    let h = t.arch.hidden;
    let input = u64::from(t.keeps(Role::MlpIn, place)) * HALF * n * h;
    let last_in = u64::from(t.keeps(Role::MlpOut, place)) * HALF * n * f;
    let inner = match t.arch.mlp {
        Mlp::Gelu => HALF * n * f,
        Mlp::SwiGlu | Mlp::GeGlu => 3 * HALF * n * f,
    };
    input + inner + last_in + u64::from(t.arch.dropout) * n * h + t.adapters(place, n)
}

/// One layer of experts over `n` tokens: the MLP input 2nh (for the router's or an expert's
/// weight gradient), the router's probabilities (fp32, 4nE); for each of the n·k routed
/// token-expert pairs, the gathered input 2h (for a weight gradient), the gated MLP's 3·2f and
/// its product 2f (for a weight gradient), and the expert's output 2h (for the routing weight's
/// gradient); the shared expert as a dense MLP, with its gate its output 2nh and sigmoid 2n.
fn experts_bytes(t: &Trained, n: u64, e: &Experts) -> u64 {
    let h = t.arch.hidden;
    let in_expert = t.keeps(Role::MlpIn, Place::Expert);
    let in_shared = e.shared > 0 && t.keeps(Role::MlpIn, Place::Shared);
    let input = u64::from(t.lora.is_none() || in_expert || in_shared) * HALF * n * h;
    let router = 4 * n * e.count;
    let routed = n * e.per_token;
    let per_pair = HALF * h * u64::from(in_expert)
        + 3 * HALF * e.intermediate
        + HALF * e.intermediate * u64::from(t.keeps(Role::MlpOut, Place::Expert))
        + HALF * h;
    let shared = if e.shared > 0 {
        let f = e.shared;
        3 * HALF * n * f
            + u64::from(t.keeps(Role::MlpOut, Place::Shared)) * HALF * n * f
            + u64::from(e.shared_gate) * HALF * n * (h + 1)
            + t.adapters(Place::Shared, n)
    } else {
        0
    };
    input + router + routed * per_pair + shared + t.adapters(Place::Expert, routed)
}

/// Bytes one layer keeps: its norms' inputs (2·2nh; four norms with post-norms), its attention
/// and its MLP or experts.
fn layer_bytes(
    t: &Trained,
    n: u64,
    experts: bool,
    attention: Attention,
    recompute: Recompute,
) -> u64 {
    let a = t.arch;
    if recompute == Recompute::Full {
        return HALF * n * a.hidden;
    }
    let norms = if a.post_norms { 4 } else { 2 } * HALF * n * a.hidden;
    let mlp = match (a.experts, experts) {
        (Some(e), true) => experts_bytes(t, n, &e),
        _ => dense_mlp_bytes(t, n, Place::Dense, a.intermediate),
    };
    norms + attention_bytes(t, n, attention, recompute) + mlp
}

/// Outside the layers: with dropout the embedding's mask nh; the final norm's input 2nh; the
/// head's input 2nh (for its weight gradient: not under LoRA); the logits in fp32 for the
/// cross-entropy 4nV, and with a soft cap the tanh's 16-bit output 2nV.
fn outside_bytes(t: &Trained, n: u64) -> u64 {
    let a = t.arch;
    let head_in = u64::from(t.lora.is_none()) * HALF * n * a.hidden;
    u64::from(a.dropout) * n * a.hidden
        + HALF * n * a.hidden
        + head_in
        + 4 * n * a.vocab
        + u64::from(a.logit_softcap) * HALF * n * a.vocab
}

/// Every term for micro-batch `b`, with LoRA when `lora` is given.
pub(crate) fn activations(
    arch: &Arch,
    b: u64,
    attention: Attention,
    recompute: Recompute,
    lora: Option<&Lora>,
) -> Activations {
    let t = Trained { arch, lora };
    let n = arch.seq_len * b;
    // Sliding layers keep what full-span ones keep: FlashAttention keeps no scores, and the
    // scores `transformers`' eager attention materialises are s × s, masked outside the window.
    // The window changes the time (`step_time`), not the bytes.
    let mut layers = 0;
    let (mut largest, mut largest_whole) = (0, 0);
    let mut adapters = 0;
    for (experts, count) in [(false, arch.dense_layers()), (true, arch.expert_layers())] {
        if count == 0 {
            continue;
        }
        let one = layer_bytes(&t, n, experts, attention, recompute);
        layers += count * one;
        largest = largest.max(one);
        largest_whole = largest_whole.max(layer_bytes(&t, n, experts, attention, Recompute::None));
        if recompute != Recompute::Full {
            adapters += count * adapter_bytes(&t, n, experts);
        }
    }
    let outside_layers = outside_bytes(&t, n);
    let recompute_working = if recompute == Recompute::Full {
        largest_whole
    } else {
        0
    };
    Activations {
        per_layer: largest,
        layers,
        adapters,
        outside_layers,
        recompute_working,
        total: layers + outside_layers + recompute_working,
    }
}

/// What one layer's adapters keep (part of `layer_bytes`).
fn adapter_bytes(t: &Trained, n: u64, experts: bool) -> u64 {
    let mlp = match (t.arch.experts, experts) {
        (Some(e), true) => {
            t.adapters(Place::Expert, n * e.per_token) + t.adapters(Place::Shared, n)
        }
        _ => t.adapters(Place::Dense, n),
    };
    t.adapters(Place::Attention, n) + mlp
}

#[cfg(test)]
mod tests;
