//! A transformer block's residual step, described once for every family: `x + second(middle(
//! first(norm(x))))`, where
//!
//! - `norm` is layer norm (gain and bias) or RMS norm (gain),
//! - `first` is one weight or several whose outputs sit side by side (GPT-2's fused `c_attn`,
//!   or LLaMA's `q_proj | k_proj | v_proj`; `c_fc`, or `gate_proj | up_proj`), each with or
//!   without a bias,
//! - `middle` is causal self-attention (grouped-query, rotary or not) or the MLP's activation
//!   (GELU or SwiGLU), which the second layer applies to its input,
//! - `second` is one weight with or without a bias (`c_proj`, `o_proj`, `down_proj`).
//!
//! The CPU runs a step as one fused op (`fused::branch`), any other device as one lean op
//! (`lean::branch`); both take the weights outside the graph and hand their gradients to a
//! `GradSink`. `composite` here is the plain reference, op by op with the weights in the graph.

use std::sync::Arc;

use candle_core::{Result, Tensor};

use super::dropout::Dropout;
use super::rope::RopeTable;
use super::{composite, Activation, AttentionShape, NormKind};

/// Takes a step's weight gradients (in `StepWeights::flat` order) during the backward. Each is
/// summed in f32 and rounded once to the storage dtype, as a single op's is: the value the
/// weight's cast received from Candle's graph, so an f32 master weight and a half-precision one
/// under offload get the same gradient. The fused CPU ops hand it over widened back to f32
/// (exact), the lean ones in the storage dtype.
pub(crate) type GradSink = Box<dyn Fn(Vec<Tensor>) -> Result<()> + Send + Sync>;

/// What sits between a step's two layers.
#[derive(Clone, Debug)]
pub enum Middle {
    /// Causal self-attention over the first layer's `qkv`, rotary with the table when given.
    Attention {
        /// Its shape.
        shape: AttentionShape,
        /// The rotary table for its positions.
        rope: Option<Arc<RopeTable>>,
    },
    /// The MLP: the second layer takes `act(first layer's output)`.
    Mlp(Activation),
}

/// A residual step: its norm and what sits between its layers (the weights carry the rest).
#[derive(Clone, Debug)]
pub struct Step {
    /// The norm's form.
    pub norm: NormKind,
    /// The norm's epsilon.
    pub eps: f64,
    /// Attention or MLP.
    pub middle: Middle,
}

/// A low-rank adapter on a layer (PEFT's LoRA): `scale · (x·A)·B` added to the layer's output,
/// A `[in, r]` and B `[r, out]` as the engine holds them.
#[derive(Clone, Debug)]
pub struct Adapter {
    /// `A`, `[in, r]`.
    pub a: Tensor,
    /// `B`, `[r, out]`.
    pub b: Tensor,
    /// `alpha / r` (`alpha / √r` with rsLoRA).
    pub scale: f64,
    /// LoRA's dropout on the adapter's input (training only): `scale · (dropout(x)·A)·B`.
    pub dropout: Option<Dropout>,
}

/// A layer's weight `[in, out]`, its bias `[out]` when it has one, and its adapter when LoRA
/// adapts it.
#[derive(Clone, Debug)]
pub struct Dense {
    /// The weight, stored `[in, out]`.
    pub w: Tensor,
    /// The bias.
    pub b: Option<Tensor>,
    /// The low-rank adapter.
    pub adapter: Option<Adapter>,
}

/// A step's weights, all in the dtype of its input, on its device.
#[derive(Clone, Debug)]
pub struct StepWeights {
    /// The norm's gain.
    pub gain: Tensor,
    /// The norm's bias (layer norm only).
    pub shift: Option<Tensor>,
    /// The first layer's weights, outputs side by side in this order.
    pub first: Vec<Dense>,
    /// The second layer.
    pub second: Dense,
    /// The base weights (norm, layers, biases) are frozen: only adapters get gradients, and
    /// none is computed for the rest.
    pub frozen: bool,
}

impl StepWeights {
    /// Every tensor: gain, shift, then each layer's weight, bias and adapter's A and B (absent
    /// ones skipped), the first layer's in order, then the second's.
    pub fn flat(&self) -> Vec<&Tensor> {
        self.tensors().into_iter().map(|(t, _)| t).collect()
    }

    /// The tensors that get gradients, in `flat` order: the order a `GradSink` receives them.
    pub fn trainable(&self) -> Vec<&Tensor> {
        self.tensors()
            .into_iter()
            .filter(|(_, adapter)| *adapter || !self.frozen)
            .map(|(t, _)| t)
            .collect()
    }

    /// The graph inputs of a step of `x` with these weights: `x`, and when `x` tracks no graph
    /// (the frozen embedding under LoRA) but a weight is trained, that weight too, as an anchor
    /// the step's node hangs on so its backward runs (the anchor gets no gradient from the graph:
    /// the sink hands it over).
    pub fn graph_inputs<'a>(&'a self, x: &'a Tensor, training: bool) -> Vec<&'a Tensor> {
        let anchor = self.trainable().into_iter().find(|t| t.track_op());
        match anchor {
            Some(a) if training && !x.track_op() => vec![x, a],
            _ => vec![x],
        }
    }

    /// `flat`'s tensors, each with whether it belongs to an adapter.
    fn tensors(&self) -> Vec<(&Tensor, bool)> {
        let mut all = vec![(&self.gain, false)];
        all.extend(self.shift.iter().map(|s| (s, false)));
        for d in self.first.iter().chain([&self.second]) {
            all.push((&d.w, false));
            all.extend(d.b.iter().map(|b| (b, false)));
            if let Some(a) = &d.adapter {
                all.extend([(&a.a, true), (&a.b, true)]);
            }
        }
        all
    }

    /// Width of the first layer's output.
    pub fn first_width(&self) -> Result<usize> {
        self.first.iter().map(|d| d.w.dim(1)).sum()
    }
}

impl Step {
    /// `x + step(x)` op by op with Candle's autograd: the weights are graph inputs (their
    /// gradients land in the `GradStore`). The reference the fused and lean steps are held to.
    pub fn composite(&self, x: &Tensor, w: &StepWeights) -> Result<Tensor> {
        let normed = match self.norm {
            NormKind::Layer => {
                let shift = w
                    .shift
                    .as_ref()
                    .ok_or_else(|| candle_core::Error::Msg("layer norm without a bias".into()))?;
                composite::layer_norm(x, &w.gain, shift, self.eps)?
            }
            NormKind::Rms => composite::rms_norm(x, &w.gain, self.eps)?,
        };
        let parts = w
            .first
            .iter()
            .map(|d| dense(&normed, d))
            .collect::<Result<Vec<_>>>()?;
        let mid = Tensor::cat(&parts, 1)?;
        let second_in = match &self.middle {
            Middle::Attention { shape, rope } => {
                composite::causal_attention(&mid, *shape, rope.as_ref())?
            }
            Middle::Mlp(Activation::Gelu) => composite::gelu(&mid)?,
            Middle::Mlp(Activation::SwiGlu) => {
                let half = mid.dim(1)? / 2;
                let gate = mid.narrow(1, 0, half)?;
                (candle_nn::ops::silu(&gate)? * mid.narrow(1, half, half)?)?
            }
            Middle::Mlp(Activation::None) => mid,
        };
        x + dense(&second_in, &w.second)?
    }

    /// The second layer's activation: none after attention.
    pub fn activation(&self) -> Activation {
        match self.middle {
            Middle::Attention { .. } => Activation::None,
            Middle::Mlp(act) => act,
        }
    }
}

/// `x·w (+ b) (+ scale·(dropout(x)·A)·B)`.
fn dense(x: &Tensor, d: &Dense) -> Result<Tensor> {
    let y = x.matmul(&d.w)?;
    let y = match &d.b {
        Some(b) => composite::bias_add(&y, b)?,
        None => y,
    };
    match &d.adapter {
        Some(a) => y + (a.dropped(x)?.matmul(&a.a)?.matmul(&a.b)? * a.scale)?,
        None => Ok(y),
    }
}

impl Adapter {
    /// The adapter's input: `x` times its dropout mask (made on `x`'s device), or `x`.
    pub fn dropped(&self, x: &Tensor) -> Result<Tensor> {
        match self.mask_for(x)? {
            Some(m) => x * m,
            None => Ok(x.clone()),
        }
    }

    /// The dropout mask for input `x` (`[rows, cols]`, in `x`'s dtype and on its device), when
    /// the adapter has dropout.
    pub fn mask_for(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Some(d) = &self.dropout else {
            return Ok(None);
        };
        let (rows, cols) = x.dims2()?;
        d.mask(rows, cols, x.dtype(), x.device()).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Mutex, PoisonError};

    use candle_core::{DType, Var};

    use super::*;
    use crate::ops::dropout::Dropout;
    use crate::ops::rope::Rope;
    use crate::ops::tests::{random, rel_err};
    use crate::ops::{force_lean, fused, lean};

    /// The output, the input's gradient and every weight's gradient of `sum(out · r)`.
    type Results = (Tensor, Tensor, Vec<Tensor>);

    /// A family's two steps: (name, step, weights); with `lora` every layer carries a rank-3
    /// adapter (B not zero, so that A's gradient is not) and the base is frozen.
    fn steps(family: &str, batch: usize, t: usize, lora: bool) -> Vec<(String, Step, StepWeights)> {
        let d = 16;
        let (norm, heads, kv, hd, bias_qkv, bias_out, act, f) = match family {
            "gpt" => (
                NormKind::Layer,
                2,
                2,
                8,
                true,
                true,
                Activation::Gelu,
                4 * d,
            ),
            "llama" => (NormKind::Rms, 4, 2, 8, false, false, Activation::SwiGlu, 24),
            _ => (NormKind::Rms, 4, 1, 4, true, false, Activation::SwiGlu, 20),
        };
        let rope = (norm == NormKind::Rms).then(|| {
            let r = Rope {
                theta: 10_000.0,
                head_dim: hd,
                scaling: None,
            };
            Arc::new(r.table(t))
        });
        let shape = AttentionShape {
            batch,
            t,
            heads,
            kv_heads: kv,
            head_dim: hd,
        };
        let mut seed = 100;
        let mut next = |shape: &[usize], std: f32| {
            seed += 1;
            random(shape, std, seed)
        };
        let dense = |next: &mut dyn FnMut(&[usize], f32) -> Tensor, i, o, bias: bool| Dense {
            w: next(&[i, o], 0.3),
            b: bias.then(|| next(&[o], 0.3)),
            adapter: lora.then(|| Adapter {
                a: next(&[i, 3], 0.3),
                b: next(&[3, o], 0.3),
                scale: 8.0 / 3.0,
                dropout: None,
            }),
        };
        let norm_weights = |next: &mut dyn FnMut(&[usize], f32) -> Tensor| {
            (
                next(&[d], 0.3).affine(1.0, 1.0).unwrap(),
                (norm == NormKind::Layer).then(|| next(&[d], 0.3)),
            )
        };
        let (gain, shift) = norm_weights(&mut next);
        let (q, k) = (heads * hd, kv * hd);
        let first = match family {
            "gpt" => vec![dense(&mut next, d, q + 2 * k, bias_qkv)],
            _ => [q, k, k]
                .iter()
                .map(|&o| dense(&mut next, d, o, bias_qkv))
                .collect(),
        };
        let attention = StepWeights {
            gain,
            shift,
            first,
            second: dense(&mut next, q, d, bias_out),
            frozen: lora,
        };
        let (gain, shift) = norm_weights(&mut next);
        let first = match act {
            Activation::Gelu => vec![dense(&mut next, d, f, true)],
            _ => vec![dense(&mut next, d, f, false), dense(&mut next, d, f, false)],
        };
        let mlp = StepWeights {
            gain,
            shift,
            first,
            second: dense(&mut next, f, d, act == Activation::Gelu),
            frozen: lora,
        };
        let step = |middle| Step {
            norm,
            eps: 1e-5,
            middle,
        };
        vec![
            (
                format!("{family} attention"),
                step(Middle::Attention { shape, rope }),
                attention,
            ),
            (format!("{family} mlp"), step(Middle::Mlp(act)), mlp),
        ]
    }

    /// `x + step(x)` through `run` (the weights outside the graph, their gradients handed to
    /// the sink).
    fn through_sink(
        run: impl Fn(&Tensor, &Step, StepWeights, Option<GradSink>) -> Result<Tensor>,
        x: &Tensor,
        step: &Step,
        w: &StepWeights,
        r: &Tensor,
    ) -> Results {
        let x = Var::from_tensor(x).unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let into = got.clone();
        let sink: GradSink = Box::new(move |g| {
            *into.lock().unwrap_or_else(PoisonError::into_inner) = g;
            Ok(())
        });
        let y = run(x.as_tensor(), step, w.clone(), Some(sink)).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * r).unwrap();
        let store = loss.sum_all().unwrap().backward().unwrap();
        let dx = store.get(x.as_tensor()).unwrap().clone();
        let grads = got.lock().unwrap_or_else(PoisonError::into_inner).clone();
        (y, dx, grads)
    }

    /// The same step op by op (`Step::composite`), the trained weights graph inputs (a frozen
    /// base is not).
    fn through_composite(x: &Tensor, step: &Step, w: &StepWeights, r: &Tensor) -> Results {
        let x = Var::from_tensor(x).unwrap();
        let var = |t: &Tensor| Var::from_tensor(t).unwrap().as_tensor().clone();
        let base = |t: &Tensor| match w.frozen {
            true => t.clone(),
            false => var(t),
        };
        let dense = |d: &Dense| Dense {
            w: base(&d.w),
            b: d.b.as_ref().map(base),
            adapter: d.adapter.as_ref().map(|a| Adapter {
                a: var(&a.a),
                b: var(&a.b),
                scale: a.scale,
                dropout: a.dropout.clone(),
            }),
        };
        let vars = StepWeights {
            gain: base(&w.gain),
            shift: w.shift.as_ref().map(base),
            first: w.first.iter().map(dense).collect(),
            second: dense(&w.second),
            frozen: w.frozen,
        };
        let y = step.composite(x.as_tensor(), &vars).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * r).unwrap();
        let store = loss.sum_all().unwrap().backward().unwrap();
        let dx = store.get(x.as_tensor()).unwrap().clone();
        let grads = vars
            .trainable()
            .iter()
            .map(|w| store.get(w).unwrap().clone())
            .collect();
        (y, dx, grads)
    }

    fn assert_close(name: &str, got: &Results, want: &Results, bound: f64) {
        assert_eq!(got.2.len(), want.2.len(), "{name}: one gradient per weight");
        let pairs = [
            (&got.0, &want.0, "output"),
            (&got.1, &want.1, "input gradient"),
        ];
        let weights = got
            .2
            .iter()
            .zip(&want.2)
            .map(|(g, w)| (g, w, "weight gradient"));
        for (i, (g, w, what)) in pairs.into_iter().chain(weights).enumerate() {
            assert_eq!(g.dims(), w.dims(), "{name}: {what} {i}");
            let e = rel_err(g, w);
            assert!(
                e <= bound,
                "{name}: {what} {i} rel. error {e:e} > {bound:e}"
            );
        }
    }

    #[test]
    fn fused_and_lean_steps_match_the_composite_reference_for_every_family() {
        // 3 sequences of 40 tokens: 120 rows, several parallel units.
        let (batch, t) = (3, 40);
        let x = random(&[batch * t, 16], 2.0, 1)
            .broadcast_add(&random(&[batch * t, 1], 3.0, 2))
            .unwrap();
        let r = random(&[batch * t, 16], 1.0, 9);
        for (family, lora) in [
            ("gpt", false),
            ("llama", false),
            ("qwen", false),
            ("gpt", true),
            ("qwen", true),
        ] {
            for (name, step, w) in steps(family, batch, t, lora) {
                let name = if lora { format!("{name} lora") } else { name };
                let want = through_composite(&x, &step, &w, &r);
                let fused = through_sink(fused::branch, &x, &step, &w, &r);
                assert_close(&format!("fused {name}"), &fused, &want, 1e-5);
                let _lean = force_lean(true);
                let lean = through_sink(lean::branch, &x, &step, &w, &r);
                assert_close(&format!("lean {name}"), &lean, &want, 1e-5);
            }
        }
    }

    /// `w` with dropout `p` on every adapter (each its own key), over `batch` samples of `t`.
    fn with_dropout(w: &StepWeights, p: f32, batch: usize, t: usize) -> StepWeights {
        let samples: Arc<[u64]> = (0..batch as u64).map(|i| 40 + 3 * i).collect();
        let mut key = 0;
        let mut dense = |d: &Dense| {
            key += 1;
            Dense {
                adapter: d.adapter.as_ref().map(|a| Adapter {
                    dropout: Some(Dropout::new(p, key, samples.clone(), t)),
                    ..a.clone()
                }),
                ..d.clone()
            }
        };
        StepWeights {
            first: w.first.iter().map(&mut dense).collect(),
            second: dense(&w.second),
            ..w.clone()
        }
    }

    /// Every result's bits.
    fn bits(r: &Results) -> Vec<Vec<u32>> {
        let all = [&r.0, &r.1].into_iter().chain(&r.2);
        all.map(|t| {
            let v = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
            v.to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
    }

    #[test]
    fn lora_dropout_steps_match_the_composite_reference_under_the_same_mask() {
        let (batch, t) = (3, 20);
        let x = random(&[batch * t, 16], 2.0, 1);
        let r = random(&[batch * t, 16], 1.0, 9);
        for family in ["gpt", "llama"] {
            for (name, step, w) in steps(family, batch, t, true) {
                let plain = through_composite(&x, &step, &w, &r);
                let w = with_dropout(&w, 0.3, batch, t);
                let want = through_composite(&x, &step, &w, &r);
                let fused = through_sink(fused::branch, &x, &step, &w, &r);
                assert_close(&format!("fused {name} dropout"), &fused, &want, 1e-5);
                let lean = {
                    let _lean = force_lean(true);
                    through_sink(lean::branch, &x, &step, &w, &r)
                };
                assert_close(&format!("lean {name} dropout"), &lean, &want, 1e-5);
                // Applied: the output and every adapter's gradient move off the p = 0 ones.
                for (i, (g, p)) in fused.2.iter().zip(&plain.2).enumerate() {
                    let e = rel_err(g, p);
                    assert!(e > 1e-2, "{name}: adapter gradient {i} moved by {e:e} only");
                }
                assert!(rel_err(&fused.0, &plain.0) > 1e-3, "{name}: output");
            }
        }
    }

    #[test]
    fn a_dropout_mask_of_all_ones_gives_the_bits_of_no_dropout() {
        let (batch, t) = (2, 24);
        let x = random(&[batch * t, 16], 2.0, 1);
        let r = random(&[batch * t, 16], 1.0, 9);
        for (name, step, w) in steps("llama", batch, t, true)
            .into_iter()
            .chain(steps("gpt", batch, t, true))
        {
            let dropped = with_dropout(&w, 0.5, batch, t);
            for lean in [false, true] {
                let _lean = force_lean(lean);
                let run = |w: &StepWeights| match lean {
                    true => through_sink(lean::branch, &x, &step, w, &r),
                    false => through_sink(fused::branch, &x, &step, w, &r),
                };
                let want = run(&w);
                let all_ones = {
                    let _keep = crate::ops::dropout::force_keep_all(true);
                    run(&with_dropout(&w, 0.5, batch, t))
                };
                assert_eq!(bits(&all_ones), bits(&want), "{name}, lean {lean}");
                assert_ne!(bits(&run(&dropped)), bits(&want), "{name}, lean {lean}");
            }
        }
    }

    #[test]
    fn a_half_precision_step_keeps_its_inner_gradients_in_f32() {
        // In bf16 the fused step rounds only what it stores; it stays as near the f32 result on
        // the same (rounded) values as bf16's rounding allows.
        let (batch, t) = (2, 24);
        let x = random(&[batch * t, 16], 2.0, 1);
        let r = random(&[batch * t, 16], 1.0, 9);
        let half = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        for family in ["gpt", "llama"] {
            for (name, step, w) in steps(family, batch, t, false) {
                let cast = |w: &StepWeights, c: &dyn Fn(&Tensor) -> Tensor| {
                    let dense = |d: &Dense| Dense {
                        w: c(&d.w),
                        b: d.b.as_ref().map(c),
                        adapter: None,
                    };
                    StepWeights {
                        gain: c(&w.gain),
                        shift: w.shift.as_ref().map(c),
                        first: w.first.iter().map(dense).collect(),
                        second: dense(&w.second),
                        frozen: false,
                    }
                };
                let (xh, wh) = (half(&x), cast(&w, &half));
                let want = through_composite(&f32s(&xh), &step, &cast(&wh, &f32s), &r);
                let got = through_sink(fused::branch, &xh, &step, &wh, &r);
                assert_eq!((got.0.dtype(), got.1.dtype()), (DType::BF16, DType::BF16));
                assert_close(&format!("{name} bf16"), &got, &want, 1e-2);
            }
        }
    }
}
