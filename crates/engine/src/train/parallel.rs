//! The trainer as one of W data-parallel ranks: joining the group, ZeRO's shards of the
//! moments (and of the gradient under stage 2), the window's sums over the ranks, and the
//! fingerprint of the knobs the ranks compare at every boundary.

use std::time::Instant;

use candle_core::{Result, Tensor};

use super::window::WindowGrads;
use super::{global_norm, noise, zero, TrainError, Trainer, ZeroRefused};
use crate::control::Control;

impl Trainer {
    /// Train as one rank of `group` (data parallel): every rank must join a trainer built from
    /// the same scenario, before the first step.
    pub fn join(&mut self, group: crate::dist::Group) -> std::result::Result<(), TrainError> {
        self.base_batch = self.scenario.base_batch(group.ranks());
        self.group = group;
        if self.knobs.zero > 0 {
            // From the whole moments a fresh model or a checkpoint holds: this rank's pieces.
            self.set_zero(self.knobs.zero, self.knobs.zero2_accumulate)?;
        }
        Ok(())
    }

    /// Reshard for ZeRO stage `stage` with ZeRO-2 accumulating as `accumulate`, at a boundary:
    /// the moments keep their values, cut into this rank's pieces (from stage 0) or gathered
    /// whole again (to stage 0). The knobs themselves change in `Knobs::apply` after it.
    pub(super) fn set_zero(
        &mut self,
        stage: u8,
        accumulate: crate::control::Zero2Accumulate,
    ) -> std::result::Result<(), TrainError> {
        let refuse = |why: &'static str| ZeroRefused::Stage { stage, why };
        if stage > 2 {
            return Err(refuse("stages are 0, 1 and 2").into());
        }
        if stage > 0 && self.knobs.offload {
            return Err(refuse(
                "ZeRO shards the optimizer state instead of offloading it; set train.offload = false",
            )
            .into());
        }
        if stage == 2 && self.pitfall_on() {
            return Err(refuse(
                "stage 2 shards the gradient, but a pitfall's error needs the whole reference \
                 gradient; measure pitfalls at train.zero = 0 or 1",
            )
            .into());
        }
        let scatters = accumulate == crate::control::Zero2Accumulate::ReduceScatter;
        if stage == 2 && scatters && self.knobs.noise {
            return Err(refuse(
                "with zero2_accumulate = \"reduce-scatter\" no rank holds its whole window \
                 gradient, which the noise scale measures; set train.noise = false",
            )
            .into());
        }
        match (self.zero.take(), stage) {
            (None, 0) => {}
            (None, _) => {
                let shard = zero::Shard::of(&self.model.params, &self.group);
                zero::cut_moments(&mut self.opt, &shard)?;
                self.zero = Some(shard);
            }
            (Some(shard), 0) => {
                zero::gather_moments(&mut self.opt, &shard, &self.model.params, &mut self.group)?;
            }
            (Some(shard), _) => self.zero = Some(shard),
        }
        Ok(())
    }

    /// Under ZeRO: offload is refused (the moments are sharded instead), and under stage 2 a
    /// pitfall (its reference gradient is whole).
    pub(super) fn check_under_zero(&self, c: &Control) -> std::result::Result<(), ZeroRefused> {
        let stage = self.zero_stage();
        let refused = match c {
            Control::SetOffload { value: true } => stage > 0,
            Control::SetLossNorm { value } => {
                stage == 2 && *value != crate::control::LossNorm::Tokens
            }
            Control::SetZeroGrad { value } => {
                stage == 2 && *value != crate::control::ZeroGrad::PerWindow
            }
            _ => false,
        };
        if refused {
            return Err(ZeroRefused::Change {
                stage,
                change: c.describe(),
            });
        }
        Ok(())
    }

    /// Whether a pitfall (loss normalisation, zero-grad, cross-rank mean) is switched on.
    fn pitfall_on(&self) -> bool {
        self.knobs.loss_norm != crate::control::LossNorm::Tokens
            || self.knobs.zero_grad != crate::control::ZeroGrad::PerWindow
            || self.scenario.train.rank_loss_norm != crate::control::RankLossNorm::Tokens
    }

    /// The ZeRO stage in force (0 without sharding).
    pub(super) fn zero_stage(&self) -> u8 {
        if self.zero.is_some() {
            self.knobs.zero
        } else {
            0
        }
    }

    /// Whether ZeRO-2 reduce-scatters every micro-batch's gradients.
    pub(super) fn scatters_micro_batches(&self) -> bool {
        self.zero_stage() == 2
            && self.knobs.zero2_accumulate == crate::control::Zero2Accumulate::ReduceScatter
    }

    /// Under ZeRO, gather the moments whole on every rank after each `every`-th step (a
    /// checkpoint is saved then); every rank must call it alike, as the gather is a collective.
    pub fn gather_state_every(&mut self, every: u64) {
        self.gather_every = every;
    }

    /// AdamW's moments whole (`m`, `v`, in parameter order): the optimizer's own, or under
    /// ZeRO the copies gathered at this step's end (`gather_state_every`); `None` under ZeRO at
    /// any other step.
    pub fn whole_moments(&self) -> Option<(&[Tensor], &[Tensor])> {
        match (&self.zero, &self.gathered) {
            (None, _) => Some((&self.opt.m, &self.opt.v)),
            (Some(_), Some((m, v))) => Some((m, v)),
            (Some(_), None) => None,
        }
    }

    /// At a step's end under ZeRO, when a checkpoint is due: the whole moments, on every rank
    /// (counted in this step's bytes).
    pub(super) fn gather_if_due(&mut self) -> Result<()> {
        let due = self.gather_every > 0 && self.step.is_multiple_of(self.gather_every);
        if let (Some(shard), true) = (&self.zero, due) {
            let params = &self.model.params;
            let whole = zero::whole_moments(&self.opt, shard, params, &mut self.group)?;
            self.gathered = Some(whole);
        }
        Ok(())
    }

    /// This process's rank and the number of ranks.
    pub fn rank(&self) -> (usize, usize) {
        (self.group.rank(), self.group.ranks())
    }

    /// Samples in a window, every rank's together: W·K·B.
    pub fn global_batch(&self) -> usize {
        self.knobs.effective_batch() * self.group.ranks()
    }

    /// Under data parallel, the window's sums over the ranks: the gradients (unless every
    /// micro-batch's already were), the pitfall's reference, and the loss. Every rank then
    /// holds the same buffer and takes the same step.
    pub(super) fn sum_over_ranks(&mut self, window: &mut WindowGrads) -> Result<()> {
        match (&self.zero, self.zero_stage()) {
            // Each micro-batch's gradients were reduce-scattered already.
            (Some(_), 2) if self.scatters_micro_batches() => {}
            (Some(shard), 2) => {
                window.grads =
                    shard.reduce_scatter(&window.grads, &mut self.group, &self.device)?;
            }
            _ => {}
        }
        if !self.group.is_parallel() {
            return Ok(());
        }
        let dist = |e: crate::dist::DistError| candle_core::Error::Msg(e.to_string());
        if self.zero_stage() < 2 && self.knobs.sync == crate::control::SyncEvery::Window {
            self.group
                .sum_tensors(&mut window.grads, true)
                .map_err(dist)?;
        }
        if let Some(reference) = window.reference.as_mut() {
            self.group.sum_tensors(reference, false).map_err(dist)?;
        }
        let mut loss = [window.loss];
        self.group.sum_scalars(&mut loss);
        window.loss = loss[0];
        Ok(())
    }

    /// Under data parallel, the noise scale's norms of every rank: each rank's micro-batches
    /// are small batches and the summed window the big one, so W ranks at K measure what one
    /// process measures at W·K (and every rank holds the same estimate). The big batch's norm
    /// is the whole window's, read after the sums.
    pub(super) fn pool_noise_over_ranks(
        &mut self,
        window: &mut WindowGrads,
        scale: f64,
    ) -> Result<()> {
        if !self.group.is_parallel() {
            return Ok(());
        }
        let Some(norms) = window.noise.as_mut() else {
            return Ok(());
        };
        let started = Instant::now();
        let whole = match &window.reference {
            Some(reference) => global_norm(reference)?,
            None => self.grad_norm(&window.grads)?,
        };
        norms.window_sq_norm = (whole / scale).powi(2);
        let mine: Vec<u64> = norms
            .micro
            .iter()
            .flat_map(|m| [m.sq_norm.to_bits(), m.tokens, m.seqs as u64])
            .collect();
        norms.micro = self
            .group
            .gather_measurements(&mine)
            .chunks(3)
            .map(|c| noise::MicroNorm {
                sq_norm: f64::from_bits(c[0]),
                tokens: c[1],
                seqs: c[2] as usize,
            })
            .collect();
        norms.cost_ms += started.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// A fingerprint of the knobs in force: ranks compare them at every boundary.
    pub(super) fn knobs_fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        serde_json::to_string(&self.knobs)
            .unwrap_or_default()
            .hash(&mut h);
        h.finish()
    }
}
