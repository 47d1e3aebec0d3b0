//! The model's numerical building blocks, each with a backward pass.
//!
//! Candle's fused `LayerNorm`, `softmax_last_dim` and `sdpa` are forward-only (gradients silently
//! stop there), so the model calls these instead. On CPU each is one fused Candle custom op
//! whose backward is one more fused pass (`fused`; f32 arithmetic on f32, bf16 or f16 storage,
//! bf16 products on AMX tiles or AVX-512 BF16 dot products where the CPU has them);
//! anywhere else (CUDA, or the CPU under `GACCWB_KERNELS=lean`) the `lean` version runs: Candle tensor ops that exist on every backend, with a backward of its own
//! and only what that backward needs kept. `composite`, the plain differentiable Candle
//! expressions, is the reference both are tested against (`force_plain` runs it in a model). All
//! compute the same function; tests hold value and gradient of each pair together. The memory
//! estimator (`memory::estimate`) models the fused and lean paths: keep it in step when a path
//! changes what it keeps.

use std::cell::Cell;
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Result, Tensor};

use rope::RopeTable;

pub mod composite;
pub(crate) mod cpu_load;
pub(crate) mod dropout;
pub mod fused;
pub(crate) mod half;
pub mod lean;
pub mod peak;
pub(crate) mod pool;
pub(crate) mod rope;
pub(crate) mod step;
pub(crate) mod vmath;
pub mod workspace;

pub use pool::{configure_process, cpu_threads};
pub use rope::{Llama3Scaling, Rope};

/// True when every tensor is an f32 CPU tensor (the domain of the fused f32-only kernels:
/// AdamW, norms, scaling) and this thread has not asked for the lean ops.
pub fn fused_domain(tensors: &[&Tensor]) -> bool {
    !lean_forced()
        && tensors
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

/// True when the model's fused ops take these tensors: all on the CPU, all stored in one of
/// f32, bf16 and f16 (the ops compute in f32 whatever the storage), and this thread has not
/// asked for the lean ops.
pub fn fused_model_domain(tensors: &[&Tensor]) -> bool {
    let Some(first) = tensors.first() else {
        return false;
    };
    let dtype = first.dtype();
    !lean_forced()
        && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        && tensors
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == dtype)
}

/// `fused_model_domain` for the loss ops: float inputs of one dtype and an f32 CPU mask.
fn fused_loss_domain(inputs: &[&Tensor], mask: &Tensor) -> bool {
    fused_model_domain(inputs) && fused_domain(&[mask])
}

/// The environment variable that sets the kernels: `lean` runs the lean ops (the code every
/// CUDA step runs) on the CPU too, in f32, so the GPU path is testable without one.
/// `composite`, its earlier name, is still accepted.
pub const KERNELS_ENV: &str = "GACCWB_KERNELS";

/// Whether `GACCWB_KERNELS=lean` (or its alias `composite`) was set when the process first
/// asked (read once). Any other value but `fused` or empty is reported by `kernels_from_env`.
pub fn lean_from_env() -> bool {
    static FROM_ENV: OnceLock<bool> = OnceLock::new();
    *FROM_ENV.get_or_init(|| matches!(kernels_from_env(), Ok(true)))
}

/// An environment variable set to a value gaccwb does not know.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: expected {expected}")]
pub struct BadEnvValue {
    /// The variable's name.
    pub var: &'static str,
    /// Its value, trimmed.
    pub value: String,
    /// The values it takes, for the message.
    pub expected: &'static str,
}

/// `GACCWB_KERNELS` parsed: `Ok(true)` for `lean` (or its alias `composite`), `Ok(false)` for
/// `fused` or unset.
pub fn kernels_from_env() -> std::result::Result<bool, BadEnvValue> {
    match std::env::var(KERNELS_ENV) {
        Err(_) => Ok(false),
        Ok(v) => match v.trim() {
            "" | "fused" => Ok(false),
            // `composite`: the value's earlier name, kept so existing scripts still run.
            "lean" | "composite" => Ok(true),
            other => Err(BadEnvValue {
                var: KERNELS_ENV,
                value: other.to_string(),
                expected: "\"fused\" (the default) or \"lean\"",
            }),
        },
    }
}

thread_local! {
    static LEAN: Cell<bool> = Cell::new(lean_from_env());
}

fn lean_forced() -> bool {
    LEAN.with(Cell::get)
}

thread_local! {
    static PLAIN: Cell<bool> = const { Cell::new(false) };
}

/// Outside the fused ops' domain, run the plain composite expressions (`composite`, which keep
/// every intermediate) instead of the lean ops on this thread until the guard drops: the
/// reference the lean ops are tested against, in a whole model.
pub fn force_plain(on: bool) -> PlainGuard {
    PlainGuard {
        previous: PLAIN.with(|c| c.replace(on)),
    }
}

/// Restores the thread's previous choice between lean and plain composite ops when dropped.
#[must_use = "the choice lasts only while the guard lives"]
pub struct PlainGuard {
    previous: bool,
}

impl Drop for PlainGuard {
    fn drop(&mut self) {
        PLAIN.with(|c| c.set(self.previous));
    }
}

fn plain() -> bool {
    PLAIN.with(Cell::get)
}

/// Run the lean ops on this thread (`true`) or let CPU tensors take the fused ones, until the
/// guard drops. Thread-local, so parallel tests do not see each other's choice.
pub fn force_lean(on: bool) -> KernelsGuard {
    KernelsGuard {
        previous: LEAN.with(|c| c.replace(on)),
    }
}

/// Restores the thread's previous kernel choice when dropped.
#[must_use = "the choice lasts only while the guard lives"]
pub struct KernelsGuard {
    previous: bool,
}

impl Drop for KernelsGuard {
    fn drop(&mut self) {
        LEAN.with(|c| c.set(self.previous));
    }
}

/// `x + step(x)`: one residual step of a block (`step`), with `weights` outside the graph
/// handing their gradients to `sink` (none: the weights get none). On the CPU one fused op,
/// elsewhere one lean op; the plain composite reference when this thread asked for it
/// (`force_plain`: the weights must then be graph inputs, and their gradients land in the
/// `GradStore`).
pub fn residual_step(
    x: &Tensor,
    step: &step::Step,
    weights: step::StepWeights,
    sink: Option<step::GradSink>,
) -> Result<Tensor> {
    let w = weights.flat();
    // `x` in the weights' dtype, or the f32 stream of a half-precision forward.
    let stream = w
        .first()
        .is_some_and(|g| x.dtype() == g.dtype() || x.dtype() == DType::F32);
    if stream && x.device().is_cpu() && fused_model_domain(&w) {
        fused::branch(x, step, weights, sink)
    } else if plain() {
        step.composite(x, &weights)
    } else {
        lean::branch(x, step, weights, sink)
    }
}

/// RMS norm over the last dimension (`LlamaRMSNorm`: f32 statistics, rounded before the gain).
pub fn rms_norm(x: &Tensor, gain: &Tensor, eps: f64) -> Result<Tensor> {
    if fused_model_domain(&[x, gain]) {
        fused::rms_norm(x, gain, eps)
    } else if plain() {
        composite::rms_norm(x, gain, eps)
    } else {
        lean::rms_norm(x, gain, eps)
    }
}

/// The norm `kind` of `x`: layer norm with `bias`, or RMS norm (which has none).
pub fn norm(
    x: &Tensor,
    kind: NormKind,
    gain: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    match (kind, bias) {
        (NormKind::Layer, Some(bias)) => layer_norm(x, gain, bias, eps),
        (NormKind::Layer, None) => candle_core::bail!("layer norm needs a bias"),
        (NormKind::Rms, _) => rms_norm(x, gain, eps),
    }
}

/// Layer norm over the last dimension, computed in f32 whatever the input dtype.
pub fn layer_norm(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if fused_model_domain(&[x, gain, bias]) {
        fused::layer_norm(x, gain, bias, eps)
    } else if plain() {
        composite::layer_norm(x, gain, bias, eps)
    } else {
        lean::layer_norm(x, gain, bias, eps)
    }
}

/// Where an op adds the f32 gradient of a weight that is not one of its graph inputs: on the
/// fused CPU path the head's and the token embedding's weights (the `[V, D]` matrices a large
/// vocabulary makes the largest), whose gradients the store would otherwise zero-fill, add and,
/// in half precision, widen from a cast, each a pass over `V·D` values.
pub trait GradTarget: Send + Sync {
    /// Runs `write` on the weight's f32 gradient of `len` values: on `Some(sum)`, the sum held so
    /// far, `write` adds to it and returns `None`; on `None` (none held yet), `write` returns
    /// the first gradient, held from then on. An op that writes every value anyway (a product)
    /// thus skips a zero-filled `[V, D]` buffer (a serial memset of the whole matrix).
    fn add_into(&self, len: usize, write: &mut GradWrite) -> Result<()>;
}

/// What a [`GradTarget`] runs on the gradient it holds (see [`GradTarget::add_into`]).
pub type GradWrite<'a> = dyn FnMut(Option<&mut [f32]>) -> Option<Vec<f32>> + 'a;

/// Whether the ops that take `weight` compute its gradient beside the graph, into a
/// [`GradTarget`]: the fused CPU ops (not the lean or the plain ones) on an f32 weight.
pub fn grads_beside(weight: &Tensor) -> bool {
    fused_domain(&[weight]) && !plain()
}

/// Rows `ids` (`[N]` u32) of the f32 table `[V, D]` computed in `dtype`, with `positions`
/// their learned position rows added, as the residual stream `widen_stream` makes (f32 storage,
/// `dtype`'s values); the tables' gradients are added into their targets (`grads_beside`), not
/// returned to the graph. The table is the `Var` itself: it keeps the op in the graph, and a
/// `Var` may go without a gradient where a cast of it may not.
pub fn embedding_beside(
    table: &Tensor,
    ids: &Tensor,
    dtype: DType,
    target: Arc<dyn GradTarget>,
    positions: Option<fused::Positions>,
) -> Result<Tensor> {
    fused::embedding(table, ids, (dtype, DType::F32), target, positions)
}

/// The residual stream a half-precision forward on the fused CPU ops carries between its
/// blocks: `x` widened to f32 (exact), the values still those of the compute dtype. Each block
/// step's input gradient then joins Candle's graph through an f32 add, where a bf16 one costs
/// 10–36 times as much (`benches/grad_add.rs`); the steps round what they store as before, so
/// the bits do not change. `x` itself without a graph, elsewhere, or in f32.
pub fn widen_stream(x: &Tensor) -> Result<Tensor> {
    if x.track_op() && x.dtype() != DType::F32 && fused_model_domain(&[x]) {
        fused::widen(x)
    } else {
        Ok(x.clone())
    }
}

/// The residual stream back in the compute dtype `dtype` (exact: `widen_stream`).
pub fn narrow_stream(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        Ok(x.clone())
    } else {
        cast(x, dtype)
    }
}

/// `t` in `dtype`: f32 to bf16 on the CPU by the fused cast (`fused::to_bf16`, the same bits,
/// vectorised and on the CPU pool), anything else by Candle's `to_dtype`.
pub fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if dtype == DType::BF16 && fused_domain(&[t]) {
        fused::to_bf16(t)
    } else {
        t.to_dtype(dtype)
    }
}

/// Rows `ids` (`[N]` u32) of an embedding table `[V, D]`. In half precision the table's
/// gradient is accumulated in f32 (`half::embedding`).
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if table.dtype() == DType::F32 {
        table.index_select(ids, 0)
    } else {
        half::embedding(table, ids)
    }
}

/// `x + b` with `b`'s shape the trailing dimensions of `x`; in half precision `b`'s gradient is
/// summed in f32.
pub fn broadcast_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    composite::bias_add(x, b)
}

/// `x·w + b` for `x` `[N, I]`, `w` `[I, O]`, `b` `[O]`.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    if fused_model_domain(&[x, w, b]) {
        fused::linear(x, w, b)
    } else if plain() {
        composite::linear(x, w, b)
    } else {
        lean::linear(x, w, b)
    }
}

/// `x·w` for `x` `[N, I]`, `w` `[I, O]` (or `x·wᵀ` for `w` `[O, I]` with
/// `WeightLayout::OutIn`): a layer without bias (the LM head).
pub fn project(x: &Tensor, w: &Tensor, layout: WeightLayout) -> Result<Tensor> {
    let w = match layout {
        WeightLayout::InOut => w.clone(),
        WeightLayout::OutIn => w.t()?,
    };
    if fused_model_domain(&[x, &w]) {
        fused::project(x, &w)
    } else {
        x.matmul(&w)
    }
}

/// `gelu(h)·w + b`: the MLP's output layer. The fused and lean versions do not keep `gelu(h)`.
pub fn gelu_linear(h: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    if fused_model_domain(&[h, w, b]) {
        fused::gelu_linear(h, w, b)
    } else if plain() {
        composite::linear(&composite::gelu(h)?, w, b)
    } else {
        lean::gelu_linear(h, w, b)
    }
}

/// How a matrix is stored: `[in, out]` (products `x·W`: this engine's layers, GPT-2's
/// `Conv1D`), or `[out, in]` (`x·Wᵀ`: a head tied to the `[vocab, d]` token embedding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[in, out]`.
    InOut,
    /// `[out, in]`.
    OutIn,
}

/// What the MLP's second layer applies to its input before the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// Nothing: a plain linear layer.
    None,
    /// GELU, tanh approximation (GPT-2's `gelu_new`).
    Gelu,
    /// SwiGLU: the input is `[gate | up]` and the product takes `silu(gate)·up` (the LLaMA family).
    SwiGlu,
}

impl Activation {
    /// Columns of the input for a product of width `i` (twice for SwiGLU's gate and up).
    pub fn input_width(self, i: usize) -> usize {
        match self {
            Activation::SwiGlu => 2 * i,
            _ => i,
        }
    }

    /// Width of the product for an input of `cols` columns.
    pub fn product_width(self, cols: usize) -> usize {
        match self {
            Activation::SwiGlu => cols / 2,
            _ => cols,
        }
    }
}

/// Which norm a residual branch starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// Layer norm: centred, scaled, with gain and bias (GPT-2, this engine's GPT).
    Layer,
    /// RMS norm: scaled by the root mean square, gain only (the LLaMA family).
    Rms,
}

/// The shape of one causal self-attention: `batch` sequences of `t` positions, `heads` query
/// heads sharing `kv_heads` key/value heads (grouped-query attention; equal for multi-head),
/// each `head_dim` wide. Its input `qkv` is `[B·T, (H + 2·KV)·hd]`: the queries, then the keys,
/// then the values, heads side by side within each; its output `[B·T, H·hd]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence.
    pub t: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; they divide `heads`.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl AttentionShape {
    /// Multi-head attention over a model of width `d_model` (heads of `d_model / heads`).
    pub fn multi_head(batch: usize, t: usize, heads: usize, d_model: usize) -> AttentionShape {
        AttentionShape {
            batch,
            t,
            heads,
            kv_heads: heads,
            head_dim: d_model / heads.max(1),
        }
    }

    /// Width of the queries (and of the output): `heads · head_dim`.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of the keys (and of the values).
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Width of the `qkv` input.
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    /// The query heads that read key/value head `g`.
    pub fn group_of(&self, g: usize) -> std::ops::Range<usize> {
        let group = self.heads / self.kv_heads.max(1);
        g * group..(g + 1) * group
    }

    /// `qkv` has this shape's rows and width, and the heads group evenly.
    pub fn check(&self, qkv: &Tensor) -> Result<()> {
        let (n, w) = qkv.dims2()?;
        let grouped = self.kv_heads > 0 && self.heads.is_multiple_of(self.kv_heads);
        if n != self.batch * self.t || w != self.qkv_width() || !grouped || self.head_dim == 0 {
            candle_core::bail!("attention: qkv {n}×{w} for {self:?}");
        }
        Ok(())
    }
}

/// Causal self-attention of `shape` over `qkv`, with rotary positions when `rope` is given
/// (queries and keys turned before the scores, half-split as transformers does); scores scaled
/// by 1/√head_dim.
pub fn attention(
    qkv: &Tensor,
    shape: AttentionShape,
    rope: Option<&Arc<RopeTable>>,
) -> Result<Tensor> {
    if fused_model_domain(&[qkv]) {
        fused::causal_attention(qkv, shape, rope)
    } else if plain() {
        composite::causal_attention(qkv, shape, rope)
    } else {
        lean::causal_attention(qkv, shape, rope)
    }
}

/// Causal multi-head self-attention: `qkv` `[B·T, 3·D]` (queries, keys, values side by side,
/// heads within each) to `[B·T, D]`, scores scaled by 1/√(D/heads).
pub fn causal_attention(qkv: &Tensor, batch: usize, t: usize, heads: usize) -> Result<Tensor> {
    let shape = AttentionShape::multi_head(batch, t, heads, qkv.dim(1)? / 3);
    attention(qkv, shape, None)
}

/// Sum over counted positions of the negative log-likelihood of `targets`.
/// `logits`: `[N, V]` (any float dtype; the softmax runs in f32), `targets`: `[N]` u32,
/// `mask`: `[N]` f32 with 1 for counted positions and 0 for padding.
pub fn nll_sum(logits: &Tensor, targets: &Tensor, mask: &Tensor) -> Result<Tensor> {
    if fused_loss_domain(&[logits], mask) {
        fused::nll_sum(logits, targets, mask)
    } else {
        composite::nll_sum(logits, targets, mask)
    }
}

/// `nll_sum(x·w, targets, mask)`: the LM head and the loss as one. The lean version never
/// holds the `[N, V]` logits at once (`lean::linear_nll_sum`), nor does the fused (CPU) one
/// but in f32 training steps, which keep up to 128 MiB of them for the backward
/// (`fused::linear_nll_sum`); the plain one makes them and passes them to `nll_sum`.
///
/// With `target`, `w`'s gradient is added into it (`grads_beside`; `w` is then not a graph
/// input).
pub fn linear_nll_sum(
    x: &Tensor,
    w: &Tensor,
    layout: WeightLayout,
    targets: &Tensor,
    mask: &Tensor,
    target: Option<Arc<dyn GradTarget>>,
) -> Result<Tensor> {
    if fused_loss_domain(&[x, w], mask) {
        fused::linear_nll_sum(x, w, layout, targets, mask, target)
    } else if target.is_some() {
        candle_core::bail!("linear nll: a gradient beside the graph needs the fused CPU ops")
    } else if plain() {
        nll_sum(&project(x, w, layout)?, targets, mask)
    } else {
        lean::linear_nll_sum(x, w, layout, targets, mask)
    }
}

#[cfg(test)]
mod tests;
