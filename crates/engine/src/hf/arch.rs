//! The architectures the planner describes beyond this engine's own: a decoder-only transformer
//! with a choice of norm (LayerNorm or RMSNorm), MLP (4×GELU or SwiGLU with its intermediate
//! size), grouped-query attention (`kv_heads` ≤ `heads`), learned or rotary positions, the biases
//! each family has, and a tied or untied head. Named shapes carry the published dimensions;
//! `config` reads the same from a Hugging Face `config.json`.

use serde::Serialize;

use crate::scenario::ModelConfig;

/// The feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mlp {
    /// `W2·gelu(W1·x)`: two matrices.
    Gelu,
    /// `W_down·(silu(W_gate·x) ⊙ W_up·x)`: three matrices.
    SwiGlu,
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

/// One decoder-only transformer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Arch {
    /// The family (`gpt2`, `llama`, `mistral`, `qwen2`, `gpt_neox`; `gaccwb` for this engine's).
    pub family: String,
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
    /// The MLP's inner width (4·hidden for GPT-2).
    pub intermediate: u64,
    /// The context the planner plans for (tokens per sample).
    pub seq_len: u64,
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
    /// q, k and v are one matrix (one module, for the largest-module count).
    pub fused_qkv: bool,
    /// The head shares the token embedding's matrix.
    pub tied: bool,
    /// Dropout in training (GPT-2/3's 0.1); the families of 2024 train without.
    pub dropout: bool,
}

/// The published shapes `--shape` accepts.
const GPT: [(&str, u64, u64, u64, u64); 5] = [
    ("gpt2", 768, 12, 12, 1024),
    ("gpt2-medium", 1024, 24, 16, 1024),
    ("gpt2-large", 1280, 36, 20, 1024),
    ("gpt2-xl", 1600, 48, 25, 1024),
    ("gpt3-175b", 12288, 96, 96, 2048),
];

/// A Llama-family shape, from the model's published `config.json`.
struct LlamaShape {
    name: &'static str,
    family: &'static str,
    vocab: u64,
    hidden: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    intermediate: u64,
    context: u64,
}

const fn llama(
    name: &'static str,
    family: &'static str,
    [vocab, hidden, layers, heads, kv_heads, intermediate, context]: [u64; 7],
) -> LlamaShape {
    LlamaShape {
        name,
        family,
        vocab,
        hidden,
        layers,
        heads,
        kv_heads,
        intermediate,
        context,
    }
}

const LLAMA: [LlamaShape; 3] = [
    llama("llama3-8b", "llama", [128256, 4096, 32, 32, 8, 14336, 8192]),
    llama(
        "llama3-70b",
        "llama",
        [128256, 8192, 80, 64, 8, 28672, 8192],
    ),
    llama(
        "mistral-7b",
        "mistral",
        [32000, 4096, 32, 32, 8, 14336, 32768],
    ),
];

/// Every name `--shape` accepts.
pub fn shape_names() -> Vec<&'static str> {
    GPT.iter()
        .map(|s| s.0)
        .chain(LLAMA.iter().map(|s| s.name))
        .collect()
}

/// The published architecture of a named shape (GPT-2/3 with their tied head), or `None`.
pub fn named(name: &str) -> Option<Arch> {
    if let Some(&(_, d, l, h, t)) = GPT.iter().find(|s| s.0 == name) {
        let m = ModelConfig {
            vocab: 50257,
            d_model: d as usize,
            layers: l as usize,
            heads: h as usize,
            seq_len: t as usize,
            path: None,
            adapter: None,
        };
        return Some(Arch {
            tied: true,
            dropout: true,
            family: if name.starts_with("gpt3") {
                "gpt3"
            } else {
                "gpt2"
            }
            .into(),
            ..Arch::engine(&m)
        });
    }
    let l = LLAMA.iter().find(|s| s.name == name)?;
    Some(Arch {
        family: l.family.into(),
        vocab: l.vocab,
        hidden: l.hidden,
        layers: l.layers,
        heads: l.heads,
        kv_heads: l.kv_heads,
        head_dim: l.hidden / l.heads,
        intermediate: l.intermediate,
        seq_len: l.context,
        positions_table: 0,
        mlp: Mlp::SwiGlu,
        norm: Norm::RmsNorm,
        positions: Positions::Rotary,
        qkv_bias: false,
        out_bias: false,
        mlp_bias: false,
        fused_qkv: false,
        tied: false,
        dropout: false,
    })
}

impl Arch {
    /// This engine's architecture for a model: pre-LN GPT blocks with biases, learned positions,
    /// an untied head, no dropout.
    pub fn engine(m: &ModelConfig) -> Arch {
        let (d, h) = (m.d_model as u64, m.heads as u64);
        Arch {
            family: "gaccwb".into(),
            vocab: m.vocab as u64,
            hidden: d,
            layers: m.layers as u64,
            heads: h,
            kv_heads: h,
            head_dim: d / h.max(1),
            intermediate: 4 * d,
            seq_len: m.seq_len as u64,
            positions_table: m.seq_len as u64,
            mlp: Mlp::Gelu,
            norm: Norm::LayerNorm,
            positions: Positions::Learned,
            qkv_bias: true,
            out_bias: true,
            mlp_bias: true,
            fused_qkv: true,
            tied: false,
            dropout: false,
        }
    }

    /// The engine's model for this architecture, when the engine can build it: GPT blocks (4×GELU
    /// MLP, LayerNorm, learned positions covering the context, multi-head attention with biases).
    /// The engine's head is always untied.
    pub fn engine_model(&self) -> Option<ModelConfig> {
        let gpt_like = self.mlp == Mlp::Gelu
            && self.intermediate == 4 * self.hidden
            && self.norm == Norm::LayerNorm
            && self.positions == Positions::Learned
            && self.positions_table == self.seq_len
            && self.kv_heads == self.heads
            && self.head_dim * self.heads == self.hidden
            && self.qkv_bias
            && self.out_bias
            && self.mlp_bias;
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

    fn norm_params(&self) -> u64 {
        match self.norm {
            Norm::LayerNorm => 2 * self.hidden,
            Norm::RmsNorm => self.hidden,
        }
    }

    /// Parameters of the attention block: q, k, v, output projection and their biases.
    fn attention_params(&self) -> u64 {
        let (h, q, kv) = (self.hidden, self.q_width(), self.kv_width());
        let weights = h * (q + 2 * kv) + q * h;
        let biases = if self.qkv_bias { q + 2 * kv } else { 0 } + if self.out_bias { h } else { 0 };
        weights + biases
    }

    /// Parameters of the MLP and its biases.
    fn mlp_params(&self) -> u64 {
        let (h, f) = (self.hidden, self.intermediate);
        match (self.mlp, self.mlp_bias) {
            (Mlp::Gelu, bias) => 2 * h * f + if bias { f + h } else { 0 },
            (Mlp::SwiGlu, bias) => 3 * h * f + if bias { 2 * f + h } else { 0 },
        }
    }

    /// Parameters of one transformer layer.
    pub fn layer_params(&self) -> u64 {
        2 * self.norm_params() + self.attention_params() + self.mlp_params()
    }

    /// Trainable parameters: embeddings, layers, final norm and (untied) head.
    pub fn param_count(&self) -> u64 {
        let embedding = self.vocab * self.hidden;
        let positions = match self.positions {
            Positions::Learned => self.positions_table * self.hidden,
            Positions::Rotary => 0,
        };
        let head = if self.tied { 0 } else { embedding };
        embedding + positions + self.layers * self.layer_params() + self.norm_params() + head
    }

    /// `param_count` in floating point, safe for any sizes (for range checks before counting).
    pub fn param_count_f64(&self) -> f64 {
        let (v, h, l) = (self.vocab as f64, self.hidden as f64, self.layers as f64);
        let (q, kv, f) = (
            self.q_width() as f64,
            self.kv_width() as f64,
            self.intermediate as f64,
        );
        2.0 * v * h
            + self.positions_table as f64 * h
            + l * (h * (2.0 * q + 2.0 * kv) + 3.0 * h * f + 8.0 * h)
    }

    /// Parameters the forward multiplies by (per token, 2 FLOPs each): every layer matrix and
    /// the head (tied or not); not the lookup tables or the norms and biases.
    pub fn matmul_params(&self) -> u64 {
        let (h, q, kv, f) = (
            self.hidden,
            self.q_width(),
            self.kv_width(),
            self.intermediate,
        );
        let mlp = match self.mlp {
            Mlp::Gelu => 2 * h * f,
            Mlp::SwiGlu => 3 * h * f,
        };
        self.layers * (h * (q + 2 * kv) + q * h + mlp) + self.vocab * h
    }

    /// Parameters of the largest single module (a matrix and its bias, or an embedding table):
    /// the unit ZeRO-3 gathers, as DeepSpeed's estimator counts it.
    pub fn largest_module_params(&self) -> u64 {
        let (h, q, kv, f) = (
            self.hidden,
            self.q_width(),
            self.kv_width(),
            self.intermediate,
        );
        let qkv = if self.fused_qkv {
            h * (q + 2 * kv) + if self.qkv_bias { q + 2 * kv } else { 0 }
        } else {
            h * q + if self.qkv_bias { q } else { 0 }
        };
        let mlp = h * f + if self.mlp_bias { f } else { 0 };
        [self.vocab * h, self.positions_table * h, qkv, mlp]
            .into_iter()
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_shapes_count_the_published_parameters() {
        // The published counts of the released checkpoints.
        let published = [
            ("gpt2", 124_439_808u64),
            ("gpt2-medium", 354_823_168),
            ("gpt2-large", 774_030_080),
            ("gpt2-xl", 1_557_611_200),
            ("llama3-8b", 8_030_261_248),
            ("llama3-70b", 70_553_706_496),
            ("mistral-7b", 7_241_732_096),
        ];
        for (name, count) in published {
            assert_eq!(named(name).unwrap().param_count(), count, "{name}");
        }
        assert!(named("gpt4").is_none());
    }

    #[test]
    fn largest_module_and_matmul_parameters() {
        let llama = named("llama3-8b").unwrap();
        assert_eq!(llama.largest_module_params(), 128256 * 4096);
        // Every layer matrix and the head: the total less the input embedding and the norms.
        let norms = (2 * 32 + 1) * 4096;
        assert_eq!(
            llama.matmul_params(),
            llama.param_count() - 128256 * 4096 - norms
        );
        let gpt3 = named("gpt3-175b").unwrap();
        // The embedding (V·h) is just larger than the MLP's 4h² + 4h at this width.
        assert_eq!(gpt3.largest_module_params(), 50257 * 12288);
        let gpt2 = named("gpt2").unwrap();
        assert_eq!(gpt2.largest_module_params(), 50257 * 768);
    }
}
