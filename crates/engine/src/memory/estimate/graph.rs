//! What one micro-batch's graph keeps for backward (`activations`), counted from the model
//! (`model.rs`) and its two residual-step ops per block (`ops::step`: `ops::fused::branch` on
//! the CPU, `ops::lean::branch` elsewhere), for every family the `Arch` describes; and how
//! activation checkpointing (`model/recompute.rs`) changes it.

use super::peaks::head_kept_bytes;
use super::{Config, F32};
use crate::hf::{Mlp, Norm, Positions};

/// The sizes the formulas share, for one micro-batch of `cfg`'s architecture.
pub(super) struct Shape {
    /// Sequences in the micro-batch (B).
    pub b: u64,
    /// Positions per sequence (T).
    pub t: u64,
    /// Tokens, B·T.
    pub n: u64,
    /// The model width (D).
    pub d: u64,
    /// The vocabulary (V).
    pub v: u64,
    /// Transformer blocks (L).
    pub layers: u64,
    /// Query heads (H).
    pub heads: u64,
    /// Width of attention's output, H·hd (D for multi-head attention of D/H-wide heads).
    pub att: u64,
    /// Width of attention's first layer, (H + 2·KV)·hd: q, k and v side by side.
    pub qkv: u64,
    /// Width of the MLP's product (F, the intermediate size).
    pub f: u64,
    /// Width of the MLP's first layer: F for the GELU MLP, 2F for SwiGLU's gate and up.
    pub mlp: u64,
    /// f32 statistics per row a lean norm keeps: mean and reciprocal std (layer norm), or the
    /// reciprocal root mean square (RMS norm).
    pub stats: u64,
    /// The norm has a bias (layer norm).
    pub norm_bias: bool,
    /// A learned position table is added to the token embedding (else rotary, in attention).
    pub learned: bool,
    /// Compute dtype bytes (c).
    pub c: u64,
    /// The compute dtype differs from f32 (the fused ops widen their inputs into f32 copies).
    pub cast: bool,
    /// The fused ops' bf16 products run on packed blocks (`ops::fused::bf16_kernel`), which read
    /// weight matrices as stored: no f32 copies of them (`ops::fused` `storage::operand`).
    pub tiles: bool,
    /// Bytes of a residual-stream element in the graph: f32 on the fused ops (half precision
    /// carries its stream widened, `ops::widen_stream`), else c.
    pub stream: u64,
    /// The base is frozen (LoRA): the embedding's output is a leaf copy, not a graph node.
    pub frozen: bool,
    /// Threads that may hold a packed copy at once (`Config::threads`).
    pub threads: u64,
}

impl Shape {
    pub(super) fn new(cfg: &Config) -> Shape {
        let a = &cfg.arch;
        let (b, t) = (cfg.micro_batch as u64, cfg.model.seq_len as u64);
        let layer_norm = a.norm == Norm::LayerNorm;
        Shape {
            b,
            t,
            n: b * t,
            d: a.hidden,
            v: a.vocab,
            layers: a.layers,
            heads: a.heads,
            att: a.q_width(),
            qkv: a.q_width() + 2 * a.kv_width(),
            f: a.intermediate,
            mlp: match a.mlp {
                Mlp::Gelu => a.intermediate,
                // Gated (GeGLU as SwiGLU): gate and up side by side.
                Mlp::SwiGlu | Mlp::GeGlu => 2 * a.intermediate,
            },
            stats: if layer_norm { 2 } else { 1 },
            norm_bias: layer_norm,
            learned: a.positions == Positions::Learned,
            c: cfg.dtype.size_in_bytes() as u64,
            cast: cfg.dtype != crate::control::Dtype::F32,
            tiles: cfg.fused
                && cfg.dtype == crate::control::Dtype::Bf16
                && crate::ops::fused::bf16_kernel() != crate::ops::fused::Bf16Kernel::Gemm,
            stream: if cfg.fused {
                F32
            } else {
                cfg.dtype.size_in_bytes() as u64
            },
            frozen: cfg.lora.is_some(),
            threads: cfg.threads.max(1) as u64,
        }
    }

    /// The fused ops read `matrix` elements of weight matrices through f32 copies: in half
    /// storage, unless on tiles. Their bytes.
    pub(super) fn matrix_copies(&self, matrix: u64) -> u64 {
        if self.cast && !self.tiles {
            matrix * F32
        } else {
            0
        }
    }

    /// N·D elements: one `[N, D]` tensor.
    pub(super) fn nd(&self) -> u64 {
        self.n * self.d
    }

    /// The residual stream is a widened copy of the compute dtype's (`ops::widen_stream`).
    pub(super) fn widened(&self) -> bool {
        self.stream != self.c
    }

    /// Elements of attention's log-sum-exp, one f32 per (sequence, query head, position).
    pub(super) fn lse(&self) -> u64 {
        self.b * self.heads * self.t
    }
}

/// The scalars at the end of the loss (its sum and the scaled loss): the part of the
/// activations that does not grow with the micro-batch.
pub(super) fn loss_scalar_bytes() -> u64 {
    2 * F32
}

/// The embeddings' outputs: the token rows (`[N, D]`) and, with a learned position table, their
/// sum with the positions; rotary families add their positions inside attention. Under LoRA
/// the frozen embedding computes outside the graph and its output is copied into a leaf
/// (`Gpt::forward_checkpointed`, PEFT's `enable_input_require_grads`): that copy only. A
/// widened stream adds its f32 copy. The fused ops' embedding adds the positions and writes the
/// stream itself (`ops::embedding_beside`): its output only.
fn embedding_bytes(cfg: &Config, s: &Shape) -> u64 {
    let widened = if s.widened() { s.nd() * s.stream } else { 0 };
    if s.frozen {
        return s.nd() * s.c + widened;
    }
    if cfg.grads_beside() {
        return s.nd() * s.stream;
    }
    (1 + u64::from(s.learned)) * s.nd() * s.c + widened
}

/// The final norm: its output, and on the lean path its f32 row statistics; after a widened
/// stream, its input narrowed back to the compute dtype too.
fn final_norm_bytes(cfg: &Config, s: &Shape) -> u64 {
    let stats = if cfg.fused { 0 } else { s.stats * s.n * F32 };
    let narrowed = if s.widened() { s.nd() * s.c } else { 0 };
    s.nd() * s.c + stats + narrowed
}

/// Bytes one block's graph keeps for backward. Each residual step is one op whose one graph
/// input is the residual stream; it keeps its norm's output (D), its first layer's output (qkv:
/// (H + 2·KV)·hd; the MLP: F, or 2F for SwiGLU's gate and up) and, after attention, attention's
/// output (H·hd): the probabilities and the activation are made again in the backward. With
/// the two steps' outputs (the stream's) that is (2·D·stream + (2·D + qkv + H·hd + mlp)·c)·N,
/// 12·N·D·c for this engine's GPT where the stream is c. The lean ops also keep f32 row
/// statistics beside their outputs: each norm's (2 floats a row for layer norm, 1 for RMS
/// norm) and attention's log-sum-exp (B·H·T).
pub(super) fn block_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    let kept = (2 * s.d * s.stream + (2 * s.d + s.qkv + s.att + s.mlp) * s.c) * s.n;
    if cfg.fused {
        kept
    } else {
        kept + (2 * s.stats * s.n + s.lse()) * F32
    }
}

/// Bytes the graph of one micro-batch keeps for backward. With checkpointing each segment of
/// blocks keeps only its output (the next segment's input): `checkpointed`. The fused head may
/// keep its logits (`head_kept_bytes`).
pub fn activation_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    let blocks = match checkpointed(cfg) {
        Some(segments) => segments.kept * s.nd() * s.stream,
        None => s.layers * block_bytes(cfg),
    };
    embedding_bytes(cfg, &s)
        + blocks
        + final_norm_bytes(cfg, &s)
        + head_kept_bytes(cfg)
        + loss_scalar_bytes()
}

/// How checkpointing splits the blocks: segment outputs kept through the forward, and the
/// blocks of the largest segment, recomputed at once in the backward.
pub struct Segments {
    /// Block outputs kept through the forward.
    pub kept: u64,
    /// Blocks in the largest segment, recomputed together.
    pub largest: u64,
}

/// The segments `cfg`'s checkpointing makes, or `None` without checkpointing.
pub fn checkpointed(cfg: &Config) -> Option<Segments> {
    let per = cfg.checkpointing.segment()? as u64;
    let layers = cfg.arch.layers;
    Some(Segments {
        kept: layers.div_ceil(per),
        largest: per.min(layers),
    })
}

/// Bytes the backward's recompute adds to the activations at its peak: the saved input's
/// copy (a `Var` to differentiate against), the largest segment's graph, the `y · grad` product
/// and its sum. 0 without checkpointing.
pub fn recomputed_bytes(cfg: &Config) -> u64 {
    let Some(segments) = checkpointed(cfg) else {
        return 0;
    };
    let s = Shape::new(cfg);
    2 * s.nd() * s.stream + segments.largest * block_bytes(cfg) + s.stream
}

/// Bytes the checkpointed forward holds at its peak beyond what its end keeps (`other` at the
/// forward's peak). A segment runs without a graph, but each block's intermediates live until
/// the block returns, so the forward peaks inside the last block of a segment: beside the
/// embeddings, the outputs of the segments before it and (when its segment has more than one
/// block) the previous block's output, that block holds (`checkpointed_block_peak_bytes`). The
/// end instead keeps every segment's output, the final norm and the loss head. 0 without
/// checkpointing.
pub fn checkpointed_forward_excess_bytes(cfg: &Config) -> u64 {
    let Some(segments) = checkpointed(cfg) else {
        return 0;
    };
    let s = Shape::new(cfg);
    let per = segments.largest;
    // The last block of segment `i` (of `size` blocks): the largest over the segments, as a
    // shorter last segment casts fewer weights than a full one before it.
    let present = (0..segments.kept)
        .map(|i| {
            let size = per.min(s.layers - i * per);
            let held = (i + u64::from(size > 1)) * s.nd() * s.stream;
            embedding_bytes(cfg, &s) + held + checkpointed_block_peak_bytes(cfg, size)
        })
        .max()
        .unwrap_or(0);
    present.saturating_sub(activation_bytes(cfg))
}

/// What one block holds at its forward's peak without a graph, its input not counted, as the
/// `blocks`-th block of its segment.
///
/// Fused ops (CPU): inside the MLP step's second layer, 3·D + mlp + F per token (11·N·D for the
/// GPT: the attention step's output, the norm's output, the first layer's output, its
/// activation and the product), and `gemm`'s packed weight on each thread; with half storage the step's tensors in c bytes (3·D + mlp) and beside them the
/// op's f32 copies of the first layer's output and of the second layer's weight, the activation
/// and the product (mlp + F + D per token, and F·D), plus the segment's weight casts.
///
/// Lean ops: the larger of attention's softmax (the norm's output, qkv and the q, k, v copies,
/// and three f32 score tensors of one chunk of sequences with two per-row reductions) and the
/// MLP's second layer (5·D + mlp + F per token, 13·N·D for the GPT: the attention step's
/// output, the norm's output, the first layer's output, its activation, the product, its bias
/// and residual sums, and one `[N, D]` more), plus the compute dtype's copies of the segment's
/// weights so far (`blocks` blocks: they are made per segment).
fn checkpointed_block_peak_bytes(cfg: &Config, blocks: u64) -> u64 {
    let s = Shape::new(cfg);
    let c = s.c;
    let casts = if s.cast && !cfg.half_weights() {
        blocks * cfg.block_cast_params() * c
    } else {
        0
    };
    if cfg.fused {
        let packing = super::peaks::stored_packing(&s, s.n, s.f, s.d);
        if !s.cast {
            return (3 * s.d + s.mlp + s.f) * s.n * F32 + packing;
        }
        let widened = (s.mlp + s.f + s.d) * s.n * F32 + s.matrix_copies(s.f * s.d);
        return (3 * s.d + s.mlp) * s.n * c + widened + packing + casts;
    }
    let attention = (s.d + 2 * s.qkv) * s.n * c + (3 * attention_chunk(&s) + 2 * s.lse()) * F32;
    let mlp = (5 * s.d + s.mlp + s.f) * s.n * c;
    attention.max(mlp) + casts
}

/// Score elements of one chunk of the lean attention (`ops::lean::sequences_per_chunk`): the
/// sequences of a chunk times H·T².
pub(super) fn attention_chunk(s: &Shape) -> u64 {
    let per = crate::ops::lean::sequences_per_chunk(s.t as usize, s.heads as usize) as u64;
    per.min(s.b) * s.heads * s.t * s.t
}
