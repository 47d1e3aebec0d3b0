use super::*;

fn tiny(b: usize, k: usize) -> Config {
    let model = ModelConfig {
        vocab: 256,
        d_model: 32,
        layers: 2,
        heads: 2,
        seq_len: 32,
        ..ModelConfig::default()
    };
    Config {
        arch: Arch::engine(&model),
        model,
        micro_batch: b,
        accum_steps: k,
        dtype: Dtype::F32,
        offload: false,
        offload_grads: OffloadGrads::Device,
        pitfall: false,
        unified: true,
        fused: true,
        scales_gradients: false,
        workspace: 0,
        threads: 1,
        checkpointing: Checkpointing::None,
        lora: None,
    }
}

#[test]
fn parameter_count_matches_the_model() {
    let cfg = tiny(4, 1);
    let model = crate::model::Gpt::new(&cfg.model, 0, &candle_core::Device::Cpu).unwrap();
    assert_eq!(param_count(&cfg.model), model.param_count());
}

/// The fixtures' model directories, one per family the engine trains.
fn fixture_specs() -> Vec<crate::model::Spec> {
    let root =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/models");
    [
        "gpt2-tied",
        "gpt2-untied",
        "llama-gqa-llama3",
        "llama-tied",
        "qwen2-bias",
        "mistral-window",
    ]
    .iter()
    .map(|dir| ModelDir::open(&root.join(dir)).unwrap().spec().unwrap())
    .collect()
}

#[test]
fn every_family_counts_the_parameters_its_model_has() {
    for spec in fixture_specs() {
        let (arch, cfg) = (spec.arch.clone(), spec.model_config(16));
        let model = crate::model::Gpt::random(spec, cfg, 0, &candle_core::Device::Cpu).unwrap();
        assert_eq!(arch.param_count(), model.param_count(), "{}", arch.family);
    }
}

/// Every layer, and one layer of each step (the first of attention, the last of the MLP).
#[test]
fn lora_books_the_adapters_the_model_trains_and_its_frozen_base() {
    for spec in fixture_specs() {
        let names = crate::model::spec::naming_of(&spec.arch.family);
        let (arch, model) = (spec.arch.clone(), spec.model_config(16));
        let gpt =
            crate::model::Gpt::random(spec, model.clone(), 0, &candle_core::Device::Cpu).unwrap();
        for targets in [vec![], vec![names.attn_in[0], names.mlp_out]] {
            let targets: Vec<String> = targets.iter().map(|t| t.to_string()).collect();
            let lora = crate::model::lora::Lora {
                rank: 4,
                alpha: 8.0,
                targets: targets.clone(),
                rslora: false,
                dropout: 0.0,
            };
            let adapted = gpt.adapt(&lora, 0, candle_core::DType::BF16).unwrap();
            let train = crate::scenario::TrainConfig {
                lora_rank: 4,
                lora_targets: targets,
                ..Default::default()
            };
            let cfg = Config {
                arch: arch.clone(),
                model: model.clone(),
                dtype: Dtype::Bf16,
                ..tiny(4, 1)
            }
            .with_lora(&train);
            let frozen: usize = adapted.frozen.iter().map(|p| p.var.elem_count()).sum();
            assert_eq!(
                cfg.trained_params(),
                adapted.param_count(),
                "{}",
                arch.family
            );
            assert_eq!(cfg.frozen_bytes(), 2 * frozen as u64, "{}", arch.family);
            let e = estimate(&cfg);
            let p = adapted.param_count() * F32;
            assert_eq!(
                (
                    e.step.parameters,
                    e.optimizer.gradients,
                    e.step.optimizer_state
                ),
                (p, p, 2 * p)
            );
        }
    }
}

#[test]
fn the_lean_step_keeps_the_fused_figure_and_its_row_statistics() {
    for spec in fixture_specs() {
        let model = spec.model_config(32);
        let a = spec.arch;
        let fused = Config {
            arch: a.clone(),
            model: model.clone(),
            ..tiny(4, 1)
        };
        let lean = Config {
            fused: false,
            ..fused.clone()
        };
        let (n, stats) = (
            4 * 32,
            if a.norm == crate::hf::Norm::RmsNorm {
                1
            } else {
                2
            },
        );
        let per_block = (2 * stats * n + 4 * a.heads * 32) * F32;
        let final_norm = stats * n * F32;
        // The lean embedding keeps the token rows beside their sum with learned positions.
        let token_rows = if a.positions_table > 0 {
            n * a.hidden * F32
        } else {
            0
        };
        // The fused f32 head keeps its logits for its backward; the lean one makes them again.
        let logits = crate::ops::fused::head_kept(n as usize, a.vocab as usize, false) as u64;
        assert_eq!(
            activation_bytes(&lean) + logits * F32 - activation_bytes(&fused),
            a.layers * per_block + final_norm + token_rows,
            "{}",
            a.family
        );
        // The block's kept tensors: 4·D + qkv + H·hd + the MLP's first layer, per token.
        let mlp = match a.mlp {
            crate::hf::Mlp::Gelu => a.intermediate,
            crate::hf::Mlp::SwiGlu | crate::hf::Mlp::GeGlu => 2 * a.intermediate,
        };
        let width = 4 * a.hidden + a.q_width() + 2 * a.kv_width() + a.q_width() + mlp;
        assert_eq!(graph::block_bytes(&fused), width * n * F32, "{}", a.family);
    }
}

#[test]
fn a_tied_head_is_cast_again_from_the_token_embedding_unless_the_embedding_reads_f32() {
    let specs = fixture_specs();
    let tied = specs.iter().find(|s| s.arch.tied).unwrap();
    for fused in [true, false] {
        let cfg = Config {
            arch: tied.arch.clone(),
            model: tied.model_config(32),
            dtype: Dtype::Bf16,
            fused,
            ..tiny(4, 1)
        };
        let a = &cfg.arch;
        // The fused ops' embedding gathers from the f32 tables: only the head casts the
        // token table, and nothing casts the learned positions.
        let (table_casts, positions) = if fused {
            (1, a.positions_table * a.hidden)
        } else {
            (2, 0)
        };
        assert_eq!(
            estimate(&cfg).forward.compute_weights,
            (a.param_count() + (table_casts - 1) * a.vocab * a.hidden - positions) * 2
        );
    }
}

#[test]
fn activations_grow_linearly_and_state_does_not() {
    let (a, b) = (estimate(&tiny(4, 8)), estimate(&tiny(32, 1)));
    assert_eq!(
        b.forward.activations,
        8 * a.forward.activations - 7 * 2 * F32
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
        fused: false,
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
        fused: true,
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
        fused: false,
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
