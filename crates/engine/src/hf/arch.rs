//! A decoder-only transformer as the planner describes it: a choice of norm (LayerNorm or
//! RMSNorm, optionally after each sub-block too, and on q and k), MLP (4×GELU, or gated: SwiGLU,
//! GeGLU; or a mixture of experts), grouped-query attention with its own head width, learned or
//! rotary positions, sliding-window layers, soft-capped scores and logits, the biases each family
//! has, and a tied or untied head. Parameters are counted from the linear layers
//! (`linears.rs`), the embeddings and the norms, as `transformers` builds the model.

use serde::Serialize;

use super::linears::{Linear, Place};
use crate::scenario::ModelConfig;

/// The feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mlp {
    /// `W2·gelu(W1·x)`: two matrices.
    Gelu,
    /// `W_down·(silu(W_gate·x) ⊙ W_up·x)`: three matrices.
    SwiGlu,
    /// `W_down·(gelu(W_gate·x) ⊙ W_up·x)` (Gemma): three matrices, the same bytes as SwiGLU.
    GeGlu,
}

impl Mlp {
    /// A gate and an up projection whose outputs are multiplied (three matrices).
    pub fn gated(self) -> bool {
        self != Mlp::Gelu
    }
}

/// The normalisation before each sub-block and at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    /// Gain and bias.
    LayerNorm,
    /// Gain only.
    RmsNorm,
}

/// How positions enter: a learned table of `positions` rows, or rotary (no parameters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Positions {
    /// A learned table of positions.
    Learned,
    /// Rotary embeddings (no parameters).
    Rotary,
}

/// A mixture of experts in place of the MLP: each token goes through `per_token` of `count`
/// gated experts (chosen by a router, a `hidden × count` matrix) and through the shared expert
/// when there is one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Experts {
    /// Experts in each layer that has them.
    pub count: u64,
    /// Experts each token is routed to.
    pub per_token: u64,
    /// Each expert's inner width.
    pub intermediate: u64,
    /// The shared expert's inner width (Qwen2-MoE); 0 without one.
    pub shared: u64,
    /// A sigmoid gate (`hidden × 1`) scales the shared expert's output.
    pub shared_gate: bool,
    /// Layers with experts; the others have the dense MLP of `Arch::intermediate`.
    pub layers: u64,
}

/// Layers whose attention sees only the last `window` keys (Mistral: all; Gemma 2: every other).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sliding {
    /// Keys a query attends to.
    pub window: u64,
    /// How many layers slide.
    pub layers: u64,
}

/// One decoder-only transformer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Arch {
    /// The family, as `model_type` names it (`gaccwb` for this engine's).
    pub family: String,
    /// The multimodal `model_type` whose `text_config` this is (its vision tower not counted).
    pub wrapper: Option<String>,
    /// Tokens in the vocabulary.
    pub vocab: u64,
    /// The model width.
    pub hidden: u64,
    /// Transformer blocks.
    pub layers: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads (grouped-query attention); equal to `heads` for multi-head attention.
    pub kv_heads: u64,
    /// Width of one head.
    pub head_dim: u64,
    /// The dense MLP's inner width (4·hidden for GPT-2).
    pub intermediate: u64,
    /// The context the planner plans for (tokens per sample).
    pub seq_len: u64,
    /// The longest context the model was built for (`max_position_embeddings`).
    pub max_context: u64,
    /// Rows of the learned position table (0 with rotary positions).
    pub positions_table: u64,
    /// The MLP's form (GELU or gated).
    pub mlp: Mlp,
    /// The norm's form (LayerNorm or RMSNorm).
    pub norm: Norm,
    /// How positions enter.
    pub positions: Positions,
    /// Biases on the q, k, v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub out_bias: bool,
    /// Biases on the MLP's matrices.
    pub mlp_bias: bool,
    /// q, k and v are one matrix (one module).
    pub fused_qkv: bool,
    /// The gate and up projections are one matrix (Phi-3's `gate_up_proj`).
    pub fused_mlp: bool,
    /// An RMSNorm over each head of q and of k (Qwen3).
    pub qk_norm: bool,
    /// A norm after the attention and after the MLP too (Gemma 2): four per layer.
    pub post_norms: bool,
    /// The token embedding is multiplied by √hidden (Gemma): no parameters, nothing kept.
    pub scaled_embedding: bool,
    /// Sliding-window attention layers.
    pub sliding: Option<Sliding>,
    /// Attention scores soft-capped, `cap·tanh(s/cap)` (Gemma 2).
    pub attention_softcap: bool,
    /// The logits soft-capped the same way (Gemma 2).
    pub logit_softcap: bool,
    /// A mixture of experts in place of the MLP.
    pub experts: Option<Experts>,
    /// The head shares the token embedding's matrix.
    pub tied: bool,
    /// Dropout in training (GPT-2/3's 0.1); the families of 2024 train without.
    pub dropout: bool,
}

impl Arch {
    /// A dense decoder of `family` with the given sizes and every optional feature off: RMSNorm,
    /// SwiGLU, rotary positions, no biases, untied, no dropout. Readers set what differs.
    pub fn dense(
        family: &str,
        [vocab, hidden, layers, heads, kv_heads, intermediate, context]: [u64; 7],
    ) -> Arch {
        Arch {
            family: family.into(),
            wrapper: None,
            vocab,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim: hidden / heads.max(1),
            intermediate,
            seq_len: context,
            max_context: context,
            positions_table: 0,
            mlp: Mlp::SwiGlu,
            norm: Norm::RmsNorm,
            positions: Positions::Rotary,
            qkv_bias: false,
            out_bias: false,
            mlp_bias: false,
            fused_qkv: false,
            fused_mlp: false,
            qk_norm: false,
            post_norms: false,
            scaled_embedding: false,
            sliding: None,
            attention_softcap: false,
            logit_softcap: false,
            experts: None,
            tied: false,
            dropout: false,
        }
    }

    /// This engine's architecture for a model: pre-LN GPT blocks with biases, learned positions,
    /// an untied head, no dropout.
    pub fn engine(m: &ModelConfig) -> Arch {
        let d = m.d_model as u64;
        let sizes = [
            m.vocab,
            m.d_model,
            m.layers,
            m.heads,
            m.heads,
            4 * m.d_model,
            m.seq_len,
        ];
        Arch {
            positions_table: m.seq_len as u64,
            mlp: Mlp::Gelu,
            norm: Norm::LayerNorm,
            positions: Positions::Learned,
            qkv_bias: true,
            out_bias: true,
            mlp_bias: true,
            fused_qkv: true,
            intermediate: 4 * d,
            ..Arch::dense("gaccwb", sizes.map(|v| v as u64))
        }
    }

    /// The engine's model for this architecture, when the engine can build it: GPT blocks (4×GELU
    /// MLP, LayerNorm, learned positions covering the context, multi-head attention with biases,
    /// nothing else). The engine's head is always untied, and its position table has a row per
    /// position it trains on.
    pub fn engine_model(&self) -> Option<ModelConfig> {
        let gpt_like = self.mlp == Mlp::Gelu
            && self.intermediate == 4 * self.hidden
            && self.norm == Norm::LayerNorm
            && self.positions == Positions::Learned
            && self.positions_table >= self.seq_len
            && self.kv_heads == self.heads
            && self.head_dim * self.heads == self.hidden
            && self.qkv_bias
            && self.out_bias
            && self.mlp_bias
            && !self.qk_norm
            && !self.post_norms
            && self.sliding.is_none()
            && !self.attention_softcap
            && !self.logit_softcap
            && self.experts.is_none();
        gpt_like.then_some(ModelConfig {
            vocab: self.vocab as usize,
            d_model: self.hidden as usize,
            layers: self.layers as usize,
            heads: self.heads as usize,
            seq_len: self.seq_len as usize,
            path: None,
            adapter: None,
        })
    }

    /// Width of the query projection's output (`heads · head_dim`).
    pub fn q_width(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Width of the key (and of the value) projection's output.
    pub fn kv_width(&self) -> u64 {
        self.kv_heads * self.head_dim
    }

    /// Layers with experts (0 for a dense model).
    pub fn expert_layers(&self) -> u64 {
        self.experts.map_or(0, |e| e.layers)
    }

    /// Layers with the dense MLP.
    pub fn dense_layers(&self) -> u64 {
        self.layers - self.expert_layers()
    }

    /// Layers whose attention slides (sees at most `window` keys).
    pub fn sliding_layers(&self) -> u64 {
        self.sliding.map_or(0, |w| w.layers.min(self.layers))
    }

    /// Keys a query of a sliding layer attends to at this context.
    pub fn sliding_span(&self) -> u64 {
        self.sliding
            .map_or(self.seq_len, |w| w.window.min(self.seq_len))
    }

    fn norm_params(&self, width: u64) -> u64 {
        match self.norm {
            Norm::LayerNorm => 2 * width,
            Norm::RmsNorm => width,
        }
    }

    /// Norm parameters of one layer: two (four with post-norms), and q/k norms over a head.
    fn layer_norm_params(&self) -> u64 {
        let per_layer = if self.post_norms { 4 } else { 2 };
        per_layer * self.norm_params(self.hidden)
            + if self.qk_norm {
                2 * self.norm_params(self.head_dim)
            } else {
                0
            }
    }

    /// How many copies of `l` the model holds.
    fn copies(&self, l: &Linear) -> u64 {
        match l.place {
            Place::Attention => self.layers,
            Place::Dense => self.dense_layers(),
            Place::Expert => self.experts.map_or(0, |e| e.layers * e.count),
            Place::Shared | Place::Router => self.expert_layers(),
        }
    }

    /// How many copies of `l` one token is multiplied by.
    fn copies_per_token(&self, l: &Linear) -> u64 {
        match l.place {
            Place::Expert => self.experts.map_or(0, |e| e.layers * e.per_token),
            _ => self.copies(l),
        }
    }

    /// Trainable parameters: embeddings, layers, final norm and (untied) head.
    pub fn param_count(&self) -> u64 {
        let linears: u64 = self
            .linears()
            .iter()
            .map(|l| self.copies(l) * l.params())
            .sum();
        let embedding = self.vocab * self.hidden;
        let positions = match self.positions {
            Positions::Learned => self.positions_table * self.hidden,
            Positions::Rotary => 0,
        };
        let head = if self.tied { 0 } else { embedding };
        embedding
            + positions
            + linears
            + self.layers * self.layer_norm_params()
            + self.norm_params(self.hidden)
            + head
    }

    /// Parameters of one transformer layer (norms included): the layers' share of the count,
    /// exact for a dense model, the mean over the layers with experts.
    pub fn layer_params(&self) -> u64 {
        let embedding = self.vocab * self.hidden;
        let positions = match self.positions {
            Positions::Learned => self.positions_table * self.hidden,
            Positions::Rotary => 0,
        };
        let head = if self.tied { 0 } else { embedding };
        let outside = embedding + positions + self.norm_params(self.hidden) + head;
        (self.param_count() - outside) / self.layers.max(1)
    }

    /// Parameters one token meets: all of them for a dense model; with experts, only the routed
    /// ones (the shared expert and the router included).
    pub fn active_params(&self) -> u64 {
        let skipped: u64 = match self.experts {
            None => 0,
            Some(e) => self
                .linears()
                .iter()
                .filter(|l| l.place == Place::Expert)
                .map(|l| e.layers * (e.count - e.per_token) * l.params())
                .sum(),
        };
        self.param_count() - skipped
    }

    /// `param_count` in floating point, safe for any sizes (for range checks before counting):
    /// an upper bound.
    pub fn param_count_f64(&self) -> f64 {
        let (v, h, l) = (self.vocab as f64, self.hidden as f64, self.layers as f64);
        let (q, kv, f) = (
            self.q_width() as f64,
            self.kv_width() as f64,
            self.intermediate as f64,
        );
        let experts = self.experts.map_or(0.0, |e| {
            3.0 * h * (e.count as f64 * e.intermediate as f64 + e.shared as f64 + e.count as f64)
        });
        2.0 * v * h
            + self.positions_table as f64 * h
            + l * (h * (2.0 * q + 2.0 * kv) + 3.0 * h * f + experts + 10.0 * h + 4.0 * q)
    }

    /// Parameters one token is multiplied by (2 FLOPs each in the forward): every layer matrix
    /// it meets (the routed experts only) and the head (tied or not); not the lookup tables or
    /// the norms and biases.
    pub fn matmul_params(&self) -> u64 {
        let linears: u64 = self
            .linears()
            .iter()
            .map(|l| self.copies_per_token(l) * l.inputs * l.outputs)
            .sum();
        linears + self.vocab * self.hidden
    }

    /// Parameters of the largest single module (a matrix and its bias, an embedding table, or a
    /// layer's bank of experts, which `transformers` keeps as one module): the unit ZeRO-3
    /// gathers, as DeepSpeed's estimator counts it.
    pub fn largest_module_params(&self) -> u64 {
        let linears = self.linears();
        let bank: u64 = self.experts.map_or(0, |e| {
            e.count
                * linears
                    .iter()
                    .filter(|l| l.place == Place::Expert)
                    .map(Linear::params)
                    .sum::<u64>()
        });
        linears
            .iter()
            .filter(|l| l.place != Place::Expert && self.copies(l) > 0)
            .map(Linear::params)
            .chain([
                self.vocab * self.hidden,
                self.positions_table * self.hidden,
                bank,
            ])
            .max()
            .unwrap_or(0)
    }

    /// Parameters of the linear layers, per place, with how many copies the model holds:
    /// `(linear, copies)`.
    pub fn linear_copies(&self) -> Vec<(Linear, u64)> {
        self.linears()
            .into_iter()
            .map(|l| {
                let n = self.copies(&l);
                (l, n)
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}
