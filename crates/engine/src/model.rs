//! One decoder-only transformer for every family the engine trains (`spec`): token embeddings
//! (plus a learned position table, or rotary positions inside attention), N pre-norm blocks of
//! two residual steps each (`ops::step`: norm → first layer → attention or activation → second
//! layer), a final norm and a head, untied or tied to the token embedding. This engine's own GPT
//! is the family `gaccwb`; Hugging Face checkpoints of GPT-2, Llama, Mistral and Qwen2 load into
//! the same structure (`hf`) under their own tensor names.
//!
//! Weights are f32 `Var`s (the master copy), linear ones held `[in, out]` so a layer is
//! `x.matmul(w) + b` (a `[out, in]` source is turned once when read and back when written). A
//! forward in bf16/f16 casts each weight once into a low-precision "compute weight"; gradients
//! flow back through the cast to the f32 Vars. Under offload in bf16/f16 the `Var`s are the
//! compute-dtype weights themselves and the f32 master copy lives with the optimizer in host
//! memory (`train::offload`; `Gpt::with_vars` swaps them).

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::control::Checkpointing;
use crate::ops::rope::{RopeCache, RopeTable};
use crate::ops::step::{Dense as StepDense, GradSink, Middle, Step, StepWeights};
use crate::ops::{self, AttentionShape, WeightLayout};
use crate::scenario::ModelConfig;

pub mod hf;
mod init;
pub(crate) mod lora;
pub(crate) mod perplexity;
mod recompute;
pub(crate) mod save;
pub(crate) mod spec;
mod weights;
pub(crate) use init::ReadWeight;
use init::{Init, Source};
pub use lora::{read_adapter_config, AdaptError, AdapterError};
pub use perplexity::perplexity;
pub use recompute::ParamGrads;
pub use save::{check_target, save};
pub use spec::Spec;
pub use spec::SpecError;
pub use weights::Weights;

/// A trainable tensor and how the optimizer treats it.
pub struct Param {
    /// The checkpoint's name for it: this engine's (`h0.attn.qkv.w`) or the source file's
    /// (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// The tensor, in f32.
    pub var: Var,
    /// Weight decay applies to matrices (linear layers, embeddings), not to biases and norm gains.
    pub decay: bool,
}

/// A linear layer: `x·w (+ b)`, `w` held `[in, out]`, plus a low-rank adapter under LoRA.
#[derive(Clone)]
pub struct Dense {
    /// The module's name in the family's naming (`model.layers.0.self_attn.q_proj`).
    pub module: String,
    /// The weight, `[in, out]`.
    pub w: Var,
    /// The bias, `[out]`, when the family has one here.
    pub b: Option<Var>,
    /// The adapter LoRA adds (`lora`).
    pub adapter: Option<lora::Adapter>,
}

/// A norm's gain and, for layer norm, bias.
#[derive(Clone)]
pub struct Norm {
    /// The gain, initialised to 1.
    pub g: Var,
    /// The bias (layer norm), initialised to 0.
    pub b: Option<Var>,
}

/// One pre-norm transformer block.
#[derive(Clone)]
pub struct Block {
    /// The family's description (norm, activation, head layout).
    spec: Arc<Spec>,
    /// The base weights are frozen (LoRA): only adapters are trained.
    frozen: bool,
    /// The norm before attention.
    pub norm1: Norm,
    /// Attention's first layer: one weight (q, k and v fused) or three, outputs side by side.
    pub attn_in: Vec<Dense>,
    /// Attention's output projection.
    pub attn_out: Dense,
    /// The norm before the MLP.
    pub norm2: Norm,
    /// The MLP's first layer: one weight, or gate and up.
    pub mlp_in: Vec<Dense>,
    /// The MLP's second layer.
    pub mlp_out: Dense,
}

/// The model being trained.
pub struct Gpt {
    /// Its shape as the scenario records it.
    pub cfg: ModelConfig,
    /// The family's full description.
    pub spec: Arc<Spec>,
    /// Every parameter in creation order (the checkpoint and optimizer order); the same `Var`s
    /// as the named layers below.
    pub params: Vec<Param>,
    /// The token embedding, `[vocab, d_model]`.
    pub embed: Var,
    /// The learned position table, `[positions, d_model]` (learned-position families).
    pub positions: Option<Var>,
    /// The transformer blocks, first to last.
    pub blocks: Vec<Block>,
    /// The final norm before the head.
    pub norm: Norm,
    /// The untied head, `[d_model, vocab]`; `None` when the head is the token embedding.
    pub head: Option<Var>,
    /// Under LoRA, the frozen base weights (in creation order; `params` then holds the
    /// adapters): no gradient, no optimizer state.
    pub frozen: Vec<Param>,
    rope: Arc<RopeCache>,
}

/// What one forward produced: everything up to the LM head, and the head's weight. The logits
/// are made on demand (`logits`) or never at once (`nll_sum`, the training loss).
pub struct Forward {
    /// The final norm's output `[B*T, D]` in the compute dtype: the head's input.
    pub features: Tensor,
    /// The head's weight as this forward computes with it: `[D, vocab]`, or the `[vocab, D]`
    /// token embedding of a tied head (`head_layout`).
    pub head: Tensor,
    /// How `head` is stored.
    pub head_layout: WeightLayout,
    /// Where the loss adds the head weight's gradient beside the graph (the fused CPU ops);
    /// `None` leaves it to the graph.
    pub head_grad: Option<Arc<dyn ops::GradTarget>>,
    /// The low-precision weight copies made for this forward (empty in f32).
    pub compute_weights: Vec<Tensor>,
    /// Parameter gradients computed outside the loss's graph, filled during the backward: those
    /// of the blocks' residual steps (the weights are not graph inputs) and of checkpointed
    /// blocks (recomputed outside the graph).
    pub recomputed: ParamGrads,
}

/// The shape of the activations a block works on.
#[derive(Clone, Debug)]
pub struct Dims {
    /// Samples.
    pub batch: usize,
    /// Positions per sample.
    pub tokens: usize,
    /// The rotary table for those positions (rotary families).
    pub rope: Option<Arc<RopeTable>>,
    /// Each sample's index in the data stream, from which LoRA's dropout masks are drawn: set
    /// by a training forward, `None` in evaluation (no dropout).
    pub samples: Option<Arc<[u64]>>,
}

impl Block {
    /// `x` `[B·T, D]` → `x + attention(norm1(x))`, then `+ mlp(norm2(·))`.
    pub fn forward(&self, x: &Tensor, dims: &Dims, w: &mut Weights) -> Result<Tensor> {
        let arch = &self.spec.arch;
        let shape = AttentionShape {
            batch: dims.batch,
            t: dims.tokens,
            heads: arch.heads as usize,
            kv_heads: arch.kv_heads as usize,
            head_dim: arch.head_dim as usize,
        };
        let attention = self.step(Middle::Attention {
            shape,
            rope: dims.rope.clone(),
        });
        let layers = (&self.attn_in[..], &self.attn_out);
        let (weights, sink) = w.step(&self.norm1, layers, self.frozen, dims)?;
        let x = ops::residual_step(x, &attention, weights, sink)?;
        let mlp = self.step(Middle::Mlp(self.spec.activation()));
        let layers = (&self.mlp_in[..], &self.mlp_out);
        let (weights, sink) = w.step(&self.norm2, layers, self.frozen, dims)?;
        ops::residual_step(&x, &mlp, weights, sink)
    }

    fn step(&self, middle: Middle) -> Step {
        Step {
            norm: self.spec.norm(),
            eps: self.spec.norm_eps,
            middle,
        }
    }

    /// The block's weights, in creation order, adapters after their layer's weights.
    pub fn vars(&self) -> Vec<&Var> {
        fn norm(n: &Norm) -> Vec<&Var> {
            std::iter::once(&n.g).chain(&n.b).collect()
        }
        fn dense(d: &Dense) -> Vec<&Var> {
            let adapter = d.adapter.iter().flat_map(|a| [&a.a, &a.b]);
            std::iter::once(&d.w).chain(&d.b).chain(adapter).collect()
        }
        let mut vars = norm(&self.norm1);
        self.attn_in.iter().for_each(|d| vars.extend(dense(d)));
        vars.extend(dense(&self.attn_out));
        vars.extend(norm(&self.norm2));
        self.mlp_in.iter().for_each(|d| vars.extend(dense(d)));
        vars.extend(dense(&self.mlp_out));
        vars
    }
}

/// Why the scenario's model could not be had.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The model directory or its files.
    #[error(transparent)]
    Hf(#[from] hf::HfError),
    /// Building this engine's GPT.
    #[error("building the model: {0}")]
    Build(#[from] candle_core::Error),
    /// Adding LoRA's adapters.
    #[error(transparent)]
    Adapt(#[from] lora::AdaptError),
    /// Reading a LoRA adapter.
    #[error(transparent)]
    Adapter(#[from] lora::AdapterError),
}

/// The scenario's model on `device`: the Hugging Face checkpoint `model.path` names (resolved
/// by `hf::prepare`; its weights checked against `available` bytes when known, `progress`
/// hearing of every tensor read), else this engine's GPT seeded by `train.seed`.
pub fn open(
    scenario: &crate::scenario::Scenario,
    device: &Device,
    available: Option<(u64, &str)>,
    progress: &mut dyn FnMut(u64, u64),
) -> std::result::Result<Gpt, OpenError> {
    let (m, t) = (&scenario.model, &scenario.train);
    let model = match &m.path {
        Some(path) => {
            hf::ModelDir::open(path)?.build(m.seq_len, t.seed, device, available, progress)?
        }
        None => Gpt::new(m, t.seed, device)?,
    };
    match t.lora_rank {
        0 => Ok(model),
        rank => {
            let lora = lora::Lora {
                rank,
                ..lora::Lora::of(t)
            };
            let mut model = model.adapt(&lora, t.seed, t.dtype.candle())?;
            if let Some(dir) = &m.adapter {
                model.load_adapter(dir)?;
            }
            Ok(model)
        }
    }
}

impl Gpt {
    /// This engine's GPT, freshly initialised; identical on every device for the same seed.
    pub fn new(cfg: &ModelConfig, seed: u64, device: &Device) -> Result<Gpt> {
        Gpt::random(Spec::gaccwb(cfg), cfg.clone(), seed, device)
    }

    /// A model of `spec` with random weights (seeded), recorded as `cfg`.
    pub fn random(spec: Spec, cfg: ModelConfig, seed: u64, device: &Device) -> Result<Gpt> {
        let source = Source::Random(Box::new(ChaCha8Rng::seed_from_u64(seed)));
        Gpt::build(Arc::new(spec), cfg, Init::new(source, device))
    }

    /// A model of `spec` over the tensors `read` returns by name (a checkpoint being loaded).
    pub fn read(
        spec: Spec,
        cfg: ModelConfig,
        device: &Device,
        read: &mut ReadWeight<'_>,
    ) -> Result<Gpt> {
        Gpt::build(Arc::new(spec), cfg, Init::new(Source::Read(read), device))
    }

    /// The same model over other weights, one `Var` per parameter in creation order (the
    /// optimizer's placement swaps the device's weights for copies of another dtype this way).
    pub fn with_vars(&self, vars: Vec<Var>) -> Result<Gpt> {
        let same_shapes = vars.len() == self.params.len()
            && vars
                .iter()
                .zip(&self.params)
                .all(|(v, p)| v.shape() == p.var.shape());
        if !same_shapes {
            return Err(candle_core::Error::Msg(
                "replacement weights do not match the model's parameters".into(),
            ));
        }
        let swaps: std::collections::HashMap<_, Var> =
            self.params.iter().map(|p| p.var.id()).zip(vars).collect();
        Ok(self.map_vars(&|v: &Var| swaps.get(&v.id()).cloned().unwrap_or_else(|| v.clone())))
    }

    /// This model with every `Var` (weights, adapters, frozen or not) replaced by `f(var)`.
    fn map_vars(&self, f: &dyn Fn(&Var) -> Var) -> Gpt {
        let norm = |n: &Norm| Norm {
            g: f(&n.g),
            b: n.b.as_ref().map(f),
        };
        let dense = |d: &Dense| Dense {
            module: d.module.clone(),
            w: f(&d.w),
            b: d.b.as_ref().map(f),
            adapter: d.adapter.as_ref().map(|a| lora::Adapter {
                a: f(&a.a),
                b: f(&a.b),
                scale: a.scale,
                dropout: a.dropout,
                key: a.key,
            }),
        };
        let param = |p: &Param| Param {
            name: p.name.clone(),
            var: f(&p.var),
            decay: p.decay,
        };
        Gpt {
            cfg: self.cfg.clone(),
            spec: self.spec.clone(),
            params: self.params.iter().map(param).collect(),
            embed: f(&self.embed),
            positions: self.positions.as_ref().map(f),
            blocks: self
                .blocks
                .iter()
                .map(|b| Block {
                    spec: b.spec.clone(),
                    frozen: b.frozen,
                    norm1: norm(&b.norm1),
                    attn_in: b.attn_in.iter().map(dense).collect(),
                    attn_out: dense(&b.attn_out),
                    norm2: norm(&b.norm2),
                    mlp_in: b.mlp_in.iter().map(dense).collect(),
                    mlp_out: dense(&b.mlp_out),
                })
                .collect(),
            norm: norm(&self.norm),
            head: self.head.as_ref().map(f),
            frozen: self.frozen.iter().map(param).collect(),
            rope: self.rope.clone(),
        }
    }

    fn build(spec: Arc<Spec>, cfg: ModelConfig, mut init: Init) -> Result<Gpt> {
        let a = &spec.arch;
        let names = spec.naming();
        let (v, d) = (a.vocab as usize, a.hidden as usize);
        let std = spec.init_std;
        // GPT-2's scheme (and this engine's): output projections scaled by 1/√(2·layers).
        let out_std = match a.family.as_str() {
            "gaccwb" | "gpt2" => std / (2.0 * a.layers as f64).sqrt(),
            _ => std,
        };
        let flat = WeightLayout::InOut;
        let embed = init.normal(names.embed, &[v, d], std, flat)?;
        let rows = a.positions_table as usize;
        let positions = match spec.learned_positions() {
            true => Some(init.normal(names.positions, &[rows, d], std, flat)?),
            false => None,
        };
        let blocks = (0..a.layers as usize)
            .map(|l| init.block(&spec, l, out_std))
            .collect::<Result<Vec<_>>>()?;
        let norm = init.norm(&spec, names.final_norm)?;
        let head = match a.tied {
            true => None,
            false => Some(init.normal(names.head, &[d, v], std, names.head_stored)?),
        };
        Ok(Gpt {
            cfg,
            spec,
            params: init.params,
            embed,
            positions,
            blocks,
            norm,
            head,
            frozen: Vec::new(),
            rope: Arc::new(RopeCache::default()),
        })
    }

    /// Trainable parameters, head included (once when tied).
    pub fn param_count(&self) -> u64 {
        self.params.iter().map(|p| p.var.elem_count() as u64).sum()
    }

    /// Bytes of the f32 master weights.
    pub fn param_bytes(&self) -> u64 {
        self.param_count() * 4
    }

    /// Every parameter's `Var`, in creation order.
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.params.iter().map(|p| &p.var)
    }

    /// Logits for token ids `[B, T]` (u32). `track` = false detaches the weights (evaluation:
    /// no graph is kept alive).
    pub fn forward(&self, ids: &Tensor, dtype: DType, track: bool) -> Result<Forward> {
        self.forward_checkpointed(ids, dtype, track, Checkpointing::None)
    }

    /// `forward`, keeping only each segment's input instead of its blocks' graphs when
    /// `checkpointing` says so (training only: `track` must be true for it to matter). Draws
    /// no dropout mask (`forward_training` does).
    pub fn forward_checkpointed(
        &self,
        ids: &Tensor,
        dtype: DType,
        track: bool,
        checkpointing: Checkpointing,
    ) -> Result<Forward> {
        self.forward_drawn(ids, dtype, track, checkpointing, None)
    }

    /// The training forward: `forward_checkpointed` with the graph, and under LoRA's dropout
    /// each adapter's mask drawn for the samples whose stream indices are `samples` (one per
    /// row of `ids`).
    pub fn forward_training(
        &self,
        ids: &Tensor,
        dtype: DType,
        checkpointing: Checkpointing,
        samples: &[u64],
    ) -> Result<Forward> {
        self.forward_drawn(ids, dtype, true, checkpointing, Some(samples.into()))
    }

    fn forward_drawn(
        &self,
        ids: &Tensor,
        dtype: DType,
        track: bool,
        checkpointing: Checkpointing,
        samples: Option<Arc<[u64]>>,
    ) -> Result<Forward> {
        let (b, t) = ids.dims2()?;
        if let Some(s) = samples.as_ref().filter(|s| s.len() != b) {
            return Err(candle_core::Error::Msg(format!(
                "{} sample indices for a batch of {b} samples",
                s.len()
            )));
        }
        let dims = Dims {
            batch: b,
            tokens: t,
            rope: self.spec.rope.as_ref().map(|r| self.rope.table(r, t)),
            samples,
        };
        let recomputed = ParamGrads::default();
        let mut w = Weights::new(dtype, track.then_some(&recomputed));
        // On the fused CPU ops the head's and the embedding's weight gradients are added in
        // place beside the graph (`ops::GradTarget`).
        let beside = (track && self.frozen.is_empty() && ops::grads_beside(self.embed.as_tensor()))
            .then_some(&recomputed);
        let mut x = self.embed(ids, &mut w, beside)?;
        // Under LoRA the embedding is frozen and its output tracks no graph: made a leaf that
        // does (PEFT's `enable_input_require_grads`), so every block's op, and a checkpointed
        // segment's recompute, joins the graph whatever the dtype.
        if track && !self.frozen.is_empty() && !x.track_op() {
            x = Var::from_tensor(&x)?.into_inner();
        }
        x = ops::widen_stream(&x)?;
        match checkpointing.segment().filter(|_| track) {
            None => {
                for block in &self.blocks {
                    x = block.forward(&x, &dims, &mut w)?;
                }
            }
            Some(n) => {
                for segment in self.blocks.chunks(n) {
                    x = recompute::segment(segment, &x, &dims, dtype, &recomputed)?;
                }
            }
        }
        let x = ops::narrow_stream(&x, dtype)?;
        let n = &self.norm;
        let gain = self.weight(&mut w, &n.g)?;
        let shift = n.b.as_ref().map(|b| self.weight(&mut w, b)).transpose()?;
        let features = ops::norm(
            &x,
            self.spec.norm(),
            &gain,
            shift.as_ref(),
            self.spec.norm_eps,
        )?;
        let (head_var, head_layout) = match &self.head {
            Some(head) => (head, WeightLayout::InOut),
            None => (&self.embed, WeightLayout::OutIn),
        };
        Ok(Forward {
            features,
            head: self.weight(&mut w, head_var)?,
            head_layout,
            head_grad: beside.map(|grads| grads.target(head_var, dtype)),
            compute_weights: w.into_casts(),
            recomputed,
        })
    }

    /// A weight outside the blocks as this forward computes with it: out of the graph when the
    /// base is frozen.
    fn weight(&self, w: &mut Weights, var: &Var) -> Result<Tensor> {
        match self.frozen.is_empty() {
            true => w.get(var),
            false => w.fixed(var),
        }
    }

    /// Token (+ learned position) embeddings, `[B·T, D]`; with `beside` the tables' gradients go
    /// there and the rows come as the residual stream (`ops::embedding_beside`).
    fn embed(&self, ids: &Tensor, w: &mut Weights, beside: Option<&ParamGrads>) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let d = self.spec.arch.hidden as usize;
        let ids_flat = ids.flatten_all()?;
        if let Some(grads) = beside {
            let positions = self.positions.as_ref().map(|p| ops::fused::Positions {
                table: p.as_tensor().clone(),
                len: t,
                target: grads.target(p, w.dtype()),
            });
            let target = grads.target(&self.embed, w.dtype());
            let table = self.embed.as_tensor();
            return ops::embedding_beside(table, &ids_flat, w.dtype(), target, positions);
        }
        let tok = ops::embedding(&self.weight(w, &self.embed)?, &ids_flat)?;
        match &self.positions {
            None => Ok(tok),
            Some(positions) => {
                let pos = self.weight(w, positions)?.narrow(0, 0, t)?;
                ops::broadcast_add(&tok.reshape((b, t, d))?, &pos)?.reshape((b * t, d))
            }
        }
    }
}

impl Forward {
    /// The logits `[B·T, vocab]` in the compute dtype (all of them at once).
    pub fn logits(&self) -> Result<Tensor> {
        ops::project(&self.features, &self.head, self.head_layout)
    }

    /// The summed token NLL over counted positions (`ops::linear_nll_sum`): on the fused path
    /// without holding every logit at once.
    pub fn nll_sum(&self, targets: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (x, w, layout) = (&self.features, &self.head, self.head_layout);
        ops::linear_nll_sum(x, w, layout, targets, mask, self.head_grad.clone())
    }
}

#[cfg(test)]
mod tests;
