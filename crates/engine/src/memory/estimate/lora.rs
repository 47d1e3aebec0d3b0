//! LoRA's share of the estimate (`model::lora`): which layers carry an adapter (A `[in, r]`, B
//! `[r, out]`), counted by the rule the model adapts them by (`Lora::adapts` on the family's
//! module names), and the backward of a residual step whose base is frozen: no gradient for
//! the norm or the base weights, only the input's and the adapters'.

use serde::Serialize;

use super::graph::Shape;
use super::peaks::{Step, Tape};
use super::{Config, F32};
use crate::hf::{Arch, Mlp};
use crate::model::lora::Lora;
use crate::scenario::TrainConfig;

/// The adapters a LoRA run trains, per block.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Adapters {
    /// The rank r.
    pub rank: u64,
    /// Attention's layers, the first layer's parts then the output projection: adapted or not.
    pub attention: Vec<bool>,
    /// The MLP's layers, the first layer's parts then the second layer: adapted or not.
    pub mlp: Vec<bool>,
    /// Dropout on the adapters' input (`train.lora_dropout` > 0): its masks are drawn again
    /// in each pass (`ops::dropout`), so they cost moments, never kept bytes.
    pub dropout: bool,
}

impl Adapters {
    /// The adapters `train` asks for on a model of `arch` (`None` without LoRA). The layers are
    /// the family's modules in block order (`model::spec::Naming`), adapted as `Lora::adapts`
    /// says for the first block's names (every block has the same layers).
    pub fn of(arch: &Arch, train: &TrainConfig) -> Option<Adapters> {
        if train.lora_rank == 0 {
            return None;
        }
        let lora = Lora::of(train);
        let names = crate::model::spec::naming_of(&arch.family);
        let prefix = names.block.replace("{l}", "0");
        let adapted = |layers: &[&str]| -> Vec<bool> {
            layers
                .iter()
                .map(|l| lora.adapts(&format!("{prefix}{l}")))
                .collect()
        };
        let attention = [names.attn_in, &[names.attn_out]].concat();
        let mlp = [names.mlp_in, &[names.mlp_out]].concat();
        Some(Adapters {
            rank: train.lora_rank as u64,
            attention: adapted(&attention),
            mlp: adapted(&mlp),
            dropout: train.lora_dropout > 0.0,
        })
    }

    /// Whether any layer is adapted (a target list may name none of this family's layers).
    pub fn any(&self) -> bool {
        self.attention.iter().chain(&self.mlp).any(|on| *on)
    }

    /// A block's linear layers as the family names them, the names targets match.
    pub fn layer_names(arch: &Arch) -> Vec<&'static str> {
        let names = crate::model::spec::naming_of(&arch.family);
        [
            names.attn_in,
            &[names.attn_out],
            names.mlp_in,
            &[names.mlp_out],
        ]
        .concat()
    }

    /// `step`'s layers (attention's or the MLP's; the first layer's parts, then the second):
    /// `(in, out)` of each adapted one, `None` for the others.
    pub(super) fn layers(&self, step: &Step, s: &Shape) -> Vec<Option<(u64, u64)>> {
        let flags = if step.attention {
            &self.attention
        } else {
            &self.mlp
        };
        let dims = step
            .first
            .iter()
            .map(|&(o, _)| (s.d, o))
            .chain([(step.product, s.d)]);
        dims.zip(flags)
            .map(|(dims, &on)| on.then_some(dims))
            .collect()
    }

    /// Elements of `step`'s adapters: r·(in + out) per adapted layer.
    pub(super) fn step_params(&self, step: &Step, s: &Shape) -> u64 {
        self.layers(step, s)
            .iter()
            .flatten()
            .map(|(i, o)| self.rank * (i + o))
            .sum()
    }
}

/// Every adapter's elements over the model.
pub fn adapter_params(cfg: &Config, a: &Adapters) -> u64 {
    let s = Shape::new(cfg);
    let per_block =
        a.step_params(&Step::attention(cfg, &s), &s) + a.step_params(&Step::mlp(cfg, &s), &s);
    s.layers * per_block
}

/// Elements of the largest adapter matrix (A `[in, r]` or B `[r, out]`).
pub(super) fn largest_adapter(cfg: &Config, a: &Adapters) -> u64 {
    let s = Shape::new(cfg);
    [Step::attention(cfg, &s), Step::mlp(cfg, &s)]
        .iter()
        .flat_map(|step| a.layers(step, &s).into_iter().flatten())
        .map(|(i, o)| a.rank * i.max(o))
        .max()
        .unwrap_or(0)
}

/// One adapted layer's backward beside what is live (`parts_backward_rows`, and Candle's ops
/// on the lean path): `t = s·dy·Bᵀ` (`[N, r]`, held to the layer's end), dA, `s·x·A` for a
/// moment, dB. Leaves dA and dB. `e` bytes an element. Under dropout (`drop`: the bytes an
/// element of the mask tensor takes, 0 where the kernel makes its factors row by row) `t·Aᵀ`
/// is made apart and masked before it joins dx, and dA and dB read the masked input, made
/// again: `[N, in]` each.
fn adapter_grads(n: u64, r: u64, (i, o): (u64, u64), e: u64, drop: Option<u64>, t: &mut Tape) {
    t.add(n * r * e);
    let (mask, masked) = match drop {
        None => (0, 0),
        Some(m) => (n * i * m, n * i * e),
    };
    t.add(mask);
    t.touch(masked);
    t.add(masked);
    t.add(i * r * e);
    t.touch(n * r * e);
    t.add(r * o * e);
    t.free(n * r * e + mask + masked);
}

/// A frozen residual step's backward on the fused path (`ops::fused::branch` with a frozen
/// base): the second layer through `parts_backward_rows` (no packed [dx; dW]), attention's or
/// the activation's gradient, the first layer's dx and the adapters' gradients, the norm's
/// [dx; dgain (; dbias)] (computed, not kept), all in f32; on half storage beside the f32
/// copies of dy, of its weights (`Step::widened`, the adapters' as matrices) and of the tensors
/// it reads.
pub(super) fn fused_step(cfg: &Config, a: &Adapters, s: &Shape, step: &Step, t: &mut Tape) {
    let (n, d, r) = (s.n, s.d, a.rank);
    let adapters = a.step_params(step, s);
    let mut layers = a.layers(step, s);
    let second_adapted = layers.pop().flatten();
    // dy comes in the f32 stream.
    let widened = step.widened(s) + s.matrix_copies(adapters);
    t.add(widened);
    // The second layer: its input's f32 copy (half storage), the activation's value (and the
    // GELU's slope), the input's gradient, the adapter's.
    let input = if s.cast { n * step.second_in * F32 } else { 0 };
    let activation = match (step.attention, cfg.arch.mlp) {
        (true, _) => 0,
        (false, Mlp::Gelu) => 2 * n * step.product * F32,
        (false, _) => n * step.product * F32,
    };
    t.add(input + activation + d * F32);
    let d_act = n * step.product * F32;
    t.add(d_act);
    let drop = a.dropout.then_some(0);
    if let Some(dims) = second_adapted {
        adapter_grads(n, r, dims, F32, drop, t);
    }
    // SwiGLU's gradient of [gate | up] is a new buffer; the GELU's is made in place.
    let d_second = n * step.second_in * F32;
    if d_second != d_act {
        t.add(d_second);
        t.free(d_act);
    }
    t.free(input + activation + d * F32);
    // The middle: attention's dqkv beside qkv's f32 copy; the MLP reads d_second itself.
    let width = step.width();
    let dmid = if step.attention { n * width * F32 } else { 0 };
    let qkv = if step.attention && s.cast { dmid } else { 0 };
    t.add(qkv + dmid);
    t.free(qkv);
    // The first layer: the normed input's f32 copy, dx, the biases' buffer, each adapter.
    let normed = if s.cast { n * d * F32 } else { 0 };
    t.add(normed + n * d * F32 + width * F32);
    for &dims in layers.iter().flatten() {
        adapter_grads(n, r, dims, F32, drop, t);
    }
    t.free(normed + width * F32);
    let norm = super::peaks::norm_backward(s, t);
    // The adapters' gradients stay in f32, rounded to the compute dtype (`storage::rounded`);
    // dx is the norm's result, rounded in place, in the f32 stream.
    t.free(d_second + dmid + n * d * F32 + widened);
    super::peaks::keep_gradients(cfg, adapters, F32, t);
    let stream = n * d * s.stream;
    t.add(2 * stream);
    t.free(stream + norm + stream);
}

/// A frozen residual step's backward on the lean path (`ops::lean::branch`, `layer_grads`
/// without `base`): Candle ops in the compute dtype, each making a new tensor.
pub(super) fn lean_step(cfg: &Config, a: &Adapters, s: &Shape, step: &Step, t: &mut Tape) {
    let (n, d, c, r) = (s.n, s.d, s.c, a.rank);
    let widen = u64::from(s.cast);
    let adapters = a.step_params(step, s);
    let mut layers = a.layers(step, s);
    let second_adapted = layers.pop().flatten();
    // The second layer: its input made again (the MLP), da, and its adapter's t·Aᵀ and sum.
    let remade = if step.attention {
        0
    } else {
        n * step.product * c
    };
    t.add(remade + n * step.product * c);
    let drop = a.dropout.then_some(c);
    if let Some(dims) = second_adapted {
        adapter_grads(n, r, dims, c, drop, t);
        t.touch(2 * n * step.product * c);
    }
    let middle = if step.attention {
        super::peaks::lean_attention_backward(cfg, s)
    } else {
        let layer = n * s.f * F32;
        match cfg.arch.mlp {
            Mlp::Gelu => 4 * layer,
            Mlp::SwiGlu | Mlp::GeGlu => (6 + 3 * widen) * layer,
        }
    };
    t.touch(middle);
    let width = step.width();
    t.add(n * width * c);
    // The first layer's parts, each on its columns of dmid: dx (summed over the parts), and
    // the adapters' gradients with their t·Aᵀ.
    for (i, (&(o, _), adapted)) in step.first.iter().zip(&layers).enumerate() {
        let columns = if step.first.len() > 1 { n * o * c } else { 0 };
        t.add(columns + n * d * c);
        if let Some(dims) = *adapted {
            adapter_grads(n, r, dims, c, drop, t);
            t.touch(2 * n * d * c);
        }
        if i > 0 {
            t.add(n * d * c);
            t.free(2 * n * d * c);
        }
        t.free(columns);
    }
    t.touch((4 + s.stats + widen) * n * d * F32);
    t.add(2 * n * d * c);
    t.free(remade + n * step.product * c + n * width * c + 2 * n * d * c);
    super::peaks::keep_gradients(cfg, adapters, c, t);
    t.add(2 * n * d * c);
    t.free(3 * n * d * c);
}
