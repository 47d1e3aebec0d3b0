//! One window, top to bottom: for each of its K micro-batches, forward → backward → accumulate.
//!
//! What is measured along the way is not in the loop: the phase clock, the memory ledger, the
//! gradient noise scale's norms and a pitfall's reference gradient are [`WindowObserver`]s,
//! called in one fixed order at the named points of each micro-batch. Tests add their own
//! observers the same way (an injected out-of-memory error is one).

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{Device, Result, Tensor};

use super::noise;
use super::offload::{self, Placement, Traffic};
use crate::control::{Knobs, LossNorm, RankLossNorm, SyncEvery, ZeroGrad};
use crate::data::{Batch, Sample};
use crate::dist::Group;
use crate::memory::Ledger;
use crate::model::Gpt;
use crate::telemetry::Phase;

/// The gradients of one window, before the boundary.
pub struct WindowGrads {
    /// One per parameter, multiplied by the loss scale.
    pub grads: Vec<Tensor>,
    /// The correct (`tokens`, zero-grad per window) gradients, also × scale; kept only while a
    /// pitfall is switched on so its error can be measured.
    pub reference: Option<Vec<Tensor>>,
    /// Window loss under the configured normalisation, unscaled.
    pub loss: f64,
    /// Counted (loss-carrying) tokens of the window.
    pub tokens: u64,
    /// Forward time summed over the micro-batches, in ms.
    pub forward_ms: f64,
    /// Backward time summed over the micro-batches, in ms.
    pub backward_ms: f64,
    /// Squared norms for the gradient noise scale (with `knobs.noise`, when the window has two
    /// micro-batches or more, every rank's counted).
    pub noise: Option<noise::WindowNorms>,
    /// Gradient bytes sent to the host as the micro-batches finished (`offload::land`).
    pub transferred: u64,
}

impl WindowGrads {
    /// Every tensor of the accumulation buffers.
    pub fn buffer(&self) -> Vec<&Tensor> {
        self.grads
            .iter()
            .chain(self.reference.iter().flatten())
            .collect()
    }
}

/// Why a window did not finish.
pub enum Interrupt {
    /// A stop arrived between micro-batches.
    Stop,
    /// A micro-batch failed (out of memory among others).
    Failed(candle_core::Error),
}

impl From<candle_core::Error> for Interrupt {
    fn from(e: candle_core::Error) -> Self {
        Interrupt::Failed(e)
    }
}

/// A micro-batch's loss weight in the window's loss: the one applied (`loss_norm`), and the
/// correct one (per counted token of the window).
#[derive(Clone, Copy, Debug)]
pub struct LossWeights {
    /// The weight `train.loss_norm` gives the micro-batch's token sum.
    pub applied: f64,
    /// The weight the correct normalisation gives it (1 / the window's counted tokens).
    pub correct: f64,
}

impl LossWeights {
    fn new(batch: &Batch, share: &Share, k: usize, loss_norm: LossNorm) -> LossWeights {
        let correct = 1.0 / share.window_tokens.max(1) as f64;
        let ranks = share.group.ranks() as f64;
        let applied = match (loss_norm, share.rank_loss_norm) {
            (LossNorm::Tokens, RankLossNorm::Tokens) => correct,
            (LossNorm::Tokens, RankLossNorm::MeanOfMeans) => {
                1.0 / (share.rank_tokens.max(1) as f64 * ranks)
            }
            (LossNorm::MeanOfMeans, _) => 1.0 / (batch.tokens.max(1) as f64 * k as f64 * ranks),
        };
        LossWeights { applied, correct }
    }
}

/// This rank's part of a window trained by several (data parallel; one rank alone is the
/// ordinary run).
pub struct Share<'g> {
    /// Counted tokens of the whole window, every rank's slice together.
    pub window_tokens: u64,
    /// Counted tokens of this rank's slice.
    pub rank_tokens: u64,
    /// How this rank's loss is weighted against the whole window's tokens.
    pub rank_loss_norm: RankLossNorm,
    /// With `MicroBatch`, each micro-batch's gradients are summed over the ranks before they
    /// are folded; with `Window`, the caller sums the buffer once the window is done.
    pub sync: SyncEvery,
    /// ZeRO-2 with `zero2_accumulate = "reduce-scatter"`: each micro-batch's gradients are
    /// reduce-scattered and only this rank's pieces are folded.
    pub scatter: Option<&'g super::zero::Shard>,
    /// The ranks this one trains with.
    pub group: &'g mut Group,
}

impl Share<'_> {
    /// Counted tokens of `samples`.
    pub fn tokens_of(samples: &[Sample]) -> u64 {
        samples.iter().map(|s| s.len as u64).sum()
    }

    /// The gradients folded into this rank's buffer: summed over the ranks first when they
    /// synchronise every micro-batch.
    fn sync_micro_batch(&mut self, grads: &mut Vec<Tensor>, device: &Device) -> Result<()> {
        if let Some(shard) = self.scatter {
            *grads = shard.reduce_scatter(grads, self.group, device)?;
            return Ok(());
        }
        if self.sync == SyncEvery::MicroBatch {
            self.group
                .sum_tensors(grads, true)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        }
        Ok(())
    }
}

/// The end of a micro-batch's forward: `loss` (weighted and scaled) roots the graph kept for
/// backward; `buffer` is every accumulation buffer the window holds so far.
pub struct ForwardEnd<'a> {
    /// The micro-batch's weighted, scaled loss: the root of the graph kept for backward.
    pub loss: &'a Tensor,
    /// The weights in the compute dtype (half-precision copies on bf16/f16).
    pub compute_weights: &'a [Tensor],
    /// Every accumulation buffer the window holds so far.
    pub buffer: &'a [&'a Tensor],
}

/// The end of a micro-batch's backward, before its gradients are folded into the buffer.
pub struct BackwardEnd<'a> {
    /// The gradients backward returned, before they are folded.
    pub store: &'a GradStore,
    /// The parameter gradients computed outside the graph, held beside the store
    /// (`Forward::recomputed`).
    pub beside: &'a crate::model::ParamGrads,
    /// Bytes of the graph activation checkpointing rebuilt inside this backward.
    pub recomputed_bytes: u64,
    /// The scaled loss: the graph's root, alive until after the observers.
    pub loss: &'a Tensor,
}

/// A micro-batch's parameter gradients (× its loss weight × the loss scale), about to be folded.
pub struct MicroGradients<'a> {
    /// One per parameter.
    pub grads: &'a [Tensor],
    /// The micro-batch's loss weights.
    pub weights: LossWeights,
    /// The loss scale they carry.
    pub scale: f64,
    /// Counted (loss-carrying) tokens and samples of the micro-batch.
    pub tokens: u64,
    /// Samples in the micro-batch.
    pub samples: usize,
}

/// Something that watches a window. Every point runs for every observer, in the window's order;
/// an error ends the window as a failure (`Interrupt::Failed`).
pub trait WindowObserver {
    /// An attempt at the window of optimizer step `step` (1-based) begins; the trainer calls
    /// it for the observers it was given (`Trainer::observe_windows`) before the first
    /// micro-batch.
    fn window_start(&mut self, _step: u64) -> Result<()> {
        Ok(())
    }
    /// A micro-batch's forward begins.
    fn forward_start(&mut self) -> Result<()> {
        Ok(())
    }
    /// Its forward has built the loss.
    fn forward_end(&mut self, _at: &ForwardEnd) -> Result<()> {
        Ok(())
    }
    /// Its backward begins.
    fn backward_start(&mut self) -> Result<()> {
        Ok(())
    }
    /// Its backward has returned the gradient store.
    fn backward_end(&mut self, _at: &BackwardEnd) -> Result<()> {
        Ok(())
    }
    /// Its parameter gradients, before they are folded into the buffer.
    fn gradients(&mut self, _micro: &MicroGradients) -> Result<()> {
        Ok(())
    }
    /// The micro-batch's gradients are in the buffer.
    fn micro_batch_end(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Forward + backward over `samples` cut into micro-batches of `micro_batch`, folding gradients
/// the way `knobs` says. `between` runs before every micro-batch and may interrupt the window.
pub fn window_gradients(
    model: &Gpt,
    samples: &[Sample],
    knobs: &Knobs,
    scale: f64,
    device: &Device,
    between: impl FnMut() -> bool,
) -> std::result::Result<WindowGrads, Interrupt> {
    window_gradients_observed(model, samples, knobs, scale, device, between, &mut [])
}

/// [`window_gradients`], watched by `observers` (the memory ledger, a test's hooks) after the
/// phase clock.
pub fn window_gradients_observed(
    model: &Gpt,
    samples: &[Sample],
    knobs: &Knobs,
    scale: f64,
    device: &Device,
    between: impl FnMut() -> bool,
    observers: &mut [&mut dyn WindowObserver],
) -> std::result::Result<WindowGrads, Interrupt> {
    let mut alone = Group::solo();
    let tokens = Share::tokens_of(samples);
    let mut share = Share {
        window_tokens: tokens,
        rank_tokens: tokens,
        rank_loss_norm: RankLossNorm::Tokens,
        sync: SyncEvery::Window,
        scatter: None,
        group: &mut alone,
    };
    rank_window_gradients(
        model, samples, knobs, scale, device, between, observers, &mut share,
    )
}

/// [`window_gradients_observed`] for this rank's `share` of a window several ranks train:
/// `samples` is this rank's slice.
#[allow(clippy::too_many_arguments)]
pub fn rank_window_gradients(
    model: &Gpt,
    samples: &[Sample],
    knobs: &Knobs,
    scale: f64,
    device: &Device,
    mut between: impl FnMut() -> bool,
    observers: &mut [&mut dyn WindowObserver],
    share: &mut Share,
) -> std::result::Result<WindowGrads, Interrupt> {
    let micro: Vec<&[Sample]> = samples.chunks(knobs.micro_batch).collect();
    let mut watch = Watchers::new(knobs, share, micro.len(), device, observers);
    let mut buffer: Option<Vec<Tensor>> = None;
    let placement = Placement::of(knobs);
    let mut traffic = Traffic::default();
    // Each micro-batch's detached token-sum loss and its weight: read back in one transfer at
    // the end of the window, not one device-to-host sync per micro-batch.
    let mut losses: Vec<(Tensor, f64)> = Vec::new();
    for chunk in &micro {
        if !between() {
            return Err(Interrupt::Stop);
        }
        watch.each(|o| o.forward_start())?;
        let batch = Batch::new(chunk, device)?;
        let weights = LossWeights::new(&batch, share, micro.len(), knobs.loss_norm);
        let indices: Vec<u64> = chunk.iter().map(|s| s.index).collect();
        let fwd = model.forward_training(
            &batch.inputs,
            knobs.dtype.candle(),
            knobs.checkpointing,
            &indices,
        )?;
        let nll = fwd.nll_sum(&batch.targets, &batch.mask)?;
        let loss = nll.affine(weights.applied * scale, 0.0)?;
        losses.push((nll.detach(), weights.applied));
        watch.forward_end(&loss, &fwd.compute_weights, buffer.as_deref())?;

        watch.each(|o| o.backward_start())?;
        let store = loss.backward()?;
        let recomputed_bytes = fwd.recomputed.recomputed_graph_bytes();
        watch.each(|o| {
            o.backward_end(&BackwardEnd {
                store: &store,
                beside: &fwd.recomputed,
                recomputed_bytes,
                loss: &loss,
            })
        })?;
        drop(loss);
        let recomputed = fwd.recomputed.clone();
        drop(fwd);
        let grads = parameter_gradients(model, &recomputed, store)?;
        let mut grads = offload::land(grads, &placement, &mut traffic)?;
        let micro_grads = MicroGradients {
            grads: &grads,
            weights,
            scale,
            tokens: batch.tokens,
            samples: chunk.len(),
        };
        watch.each(|o| o.gradients(&micro_grads))?;
        share.sync_micro_batch(&mut grads, device)?;
        buffer = Some(fold(buffer.take(), grads, knobs.zero_grad)?);
        watch.each(|o| o.micro_batch_end())?;
    }
    let loss = window_loss(&losses)?;
    let mut grads = watch.finish(buffer.unwrap_or_default(), scale, loss, share.rank_tokens)?;
    grads.transferred = traffic.bytes;
    Ok(grads)
}

/// The window's observers in their fixed order: the phase clock first (it waits for the
/// device, so what the others read is finished work), then the caller's, then the noise
/// scale's norms and the pitfall's reference gradient.
struct Watchers<'a, 'b> {
    clock: PhaseClock<'a>,
    outside: &'a mut [&'b mut dyn WindowObserver],
    noise: Option<NoiseNorms>,
    reference: Option<PitfallReference>,
}

impl<'a, 'b> Watchers<'a, 'b> {
    fn new(
        knobs: &Knobs,
        share: &Share,
        k: usize,
        device: &'a Device,
        outside: &'a mut [&'b mut dyn WindowObserver],
    ) -> Self {
        let pitfall = knobs.loss_norm != LossNorm::Tokens
            || knobs.zero_grad != ZeroGrad::PerWindow
            || share.rank_loss_norm != RankLossNorm::Tokens;
        Watchers {
            clock: PhaseClock::new(device),
            outside,
            // Two micro-batches make two batch sizes: this rank's K, or every rank's together.
            noise: (knobs.noise && k * share.group.ranks() >= 2)
                .then(|| NoiseNorms(noise::WindowNorms::default())),
            reference: pitfall.then(PitfallReference::default),
        }
    }

    fn each(&mut self, mut f: impl FnMut(&mut dyn WindowObserver) -> Result<()>) -> Result<()> {
        f(&mut self.clock)?;
        for o in self.outside.iter_mut() {
            f(&mut **o)?;
        }
        if let Some(n) = self.noise.as_mut() {
            f(n)?;
        }
        if let Some(r) = self.reference.as_mut() {
            f(r)?;
        }
        Ok(())
    }

    /// `forward_end` for all, with the reference gradient counted in the buffers held.
    fn forward_end(
        &mut self,
        loss: &Tensor,
        compute_weights: &[Tensor],
        buffer: Option<&[Tensor]>,
    ) -> Result<()> {
        let reference = self.reference.as_ref().and_then(|r| r.0.clone());
        let held: Vec<&Tensor> = buffer
            .into_iter()
            .flatten()
            .chain(reference.iter().flatten())
            .collect();
        let at = ForwardEnd {
            loss,
            compute_weights,
            buffer: &held,
        };
        self.each(|o| o.forward_end(&at))
    }

    fn finish(self, grads: Vec<Tensor>, scale: f64, loss: f64, tokens: u64) -> Result<WindowGrads> {
        let reference = self.reference.and_then(|r| r.0);
        let noise = match self.noise {
            Some(NoiseNorms(mut n)) => {
                n.finish(reference.as_ref().unwrap_or(&grads), scale)?;
                Some(n)
            }
            None => None,
        };
        Ok(WindowGrads {
            grads,
            reference,
            loss,
            tokens,
            forward_ms: self.clock.forward_ms,
            backward_ms: self.clock.backward_ms,
            noise,
            transferred: 0,
        })
    }
}

/// Times the window's forward and backward phases. CUDA runs asynchronously: a phase's time,
/// and any memory reading after it, are only true once its kernels have finished, so the clock
/// waits for the device at the end of each phase (a no-op on the CPU).
struct PhaseClock<'a> {
    device: &'a Device,
    started: Instant,
    forward_ms: f64,
    backward_ms: f64,
}

impl<'a> PhaseClock<'a> {
    fn new(device: &'a Device) -> Self {
        PhaseClock {
            device,
            started: Instant::now(),
            forward_ms: 0.0,
            backward_ms: 0.0,
        }
    }

    fn lap_ms(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * 1e3
    }
}

impl WindowObserver for PhaseClock<'_> {
    fn forward_start(&mut self) -> Result<()> {
        self.started = Instant::now();
        Ok(())
    }
    fn forward_end(&mut self, _at: &ForwardEnd) -> Result<()> {
        self.device.synchronize()?;
        self.forward_ms += self.lap_ms();
        Ok(())
    }
    fn backward_start(&mut self) -> Result<()> {
        self.started = Instant::now();
        Ok(())
    }
    fn backward_end(&mut self, _at: &BackwardEnd) -> Result<()> {
        self.device.synchronize()
    }
    /// The backward's time includes taking its gradients and folding them in.
    fn micro_batch_end(&mut self) -> Result<()> {
        self.backward_ms += self.lap_ms();
        Ok(())
    }
}

/// The memory ledger's measurement points.
impl WindowObserver for Ledger {
    fn forward_start(&mut self) -> Result<()> {
        self.start_phase(Phase::Forward);
        Ok(())
    }
    fn forward_end(&mut self, at: &ForwardEnd) -> Result<()> {
        self.forward_done(at.loss, at.compute_weights, at.buffer);
        Ok(())
    }
    fn backward_start(&mut self) -> Result<()> {
        self.start_phase(Phase::Backward);
        Ok(())
    }
    fn backward_end(&mut self, at: &BackwardEnd) -> Result<()> {
        self.backward_done(at.store, at.beside, at.recomputed_bytes, at.loss);
        Ok(())
    }
}

/// Each micro-batch's gradient norm, for the gradient noise scale.
struct NoiseNorms(noise::WindowNorms);

impl WindowObserver for NoiseNorms {
    fn gradients(&mut self, m: &MicroGradients) -> Result<()> {
        self.0
            .push(m.grads, m.weights.applied * m.scale, m.tokens, m.samples)
    }
}

/// While a pitfall is on: the correct fold of correctly weighted gradients, the reference its
/// `grad_error` is measured against.
#[derive(Default)]
struct PitfallReference(Option<Vec<Tensor>>);

impl WindowObserver for PitfallReference {
    fn gradients(&mut self, m: &MicroGradients) -> Result<()> {
        let ratio = m.weights.correct / m.weights.applied;
        let correct: Vec<Tensor> = m
            .grads
            .iter()
            .map(|g| g.affine(ratio, 0.0))
            .collect::<Result<_>>()?;
        self.0 = Some(fold(self.0.take(), correct, ZeroGrad::PerWindow)?);
        Ok(())
    }
}

/// Each parameter's gradient from one backward, detached: a parameter's gradient is computed
/// from activations and would otherwise keep this micro-batch's whole graph alive through the
/// buffer, the optimizer moments and every later step.
fn parameter_gradients(
    model: &Gpt,
    recomputed: &crate::model::ParamGrads,
    store: GradStore,
) -> Result<Vec<Tensor>> {
    model
        .params
        .iter()
        .map(|p| {
            recomputed.get(&store, &p.var)?.ok_or_else(|| {
                candle_core::Error::Msg(format!("parameter {} received no gradient", p.name))
            })
        })
        .collect()
}

/// Σ weight × loss over the window's micro-batches, with one device-to-host transfer.
fn window_loss(losses: &[(Tensor, f64)]) -> Result<f64> {
    if losses.is_empty() {
        return Ok(0.0);
    }
    let tensors: Vec<&Tensor> = losses.iter().map(|(t, _)| t).collect();
    let values = Tensor::stack(&tensors, 0)?.to_vec1::<f32>()?;
    Ok(values
        .iter()
        .zip(losses)
        .map(|(v, (_, weight))| f64::from(*v) * weight)
        .sum())
}

/// Add a micro-batch's gradients into the accumulation buffer (or replace it: the zero-grad
/// pitfall).
fn fold(
    buffer: Option<Vec<Tensor>>,
    micro: Vec<Tensor>,
    zero_grad: ZeroGrad,
) -> Result<Vec<Tensor>> {
    match (buffer, zero_grad) {
        (Some(acc), ZeroGrad::PerWindow) => acc.iter().zip(&micro).map(|(a, g)| a + g).collect(),
        _ => Ok(micro),
    }
}
