//! What each `model_type` reads, and the defaults its `transformers` configuration class gives a
//! field the file leaves out.

use super::{Fields, HfConfigError};
use crate::hf::{Arch, Experts, Mlp, Norm, Positions, Sliding};

/// The architecture `f` describes; `f.model_type` is one of `SUPPORTED`.
pub(super) fn read(f: &Fields) -> Result<Arch, HfConfigError> {
    match f.model_type.as_str() {
        "gpt2" => gpt2(f),
        "gpt_neox" => gpt_neox(f),
        _ => decoder(f),
    }
}

/// GPT-2: LayerNorm, 4×GELU (or `n_inner`), learned positions, biases everywhere, fused qkv;
/// the head tied unless `tie_word_embeddings` is false; dropout 0.1 unless set.
fn gpt2(f: &Fields) -> Result<Arch, HfConfigError> {
    let hidden = f.size("n_embd")?;
    let heads = f.size("n_head")?;
    let positions = f.size("n_positions")?;
    let mut dropout = false;
    for k in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
        dropout |= f.rate_or(k, 0.1)? > 0.0;
    }
    let sizes = [
        f.size("vocab_size")?,
        hidden,
        f.size("n_layer")?,
        heads,
        heads,
        0,
        positions,
    ];
    Ok(Arch {
        head_dim: f.head_dim(hidden, heads)?,
        intermediate: f.size_or("n_inner", Some(4 * hidden))?,
        positions_table: positions,
        mlp: Mlp::Gelu,
        norm: Norm::LayerNorm,
        positions: Positions::Learned,
        qkv_bias: true,
        out_bias: true,
        mlp_bias: true,
        fused_qkv: true,
        tied: f.flag_or("tie_word_embeddings", true)?,
        dropout,
        ..Arch::dense("gpt2", sizes)
    })
}

/// GPT-NeoX (Pythia): LayerNorm, GELU MLP of `intermediate_size`, rotary positions, fused qkv
/// with biases, an untied `embed_out` head.
fn gpt_neox(f: &Fields) -> Result<Arch, HfConfigError> {
    let hidden = f.size("hidden_size")?;
    let heads = f.size("num_attention_heads")?;
    let bias = f.flag_or("attention_bias", true)?;
    let sizes = [
        f.size("vocab_size")?,
        hidden,
        f.size("num_hidden_layers")?,
        heads,
        heads,
        f.size("intermediate_size")?,
        f.size("max_position_embeddings")?,
    ];
    Ok(Arch {
        head_dim: f.head_dim(hidden, heads)?,
        mlp: Mlp::Gelu,
        norm: Norm::LayerNorm,
        qkv_bias: bias,
        out_bias: bias,
        mlp_bias: true,
        fused_qkv: true,
        tied: f.flag_or("tie_word_embeddings", false)?,
        dropout: f.any_dropout(&["attention_dropout", "hidden_dropout"])?,
        ..Arch::dense("gpt_neox", sizes)
    })
}

/// The Llama-like decoders: RMSNorm, a gated MLP (or experts), rotary positions, grouped-query
/// attention, and what each family adds.
fn decoder(f: &Fields) -> Result<Arch, HfConfigError> {
    let family = f.model_type.as_str();
    let hidden = f.size("hidden_size")?;
    let heads = f.size("num_attention_heads")?;
    let kv_heads = f.size_or("num_key_value_heads", Some(heads))?;
    if !heads.is_multiple_of(kv_heads) {
        return Err(f.bad(
            "num_key_value_heads",
            &format!("{kv_heads} key/value heads must divide the {heads} attention heads"),
        ));
    }
    let layers = f.size("num_hidden_layers")?;
    let gemma = family.starts_with("gemma");
    let sizes = [
        f.size("vocab_size")?,
        hidden,
        layers,
        heads,
        kv_heads,
        f.size("intermediate_size")?,
        f.size("max_position_embeddings")?,
    ];
    let mut a = Arch {
        head_dim: f.head_dim(hidden, heads)?,
        tied: f.flag_or("tie_word_embeddings", gemma)?,
        dropout: f.any_dropout(&["attention_dropout", "resid_pdrop", "embd_pdrop"])?,
        ..Arch::dense(family, sizes)
    };
    match family {
        "llama" | "qwen3" | "qwen3_moe" => {
            let attention = f.flag_or("attention_bias", false)?;
            (a.qkv_bias, a.out_bias) = (attention, attention);
            a.mlp_bias = family == "llama" && f.flag_or("mlp_bias", false)?;
            a.qk_norm = family != "llama";
        }
        "qwen2" | "qwen2_moe" => a.qkv_bias = true,
        "phi3" => (a.fused_qkv, a.fused_mlp) = (true, true),
        _ => {}
    }
    if gemma {
        a.mlp = Mlp::GeGlu;
        a.scaled_embedding = true;
    }
    if family == "gemma2" {
        a.post_norms = true;
        a.attention_softcap = f.optional_positive("attn_logit_softcapping")?.is_some();
        a.logit_softcap = f.optional_positive("final_logit_softcapping")?.is_some();
    }
    a.sliding = sliding(f, layers)?;
    a.experts = experts(f, layers)?;
    Ok(a)
}

/// Sliding-window layers: Gemma 2's every other layer (`layer_types` when given), every layer of
/// Mistral, Mixtral and Phi-3 when `sliding_window` is set. Qwen's `use_sliding_window` is off in
/// every published config and is not read.
fn sliding(f: &Fields, layers: u64) -> Result<Option<Sliding>, HfConfigError> {
    let count = match f.model_type.as_str() {
        "gemma2" => match f.count_of("layer_types", "sliding_attention")? {
            Some(n) => n,
            None => layers.div_ceil(2),
        },
        "mistral" | "mixtral" | "phi3" => layers,
        _ => return Ok(None),
    };
    let default = (f.model_type == "gemma2").then_some(4096);
    let window = match f.optional_size("sliding_window")? {
        Some(w) => Some(w),
        None => default,
    };
    Ok(window.filter(|_| count > 0).map(|window| Sliding {
        window,
        layers: count,
    }))
}

/// The experts of Mixtral and the Qwen mixtures: every layer, or (Qwen) those
/// `decoder_sparse_step` picks and `mlp_only_layers` leaves out.
fn experts(f: &Fields, layers: u64) -> Result<Option<Experts>, HfConfigError> {
    let (count_field, width_field, shared) = match f.model_type.as_str() {
        "mixtral" => ("num_local_experts", "intermediate_size", 0),
        "qwen2_moe" => (
            "num_experts",
            "moe_intermediate_size",
            f.size("shared_expert_intermediate_size")?,
        ),
        "qwen3_moe" => ("num_experts", "moe_intermediate_size", 0),
        _ => return Ok(None),
    };
    let count = f.size(count_field)?;
    let per_token = f.size("num_experts_per_tok")?;
    if per_token > count {
        return Err(f.bad(
            "num_experts_per_tok",
            &format!("{per_token} experts per token, but only {count} experts"),
        ));
    }
    let step = f.size_or("decoder_sparse_step", Some(1))?;
    let dense = f.indices("mlp_only_layers")?;
    let with_experts = (0..layers)
        .filter(|i| !dense.contains(i) && (i + 1).is_multiple_of(step))
        .count() as u64;
    Ok(Some(Experts {
        count,
        per_token,
        intermediate: f.size(width_field)?,
        shared,
        shared_gate: shared > 0,
        layers: with_experts,
    }))
}
