//! The analytic estimator: bytes per ledger category for a configuration, derived by counting
//! the tensors the model's forward creates (`model.rs`, `ops::step`) and what its backward
//! holds; no measurement goes in. It describes every family the engine trains (`Arch`: this
//! engine's GPT, GPT-2, Llama, Mistral, Qwen2; tied or untied), on the fused CPU ops and on the
//! lean ops (CUDA, or the CPU under `GACCWB_KERNELS=composite`).
//!
//! Activations (`graph`). Candle keeps every tensor of the graph alive until the loss is
//! dropped (each op holds its inputs), so activations are every new storage the forward's graph
//! holds; views add none. With N = B·T tokens, D the model width, H heads of width hd, KV
//! key/value heads, F the MLP's intermediate size and c the compute dtype's bytes, a block's
//! two residual steps (one op each) keep (4·D + (H + 2·KV)·hd + H·hd + mlp)·N·c, mlp being F
//! for the GELU MLP and 2F for SwiGLU's gate and up: 12·N·D·c for this engine's GPT. The lean
//! ops add f32 row statistics (each norm's mean and reciprocal std, or RMS norm's reciprocal
//! root mean square; attention's log-sum-exp). In the transformer form of Korthikanti et al.
//! 2022, "Reducing Activation Recomputation in Large Transformer Models", s·b·h·(α + β·a·s/h)
//! per layer, α = 12·c for the GPT (24 bytes in bf16) and β = 0, against their 34 and 5 for a
//! 16-bit Megatron block: attention's probabilities and the activation are recomputed in the
//! backward, as in their "selective recomputation". The head and loss keep no logits but on
//! the fused ops with their products on `gemm` (not on bf16 tiles), up to 128 MiB of them
//! (`peaks::head_kept_bytes`).
//!
//! Transient gradients (`peaks`): the backward is played op by op, its parameter gradients kept
//! once made; the measured figure is the backward's peak over its start.

use serde::Serialize;

use crate::control::{Checkpointing, Control, Dtype, Knobs, LossNorm, OffloadGrads, ZeroGrad};
use crate::hf::Arch;
use crate::model::hf::{HfError, ModelDir};
use crate::scenario::{ModelConfig, Scenario};
use crate::telemetry::{Categories, EstimateEvent, Phase};

mod graph;
mod lora;
mod peaks;
mod report;

pub use graph::{
    activation_bytes, checkpointed, checkpointed_forward_excess_bytes, recomputed_bytes, Segments,
};
pub use lora::{adapter_params, Adapters};
pub use peaks::{embedding_peak_bytes, grad_store_bytes, head_peak_bytes, transient_bytes};
pub use report::Report;

const F32: u64 = 4;

/// Everything the estimate depends on.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Config {
    /// The model as the scenario records it (its `seq_len` is the run's T).
    pub model: ModelConfig,
    /// The model's architecture: widths, heads, norm, MLP, biases, tied head, positions.
    pub arch: Arch,
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
    /// The model runs on the fused CPU ops (`ops::fused`); else on the lean ops (`ops::lean`:
    /// CUDA, or the CPU under `GACCWB_KERNELS=composite`).
    pub fused: bool,
    /// The boundary multiplies the gradients: f16 unscaling, or a clip threshold is set.
    pub scales_gradients: bool,
    /// Workspace outside any tensor (`other`): on CPU, `gemm`'s packing slab on every thread
    /// that multiplies (`ops::workspace::bytes`); 0 elsewhere.
    pub workspace: u64,
    /// Threads whose products may pack at once on the fused ops: `ops::cpu_threads`; 1 for
    /// ops run on the trainer's thread alone (`Trainer::force_serial_ops`). `gemm` packs a copy
    /// of an operand on each thread that takes part in a product, and a pool worker takes part
    /// only when it is scheduled in time, so above one thread this books the most a product can
    /// hold (an idle machine's figure; a busy one holds less).
    pub threads: usize,
    /// Activation checkpointing (`model/recompute.rs`): see `checkpointed`.
    pub checkpointing: Checkpointing,
    /// LoRA (`train.lora_rank` > 0): the base frozen in the compute dtype, the adapters trained.
    pub lora: Option<Adapters>,
}

/// The architecture a scenario's model has: the `config.json` of the Hugging Face model
/// `model.path` names, else this engine's GPT of `model`'s shape.
pub fn arch_of(model: &ModelConfig) -> Result<Arch, HfError> {
    match &model.path {
        None => Ok(Arch::engine(model)),
        Some(path) => {
            let dir = crate::model::hf::resolve(&path.to_string_lossy())?;
            Ok(ModelDir::open(&dir)?.spec()?.arch)
        }
    }
}

impl Config {
    /// The configuration the knobs `k` give for a model of architecture `arch` recorded as
    /// `model` (whose `seq_len` is the run's); `unified` when host and device are one memory.
    /// The fused CPU ops run there unless `GACCWB_KERNELS=composite` asks for the lean ones.
    pub fn for_arch(arch: &Arch, model: &ModelConfig, k: &Knobs, unified: bool) -> Config {
        Config {
            model: model.clone(),
            arch: arch.clone(),
            micro_batch: k.micro_batch,
            accum_steps: k.accum_steps,
            dtype: k.dtype,
            offload: k.offload,
            offload_grads: k.offload_grads,
            pitfall: k.loss_norm != LossNorm::Tokens || k.zero_grad != ZeroGrad::PerWindow,
            unified,
            fused: unified && !crate::ops::lean_from_env(),
            scales_gradients: k.dtype.needs_loss_scaling() || k.clip.is_some(),
            workspace: if unified {
                crate::ops::workspace::bytes()
            } else {
                0
            },
            threads: crate::ops::pool::cpu_threads(),
            checkpointing: k.checkpointing,
            lora: None,
        }
    }

    /// This configuration with the LoRA adapters `train` asks for (`train.lora_*`), if any.
    pub fn with_lora(self, train: &crate::scenario::TrainConfig) -> Config {
        Config {
            lora: Adapters::of(&self.arch, train),
            ..self
        }
    }

    /// [`Config::for_arch`] for `model`'s architecture (`arch_of`: a model directory's
    /// `config.json` is read when `model.path` names one).
    pub fn from_knobs(model: &ModelConfig, k: &Knobs, unified: bool) -> Result<Config, HfError> {
        Ok(Config::for_arch(&arch_of(model)?, model, k, unified))
    }

    /// [`Config::from_knobs`] with the scenario's first knobs.
    pub fn from_scenario(s: &Scenario, unified: bool) -> Result<Config, HfError> {
        Ok(Config::from_knobs(&s.model, &Knobs::from_scenario(s), unified)?.with_lora(&s.train))
    }

    /// Parameters the optimizer trains: every weight, or under LoRA the adapters'.
    pub fn trained_params(&self) -> u64 {
        match &self.lora {
            None => self.arch.param_count(),
            Some(a) => adapter_params(self, a),
        }
    }

    /// Elements of one block's weights the forward casts to the compute dtype: all of them, or
    /// under LoRA the adapters' (the frozen base is in the compute dtype already).
    pub fn block_cast_params(&self) -> u64 {
        match &self.lora {
            None => self.arch.layer_params(),
            Some(a) => adapter_params(self, a) / self.arch.layers.max(1),
        }
    }

    /// Bytes of the frozen base under LoRA (in the compute dtype), else 0.
    pub fn frozen_bytes(&self) -> u64 {
        match self.lora {
            None => 0,
            Some(_) => self.arch.param_count() * self.dtype.size_in_bytes() as u64,
        }
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

    /// The head's and the token embedding's weight gradients are added in place beside the
    /// graph (`ops::GradTarget`): the fused CPU ops on f32 weights, the base not frozen. The
    /// embedding then reads its rows from the f32 table, which no cast copies.
    fn grads_beside(&self) -> bool {
        self.fused && self.lora.is_none() && !self.half_weights()
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

/// Trainable parameters of this engine's GPT of shape `m` (`Arch::param_count` counts any
/// family's).
pub fn param_count(m: &ModelConfig) -> u64 {
    Arch::engine(m).param_count()
}

/// The scalars the loss leaves and what the vocabulary costs at the backward's start: the
/// logits' gradient in flight in the head and loss. It grows with N·V, so at a subword
/// vocabulary it is the share a smaller micro-batch cuts most.
pub fn head_bytes(cfg: &Config) -> u64 {
    2 * F32 + head_peak_bytes(cfg)
}

/// Bytes of the largest trained parameter (f32): the token embedding or head (V·D), the
/// position table, or a block's largest matrix (the fused qkv, an MLP matrix); under LoRA the
/// largest adapter matrix.
fn largest_param_bytes(cfg: &Config) -> u64 {
    if let Some(l) = &cfg.lora {
        return lora::largest_adapter(cfg, l) * F32;
    }
    let a = &cfg.arch;
    let (d, q, kv, f) = (a.hidden, a.q_width(), a.kv_width(), a.intermediate);
    let attention = if a.fused_qkv { d * (q + 2 * kv) } else { d * q };
    [a.vocab * d, a.positions_table * d, attention, d * f]
        .into_iter()
        .max()
        .unwrap_or(0)
        * F32
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
    largest_param_bytes(cfg)
}

/// Host bytes the optimizer phase adds while offloaded from a separate device: each gradient
/// is copied to the host for the host-side update, one parameter at a time (none when they
/// accumulate there already).
pub fn offload_copy_bytes(cfg: &Config) -> u64 {
    if cfg.unified || !cfg.offload || cfg.grads_on_host() {
        return 0;
    }
    largest_param_bytes(cfg)
}

/// Bytes of the copy back of one updated weight in half precision under offload: the host
/// master weight cast to the compute dtype, one parameter at a time (`AdamW::copy_back`); on a
/// GPU the same bytes again on the device while they land.
pub fn weight_copy_bytes(cfg: &Config) -> u64 {
    if !cfg.half_weights() {
        return 0;
    }
    largest_param_bytes(cfg) / F32 * cfg.dtype.size_in_bytes() as u64
}

/// Bytes the optimizer's update holds beyond the moments on the lean path without offload:
/// AdamW by Candle ops (`AdamW::update_by_ops`), each making a new tensor, the largest
/// parameter at a time: the new moments, the denominator, the update and the new weight with
/// their temporaries, six tensors of the parameter's size at once. The fused update (the CPU,
/// or the host under offload) works in place: 0.
pub fn update_work_bytes(cfg: &Config) -> u64 {
    if cfg.fused || cfg.offload {
        return 0;
    }
    6 * largest_param_bytes(cfg)
}

/// Compute-dtype copies the forward keeps through the micro-step: one of every parameter, or
/// with checkpointing only of those outside the blocks (the blocks cast theirs transiently);
/// a tied head is cast again from the token embedding for the head, and with the gradients
/// beside the graph the embedding reads the f32 tables (tokens and learned positions) uncast.
/// Under LoRA the frozen base is in the compute dtype already: the adapters' casts only (all in
/// the blocks).
fn kept_cast_params(cfg: &Config) -> u64 {
    let a = &cfg.arch;
    if cfg.lora.is_some() {
        return match checkpointed(cfg) {
            Some(_) => 0,
            None => cfg.trained_params(),
        };
    }
    let table = a.vocab * a.hidden;
    let uncast = table + a.positions_table * a.hidden;
    let all = a.param_count() + if a.tied { table } else { 0 }
        - if cfg.grads_beside() { uncast } else { 0 };
    match checkpointed(cfg) {
        Some(_) => all - a.layers * a.layer_params(),
        None => all,
    }
}

/// The predicted ledger of one optimizer step under `cfg`.
pub fn estimate(cfg: &Config) -> Estimate {
    let p = cfg.trained_params() * F32;
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
        frozen: cfg.frozen_bytes(),
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
                + peaks::head_forward_transient_bytes(cfg)
                    .max(checkpointed_forward_excess_bytes(cfg)),
            ..persistent
        },
        in_window_buffer,
    );
    let backward = Categories {
        gradients_transient: transient_bytes(cfg),
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
            other: persistent.other + copy_back + update_work_bytes(cfg),
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
    let buffer = if cfg.pitfall { 2 } else { 1 } * cfg.trained_params() * F32;
    let on_host = if cfg.grads_on_host() { buffer } else { 0 };
    let s = &e.step;
    ModelStates {
        device: s.frozen + s.parameters + s.compute_weights + s.optimizer_state + buffer - on_host,
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

#[cfg(test)]
mod tests;
