use super::*;
use crate::hf::named;
use crate::planner::lora::BaseDtype;

/// The paper's per-layer formula, s·b·h·(34 + 5·a·s/h), kept in integers: 34·sbh + 5·a·s²·b.
fn paper(arch: &Arch, b: u64) -> u64 {
    let (s, h, a) = (arch.seq_len, arch.hidden, arch.heads);
    34 * s * b * h + 5 * a * s * s * b
}

fn layer(arch: &Arch, b: u64, attention: Attention, recompute: Recompute) -> u64 {
    activations(arch, b, attention, recompute, None).per_layer
}

fn lora(arch: &Arch, targets: &[&str], dropout: f64) -> Lora {
    let targets = targets.iter().map(|t| t.to_string()).collect();
    Lora::new(arch, 16, Some(targets), dropout, BaseDtype::Bf16).unwrap()
}

#[test]
fn the_papers_formula_at_gpt2_and_gpt3_175b() {
    for name in ["gpt2", "gpt3-175b"] {
        let arch = named(name).unwrap();
        for b in [1, 4] {
            let sbh = arch.seq_len * b * arch.hidden;
            assert_eq!(
                layer(&arch, b, Attention::Full, Recompute::None),
                paper(&arch, b),
                "{name} b={b}"
            );
            // Selective recomputation: the paper's 34·sbh.
            assert_eq!(
                layer(&arch, b, Attention::Full, Recompute::Selective),
                34 * sbh
            );
            // FlashAttention: 34·sbh and a log-sum-exp per head and row.
            assert_eq!(
                layer(&arch, b, Attention::Flash, Recompute::None),
                34 * sbh + 4 * arch.heads * arch.seq_len * b
            );
            // Full recomputation: 2·sbh.
            assert_eq!(layer(&arch, b, Attention::Full, Recompute::Full), 2 * sbh);
        }
    }
    // At gpt3-175b, micro-batch 1, over 96 layers: 256.5 and 76.5 GiB.
    let gpt3 = named("gpt3-175b").unwrap();
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    let full = activations(&gpt3, 1, Attention::Full, Recompute::None, None).layers;
    let selective = activations(&gpt3, 1, Attention::Full, Recompute::Selective, None).layers;
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
    assert_eq!(layer(&llama, 1, Attention::Full, Recompute::None), expected);
    let flash = layer(&llama, 1, Attention::Flash, Recompute::None);
    assert_eq!(flash, expected - 2 * a * s * s + 4 * a * s);
    let whole = activations(&llama, 1, Attention::Flash, Recompute::Full, None);
    assert_eq!(whole.recompute_working, flash);
    assert_eq!(
        whole.total,
        32 * 2 * s * h + flash + 4 * s * h + 4 * s * 128256
    );
}

#[test]
fn lora_keeps_the_adapted_layers_inputs_and_adds_a_s_outputs() {
    let llama = named("llama3-8b").unwrap();
    let (s, h, f, r) = (8192u64, 4096u64, 14336u64, 16u64);
    let full = activations(&llama, 1, Attention::Full, Recompute::None, None);
    let all = default_lora(&llama);
    let with = activations(&llama, 1, Attention::Full, Recompute::None, Some(&all));
    // Every projection adapted: every input the full fine-tune keeps is kept, plus A's output
    // (r wide) of the seven adapters; the frozen head keeps no input.
    assert_eq!(with.adapters, 32 * 7 * 2 * s * r);
    assert_eq!(with.layers, full.layers + with.adapters);
    assert_eq!(with.outside_layers, full.outside_layers - 2 * s * h);
    // q and v only: the output projection's input (with materialised attention), the MLP's input
    // and the down projection's input are no longer kept.
    let qv = lora(&llama, &["q_proj", "v_proj"], 0.0);
    let per_layer = activations(&llama, 1, Attention::Full, Recompute::None, Some(&qv)).per_layer;
    let full_layer = full.per_layer;
    assert_eq!(
        per_layer,
        full_layer - 2 * s * h - 2 * s * h - 2 * s * f + 2 * 2 * s * r
    );
    // FlashAttention keeps the attention's output whatever is trained.
    let flash =
        |l: Option<&Lora>| activations(&llama, 1, Attention::Flash, Recompute::None, l).per_layer;
    assert_eq!(
        flash(Some(&qv)),
        flash(None) - 2 * s * h - 2 * s * f + 2 * 2 * s * r
    );
    // Dropout on the adapters' inputs: each adapter's own dropped copy (2 bytes) and mask (1).
    let dropped = lora(&llama, &["q_proj", "v_proj"], 0.1);
    let d = activations(&llama, 1, Attention::Flash, Recompute::None, Some(&dropped));
    assert_eq!(d.per_layer, flash(Some(&qv)) + 2 * 3 * s * h);
}

fn default_lora(arch: &Arch) -> Lora {
    Lora::new(arch, 16, None, 0.0, BaseDtype::Bf16).unwrap()
}

#[test]
fn what_todays_families_add() {
    let dense = |family: &str| {
        let mut a = named("llama3-8b").unwrap();
        a.family = family.into();
        a.seq_len = 1024;
        a
    };
    let (s, h, q, k, heads, v) = (1024u64, 4096u64, 4096u64, 1024u64, 32u64, 128256u64);
    let base = dense("llama");
    let at = |a: &Arch, att| activations(a, 1, att, Recompute::None, None);
    // q/k norms keep their inputs.
    let qwen3 = Arch {
        qk_norm: true,
        ..dense("qwen3")
    };
    assert_eq!(
        at(&qwen3, Attention::Flash).per_layer,
        at(&base, Attention::Flash).per_layer + 2 * s * (q + k)
    );
    // Post-norms keep the attention's and the MLP's outputs; a soft cap on the scores keeps
    // its tanh (materialised attention only); one on the logits its tanh too.
    let gemma2 = Arch {
        post_norms: true,
        attention_softcap: true,
        logit_softcap: true,
        mlp: Mlp::GeGlu,
        ..dense("gemma2")
    };
    assert_eq!(
        at(&gemma2, Attention::Flash).per_layer,
        at(&base, Attention::Flash).per_layer + 4 * s * h
    );
    assert_eq!(
        at(&gemma2, Attention::Full).per_layer,
        at(&base, Attention::Full).per_layer + 4 * s * h + 2 * heads * s * s
    );
    assert_eq!(
        at(&gemma2, Attention::Flash).outside_layers,
        at(&base, Attention::Flash).outside_layers + 2 * s * v
    );
}

#[test]
fn experts_keep_the_routed_tokens_only() {
    let mut mixtral = named("mistral-7b").unwrap();
    mixtral.seq_len = 1024;
    let e = Experts {
        count: 8,
        per_token: 2,
        intermediate: 14336,
        shared: 0,
        shared_gate: false,
        layers: 32,
    };
    let dense = activations(&mixtral, 1, Attention::Flash, Recompute::None, None);
    mixtral.experts = Some(e);
    let moe = activations(&mixtral, 1, Attention::Flash, Recompute::None, None);
    let (n, h, f) = (1024u64, 4096u64, 14336u64);
    // The dense MLP's input 2nh and 4·2nf, against: the same input, the router's fp32
    // probabilities 4n·8 and, per routed pair (2n of them), the gathered input 2h, 4·2f and the
    // expert's output 2h.
    let dense_mlp = 2 * n * h + 8 * n * f;
    let moe_mlp = 2 * n * h + 4 * n * 8 + 2 * n * (2 * h + 8 * f + 2 * h);
    assert_eq!(moe.per_layer, dense.per_layer - dense_mlp + moe_mlp);
}
