//! Data parallel: W ranks train one model, each on its own slice of the window's samples, and
//! sum their gradients before the update.
//!
//! The rules, one each (docs/DATA_PARALLEL.md):
//! - a window takes W·K·B samples from the data stream; rank r trains samples
//!   `[r·K·B, (r+1)·K·B)` of it, so W = 2, K = 2 trains the samples W = 1, K = 4 trains;
//! - the window's counted tokens are summed over the ranks (one all-reduce of a scalar) before
//!   any backward is scaled, so the update is the global per-token mean
//!   ([`RankLossNorm`](crate::control::RankLossNorm));
//! - gradients are summed once per window, or after every micro-batch ([`SyncEvery`]): the same
//!   sum, K× the bytes;
//! - every rank then takes the same AdamW step on the same sum, so the weights never differ.
//!
//! Ranks run on existing engines, not a home-made transport: MPI (the `mpi` feature, over the
//! system's Open MPI or MPICH), and on CUDA devices NCCL for the gradients (the `nccl`
//! feature: the gradient all-reduce stays on the device; scalars, controls and ZeRO's pieces
//! still go over MPI). [`Group`] counts what each collective moves under the ring rule and
//! times it; a watchdog ends a rank that waits on its peers past the timeout, so nothing hangs
//! in a collective.

pub(crate) mod launch;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
pub mod watchdog;

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::control::SyncEvery;
pub use launch::{from_env, launched, local_rank, Launch};

/// Why a collective failed.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// Started as a rank by a build without the `mpi` feature.
    #[error(
        "launched as rank {rank} of {ranks} by an MPI launcher, but this gaccwb was built \
         without MPI: rebuild with `cargo build --release --features mpi` (needs an MPI library, \
         e.g. Debian's libopenmpi-dev, and libclang)"
    )]
    NotBuiltWithMpi {
        /// This process's rank, as the launcher said.
        rank: usize,
        /// The ranks the launcher started.
        ranks: usize,
    },
    /// MPI can be initialised once per process.
    #[error("MPI was already initialised in this process")]
    AlreadyInitialised,
    /// The launcher's environment and MPI disagree, or a launcher variable is garbled.
    #[error("{0}")]
    Launch(String),
    /// A rank runs other knobs than the others (a rank started with another `--set`).
    #[error("step {step}: the ranks disagree on {what}; every rank must run the same knobs")]
    Disagree {
        /// The boundary where it was found.
        step: u64,
        /// What differs.
        what: &'static str,
    },
    /// Rank 0's controls did not reach the others intact.
    #[error("sharing rank 0's controls: {0}")]
    Controls(serde_json::Error),
    /// Flattening or rebuilding the gradients failed.
    #[error("gradients for data parallel: {0}")]
    Tensor(candle_core::Error),
    /// NCCL refused to start or to reduce.
    #[error("NCCL on rank {rank}: {what}")]
    Nccl {
        /// This process's rank.
        rank: usize,
        /// What failed, with NCCL's error.
        what: String,
    },
}

// The causes are in the messages already: `From` without `#[from]`, which would make them
// `source`s too and print each twice in a chain.
impl From<serde_json::Error> for DistError {
    fn from(e: serde_json::Error) -> Self {
        DistError::Controls(e)
    }
}

impl From<candle_core::Error> for DistError {
    fn from(e: candle_core::Error) -> Self {
        DistError::Tensor(e)
    }
}

/// What carries the ranks' gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, strum::Display)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Collectives {
    /// One process: nothing to carry.
    Solo,
    /// MPI, through host memory.
    Mpi,
    /// NCCL on the CUDA devices (the rest over MPI).
    Nccl,
}

/// What each rank can do with the others. Every rank calls the same collectives in the same
/// order; the implementations block until all have.
pub trait Transport: Send {
    /// This process's rank, 0 to `ranks() - 1`.
    fn rank(&self) -> usize;
    /// How many ranks train together (W).
    fn ranks(&self) -> usize;
    /// Element-wise sum over the ranks, in place.
    fn sum_f32(&mut self, values: &mut [f32]);
    /// Element-wise sum over the ranks, in place.
    fn sum_f64(&mut self, values: &mut [f64]);
    /// Element-wise sum over the ranks, in place.
    fn sum_u64(&mut self, values: &mut [u64]);
    /// Element-wise maximum over the ranks, in place.
    fn max_u64(&mut self, values: &mut [u64]);
    /// Every rank's `values`, concatenated in rank order.
    fn gather_u64(&mut self, values: &[u64]) -> Vec<u64>;
    /// Every rank's `values` (the same length on each), concatenated in rank order.
    fn gather_f32(&mut self, values: &[f32]) -> Vec<f32>;
    /// The element-wise sum over the ranks of `values` (W equal blocks), of which this rank
    /// receives block `rank`.
    fn reduce_scatter_f32(&mut self, values: &[f32]) -> Vec<f32>;
    /// Rank 0's `bytes` on every rank (the others' are replaced).
    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>);
    /// What carries [`Transport::sum_tensor`].
    fn collectives(&self) -> Collectives;
    /// The element-wise sum over the ranks of a flat f32 tensor, on its device. By default
    /// through host memory ([`Transport::sum_f32`]); NCCL sums CUDA tensors where they are.
    fn sum_tensor(&mut self, flat: &Tensor) -> Result<Tensor, DistError> {
        let mut host = flat.to_vec1::<f32>()?;
        self.sum_f32(&mut host);
        Ok(Tensor::from_vec(host, flat.elem_count(), flat.device())?)
    }
}

/// One process alone: every collective is the identity.
pub struct Solo;

impl Transport for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn ranks(&self) -> usize {
        1
    }
    fn sum_f32(&mut self, _: &mut [f32]) {}
    fn sum_f64(&mut self, _: &mut [f64]) {}
    fn sum_u64(&mut self, _: &mut [u64]) {}
    fn max_u64(&mut self, _: &mut [u64]) {}
    fn gather_u64(&mut self, values: &[u64]) -> Vec<u64> {
        values.to_vec()
    }
    fn gather_f32(&mut self, values: &[f32]) -> Vec<f32> {
        values.to_vec()
    }
    fn reduce_scatter_f32(&mut self, values: &[f32]) -> Vec<f32> {
        values.to_vec()
    }
    fn broadcast_bytes(&mut self, _: &mut Vec<u8>) {}
    fn collectives(&self) -> Collectives {
        Collectives::Solo
    }
}

/// Bytes one rank sends (and receives) in a ring all-reduce of `bytes` over `ranks`: the
/// reduce-scatter and the all-gather each pass (W − 1)/W of the buffer. Bandwidth-optimal, and
/// what NCCL's ring moves; MPI libraries choose their own algorithm, so this is the payload
/// rule the counters follow, not a packet count.
pub fn ring_all_reduce_bytes(bytes: u64, ranks: usize) -> u64 {
    let w = ranks as u64;
    if w <= 1 {
        return 0;
    }
    2 * (w - 1) * bytes / w
}

/// Bytes one rank sends (and receives) in a ring reduce-scatter or all-gather of `bytes` (the
/// whole buffer, every rank's block together): (W − 1)/W of it.
pub fn ring_half_bytes(bytes: u64, ranks: usize) -> u64 {
    ring_all_reduce_bytes(bytes, ranks) / 2
}

/// One rank's communication over a window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankComm {
    /// Bytes sent and received under the ring rule ([`ring_all_reduce_bytes`]).
    pub sent_bytes: u64,
    /// Bytes received, by the same rule.
    pub received_bytes: u64,
    /// Wall time inside collectives, waiting for slower ranks included.
    pub comm_ms: f64,
    /// Gradient all-reduces: 1 per window with `sync = window`, K with `micro-batch`.
    pub gradient_reduces: u32,
}

/// The communication of one optimizer step: every rank's, gathered at the step's end.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CommEvent {
    /// The ranks (W).
    pub ranks: usize,
    /// When gradients were summed in this step.
    pub sync: SyncEvery,
    /// One entry per rank, in rank order.
    pub per_rank: Vec<RankComm>,
    /// Each rank's peak bytes over the step (the memory ledger's total), in rank order.
    pub peak_bytes: Vec<u64>,
}

impl CommEvent {
    /// Bytes the ranks sent together.
    pub fn sent_bytes(&self) -> u64 {
        self.per_rank.iter().map(|r| r.sent_bytes).sum()
    }

    /// The slowest rank's time in collectives.
    pub fn comm_ms(&self) -> f64 {
        self.per_rank.iter().map(|r| r.comm_ms).fold(0.0, f64::max)
    }

    /// The share of rank 0's step (`step_ms`, the time a step event reports) that rank 0 spent
    /// in collectives, waiting for slower ranks included: at most 1. Another rank's time is on
    /// another clock; set against rank 0's step it is no share of anything.
    pub fn share_of_step(&self, step_ms: f64) -> f64 {
        let mine = self.per_rank.first().map_or(0.0, |r| r.comm_ms);
        (mine / step_ms.max(1e-9)).clamp(0.0, 1.0)
    }
}

/// The ranks of a data-parallel run, as this process sees them: the transport, the counters of
/// the window in progress and the watchdog over every collective.
pub struct Group {
    transport: Box<dyn Transport>,
    window: RankComm,
    watchdog: Option<watchdog::Watchdog>,
}

impl Default for Group {
    fn default() -> Self {
        Group::solo()
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank(), self.ranks())
    }
}

impl Group {
    /// A run of one process.
    pub fn solo() -> Group {
        Group::new(Box::new(Solo), None)
    }

    /// Ranks over `transport`; a collective that waits longer than `timeout` ends the process.
    pub fn new(transport: Box<dyn Transport>, timeout: Option<Duration>) -> Group {
        let watchdog = timeout
            .filter(|_| transport.ranks() > 1)
            .map(|t| watchdog::Watchdog::start(transport.rank(), t));
        Group {
            transport,
            window: RankComm::default(),
            watchdog,
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// How many ranks train together (W).
    pub fn ranks(&self) -> usize {
        self.transport.ranks()
    }

    /// Whether this process is one of several.
    pub fn is_parallel(&self) -> bool {
        self.ranks() > 1
    }

    /// What carries the gradients.
    pub fn collectives(&self) -> Collectives {
        self.transport.collectives()
    }

    /// On a CUDA device, moves the gradient all-reduce onto NCCL (built with the `nccl`
    /// feature); MPI keeps everything else. Otherwise the group stays as it is: on the CPU,
    /// or in a build without NCCL, where CUDA gradients cross the host (see
    /// [`Group::gradients_cross_the_host`]).
    pub fn adopt_device(self, device: &candle_core::Device) -> Result<Group, DistError> {
        if !self.is_parallel() || !device.is_cuda() {
            return Ok(self);
        }
        self.adopt_cuda(device)
    }

    #[cfg(feature = "nccl")]
    fn adopt_cuda(self, device: &candle_core::Device) -> Result<Group, DistError> {
        let Group {
            mut transport,
            window,
            watchdog,
        } = self;
        if let Some(w) = &watchdog {
            w.enter("starting NCCL");
        }
        let nccl = nccl::Nccl::start(transport.as_mut(), device);
        if let Some(w) = &watchdog {
            w.leave();
        }
        Ok(Group {
            transport: Box::new(nccl::WithNccl::new(transport, nccl?)),
            window,
            watchdog,
        })
    }

    /// A world of one whose gradient sums run through NCCL on `device` all the same: what a
    /// one-GPU machine can check of the NCCL path (the communicator on Candle's stream, the
    /// reduce as a Candle op, the buckets cut back into gradients). Training alone never sums.
    #[cfg(feature = "nccl")]
    pub fn solo_on_nccl(device: &candle_core::Device) -> Result<Group, DistError> {
        let mut solo: Box<dyn Transport> = Box::new(Solo);
        let nccl = nccl::Nccl::start(solo.as_mut(), device)?;
        Ok(Group::new(Box::new(nccl::WithNccl::new(solo, nccl)), None))
    }

    #[cfg(not(feature = "nccl"))]
    fn adopt_cuda(self, _device: &candle_core::Device) -> Result<Group, DistError> {
        Ok(self)
    }

    /// Whether this rank's gradients live on a CUDA device but are summed through host memory
    /// (a build without the `nccl` feature): correct, and slower by two copies per reduce.
    pub fn gradients_cross_the_host(&self, device: &candle_core::Device) -> bool {
        self.is_parallel() && device.is_cuda() && self.collectives() != Collectives::Nccl
    }

    /// Runs a collective under the watchdog and the window's clock.
    fn collective<R>(&mut self, what: &'static str, f: impl FnOnce(&mut dyn Transport) -> R) -> R {
        if let Some(w) = &self.watchdog {
            w.enter(what);
        }
        let started = Instant::now();
        let out = f(self.transport.as_mut());
        self.window.comm_ms += started.elapsed().as_secs_f64() * 1e3;
        if let Some(w) = &self.watchdog {
            w.leave();
        }
        out
    }

    /// A collective between steps (the boundary's agreement, rank 0's controls, the telemetry):
    /// watched, but not on the window's clock. Its wait includes whatever the other ranks do
    /// between steps (rank 0 evaluating, recording, saving), which is no part of any step, and
    /// counted it made "the share of the step in collectives" exceed the step.
    fn between_steps<R>(
        &mut self,
        what: &'static str,
        f: impl FnOnce(&mut dyn Transport) -> R,
    ) -> R {
        let clock = self.window.comm_ms;
        let out = self.collective(what, f);
        self.window.comm_ms = clock;
        out
    }

    fn count(&mut self, bytes: u64) {
        self.count_moved(ring_all_reduce_bytes(bytes, self.ranks()));
    }

    fn count_moved(&mut self, moved: u64) {
        self.window.sent_bytes += moved;
        self.window.received_bytes += moved;
    }

    /// The window's counted tokens, summed over the ranks.
    pub fn sum_tokens(&mut self, local: u64) -> u64 {
        let mut v = [local];
        self.count(8);
        self.collective("summing the window's tokens", |t| t.sum_u64(&mut v));
        v[0]
    }

    /// Sums scalars over the ranks (the window's loss), in f64.
    pub fn sum_scalars(&mut self, values: &mut [f64]) {
        self.count(8 * values.len() as u64);
        self.collective("summing the window's loss", |t| t.sum_f64(values));
    }

    /// Sums `tensors` over the ranks, in place: one flat f32 bucket, one all-reduce. Counted as
    /// a gradient reduce when `gradients`.
    pub fn sum_tensors(
        &mut self,
        tensors: &mut [Tensor],
        gradients: bool,
    ) -> Result<(), DistError> {
        // Alone there is nothing to sum, except through NCCL (`Group::solo_on_nccl`).
        if !self.is_parallel() && self.collectives() != Collectives::Nccl {
            return Ok(());
        }
        let pieces = tensors
            .iter()
            .map(|t| t.flatten_all()?.to_dtype(DType::F32))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let flat = Tensor::cat(&pieces, 0)?;
        drop(pieces);
        self.count(4 * flat.elem_count() as u64);
        if gradients {
            self.window.gradient_reduces += 1;
        }
        let summed = self.collective("summing gradients", |t| t.sum_tensor(&flat))?;
        let mut at = 0;
        for t in tensors.iter_mut() {
            let n = t.elem_count();
            let piece = summed.narrow(0, at, n)?.reshape(t.shape())?;
            // A storage of its own for each gradient: later steps update them in place.
            *t = match t.dtype() {
                DType::F32 => piece.copy()?,
                dtype => piece.to_dtype(dtype)?,
            };
            at += n;
        }
        Ok(())
    }

    /// This rank's block of the sum over the ranks of `flat` (W equal blocks, padded by the
    /// caller): ZeRO-2's gradient reduce-scatter, counted as a gradient reduce.
    pub fn reduce_scatter(&mut self, flat: &[f32]) -> Vec<f32> {
        self.count_moved(ring_half_bytes(4 * flat.len() as u64, self.ranks()));
        self.window.gradient_reduces += 1;
        self.collective("reduce-scattering gradients", |t| {
            t.reduce_scatter_f32(flat)
        })
    }

    /// Every rank's block, in rank order: ZeRO's all-gather of the updated weights.
    pub fn all_gather(&mut self, block: &[f32]) -> Vec<f32> {
        let whole = 4 * (block.len() * self.ranks()) as u64;
        self.count_moved(ring_half_bytes(whole, self.ranks()));
        self.collective("gathering the updated weights", |t| t.gather_f32(block))
    }

    /// Every rank's `values` (the same length on each), in rank order: measurements such as
    /// the noise scale's norms. Not counted: workbench traffic, like the telemetry.
    pub fn gather_measurements(&mut self, values: &[u64]) -> Vec<u64> {
        if !self.is_parallel() {
            return values.to_vec();
        }
        self.collective("gathering measurements", |t| t.gather_u64(values))
    }

    /// At a boundary: rank 0's controls (the screen's keys reach rank 0 only) on every rank, so
    /// every rank applies the same changes at the same boundary. Not counted: workbench traffic.
    pub fn share_controls(
        &mut self,
        controls: Vec<crate::control::ControlMsg>,
    ) -> Result<Vec<crate::control::ControlMsg>, DistError> {
        if !self.is_parallel() {
            return Ok(controls);
        }
        let pairs: Vec<(crate::control::Control, crate::control::Origin)> = controls
            .into_iter()
            .map(|m| (m.control, m.origin))
            .collect();
        let mut bytes = match self.rank() {
            0 => serde_json::to_vec(&pairs)?,
            _ => Vec::new(),
        };
        self.between_steps("sharing rank 0's controls", |t| {
            t.broadcast_bytes(&mut bytes)
        });
        let pairs: Vec<(crate::control::Control, crate::control::Origin)> =
            serde_json::from_slice(&bytes)?;
        Ok(pairs
            .into_iter()
            .map(|(control, origin)| crate::control::ControlMsg { control, origin })
            .collect())
    }

    /// Before anything is built: rank 0's `mine` on every rank (a rank compares it with its
    /// own scenario). Not counted: workbench traffic.
    pub fn rank0_bytes(&mut self, mine: &[u8]) -> Vec<u8> {
        let mut bytes = mine.to_vec();
        if self.is_parallel() {
            self.collective("comparing the scenarios", |t| t.broadcast_bytes(&mut bytes));
        }
        bytes
    }

    /// Every rank's outcome of a stage (0: ready; else the exit code it ends with), in rank
    /// order, so a rank that refused ends every rank at once instead of leaving them waiting
    /// in their first collective.
    pub fn settle(&mut self, outcome: u64) -> Vec<u64> {
        if !self.is_parallel() {
            return vec![outcome];
        }
        self.collective("starting together", |t| t.gather_u64(&[outcome]))
    }

    /// At a boundary: whether any rank asks to stop, and a check that every rank runs the same
    /// knobs (`fingerprint`), so a rank that changed alone fails here instead of hanging later.
    pub fn agree(&mut self, step: u64, stop: bool, fingerprint: u64) -> Result<bool, DistError> {
        if !self.is_parallel() {
            return Ok(stop);
        }
        // max(fingerprint) and max(!fingerprint) = !min(fingerprint): equal iff all agree.
        let mut v = [u64::from(stop), fingerprint, !fingerprint];
        self.between_steps("agreeing at the boundary", |t| t.max_u64(&mut v));
        if v[1] != !v[2] {
            return Err(DistError::Disagree {
                step,
                what: "the knobs in force",
            });
        }
        Ok(v[0] != 0)
    }

    /// Ends the window's counting: every rank's counters and peak, gathered (not counted: it is
    /// the workbench's telemetry, not training traffic).
    pub fn finish_window(&mut self, sync: SyncEvery, peak_bytes: u64) -> CommEvent {
        let mine = std::mem::take(&mut self.window);
        let ranks = self.ranks();
        let fields = [
            mine.sent_bytes,
            mine.received_bytes,
            (mine.comm_ms * 1e3) as u64,
            u64::from(mine.gradient_reduces),
            peak_bytes,
        ];
        let all = if self.is_parallel() {
            self.between_steps("gathering telemetry", |t| t.gather_u64(&fields))
        } else {
            fields.to_vec()
        };
        let per_rank = all
            .chunks(fields.len())
            .map(|c| RankComm {
                sent_bytes: c[0],
                received_bytes: c[1],
                comm_ms: c[2] as f64 / 1e3,
                gradient_reduces: c[3] as u32,
            })
            .collect();
        CommEvent {
            ranks,
            sync,
            per_rank,
            peak_bytes: all.chunks(fields.len()).map(|c| c[4]).collect(),
        }
    }
}

#[cfg(test)]
mod tests;
