//! The analytic estimator: bytes per ledger category for a configuration, derived by counting
//! the tensors this model's forward creates (`model.rs`, `ops.rs`) and what Candle's backward
//! keeps; no measurement goes in.
//!
//! Activations. Candle keeps every tensor of the graph alive until the loss is dropped (each op
//! holds its inputs), so activations are every new storage the forward's graph holds; views
//! (reshape, permute, transpose, narrow, broadcast) add none. With N = B·T tokens, d model
//! width, H heads, V vocab and c the compute dtype's bytes, one block keeps 12·N·d·c: both the
//! fused CPU ops and the lean ones (`ops::lean`: CUDA) run each residual step as one op that
//! keeps no branch output; the lean ops add f32 row figures (each norm's mean and reciprocal
//! std, attention's log-sum-exp: 4·N·4 + B·H·T·4); no T² term.
//! In the transformer form of Korthikanti et al. 2022, "Reducing Activation Recomputation in
//! Large Transformer Models", s·b·h·(α + β·a·s/h) per layer, that is α = 12·c (24 bytes in
//! bf16) and β = 0, against their 34 and 5 for a 16-bit Megatron block: attention's
//! probabilities and the GELU are recomputed in the backward, as in their "selective
//! recomputation". The head and loss keep no logits on either path.
//!
//! Transient gradients: the store one backward returns, one f32 gradient per parameter (in the
//! compute dtype under offload in half precision, whose weights are that dtype; no constant is a
//! graph input, and both paths return gradients computed from detached tensors,
//! which reference nothing). The measured figure is the backward's peak over its start, so the
//! estimate takes the largest of three peaks: block 0's MLP (the store so far plus what is in
//! flight there, `in_flight_bytes`, less what only exists after it, `after_peak_bytes`), the loss
//! head at the very start (`head_peak_bytes`) and the token embedding's gradient at the very
//! end (`embedding_peak_bytes`).

use serde::Serialize;

use crate::scenario::{ModelConfig, Scenario};
use crate::telemetry::{
    Categories, Checkpointing, Control, Dtype, EstimateEvent, Knobs, LossNorm, OffloadGrads, Phase,
    ZeroGrad,
};

use super::verdict::Verdict;

const F32: u64 = 4;

/// Everything the estimate depends on.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Config {
    /// The model's shape.
    pub model: ModelConfig,
    /// B.
    pub micro_batch: usize,
    /// K.
    pub accum_steps: usize,
    /// The compute precision.
    pub dtype: Dtype,
    /// Whether the optimizer state lives in host memory.
    pub offload: bool,
    /// Where the window's gradients accumulate while offloaded (`train.offload_grads`).
    pub offload_grads: OffloadGrads,
    /// A pitfall is on (mean-of-means or zero-grad per micro-batch): a reference buffer is kept.
    pub pitfall: bool,
    /// Host and device are one memory (CPU): offload keeps no separate master copy.
    pub unified: bool,
    /// The boundary multiplies the gradients: f16 unscaling, or a clip threshold is set.
    pub scales_gradients: bool,
    /// Workspace outside any tensor (`other`): on CPU, `gemm`'s packing slab on every thread
    /// that multiplies (`ops::workspace::bytes`); 0 elsewhere.
    pub workspace: u64,
    /// Activation checkpointing (`model/recompute.rs`): see `checkpointed`.
    pub checkpointing: Checkpointing,
}

impl Config {
    /// The configuration the knobs `k` give for `model`; `unified` when host and device are one memory.
    pub fn from_knobs(model: &ModelConfig, k: &Knobs, unified: bool) -> Config {
        Config {
            model: model.clone(),
            micro_batch: k.micro_batch,
            accum_steps: k.accum_steps,
            dtype: k.dtype,
            offload: k.offload,
            offload_grads: k.offload_grads,
            pitfall: k.loss_norm != LossNorm::Tokens || k.zero_grad != ZeroGrad::PerWindow,
            unified,
            scales_gradients: k.dtype.needs_loss_scaling() || k.clip.is_some(),
            workspace: if unified {
                crate::ops::workspace::bytes()
            } else {
                0
            },
            checkpointing: k.checkpointing,
        }
    }

    /// [`Config::from_knobs`] with the scenario's first knobs.
    pub fn from_scenario(s: &Scenario, unified: bool) -> Config {
        Config::from_knobs(&s.model, &Knobs::from_scenario(s), unified)
    }

    /// Offload in half precision (`train::offload`): the device's weights are compute-dtype
    /// copies, the f32 master weights live in host memory, and backward's gradients come in
    /// the compute dtype.
    pub fn half_weights(&self) -> bool {
        self.offload && self.dtype != Dtype::F32
    }

    /// The window's gradient buffer lives in host memory.
    pub fn grads_on_host(&self) -> bool {
        self.offload && self.offload_grads == OffloadGrads::Host
    }

    /// Bytes of one parameter's gradient as backward returns it.
    fn grad_elem_bytes(&self) -> u64 {
        if self.half_weights() {
            self.dtype.size_in_bytes() as u64
        } else {
            F32
        }
    }
}

/// Predicted categories at the end of each phase of one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// At the end of the forward.
    pub forward: Categories,
    /// At the end of the backward (the peak of most runs).
    pub backward: Categories,
    /// During the optimizer step.
    pub optimizer: Categories,
    /// After the step: what persists between steps.
    pub step: Categories,
    /// True when host and device are one memory.
    pub unified: bool,
}

impl Estimate {
    /// The four phases with their categories, in step order.
    pub fn phases(&self) -> [(Phase, Categories); 4] {
        [
            (Phase::Forward, self.forward),
            (Phase::Backward, self.backward),
            (Phase::Optimizer, self.optimizer),
            (Phase::Step, self.step),
        ]
    }

    /// Bytes in the measured memory (the device; everything when unified).
    pub fn resident(&self, c: &Categories) -> u64 {
        if self.unified {
            c.sum()
        } else {
            c.sum() - c.offloaded
        }
    }

    /// The step's predicted peak: the largest phase.
    pub fn peak(&self) -> u64 {
        self.phases()
            .iter()
            .map(|(_, c)| self.resident(c))
            .max()
            .unwrap_or(0)
    }

    /// `estimate` events for the step the configuration applies from.
    pub fn events(&self, step: u64) -> Vec<EstimateEvent> {
        self.phases()
            .into_iter()
            .map(|(phase, categories)| EstimateEvent {
                step,
                phase,
                categories,
                total: self.resident(&categories),
                unified: self.unified,
            })
            .collect()
    }
}

/// Controls that change what the step holds, so a new estimate is due (the knob table's
/// `moves_memory`).
pub fn changes_memory(c: &Control) -> bool {
    c.knob().is_some_and(|k| k.moves_memory)
}

/// Shape figures the formulas share.
struct Shape {
    n: u64,
    d: u64,
    v: u64,
    t: u64,
    layers: u64,
    /// Batch × heads × T × T: one attention score tensor.
    scores: u64,
    /// Heads × T × T: one sequence's share of `scores`.
    sequence_scores: u64,
    /// Compute dtype bytes.
    c: u64,
    /// The compute dtype differs from f32 (casts make copies).
    cast: bool,
}

impl Shape {
    fn new(cfg: &Config) -> Shape {
        let m = &cfg.model;
        let (b, t) = (cfg.micro_batch as u64, m.seq_len as u64);
        Shape {
            n: b * t,
            d: m.d_model as u64,
            v: m.vocab as u64,
            t,
            layers: m.layers as u64,
            scores: b * m.heads as u64 * t * t,
            sequence_scores: m.heads as u64 * t * t,
            c: cfg.dtype.size_in_bytes() as u64,
            cast: cfg.dtype != Dtype::F32,
        }
    }
}

/// Trainable parameters of the model.
pub fn param_count(m: &ModelConfig) -> u64 {
    let (v, d, t, l) = (
        m.vocab as u64,
        m.d_model as u64,
        m.seq_len as u64,
        m.layers as u64,
    );
    let block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
    v * d + t * d + l * block + 2 * d + d * v
}

/// `crate::ops` runs its fused CPU kernels on the host (f32 arithmetic, any storage dtype);
/// elsewhere the lean ops.
fn fused(cfg: &Config) -> bool {
    cfg.unified
}

/// Bytes one `ops::layer_norm` keeps (input dtype = compute dtype): its output; the lean op
/// (`ops::lean::layer_norm`) also an f32 mean and reciprocal std per row.
fn layer_norm_bytes(s: &Shape, fused: bool) -> u64 {
    let output = s.n * s.d * s.c;
    if fused {
        output
    } else {
        output + 2 * s.n * F32
    }
}

/// The scalars at the end of the loss (its sum and the scaled loss): the part of the
/// activations that does not grow with the micro-batch.
fn loss_scalar_bytes() -> u64 {
    2 * F32
}

/// Bytes the graph of one micro-batch keeps for backward. With checkpointing each segment of
/// blocks keeps only its output (the next segment's input): `checkpointed`.
pub fn activation_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    let (n, d, c) = (s.n, s.d, s.c);
    let embedding = 2 * n * d * c;
    let ln = layer_norm_bytes(&s, fused(cfg));
    let blocks = match checkpointed(cfg) {
        Some(segments) => segments.kept * n * d * c,
        None => s.layers * block_bytes(cfg),
    };
    embedding + blocks + ln + loss_head_activation_bytes()
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
    let layers = cfg.model.layers as u64;
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
    2 * s.n * s.d * s.c + segments.largest * block_bytes(cfg) + s.c
}

/// Bytes the checkpointed forward holds at its peak beyond what its end keeps (`other` at the
/// forward's peak). A segment runs without a graph, but each block's intermediates live until
/// the block returns, so the forward peaks inside the last block: beside the embeddings, the
/// outputs of the segments before it and (when its segment has more than one block) the previous
/// block's output, that block holds (`checkpointed_block_peak_bytes`). The end instead keeps
/// every segment's output, the final norm and the loss head. 0 without checkpointing.
pub fn checkpointed_forward_excess_bytes(cfg: &Config) -> u64 {
    let Some(segments) = checkpointed(cfg) else {
        return 0;
    };
    let s = Shape::new(cfg);
    let (n, d, c) = (s.n, s.d, s.c);
    let per = segments.largest;
    // The last block of segment `i` (of `size` blocks): the largest over the segments, as a
    // shorter last segment casts fewer weights than a full one before it.
    let present = (0..segments.kept)
        .map(|i| {
            let size = per.min(s.layers - i * per);
            let held = (i + u64::from(size > 1)) * n * d * c;
            2 * n * d * c + held + checkpointed_block_peak_bytes(cfg, size)
        })
        .max()
        .unwrap_or(0);
    present.saturating_sub(activation_bytes(cfg))
}

/// What one block holds at its forward's peak without a graph, its input not counted, as the
/// `blocks`-th block of its segment.
///
/// Fused ops (CPU): inside the GELU-linear, ln1's output, the residual, ln2's output, the
/// hidden layer, its GELU and the product (12·N·d) and `gemm`'s packed weight on each thread;
/// with half storage the first seven N·d in c bytes, the GELU and product in f32 beside the
/// op's f32 copies of h and W (9·N·d + 4·d²), plus the segment's weight casts.
///
/// Lean ops: the larger of attention's softmax (ln1's output, qkv, the q/k/v copies: 7·N·d,
/// and three f32 score tensors of one chunk of sequences with two per-row reductions) and the
/// MLP's output layer or
/// ln2 (13·N·d: ln1's output, the residual, ln2's output, the hidden layer before and after its
/// bias or GELU, the product and its bias; ln2's f32 copies weigh the same), plus the compute
/// dtype's copies of the segment's weights so far (`blocks` blocks: they are made per segment).
fn checkpointed_block_peak_bytes(cfg: &Config, blocks: u64) -> u64 {
    let s = Shape::new(cfg);
    let (n, d, c) = (s.n, s.d, s.c);
    let casts = if s.cast && !cfg.half_weights() {
        blocks * block_params(&cfg.model) * c
    } else {
        0
    };
    if fused(cfg) {
        let (per_thread, units) =
            crate::ops::fused::rhs_packing(n as usize, 4 * d as usize, d as usize);
        let threads = crate::ops::pool::cpu_threads().min(units) as u64;
        let packing = threads * per_thread;
        if !s.cast {
            return 12 * n * d * F32 + packing;
        }
        // Half storage: the block's tensors in c bytes, the op's f32 copies of h and W, the
        // GELU and the product in f32.
        return 7 * n * d * c + (9 * n * d + 4 * d * d) * F32 + packing + casts;
    }
    let attention = 7 * n * d * c + (3 * attention_chunk(&s) + 2 * (s.scores / s.t)) * F32;
    let mlp = 13 * n * d * c;
    attention.max(mlp) + casts
}

/// Bytes one block's graph keeps for backward. Both paths run each residual step as one op
/// (`ops::fused::branch`, `ops::lean::branch`) that keeps the norm's output (1), the first
/// layer's output (qkv 3, fc 4) and attention's output (1: the probabilities and the activation
/// are recomputed in the backward), and each step's output is the next one's input (2): 12·N·d.
/// The lean ops add f32 row figures beside their nodes: each norm's mean and reciprocal std
/// (2·N each) and attention's log-sum-exp (B·H·T).
fn block_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    let nd = s.n * s.d * s.c;
    if fused(cfg) {
        12 * nd
    } else {
        12 * nd + 4 * s.n * F32 + (s.scores / s.t) * F32
    }
}

/// The activations of the loss head: on both paths the head and loss are one op that keeps
/// only its input (the final norm's output) and weight, never the logits
/// (`ops::fused::linear_nll_sum`, `ops::lean::linear_nll_sum`): only the loss's scalars remain.
fn loss_head_activation_bytes() -> u64 {
    loss_scalar_bytes()
}

/// What the vocabulary costs at the backward's start: the head's activations (logits and the
/// loss's copies) and the logits' gradient in flight. It grows with N·V, so at a subword
/// vocabulary it is the share a smaller micro-batch cuts most.
pub fn head_bytes(cfg: &Config) -> u64 {
    loss_head_activation_bytes() + head_peak_bytes(cfg)
}

/// Bytes of the gradient store one backward returns: one gradient per parameter, f32 (compute
/// dtype under offload in half precision). Neither
/// path gives constants a gradient (the causal mask and the loss mask are not graph inputs), and
/// both return gradients computed from detached tensors, which reference nothing.
pub fn grad_store_bytes(cfg: &Config) -> u64 {
    param_count(&cfg.model) * cfg.grad_elem_bytes()
}

/// Bytes in flight at the backward's block-0 peak, when the store is largest.
///
/// Lean ops (CUDA): the peak falls in block 0's GELU-linear backward
/// (`ops::lean::gelu_linear`), while it rebuilds the GELU's slope in f32: four f32 tensors of the
/// hidden layer's size at once (4 × 4·N·d·4; the gradient's f32 copy is made after), and in the
/// compute dtype the hidden layer's gradient (4·N·d), the output's gradient and the residual
/// stream's pending one (2·N·d).
///
/// Fused ops (CPU): the peak falls inside block 0's GELU-linear backward, which holds its
/// packed result (dh, 4·N·d, and dW, db: 4·d² + d) and its recomputed GELU and slope (2 × 4·N·d),
/// all f32, beside the output's gradient and the residual stream's pending one (2·N·d·c):
/// 14·N·d + 4·d² + d in f32, and, while its dx product (`dy·Wᵀ`) runs, `gemm`'s copy of Wᵀ
/// packed on each thread (`ops::fused::rhs_packing`; timing decides how many overlap, so every
/// thread is counted). With half storage the op also holds f32 copies of its inputs h (4·N·d),
/// W (4·d²) and the incoming gradient (N·d).
pub fn in_flight_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    if fused(cfg) {
        let (d, n) = (s.d as usize, s.n as usize);
        let (per_thread, blocks) = crate::ops::fused::rhs_packing(n, d, 4 * d);
        let threads = crate::ops::pool::cpu_threads().min(blocks) as u64;
        let (nd, dd) = (s.n * s.d, s.d * s.d);
        // Packed result, GELU and slope (f32), then the output's and the residual's gradients.
        let f32_work = (4 * nd + 4 * dd + s.d) + 8 * nd;
        let graph = 2 * nd * s.c;
        // Half storage: the op's f32 copies of h, W and the incoming gradient.
        let widened = if s.cast { 4 * nd + 4 * dd + nd } else { 0 };
        return (f32_work + widened) * F32 + graph + threads * per_thread;
    }
    (4 * 4 * F32 + 6 * s.c) * s.n * s.d
}

/// Bytes of the end-of-backward figure that do not exist yet at the block-0 peak: the
/// gradients still to come (lean: block 0's parameters before its MLP output and the
/// embeddings; fused: all of block 0's and the embeddings).
pub fn after_peak_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    let d = s.d;
    let embeddings = s.v * d + s.t * d;
    if fused(cfg) {
        return (12 * d * d + 13 * d + embeddings) * F32;
    }
    (8 * d * d + 12 * d + embeddings) * cfg.grad_elem_bytes()
}

/// Bytes in flight at the top of the backward, in the head and loss's backward. Lean
/// (`ops::lean::linear_nll_sum`): inside one chunk of `r = min(chunk_rows(V), N)` rows, the
/// softmax, the one-hot targets and their difference (3·r·V·4), beside the f32 sum of dW over
/// the chunks before it (d·V·4, when there are several) and the rows of dx made so far (N·d·c). The
/// fused head (CPU): see `fused_head_peak_bytes`.
pub fn head_peak_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    if fused(cfg) {
        return fused_head_peak_bytes(&s);
    }
    let chunk = fused_head_chunk(&s);
    let dw_sum = if chunk < s.n * s.v { s.d * s.v } else { 0 };
    (3 * chunk + dw_sum) * F32 + s.n * s.d * s.c
}

/// The fused head and loss's backward (`ops::fused::linear_nll_sum`) peaks at the larger of two
/// moments. Inside it: its packed result (dx, N·d, and dW, d·V) and one chunk of logits turned
/// into their gradient (`chunk_rows(V)` rows of V, or N when fewer). After it, when the store
/// adds its results (a zero tensor, then the sum, per input): beside the packed buffer, x's zero
/// tensor and sum (3·N·d + d·V), then x's sum with W's zero tensor and sum (2·N·d + 3·d·V).
///
/// With half storage the inside also holds f32 copies of x and W (N·d + d·V), the packed result
/// is rounded into a half copy while the f32 one lives (N·d + d·V of each), and the store adds
/// half gradients (c bytes each).
fn fused_head_peak_bytes(s: &Shape) -> u64 {
    let (n, d, v) = (s.n, s.d, s.v);
    let packed = n * d + d * v;
    if s.cast {
        let inside = (2 * packed + fused_head_chunk(s)) * F32;
        let rounding = packed * (F32 + s.c);
        let adding = (2 * n * d + 3 * d * v).max(3 * n * d + d * v) * s.c;
        return inside.max(rounding).max(adding);
    }
    let inside = packed + fused_head_chunk(s);
    let adding_dx = 3 * n * d + d * v;
    let adding_dw = 2 * n * d + 3 * d * v;
    inside.max(adding_dx).max(adding_dw) * F32
}

/// What the end of the forward holds only while it runs, beyond the activations it leaves: no
/// category holds it, so the forward's measured peak shows it in `other`.
///
/// Fused head and loss (CPU): one chunk of logits and each row's loss (the backward reuses
/// its chunk inside `head_peak_bytes`); with half storage the f32 copies the ops make of their
/// inputs, the largest in the last block's GELU-linear. Lean ops: the larger of the final norm's f32 work (the
/// input's f32 copy when cast, the normalised rows, ×gain and +bias: 3 or 4 × N·d·4, the result
/// and its copy into the graph: 2·N·d·c) and one chunk of the head's logits with the shifted and
/// exponentiated copies the log-sum-exp makes (3 × chunk · 4).
fn head_forward_transient_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    if fused(cfg) {
        let head = (fused_head_chunk(&s) + s.n) * F32;
        if !s.cast {
            return head;
        }
        // Half storage: the head's f32 copies of x and W; and the last block's GELU-linear,
        // which holds f32 copies of h and W, the GELU and its f32 result (9·N·d + 4·d² + d)
        // before that block's output, its residual and the final norm (3·N·d·c) exist.
        let (nd, dd) = (s.n * s.d, s.d * s.d);
        let head = head + (nd + s.d * s.v) * F32;
        let mlp = ((9 * nd + 4 * dd + s.d) * F32).saturating_sub(3 * nd * s.c);
        return head.max(mlp);
    }
    let f32_copies = if s.cast { 4 } else { 3 };
    let final_norm = (f32_copies * F32 + 2 * s.c) * s.n * s.d;
    final_norm.max(3 * fused_head_chunk(&s) * F32)
}

/// Score elements of one chunk of the lean attention (`ops::lean::sequences_per_chunk`).
fn attention_chunk(s: &Shape) -> u64 {
    let heads = (s.sequence_scores / (s.t * s.t).max(1)) as usize;
    let per = crate::ops::lean::sequences_per_chunk(s.t as usize, heads) as u64;
    s.scores.min(per * s.sequence_scores)
}

/// Floats of one chunk of the fused head's logits.
fn fused_head_chunk(s: &Shape) -> u64 {
    (crate::ops::fused::head_chunk_rows(s.v as usize) as u64).min(s.n) * s.v
}

/// Bytes at the backward's very end, in the token embedding's gradient: every other gradient is
/// in the store (and retained). In f32 Candle's `index_select` backward holds the table's zero
/// tensor and the `index_add` result (2·V·d) beside the tokens' gradient (N·d). In half
/// precision the largest moment comes after `ops::half::embedding` (whose f32 sum is rounded to
/// the table's dtype): the cast's backward adds the table's half gradient (V·d·c, still held)
/// into the f32 weight's store, its f32 copy, the zero tensor and the sum all live at once
/// (3·V·d·4), the weight's own f32 gradient not yet in the store. Large once V·d is (a subword
/// vocabulary). The half-precision moment is counted where it was measured, on the fused CPU
/// path (`tests/memory_ledger.rs`, V = 8192); the lean path's estimate leaves it out.
pub fn embedding_peak_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    let (vd, nd) = (s.v * s.d, s.n * s.d);
    if !s.cast {
        return grad_store_bytes(cfg) + (vd + nd) * F32;
    }
    if !fused(cfg) {
        return 0;
    }
    let casting = vd * s.c + 3 * vd * F32 - vd * F32;
    let summing = vd * F32 + nd * (F32 + s.c);
    grad_store_bytes(cfg) + casting.max(summing)
}

/// What backward holds at its peak on top of what it started from: the largest of the
/// candidate peaks, the loss head (first), block 0's MLP (last, with everything retained) and
/// the token embedding's gradient at the very end.
pub fn transient_bytes(cfg: &Config) -> u64 {
    let block0 = (grad_store_bytes(cfg) + in_flight_bytes(cfg) + recompute_in_flight_bytes(cfg))
        .saturating_sub(after_peak_bytes(cfg));
    block0
        .max(head_peak_bytes(cfg))
        .max(embedding_peak_bytes(cfg))
}

/// Gradients the checkpointed backward holds at block 0's peak beyond the plain one: the outer
/// backward's gradient of the segment's output, held while the recompute runs, the gradient
/// Candle's `Mul` backward computes and keeps in the recompute's store for the detached `grad_y`
/// side of `y · grad_y` (never a node, so never removed), and three more N·d·c measured and not
/// yet attributed (`tests/checkpointing_memory.rs`: 5.0 N·d·4 of slope over the micro-batch at
/// d 48 and 64 on the fused path; on the lean ops' path the same 5·N·d·c brings the one gap over
/// 5%, the `notes-table` model at B 32, within). 0 without checkpointing.
fn recompute_in_flight_bytes(cfg: &Config) -> u64 {
    if checkpointed(cfg).is_none() {
        return 0;
    }
    let s = Shape::new(cfg);
    5 * s.n * s.d * s.c
}

/// Bytes of the largest parameter (f32): the token embedding or head (V·d), or an MLP matrix
/// (4·d²).
fn largest_param_bytes(m: &ModelConfig) -> u64 {
    let (v, d) = (m.vocab as u64, m.d_model as u64);
    (v * d).max(4 * d * d) * F32
}

/// Bytes the optimizer phase copies beyond the buffer. On the CPU (and on the host, where
/// offload may keep the buffer) the boundary unscales and clips in place and AdamW updates in
/// place: nothing. Elsewhere Candle has no in-place multiply,
/// so unscaling and clipping replace one gradient at a time by its scaled copy (the largest
/// parameter's f32 gradient at once, `train::inplace::scale_in_place`).
pub fn boundary_copy_bytes(cfg: &Config) -> u64 {
    if cfg.unified || !cfg.scales_gradients || cfg.grads_on_host() {
        return 0;
    }
    largest_param_bytes(&cfg.model)
}

/// Host bytes the optimizer phase adds while offloaded from a separate device: each gradient
/// is copied to the host for the host-side update, one parameter at a time (none when they
/// accumulate there already).
pub fn offload_copy_bytes(cfg: &Config) -> u64 {
    if cfg.unified || !cfg.offload || cfg.grads_on_host() {
        return 0;
    }
    largest_param_bytes(&cfg.model)
}

/// Bytes of the copy back of one updated weight in half precision under offload: the host
/// master weight cast to the compute dtype, one parameter at a time (`AdamW::copy_back`); on a
/// GPU the same bytes again on the device while they land.
pub fn weight_copy_bytes(cfg: &Config) -> u64 {
    if !cfg.half_weights() {
        return 0;
    }
    largest_param_bytes(&cfg.model) / F32 * cfg.dtype.size_in_bytes() as u64
}

/// Parameters whose compute-dtype copy lives through the micro-step: all of them, or with
/// checkpointing only those outside the blocks (the blocks cast theirs transiently).
fn kept_cast_params(cfg: &Config) -> u64 {
    let all = param_count(&cfg.model);
    match checkpointed(cfg) {
        Some(_) => all - cfg.model.layers as u64 * block_params(&cfg.model),
        None => all,
    }
}

fn block_params(m: &ModelConfig) -> u64 {
    let one = ModelConfig {
        layers: 1,
        ..m.clone()
    };
    let none = ModelConfig {
        layers: 0,
        ..m.clone()
    };
    param_count(&one) - param_count(&none)
}

/// The compute-dtype copies the backward's recompute makes of one segment's weights.
fn recompute_casts(cfg: &Config) -> u64 {
    match checkpointed(cfg) {
        Some(seg) if cfg.dtype != Dtype::F32 && !cfg.half_weights() => {
            seg.largest * block_params(&cfg.model) * cfg.dtype.size_in_bytes() as u64
        }
        _ => 0,
    }
}

/// The predicted ledger of one optimizer step under `cfg`.
pub fn estimate(cfg: &Config) -> Estimate {
    let p = param_count(&cfg.model) * F32;
    let c = cfg.dtype.size_in_bytes() as u64;
    let buffers = if cfg.pitfall { 2 } else { 1 };
    let moments = 2 * p;
    // Host master weights: under offload from a separate device, and in half precision under
    // offload on any device (the device keeps compute-dtype weights only).
    let master = if cfg.offload && (!cfg.unified || cfg.half_weights()) {
        p
    } else {
        0
    };
    let (optimizer_state, offloaded) = if cfg.offload {
        (0, moments + master)
    } else {
        (moments, 0)
    };
    let (parameters, resident_compute) = if cfg.half_weights() {
        (0, p / F32 * c)
    } else {
        (p, 0)
    };
    let persistent = Categories {
        parameters,
        compute_weights: resident_compute,
        optimizer_state,
        offloaded,
        other: cfg.workspace,
        ..Categories::default()
    };
    // The accumulation buffer exists inside a window from its second micro-batch on.
    let in_window_buffer = if cfg.accum_steps > 1 { buffers * p } else { 0 };
    let compute_weights = if cfg.dtype == Dtype::F32 || cfg.half_weights() {
        resident_compute
    } else {
        kept_cast_params(cfg) * c
    };
    let forward = buffer_at(
        cfg,
        Categories {
            compute_weights,
            activations: activation_bytes(cfg),
            other: cfg.workspace
                + head_forward_transient_bytes(cfg).max(checkpointed_forward_excess_bytes(cfg)),
            ..persistent
        },
        in_window_buffer,
    );
    let backward = Categories {
        gradients_transient: transient_bytes(cfg) + recompute_casts(cfg),
        activations: forward.activations + recomputed_bytes(cfg),
        other: persistent.other,
        ..forward
    };
    let copy_back = weight_copy_bytes(cfg);
    let optimizer = buffer_at(
        cfg,
        Categories {
            gradients_transient: boundary_copy_bytes(cfg),
            offloaded: persistent.offloaded
                + offload_copy_bytes(cfg)
                + if cfg.unified { 0 } else { copy_back },
            other: persistent.other + copy_back,
            ..persistent
        },
        buffers * p,
    );
    Estimate {
        forward,
        backward,
        optimizer,
        step: persistent,
        unified: cfg.unified,
    }
}

/// `c` with the window's gradient buffer of `bytes` where it lives: `gradients` on the device,
/// `offloaded` in host memory.
fn buffer_at(cfg: &Config, c: Categories, bytes: u64) -> Categories {
    c.with_gradient_buffer(bytes, cfg.grads_on_host())
}

/// Model states (weights, the gradient buffer at the optimizer step, optimizer state) in bytes,
/// on the device and in host memory (DeepSpeed's `estimate_zero2_model_states_mem_needs` counts
/// the same states).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ModelStates {
    /// Bytes the device holds.
    pub device: u64,
    /// Bytes host memory holds (offload).
    pub host: u64,
}

/// Where `cfg`'s model states live, from its estimate at the optimizer step.
pub fn model_states(cfg: &Config) -> ModelStates {
    let e = estimate(cfg);
    let buffer = if cfg.pitfall { 2 } else { 1 } * param_count(&cfg.model) * F32;
    let on_host = if cfg.grads_on_host() { buffer } else { 0 };
    let s = &e.step;
    ModelStates {
        device: s.parameters + s.compute_weights + s.optimizer_state + buffer - on_host,
        host: s.offloaded + on_host,
    }
}

/// What one rank of `ranks` holds under ZeRO stage `zero` (`e` is the estimate of one process
/// training the rank's slice): from stage 1 a W-th of the moments; from stage 2 a W-th of the
/// summed gradient at the update, and inside the window too when each micro-batch's gradients
/// are reduce-scattered (`scatter_micro_batches`).
pub fn per_rank(mut e: Estimate, ranks: usize, zero: u8, scatter_micro_batches: bool) -> Estimate {
    let share = |bytes: u64| bytes.div_ceil(ranks.max(1) as u64);
    let mut phases = [
        &mut e.forward,
        &mut e.backward,
        &mut e.optimizer,
        &mut e.step,
    ];
    if zero >= 1 {
        for c in phases.iter_mut() {
            c.optimizer_state = share(c.optimizer_state);
        }
    }
    if zero >= 2 {
        e.optimizer.gradients = share(e.optimizer.gradients);
        if scatter_micro_batches {
            e.forward.gradients = share(e.forward.gradients);
            e.backward.gradients = share(e.backward.gradients);
        }
    }
    e
}

/// One row of the micro-batch table at a fixed effective batch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Row {
    /// B.
    pub micro_batch: usize,
    /// K.
    pub accum_steps: usize,
    /// Predicted activations at the backward's peak.
    pub activations: u64,
    /// Predicted transient gradients at the backward's peak.
    pub gradients_transient: u64,
    /// Predicted peak over all phases.
    pub peak: u64,
}

/// Every split B·K = `effective` (B a divisor), smallest B first.
pub fn micro_batch_table(cfg: &Config, effective: usize) -> Vec<Row> {
    (1..=effective)
        .filter(|b| effective.is_multiple_of(*b))
        .map(|b| {
            let c = Config {
                micro_batch: b,
                accum_steps: effective / b,
                ..cfg.clone()
            };
            let e = estimate(&c);
            Row {
                micro_batch: b,
                accum_steps: c.accum_steps,
                activations: e.backward.activations,
                gradients_transient: e.backward.gradients_transient,
                peak: e.peak(),
            }
        })
        .collect()
}

/// The largest micro-batch whose predicted peak fits in `budget` bytes at effective batch
/// `effective`, or `None` when even B=1 does not fit.
pub fn largest_micro_batch(cfg: &Config, effective: usize, budget: u64) -> Option<Row> {
    micro_batch_table(cfg, effective)
        .into_iter()
        .filter(|r| r.peak <= budget)
        .max_by_key(|r| r.micro_batch)
}

/// What `gaccwb estimate` prints.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The preset's name.
    pub preset: String,
    /// The configuration estimated.
    pub config: Config,
    /// Trainable parameters.
    pub params: u64,
    /// The predicted ledger per phase.
    pub estimate: Estimate,
    /// The predicted peak.
    pub peak: u64,
    /// B·K, held fixed across the table.
    pub effective_batch: usize,
    /// Every split of the effective batch.
    pub table: Vec<Row>,
    /// The budget judged against, bytes.
    pub budget: u64,
    /// The largest micro-batch that fits the budget.
    pub largest_fitting: Option<Row>,
    /// Why this shape cannot be trained by this program (the estimate still holds for it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_trainable_here: Option<String>,
    /// What blocks, and what each lever reaches, for `budget`.
    pub verdict: Verdict,
}

impl Report {
    /// The report for `cfg` at effective batch `effective` against `budget` bytes.
    pub fn new(preset: &str, cfg: &Config, effective: usize, budget: u64) -> Report {
        let estimate = estimate(cfg);
        Report {
            preset: preset.to_string(),
            config: cfg.clone(),
            params: param_count(&cfg.model),
            peak: estimate.peak(),
            estimate,
            effective_batch: effective,
            table: micro_batch_table(cfg, effective),
            budget,
            largest_fitting: largest_micro_batch(cfg, effective, budget),
            not_trainable_here: None,
            verdict: Verdict::new(cfg, effective, budget),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(b: usize, k: usize) -> Config {
        Config {
            model: ModelConfig {
                vocab: 256,
                d_model: 32,
                layers: 2,
                heads: 2,
                seq_len: 32,
                path: None,
                adapter: None,
            },
            micro_batch: b,
            accum_steps: k,
            dtype: Dtype::F32,
            offload: false,
            offload_grads: OffloadGrads::Device,
            pitfall: false,
            unified: true,
            scales_gradients: false,
            workspace: 0,
            checkpointing: Checkpointing::None,
        }
    }

    #[test]
    fn parameter_count_matches_the_model() {
        let cfg = tiny(4, 1);
        let model = crate::model::Gpt::new(&cfg.model, 0, &candle_core::Device::Cpu).unwrap();
        assert_eq!(param_count(&cfg.model), model.param_count());
    }

    #[test]
    fn activations_grow_linearly_and_state_does_not() {
        let (a, b) = (estimate(&tiny(4, 8)), estimate(&tiny(32, 1)));
        assert_eq!(
            b.forward.activations,
            8 * a.forward.activations - 7 * loss_scalar_bytes()
        );
        assert_eq!(a.optimizer.gradients, b.optimizer.gradients);
        assert_eq!(a.step.optimizer_state, b.step.optimizer_state);
    }

    /// DeepSpeed's ZeRO-Offload leaves 2 bytes per parameter of model states on the device in
    /// 16-bit precision; gradients accumulating on the device add their f32 buffer.
    #[test]
    fn offload_in_half_precision_leaves_the_compute_weights_on_a_gpu() {
        let cfg = Config {
            dtype: Dtype::Bf16,
            offload: true,
            unified: false,
            ..tiny(4, 2)
        };
        let p = param_count(&cfg.model);
        let host = Config {
            offload_grads: OffloadGrads::Host,
            ..cfg.clone()
        };
        assert_eq!(
            model_states(&host),
            ModelStates {
                device: 2 * p,
                host: 16 * p
            }
        );
        assert_eq!(
            model_states(&cfg),
            ModelStates {
                device: 6 * p,
                host: 12 * p
            }
        );
        let e = estimate(&host);
        assert_eq!((e.step.parameters, e.step.compute_weights), (0, 2 * p));
        assert_eq!(e.optimizer.gradients, 0);
        // On the CPU the same books, all in the one memory.
        let cpu = model_states(&Config {
            unified: true,
            ..host
        });
        assert_eq!(
            cpu,
            ModelStates {
                device: 2 * p,
                host: 16 * p
            }
        );
    }

    #[test]
    fn offload_moves_moments_and_the_largest_fitting_batch_is_monotone() {
        let on = estimate(&Config {
            offload: true,
            unified: false,
            ..tiny(4, 1)
        });
        assert_eq!(on.step.optimizer_state, 0);
        assert_eq!(on.step.offloaded, 3 * on.step.parameters);
        let cfg = tiny(1, 1);
        let small = largest_micro_batch(&cfg, 64, 4 << 20).unwrap();
        let large = largest_micro_batch(&cfg, 64, 200 << 20).unwrap();
        assert!(small.micro_batch < large.micro_batch);
        assert!(largest_micro_batch(&cfg, 64, 1).is_none());
    }
}
