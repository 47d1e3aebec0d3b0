//! What a micro-step holds only while it runs: the backward's gradients in flight
//! (`gradients_transient`, its peak over its start) and the forward's work beyond what its end
//! keeps (shown in the forward's `other`).
//!
//! The backward is played op by op, as the ops allocate and free (`Tape`): the head and loss,
//! the final norm, each block's two residual steps from the last block to the first, then the
//! embeddings; the parameter gradients it has made stay in the store (or, for the blocks, in
//! the sink beside it) to the end. Its peak is the highest point of that play. Every figure
//! is read from the op's code (`ops::fused`, `ops::lean`) and Candle's backward, which adds
//! each gradient reaching a graph node into a zeroed buffer of the node's dtype.

use super::graph::{attention_chunk, checkpointed, recomputed_bytes, Shape};
use super::{Config, F32};
use crate::control::Dtype;
use crate::hf::Mlp;

/// Bytes live over a run of allocations and frees, from 0, and the highest point reached.
#[derive(Default)]
pub(super) struct Tape {
    live: u64,
    peak: u64,
}

impl Tape {
    pub(super) fn add(&mut self, bytes: u64) {
        self.live += bytes;
        self.peak = self.peak.max(self.live);
    }

    pub(super) fn free(&mut self, bytes: u64) {
        self.live = self.live.saturating_sub(bytes);
    }

    /// `bytes` live for a moment: allocated and freed again.
    pub(super) fn touch(&mut self, bytes: u64) {
        self.add(bytes);
        self.free(bytes);
    }
}

/// One residual step as the backward sees it.
pub(super) struct Step {
    /// The first layer's parts: output width and whether it has a bias.
    pub first: Vec<(u64, bool)>,
    /// Columns of the second layer's input (attention's output, or the MLP's first layer).
    pub second_in: u64,
    /// Width of the second layer's product input (`second_in`, or F for SwiGLU).
    pub product: u64,
    /// The second layer has a bias.
    pub second_bias: bool,
    /// The step is attention (else the MLP).
    pub attention: bool,
}

impl Step {
    pub(super) fn attention(cfg: &Config, s: &Shape) -> Step {
        let a = &cfg.arch;
        let first = if a.fused_qkv {
            vec![(s.qkv, a.qkv_bias)]
        } else {
            let kv = a.kv_width();
            vec![(s.att, a.qkv_bias), (kv, a.qkv_bias), (kv, a.qkv_bias)]
        };
        Step {
            first,
            second_in: s.att,
            product: s.att,
            second_bias: a.out_bias,
            attention: true,
        }
    }

    pub(super) fn mlp(cfg: &Config, s: &Shape) -> Step {
        let a = &cfg.arch;
        let parts = match a.mlp {
            Mlp::Gelu => 1,
            Mlp::SwiGlu | Mlp::GeGlu => 2,
        };
        Step {
            first: vec![(s.f, a.mlp_bias); parts],
            second_in: s.mlp,
            product: s.f,
            second_bias: a.mlp_bias,
            attention: false,
        }
    }

    /// Elements of the step's weights: the norm's, the first layer's and the second's.
    pub(super) fn params(&self, s: &Shape) -> u64 {
        let norm = s.d * (1 + u64::from(s.norm_bias));
        let first: u64 = self
            .first
            .iter()
            .map(|&(o, b)| s.d * o + if b { o } else { 0 })
            .sum();
        norm + first + self.product * s.d + if self.second_bias { s.d } else { 0 }
    }

    /// Elements of the step's weight matrices (its parameters but the norm's and the biases).
    pub(super) fn matrices(&self, s: &Shape) -> u64 {
        self.width() * s.d + self.product * s.d
    }

    /// Bytes of the f32 copies a fused step reads its weights through in half storage: all of
    /// them, or the vectors alone where the matrices are read as stored (`Shape::tiles`).
    pub(super) fn widened(&self, s: &Shape) -> u64 {
        if !s.cast {
            return 0;
        }
        let matrices = self.matrices(s);
        (self.params(s) - matrices) * F32 + s.matrix_copies(matrices)
    }

    /// Width of the first layer's output.
    pub(super) fn width(&self) -> u64 {
        self.first.iter().map(|p| p.0).sum()
    }
}

/// A fused residual step's norm in the backward: its input's f32 copy (a stream in half
/// storage) for the op's run, and its packed result `[dx; dgain (; dbias)]`, which stays: its
/// bytes.
pub(super) fn norm_backward(s: &Shape, t: &mut Tape) -> u64 {
    let (n, d) = (s.n, s.d);
    let x = if s.stream == F32 { 0 } else { n * d * F32 };
    let norm = (n + 1 + u64::from(s.norm_bias)) * d * F32;
    t.add(x + norm);
    t.free(x);
    norm
}

/// `gemm`'s packed copy of the right-hand matrix of a `rows × inner · inner × cols` product,
/// read transposed (a weight in the backward's input gradient), on each thread that takes part
/// (`ops::fused::rhs_packing`).
fn packing(s: &Shape, rows: u64, inner: u64, cols: u64) -> u64 {
    on_threads(
        s,
        crate::ops::fused::rhs_packing(rows as usize, inner as usize, cols as usize),
    )
}

/// A packed copy's bytes on each thread that may take part in a product of `blocks` blocks
/// (`Config::threads`).
fn on_threads(s: &Shape, (bytes, blocks): (u64, usize)) -> u64 {
    s.threads.min(blocks as u64) * bytes
}

/// The same for a right-hand matrix read as stored (a weight in the forward): none where
/// `gemm` reads it in place (`ops::fused::gemm_packs_stored`).
pub(super) fn stored_packing(s: &Shape, rows: u64, inner: u64, cols: u64) -> u64 {
    match crate::ops::fused::gemm_packs_stored() {
        true => packing(s, rows, inner, cols),
        false => 0,
    }
}

/// One residual step's backward on the fused path (`ops::fused::branch`), from the incoming
/// gradient `dy` (`[N, D]`, in the graph) to the input's gradient added into the store. The
/// weights' gradients are left live (they go to the sink).
fn fused_step(cfg: &Config, s: &Shape, step: &Step, t: &mut Tape) {
    let (n, d) = (s.n, s.d);
    // Half storage: the op reads f32 copies of its weights for its whole run (dy comes in the
    // f32 stream).
    let widened = step.widened(s);
    t.add(widened);
    // The second layer: its input's gradient, weight's and bias's, each in its own buffer,
    // beside the input's f32 copy (half storage) and the activation's recomputed value and
    // slope (GELU) or value and the product's gradient (SwiGLU).
    let input = if s.cast { n * step.second_in * F32 } else { 0 };
    let activation = if step.attention {
        0
    } else {
        2 * n * step.product * F32
    };
    let bias = if step.second_bias { d } else { 0 };
    let dh = n * step.second_in * F32;
    t.add(input + activation + dh + (step.product * d + bias) * F32);
    t.touch(packing(s, n, d, step.product));
    t.free(input + activation);
    // The middle: attention's qkv gradient (reading qkv's f32 copy); the MLP's first layer
    // takes the second's input gradient as it is.
    let width = step.width();
    let dmid = if step.attention { n * width * F32 } else { 0 };
    let qkv = if s.cast { dmid } else { 0 };
    t.add(qkv + dmid);
    t.free(qkv);
    // The first layer: dx, the bias gradients' buffer, then each part's dW and db.
    let normed = if s.cast { n * d * F32 } else { 0 };
    t.add(normed + n * d * F32 + width * F32);
    let parts: u64 = step
        .first
        .iter()
        .map(|&(o, b)| d * o + u64::from(b) * o)
        .sum();
    t.add(parts * F32);
    t.free(normed + width * F32);
    let norm = norm_backward(s, t);
    // The norm's weight gradients copied out of its result. Every weight's gradient is
    // rounded to the compute dtype in place and kept in f32 (`storage::rounded`); dx is the
    // norm's result, rounded in place.
    t.add(s.d * (1 + u64::from(s.norm_bias)) * F32);
    t.free(dh + dmid + n * d * F32 + widened);
    keep_gradients(cfg, step.params(s), F32, t);
    // Candle adds dx into the input's gradient (a zeroed tensor of the stream, then the sum);
    // dx and the incoming dy go.
    let stream = n * d * s.stream;
    t.add(2 * stream);
    t.free(stream + norm + stream);
}

/// One residual step's backward on the lean path (`ops::lean::branch`): Candle tensor ops on
/// detached tensors, each making a new tensor. The weights' gradients are left live.
fn lean_step(cfg: &Config, s: &Shape, step: &Step, t: &mut Tape) {
    let (n, d, c) = (s.n, s.d, s.c);
    let width = step.width();
    let widen = u64::from(s.cast);
    // The second layer: its input made again (the MLP's activation; attention's output is
    // kept), then da, dW and db; all live to the step's end.
    let remade = if step.attention {
        0
    } else {
        n * step.product * c
    };
    let bias = if step.second_bias { d * c } else { 0 };
    let second = remade + n * step.product * c + step.product * d * c + bias;
    t.add(second);
    // The middle's gradient at its peak, then dmid.
    let middle = if step.attention {
        lean_attention_backward(cfg, s)
    } else {
        let layer = n * s.f * F32;
        match cfg.arch.mlp {
            // The GELU's slope: four f32 tensors of the layer at once (the layer's own f32
            // copy among them in half precision).
            Mlp::Gelu => 4 * layer,
            // SwiGLU: σ, the slope, d gate, d up and their concatenation (f32), beside the f32
            // copies of [gate | up] and of da in half precision.
            Mlp::SwiGlu | Mlp::GeGlu => (6 + 3 * widen) * layer,
        }
    };
    t.touch(middle);
    t.add(n * width * c);
    // The first layer's parts, each on its columns of dmid: dx (summed over the parts), dW, db.
    for (i, &(o, b)) in step.first.iter().enumerate() {
        let columns = if step.first.len() > 1 { n * o * c } else { 0 };
        let part = d * o * c + if b { o * c } else { 0 };
        t.add(columns + n * d * c + part);
        if i > 0 {
            t.add(n * d * c);
            t.free(2 * n * d * c);
        }
        t.free(columns);
    }
    // The norm's backward: x̂, g, their centred difference and the products (f32, 4 + the
    // statistics' count of `[N, D]` tensors at its peak; x's f32 copy in half precision), then
    // dx in the compute dtype, and dx + dy.
    t.touch((4 + s.stats + widen) * n * d * F32);
    t.add(2 * n * d * c);
    // The step's temporaries go; its gradients stay.
    t.free(second - step.product * d * c - bias + n * width * c + 2 * n * d * c);
    keep_gradients(cfg, step.params(s), c, t);
    // Candle adds dx + dy into the input's gradient (a zeroed tensor, then the sum); dx + dy
    // and the incoming dy go.
    t.add(2 * n * d * c);
    t.free(3 * n * d * c);
}

/// The sink keeps each of a step's `params` gradients, made in `made` bytes each (the fused
/// ops' f32, the lean ops' compute dtype), in its weight's dtype: converted, or kept as made.
pub(super) fn keep_gradients(cfg: &Config, params: u64, made: u64, t: &mut Tape) {
    let kept = cfg.grad_elem_bytes();
    if kept != made {
        t.add(params * kept);
        t.free(params * made);
    }
}

/// The lean attention's backward at its peak (`ops::lean::attention`), for one chunk of
/// sequences: the probabilities, dP and the three temporaries of dS (five score-sized f32
/// tensors at once), beside the q, k, v head copies, the output's and its gradient's head
/// copies and dV, in the compute dtype.
pub(super) fn lean_attention_backward(cfg: &Config, s: &Shape) -> u64 {
    let copies = s.qkv + 2 * s.att + cfg.arch.kv_width();
    5 * attention_chunk(s) * F32 + s.n * copies * s.c
}

/// Bytes in flight at the top of the backward, in the head and loss's backward. Lean
/// (`ops::lean::linear_nll_sum`): inside one chunk of `r = min(chunk_rows(V), N)` rows, the
/// softmax, the one-hot targets and their difference (3·r·V·4), beside the f32 sum of dW over
/// the chunks before it (D·V·4, when there are several) and the rows of dx made so far
/// (N·D·c). The fused head (CPU): see `fused_head_peak_bytes`.
pub fn head_peak_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    if cfg.lora.is_some() {
        return frozen_head_peak_bytes(cfg, &s);
    }
    let op = if cfg.grads_beside() {
        beside_head_peak_bytes(cfg, &s)
    } else if cfg.fused {
        fused_head_peak_bytes(&s)
    } else {
        let chunk = lean_head_chunk(&s);
        let dw_sum = if chunk < s.n * s.v { s.d * s.v } else { 0 };
        (3 * chunk + dw_sum) * F32 + s.nd() * s.c
    };
    op.max(head_cast_bytes(cfg, &s))
}

/// In half precision the head's weight is a cast of its f32 weight (a tied head's, of the token
/// embedding): after the op the cast's backward widens the half gradient and adds it into a
/// zeroed f32 tensor, D·V·(c + 3·4) beside the features' gradient. 0 in f32, and under offload
/// in half precision (the weights are half already).
fn head_cast_bytes(cfg: &Config, s: &Shape) -> u64 {
    if !s.cast || cfg.half_weights() || cfg.lora.is_some() || cfg.grads_beside() {
        return 0;
    }
    s.d * s.v * (s.c + 3 * F32) + s.nd() * s.c
}

/// The fused head and loss's backward (`ops::fused::linear_nll_sum`) peaks at the larger of two
/// moments. Inside it: its packed result (dx, N·D, and dW, D·V) and one block of logits turned
/// into their gradient (`fused_head_block`). After it, when the store
/// adds its results (a zero tensor, then the sum, per input): beside the packed buffer, x's zero
/// tensor and sum (3·N·D + D·V), then x's sum with W's zero tensor and sum (2·N·D + 3·D·V). A
/// tied head's W is the token embedding: the same sizes.
///
/// With half storage the inside also holds f32 copies of x and W (N·D + D·V; W read as stored
/// on tiles: `Shape::matrix_copies`), the packed result
/// is rounded into a half copy while the f32 one lives (N·D + D·V of each), and the store adds
/// half gradients (c bytes each).
fn fused_head_peak_bytes(s: &Shape) -> u64 {
    let (n, d, v) = (s.n, s.d, s.v);
    let packed = n * d + d * v;
    if s.cast {
        // The packed result and x's f32 copy, W's (`Shape::matrix_copies`), a block of logits.
        let inside = (packed + n * d + fused_head_block(s)) * F32 + s.matrix_copies(d * v);
        let rounding = packed * (F32 + s.c);
        let adding = (2 * n * d + 3 * d * v).max(3 * n * d + d * v) * s.c;
        return inside.max(rounding).max(adding);
    }
    let inside = packed + fused_head_block(s);
    let adding_dx = 3 * n * d + d * v;
    let adding_dw = 2 * n * d + 3 * d * v;
    inside.max(adding_dx).max(adding_dw) * F32
}

/// The fused head and loss's backward with W's gradient beside the graph: inside it dx (N·D)
/// and W's f32 gradient (D·V, written by its first block of rows, or the embedding's) beside one
/// block of logits and `gemm`'s packed copies of an untied W (`head_packing`); after it, the
/// store adds dx (a zero tensor and the sum). With half storage the inside also holds f32
/// copies of x and W (`Shape::matrix_copies`), and dx is rounded into a half copy while the f32
/// one lives.
fn beside_head_peak_bytes(cfg: &Config, s: &Shape) -> u64 {
    let (nd, dv) = (s.nd(), s.d * s.v);
    let packing = head_packing(cfg, s, true);
    if s.cast {
        let inside = (2 * nd + dv + fused_head_block(s)) * F32 + s.matrix_copies(dv) + packing;
        let rounding = nd * (F32 + s.c) + dv * F32;
        return inside.max(rounding).max(3 * nd * s.c + dv * F32);
    }
    ((nd + dv + fused_head_block(s)) * F32 + packing).max((3 * nd + dv) * F32)
}

/// The head and loss's backward with a frozen head (LoRA): the same moments without dW. Fused:
/// inside, dx and a block of logits (with half storage beside the f32 copies of x and W:
/// `Shape::matrix_copies`), then
/// dx rounded, then the store adding dx (a zero tensor and the sum beside it). Lean: the
/// chunk's three tensors beside the rows of dx.
fn frozen_head_peak_bytes(cfg: &Config, s: &Shape) -> u64 {
    let (nd, dv) = (s.nd(), s.d * s.v);
    if !cfg.fused {
        return 3 * lean_head_chunk(s) * F32 + nd * s.c;
    }
    let chunk = fused_head_block(s);
    let packing = head_packing(cfg, s, false);
    if s.cast {
        let inside = (2 * nd + chunk) * F32 + s.matrix_copies(dv) + packing;
        return inside.max(nd * (F32 + s.c)).max(3 * nd * s.c);
    }
    ((nd + chunk) * F32 + packing).max(3 * nd * F32)
}

/// `gemm`'s packed copies while the fused backward of an untied head (stored `[D, V]`; frozen,
/// or with W's gradient beside the graph) multiplies a block's logits gradient by its slice of
/// W, transposed (dx, `[rows, cols]·[cols, D]`): on each thread that takes part (one per
/// block of the product, `ops::fused::rhs_packing`), D rounded up to the rows of `gemm`'s
/// micro-kernel (`ops::fused::gemm_kernel_rows`) by at most 512 columns (the inner-sum block
/// `gemm` takes for small products), whatever the block's rows. Measured
/// (`ops::fused::linear_nll_sum`'s backward, two threads) with AVX-512: 131,072 bytes at V 256
/// and 262,144 at V 512 and 1,024, with N 64–256 and D 16–64; 92,160 on the Llama fixture under
/// LoRA (V 360, one block); with AVX2, 65,536 per thread at V 256, D 64, and 46,080 at V 360,
/// D 32. With W's gradient (`dw`) the block's `xᵀ·dlogits` then packs x
/// (`ops::fused::transposed_lhs_packing`) and may pack its slice of dlogits
/// (`ops::fused::column_packing`): each thread holds the larger of that and dx's copy. With
/// AVX2, 67,584 bytes a thread at N 128, V 360, D 32 (18,432 of x, 49,152 of dlogits in blocks
/// 90 wide), against 46,080 for dx. A tied
/// head's W is the embedding, stored `[V, D]`: `gemm` reads it in place (the fixtures' ledger
/// shows no copy). Products on packed blocks (AMX, AVX-512 BF16) pack into the
/// slab `other` counts.
fn head_packing(cfg: &Config, s: &Shape, dw: bool) -> u64 {
    if cfg.arch.tied || s.tiles {
        return 0;
    }
    let (rows, cols) = crate::ops::fused::head_block(s.n as usize, s.v as usize);
    let inner = cols.min(crate::ops::fused::GEMM_INNER_BLOCK);
    let (_, blocks) = crate::ops::fused::rhs_packing(rows, inner, s.d as usize);
    let packed = (s.d as usize).next_multiple_of(crate::ops::fused::gemm_kernel_rows());
    let dx = on_threads(s, ((inner * packed) as u64 * F32, blocks));
    // W's gradient slice `xᵀ·dlogits` is cut into column blocks: each packs x's rows and its
    // columns of dlogits (read as stored; packed where the micro-kernel does not divide them).
    let dw = match dw {
        true => {
            let d = s.d as usize;
            let (lhs, blocks) = crate::ops::fused::transposed_lhs_packing(d, rows, cols);
            let (rhs, _) = crate::ops::fused::column_packing(d, rows, cols, false);
            on_threads(s, (lhs + rhs, blocks))
        }
        false => 0,
    };
    dx.max(dw)
}

/// `gemm`'s packed slices of W while the fused head's forward makes a block of logits
/// (`[rows, D]·[D, cols]`, cut into column blocks: `ops::fused::column_packing`; a tied head
/// reads the embedding, stored `[V, D]`, transposed), on each thread that takes part. Products
/// on tiles pack into the slab `other` counts.
fn head_forward_packing(cfg: &Config, s: &Shape) -> u64 {
    if s.tiles {
        return 0;
    }
    let (rows, cols) = crate::ops::fused::head_block(s.n as usize, s.v as usize);
    on_threads(
        s,
        crate::ops::fused::column_packing(rows, s.d as usize, cols, cfg.arch.tied),
    )
}

/// Floats of one chunk of the lean head's logits (`ops::lean::head_chunk_rows` rows of V).
fn lean_head_chunk(s: &Shape) -> u64 {
    (crate::ops::lean::head_chunk_rows(s.v as usize) as u64).min(s.n) * s.v
}

/// Floats of one block of the fused head's logits (`ops::fused::head_block`).
fn fused_head_block(s: &Shape) -> u64 {
    let (rows, cols) = crate::ops::fused::head_block(s.n as usize, s.v as usize);
    (rows * cols) as u64
}

/// Bytes of the logits the fused head's forward keeps for its backward
/// (`ops::fused::head_kept`; with its products on `gemm` at most 128 MiB, else none):
/// activations until the head's backward ends.
pub(super) fn head_kept_bytes(cfg: &Config) -> u64 {
    if !cfg.fused {
        return 0;
    }
    let s = Shape::new(cfg);
    crate::ops::fused::head_kept(s.n as usize, s.v as usize, s.tiles) as u64 * F32
}

/// What the head and loss leave live when their backward is done: the head weight's gradient
/// in the store (a tied head's is the token embedding's) and the features' gradient (`[N, D]`,
/// in flight to the final norm).
fn after_head(cfg: &Config, s: &Shape) -> u64 {
    let head = if cfg.lora.is_some() { 0 } else { s.d * s.v };
    head * cfg.grad_elem_bytes() + s.nd() * s.c
}

/// The final norm's backward: its packed [dx; dgain (; dbias)] in the compute dtype, then the
/// store adds each (a zeroed tensor and the sum). Leaves its gain's (and bias's) gradient and
/// dx.
fn final_norm(cfg: &Config, s: &Shape, t: &mut Tape) {
    // A frozen norm (LoRA) gets no gradient.
    let norm = if cfg.lora.is_some() {
        0
    } else {
        (1 + u64::from(s.norm_bias)) * s.d
    };
    let packed = (s.nd() + norm) * s.c;
    t.add(packed);
    t.add(2 * s.nd() * s.c);
    t.add(norm * cfg.grad_elem_bytes());
    // The packed buffer, the zeroed tensor and the head's dx go.
    t.free(packed + 2 * s.nd() * s.c);
}

/// Bytes of the gradient store one backward returns: one gradient per parameter, f32 (compute
/// dtype under offload in half precision). Neither path gives constants a gradient (the causal
/// mask and the loss mask are not graph inputs), and both return gradients computed from
/// detached tensors, which reference nothing. A tied head's gradient is the token embedding's.
///
/// Under LoRA the adapters' gradients, and the first block's input's: the frozen embedding's
/// output is a leaf (`Gpt::forward_checkpointed`), whose gradient stays in the store.
pub fn grad_store_bytes(cfg: &Config) -> u64 {
    match &cfg.lora {
        None => cfg.arch.param_count() * cfg.grad_elem_bytes(),
        Some(a) => {
            let s = Shape::new(cfg);
            super::lora::adapter_params(cfg, a) * cfg.grad_elem_bytes() + s.nd() * s.c
        }
    }
}

/// Bytes at the backward's very end, in the embeddings' gradients: every other gradient is
/// in the store. With the gradients beside the graph (`Config::grads_beside`) the op adds the
/// tokens' gradient rows into the table's f32 gradient in place: that gradient beside an f32
/// copy of them. In f32 Candle's `index_select` backward holds the table's zero tensor (or,
/// for a tied head, the head's gradient already there) and the `index_add` result (2·V·D)
/// beside the tokens' gradient (N·D). In half precision the largest moment comes after
/// `ops::half::embedding` (whose f32 sum is rounded to the table's dtype): the cast's backward
/// adds the table's half gradient (V·D·c, still held) into the f32 weight's store, its f32
/// copy, the zero tensor and the sum all live at once (3·V·D·4), the weight's own f32 gradient
/// not yet in the store. Large once V·D is (a subword vocabulary). The half-precision moment
/// is counted where it was measured, on the fused CPU path (`tests/memory/memory_ledger.rs`, V = 8192);
/// the lean path's estimate leaves it out.
pub fn embedding_peak_bytes(cfg: &Config) -> u64 {
    if cfg.lora.is_some() {
        // A frozen embedding gets no gradient: the backward ends at the first block.
        return 0;
    }
    let s = Shape::new(cfg);
    let (vd, nd) = (s.v * s.d, s.nd());
    if cfg.grads_beside() {
        // The tokens' gradient, its f32 widening (half storage) and the rows read out of it.
        let widened = if s.cast { nd * F32 } else { 0 };
        return grad_store_bytes(cfg) + nd * (s.c + F32) + widened;
    }
    if !s.cast {
        return grad_store_bytes(cfg) + (vd + nd) * F32;
    }
    if !cfg.fused {
        return 0;
    }
    let casting = vd * s.c + 3 * vd * F32 - vd * F32;
    let summing = vd * F32 + nd * (F32 + s.c);
    grad_store_bytes(cfg) + casting.max(summing)
}

/// The highest point of the blocks' backward over its start, the head's and the final norm's
/// gradients already made: each block's MLP step, then its attention step, last block first,
/// with every block's gradients kept once made.
fn blocks_peak(cfg: &Config, s: &Shape) -> u64 {
    let mut t = Tape::default();
    // The head's weight gradient and the features' gradient, then the final norm's.
    t.add(after_head(cfg, s));
    final_norm(cfg, s, &mut t);
    let (mlp, attention) = (Step::mlp(cfg, s), Step::attention(cfg, s));
    let recompute = recompute_in_flight_bytes(cfg);
    for _ in 0..s.layers {
        t.add(recompute);
        for step in [&mlp, &attention] {
            match (&cfg.lora, cfg.fused) {
                (Some(a), true) => super::lora::fused_step(cfg, a, s, step, &mut t),
                (Some(a), false) => super::lora::lean_step(cfg, a, s, step, &mut t),
                (None, true) => fused_step(cfg, s, step, &mut t),
                (None, false) => lean_step(cfg, s, step, &mut t),
            }
        }
        t.free(recompute);
    }
    t.peak
}

/// What backward holds at its peak on top of what it started from, as the ledger books it: the
/// largest of the loss head's backward (first), the blocks' (with every gradient made before
/// kept, and with checkpointing the recompute's casts of a segment's weights) and the token
/// embedding's gradient at the very end. With checkpointing the ledger books the largest
/// recomputed graph as activations held at the peak, so a peak outside the blocks shows less
/// that much here. The logits the fused head kept (`head_kept_bytes`) are part of the start
/// and gone after the head: the later moments stand that much lower over it.
pub fn transient_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    let graph = recomputed_bytes(cfg);
    let freed = head_kept_bytes(cfg);
    (blocks_peak(cfg, &s) + recompute_casts(cfg))
        .saturating_sub(freed)
        .max(head_peak_bytes(cfg).saturating_sub(graph))
        .max(embedding_peak_bytes(cfg).saturating_sub(graph + freed))
}

/// The compute-dtype copies the backward's recompute makes of one segment's weights.
fn recompute_casts(cfg: &Config) -> u64 {
    match checkpointed(cfg) {
        Some(seg) if cfg.dtype != Dtype::F32 && !cfg.half_weights() => {
            seg.largest * cfg.block_cast_params() * cfg.dtype.size_in_bytes() as u64
        }
        _ => 0,
    }
}

/// Gradients the checkpointed backward holds in a segment beyond the plain one: the outer
/// backward's gradient of the segment's output, held while the recompute runs, the gradient
/// Candle's `Mul` backward computes and keeps in the recompute's store for the detached `grad_y`
/// side of `y · grad_y` (never a node, so never removed), and three more `[N, D]` measured and
/// not yet attributed (`tests/memory/checkpointing_memory.rs`), all in the residual stream's
/// dtype. 0 without checkpointing.
fn recompute_in_flight_bytes(cfg: &Config) -> u64 {
    if checkpointed(cfg).is_none() {
        return 0;
    }
    let s = Shape::new(cfg);
    5 * s.nd() * s.stream
}

/// What the end of the forward holds only while it runs, beyond the activations it leaves: no
/// category holds it, so the forward's measured peak shows it in `other`.
///
/// Fused head and loss (CPU): one block of logits (none when it keeps them all, as activations:
/// `head_kept_bytes`) and each row's three running statistics; with half storage the f32 copies the ops make of their
/// inputs, the largest in the last block's MLP step. Lean ops: the larger of the final norm's
/// f32 work (the input's f32 copy when cast, the normalised rows, ×gain and +bias: 3 or 4 ×
/// N·D·4, the result and its copy into the graph: 2·N·D·c) and one chunk of the head's logits
/// with the shifted and exponentiated copies the log-sum-exp makes (3 × chunk · 4).
pub(super) fn head_forward_transient_bytes(cfg: &Config) -> u64 {
    let s = Shape::new(cfg);
    if cfg.fused {
        // Kept logits are activations at the forward's end but do not exist yet while the
        // last block runs, so that block's step counts against the end without them.
        let kept = head_kept_bytes(cfg);
        let block = match kept {
            0 => fused_head_block(&s),
            _ => 0,
        };
        let head = (block + 3 * s.n) * F32 + head_forward_packing(cfg, &s);
        if !s.cast {
            // Or the last block's MLP step: its activation, `gemm`'s packed second weight and
            // the output, before the final norm and the kept logits exist (the output stays).
            let mlp = (s.n * s.f * F32 + stored_packing(&s, s.n, s.f, s.d))
                .saturating_sub(s.nd() * F32 + kept);
            return head.max(mlp);
        }
        // Half storage: the head's f32 copies of x and W; and the last block's MLP step, which
        // holds f32 copies of its input, of its weights (`Step::widened`), of its first layer's
        // output, the activation and its f32 result, and `gemm`'s packed second weight, before
        // that block's output, the final norm (2·N·D·c) and the kept logits exist.
        let nd = s.nd();
        let head = head + nd * F32 + s.matrix_copies(s.d * s.v);
        let step = Step::mlp(cfg, &s);
        let work = (2 * nd + s.n * (s.mlp + s.f)) * F32 + step.widened(&s);
        let mlp = (work + stored_packing(&s, s.n, s.f, s.d)).saturating_sub(2 * nd * s.c + kept);
        return head.max(mlp);
    }
    let f32_copies = if s.cast { 4 } else { 3 };
    let final_norm = (f32_copies * F32 + 2 * s.c) * s.nd();
    final_norm.max(3 * lean_head_chunk(&s) * F32)
}
