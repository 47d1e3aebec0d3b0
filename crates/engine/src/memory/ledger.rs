//! The per-category memory ledger: what each optimizer step holds, at the peak of each phase.
//!
//! The trainer calls its measurement points inside a window (start and end of each forward and
//! backward, through the window's observer list) and `begin_window` / `optimizer_*` /
//! `finish_window` around it. For every phase the ledger keeps the micro-step whose measured peak
//! was highest, with the categories taken at that phase's end, and turns them into
//! `MemoryEvent`s once the step is done. docs/MEMORY.md defines the
//! categories; `other` is the measured figure minus the sum of the rest.

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use crate::model::ParamGrads;
use crate::telemetry::{Categories, MemoryEvent, MemorySource, Phase};
use crate::tensors::{activation_bytes, beside_bytes, grad_store_bytes, StorageSet};

/// Measures the total the categories are checked against, with a peak that restarts per phase.
pub trait TotalMeter: Send {
    /// Which meter it is, for the events.
    fn source(&self) -> MemorySource;
    /// True when host and device are one memory (CPU runs): offloaded bytes count towards it.
    fn unified(&self) -> bool;
    /// Bytes in use now.
    fn live(&self) -> u64;
    /// Highest `live` since the last `reset_peak`.
    fn peak(&self) -> u64;
    /// Start a new peak from the current use.
    fn reset_peak(&self);
}

/// The counting global allocator: every byte the process holds on the CPU.
pub(crate) struct AllocatorMeter;

impl TotalMeter for AllocatorMeter {
    fn source(&self) -> MemorySource {
        MemorySource::Allocator
    }
    fn unified(&self) -> bool {
        true
    }
    fn live(&self) -> u64 {
        super::alloc::live()
    }
    fn peak(&self) -> u64 {
        super::alloc::peak()
    }
    fn reset_peak(&self) {
        super::alloc::reset_peak()
    }
}

/// Categories taken at the end of a phase, with the measured figures of that phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Snapshot {
    categories: Categories,
    total: u64,
    peak: u64,
}

/// What persists across the window, set by the trainer before it starts.
#[derive(Clone, Copy, Debug, Default)]
pub struct Persistent {
    /// AdamW's moments on the device.
    pub optimizer_state: u64,
    /// What offload holds in host memory.
    pub offloaded: u64,
    /// The accumulation buffer is in host memory (offload with `train.offload_grads = "host"`):
    /// its bytes are booked as `offloaded`, not `gradients`.
    pub gradients_on_host: bool,
}

/// Measures every window: bytes per category at the start and end of each phase, each phase's peak, and the events that report them.
pub struct Ledger {
    meter: Box<dyn TotalMeter>,
    /// The model's f32 weights (`parameters`).
    params: Vec<Tensor>,
    /// The model's weights kept in half precision (offload in bf16/f16: the device holds only
    /// these): `compute_weights` for the whole step, not a forward's casts.
    resident_compute: Vec<Tensor>,
    /// Weights no step trains (LoRA's base): `frozen`.
    frozen: Vec<Tensor>,
    persistent: Persistent,
    /// The highest-peak snapshot of each phase in the current window.
    forward: Option<Snapshot>,
    backward: Option<Snapshot>,
    optimizer: Option<Snapshot>,
    pending: Vec<MemoryEvent>,
    /// Measured bytes when the current backward began.
    backward_start: u64,
    /// Categories of the current micro-step's forward, reused for its backward (same graph).
    micro: Categories,
    /// Activations walked in this window's first micro-step. Every micro-batch of a window has
    /// the same shape, so its graph holds the same bytes; later micro-steps reuse the figure.
    window_activations: Option<u64>,
    /// Of those, what ops keep beside the graph (`tensors::beside_bytes`), and what of it the
    /// backward frees as it runs (the logits the f32 head keeps): walked in the window's first
    /// micro-step too.
    window_beside: Option<u64>,
    window_freed: Option<u64>,
    /// Bytes of the last backward's gradient store (all ids, de-duplicated): the part of
    /// `gradients_transient` visible from outside Candle.
    pub last_store_bytes: u64,
}

impl Ledger {
    /// A ledger measuring totals with `meter`.
    pub fn new(meter: Box<dyn TotalMeter>) -> Ledger {
        Ledger {
            meter,
            params: Vec::new(),
            resident_compute: Vec::new(),
            frozen: Vec::new(),
            persistent: Persistent::default(),
            forward: None,
            backward: None,
            optimizer: None,
            pending: Vec::new(),
            backward_start: 0,
            micro: Categories::default(),
            window_activations: None,
            window_beside: None,
            window_freed: None,
            last_store_bytes: 0,
        }
    }

    /// Where its totals come from.
    pub fn source(&self) -> MemorySource {
        self.meter.source()
    }

    /// Whether host and device are one memory here.
    pub fn unified(&self) -> bool {
        self.meter.unified()
    }

    /// A window for optimizer step `step` (1-based) starts with these parameters, frozen weights
    /// and state.
    pub fn begin_window(
        &mut self,
        params: Vec<Tensor>,
        frozen: Vec<Tensor>,
        persistent: Persistent,
    ) {
        let (f32_weights, half) = params
            .into_iter()
            .partition(|t| t.dtype() == candle_core::DType::F32);
        self.params = f32_weights;
        self.resident_compute = half;
        self.frozen = frozen;
        self.persistent = persistent;
        self.window_activations = None;
        self.window_beside = None;
        self.window_freed = None;
        self.forward = None;
        self.backward = None;
        self.optimizer = None;
    }

    /// The optimizer phase starts; `buffer` is the accumulated gradient about to be applied.
    pub fn optimizer_start(&mut self, buffer: &[&Tensor]) {
        let mut seen = self.seen_params();
        let buffer = seen.add_all(buffer.iter().copied());
        let categories = self.with_buffer(
            Categories {
                parameters: self.param_bytes(),
                compute_weights: self.resident_compute_bytes(),
                ..self.persistent_categories()
            },
            buffer,
        );
        self.optimizer = Some(Snapshot {
            categories,
            total: self.meter.live(),
            peak: 0,
        });
        self.meter.reset_peak();
    }

    /// The optimizer step is done; `persistent` is the state it left (offload may have moved it).
    pub fn finish_window(&mut self, step: u64, persistent: Persistent) {
        let opt_peak = self.meter.peak();
        if let Some(s) = self.optimizer.as_mut() {
            s.peak = opt_peak;
        }
        self.persistent = persistent;
        let after = Snapshot {
            categories: Categories {
                parameters: self.param_bytes(),
                compute_weights: self.resident_compute_bytes(),
                ..self.persistent_categories()
            },
            total: self.meter.live(),
            peak: 0,
        };
        let phases = [
            (Phase::Forward, self.forward.take()),
            (Phase::Backward, self.backward.take()),
            (Phase::Optimizer, self.optimizer.take()),
        ];
        let step_peak = phases
            .iter()
            .filter_map(|(_, s)| s.map(|s| s.peak))
            .max()
            .unwrap_or(0)
            .max(after.total);
        for (phase, snap) in phases {
            if let Some(snap) = snap {
                self.push(step, phase, snap, snap.peak);
            }
        }
        self.push(step, Phase::Step, after, step_peak);
    }

    /// The peak over the window just finished (its step event's), before its events are taken.
    pub fn last_step_peak(&self) -> u64 {
        self.pending
            .iter()
            .rev()
            .find(|e| e.phase == Phase::Step)
            .map_or(0, |e| e.peak)
    }

    /// Events made since the last call.
    pub fn take_events(&mut self) -> Vec<MemoryEvent> {
        std::mem::take(&mut self.pending)
    }

    fn push(&mut self, step: u64, phase: Phase, snap: Snapshot, peak: u64) {
        let mut categories = snap.categories;
        // Phase events explain their peak; the step event explains what stays live after it.
        let measured = if phase == Phase::Step {
            snap.total
        } else {
            peak
        };
        let in_measured = if self.unified() {
            categories.sum()
        } else {
            categories.sum() - categories.offloaded
        };
        categories.other = measured.saturating_sub(in_measured);
        self.pending.push(MemoryEvent {
            step,
            phase,
            source: self.source(),
            categories,
            total: snap.total,
            peak,
            unified: self.unified(),
        });
    }

    fn persistent_categories(&self) -> Categories {
        Categories {
            optimizer_state: self.persistent.optimizer_state,
            offloaded: self.persistent.offloaded,
            frozen: StorageSet::default().add_all(&self.frozen),
            ..Categories::default()
        }
    }

    fn seen_params(&self) -> StorageSet {
        let mut seen = StorageSet::default();
        seen.add_all(&self.params);
        seen.add_all(&self.resident_compute);
        seen.add_all(&self.frozen);
        seen
    }

    fn param_bytes(&self) -> u64 {
        StorageSet::default().add_all(&self.params)
    }

    fn resident_compute_bytes(&self) -> u64 {
        StorageSet::default().add_all(&self.resident_compute)
    }

    /// `c` with the accumulation buffer's `bytes` booked where the buffer is: `gradients` on the
    /// device, `offloaded` in host memory.
    fn with_buffer(&self, c: Categories, bytes: u64) -> Categories {
        c.with_gradient_buffer(bytes, self.persistent.gradients_on_host)
    }

    /// Categories alive at the end of a forward: parameters, compute weights, the accumulation
    /// buffer and the activations the graph keeps for backward.
    fn forward_categories(
        &mut self,
        loss: &Tensor,
        compute_weights: &[Tensor],
        buffer: &[&Tensor],
    ) -> Categories {
        let mut seen = StorageSet::default();
        seen.add_all(&self.frozen);
        let parameters = seen.add_all(&self.params);
        let compute_weights = seen.add_all(&self.resident_compute) + seen.add_all(compute_weights);
        let buffer = seen.add_all(buffer.iter().copied());
        let activations = *self
            .window_activations
            .get_or_insert_with(|| activation_bytes(loss, &mut seen));
        self.window_beside.get_or_insert_with(|| beside_bytes(loss));
        let categories = Categories {
            parameters,
            compute_weights,
            activations,
            ..self.persistent_categories()
        };
        self.with_buffer(categories, buffer)
    }

    fn keep_highest(slot: &mut Option<Snapshot>, snap: Snapshot) {
        if slot.is_none_or(|s| snap.peak >= s.peak) {
            *slot = Some(snap);
        }
    }
}

/// The measurement points inside a window (the trainer's window observer calls them).
impl Ledger {
    /// A phase (forward or backward of one micro-batch) begins.
    pub fn start_phase(&mut self, phase: Phase) {
        self.meter.reset_peak();
        if phase == Phase::Backward {
            self.backward_start = self.meter.live();
        }
    }

    /// The forward of one micro-batch is done: `loss` roots the graph kept for backward.
    pub fn forward_done(&mut self, loss: &Tensor, compute_weights: &[Tensor], buffer: &[&Tensor]) {
        let peak = self.meter.peak();
        self.micro = self.forward_categories(loss, compute_weights, buffer);
        let snap = Snapshot {
            categories: self.micro,
            total: self.meter.live(),
            peak,
        };
        Self::keep_highest(&mut self.forward, snap);
    }

    /// The backward is done and its gradient store not yet folded into the buffer; `beside` are
    /// the parameter gradients it computed outside the graph (the store's share of them);
    /// activation checkpointing rebuilt a graph of `recomputed` bytes inside it; `loss` roots
    /// the graph, still alive.
    ///
    /// The graph and buffers are those of the forward; what backward adds is measured as its
    /// peak over the figure it started from (the store, the gradients in flight, and the
    /// upstream gradients Candle keeps referenced from f32 weight gradients until the store
    /// is dropped). It is at least the store, less what the backward freed of the activations
    /// (the logits the f32 head kept, freed after the head's backward).
    pub fn backward_done(
        &mut self,
        store: &GradStore,
        beside: &ParamGrads,
        recomputed: u64,
        loss: &Tensor,
    ) {
        let peak = self.meter.peak();
        let mut seen = StorageSet::default();
        self.last_store_bytes = grad_store_bytes(store, &mut seen) + beside.bytes(&mut seen);
        let added = peak.saturating_sub(self.backward_start);
        let kept = self.window_beside.unwrap_or(0);
        let freed = *self
            .window_freed
            .get_or_insert_with(|| kept.saturating_sub(beside_bytes(loss)));
        let floor = self.last_store_bytes.saturating_sub(freed);
        // A recomputed block's graph is activations held at the backward's peak, not gradients.
        let snap = Snapshot {
            categories: Categories {
                activations: self.micro.activations + recomputed,
                gradients_transient: added.saturating_sub(recomputed).max(floor),
                ..self.micro
            },
            total: self.meter.live(),
            peak,
        };
        Self::keep_highest(&mut self.backward, snap);
    }
}
