//! The engine: windows of K micro-batches, loss normalisation, loss scaling, clipping, AdamW.
//!
//! One optimizer step, top to bottom (`Trainer::train_step`, in `step.rs`):
//! 1. take the window's B·K samples (the data stream does not depend on how it is split);
//! 2. for each micro-batch: forward, token-sum loss × weight × loss scale, backward, fold into
//!    the accumulation buffer (`window.rs`; memory, timing and the noise scale are its observers);
//! 3. at the boundary (`boundary.rs`): unscale once → non-finite check → global L2 norm → clip →
//!    AdamW step (or skip on overflow) → loss-scaler update → clear the buffer;
//! 4. apply controls that arrived, so they take effect for the next window only (`run_loop.rs`).
//!
//! Under data parallel, the sums over ranks, ZeRO and the ranks' agreement are in
//! `parallel.rs`; the trainer's own thread and its handle in `thread.rs`. This file holds the
//! state and what reads it. The trainer knows nothing of terminals: it reads `ControlMsg`s and
//! writes `Event`s.

pub(crate) mod adamw;
pub(crate) mod adaptive;
mod boundary;
mod error;
pub(crate) mod failures;
pub(crate) mod inplace;
pub(crate) mod noise;
pub(crate) mod offload;
pub(crate) mod oom_guard;
mod parallel;
pub(crate) mod pool_governor;
mod run_loop;
pub(crate) mod scaler;
pub(crate) mod schedule;
mod step;
mod thread;
pub(crate) mod window;
pub(crate) mod zero;

use std::time::{SystemTime, UNIX_EPOCH};

use candle_core::{Device, Result, Tensor};

use crate::control::Knobs;
use crate::data::Corpus;
use crate::device::device_name;
use crate::end::EndReason;
use crate::memory::{Ledger, Persistent};
use crate::model::{Gpt, Param};
use crate::scenario::{Scenario, TimelineEntry};
use crate::telemetry::EventSink;
use crate::telemetry::{BuildInfo, Event, Header, FORMAT_VERSION};
pub use adamw::{AdamW, Hyper};
pub use boundary::global_norm;
pub use error::{OverBudget, TrainError, ZeroRefused};
pub use inplace::{relative_error, scale_in_place};
pub use noise::NoiseTracker;
pub use run_loop::{run, run_returning};
use scaler::LossScaler;
pub use thread::{spawn, spawn_trainer, TrainerHandle};
pub use window::{
    rank_window_gradients, window_gradients, window_gradients_observed, BackwardEnd, ForwardEnd,
    Interrupt, Share, WindowGrads, WindowObserver,
};

/// Work a caller adds after each optimizer step (saving a checkpoint). The trainer does not
/// know what it does, so the layers above it may add any.
pub trait AfterStep: Send {
    /// Called after every optimizer step; its events go to the event log. `Some` ends the run
    /// with that reason.
    fn after_step(&mut self, trainer: &Trainer, sink: &EventSink) -> Option<EndReason>;

    /// The run is ending with `reason`; the hook may do its last work (saving the model) and
    /// turn the reason into a failure (a run that saved nothing it tried to save).
    fn at_end(&mut self, _trainer: &Trainer, _sink: &EventSink, reason: EndReason) -> EndReason {
        reason
    }
}

/// A trainer's counters, as a checkpoint saves them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Optimizer steps taken, skipped ones included.
    pub step: u64,
    /// Steps the LR schedule has advanced.
    pub lr_step: u64,
    /// Index of the next training sample.
    pub cursor: u64,
    /// Steps skipped because their gradients were not finite.
    pub overflow_count: u64,
}

/// A saved run's state, as a checkpoint restores it (`Trainer::resume`).
pub struct Saved {
    /// One tensor per parameter, in parameter order.
    pub weights: Vec<Tensor>,
    /// AdamW's first moments, in parameter order.
    pub m: Vec<Tensor>,
    /// AdamW's second moments, in parameter order.
    pub v: Vec<Tensor>,
    /// AdamW's step count (its bias correction).
    pub adam_t: u64,
    /// The loss scaler as it was.
    pub scaler: LossScaler,
    /// The knobs in force when it was saved.
    pub knobs: Knobs,
    /// The counters.
    pub progress: Progress,
}

/// The training state of one run: model, optimizer, loss scaler, data stream, knobs in force,
/// counters and the observers of its windows. Its fields are private: the run loop, the guard,
/// checkpoints and tests act through its methods (below, and in `step.rs`, `boundary.rs`,
/// `parallel.rs`, `run_loop.rs`).
pub struct Trainer {
    scenario: Scenario,
    device: Device,
    model: Gpt,
    opt: AdamW,
    scaler: LossScaler,
    corpus: Corpus,
    knobs: Knobs,
    /// Optimizer steps taken, skipped ones included.
    step: u64,
    /// Steps the LR schedule has advanced (skipped steps do not advance it).
    lr_step: u64,
    /// Index of the next training sample.
    cursor: u64,
    overflow_count: u64,
    /// Bytes per category, per step and phase; its events leave with each step.
    memory: Ledger,
    /// Runs after every optimizer step; `--checkpoint-every` installs a saver
    /// (`checkpoint::Policy::after_step`).
    after_step: Vec<Box<dyn AfterStep>>,
    /// Controls given with `--control STEP:KIND=VALUE`: a timeline reported with origin `cli`.
    cli_controls: Vec<TimelineEntry>,
    /// Run the lean ops (CUDA's code path) even where the fused CPU kernels apply; from
    /// `GACCWB_KERNELS=lean` (see `ops::KERNELS_ENV`).
    lean: bool,
    /// Run the fused CPU ops on the trainer's thread alone in every step (`force_serial_ops`),
    /// whatever the pool governor would choose.
    serial: bool,
    /// The memory guard: budget, out-of-memory retries, changes queued for the boundary.
    guard: oom_guard::Guard,
    /// Smoothed gradient noise scale.
    noise: noise::NoiseTracker,
    /// The adaptive accumulation policy's memory.
    adaptive: adaptive::AdaptiveK,
    /// Whether the CPU's fused ops use the thread pool, window by window (`run` consults it).
    pool: pool_governor::PoolGovernor,
    /// Other processes' load on this process's CPUs, read for the governor between windows
    /// (from the trainer's start, so the first reading covers building the model).
    cpu_load: crate::ops::cpu_load::OthersLoad,
    /// Watch every window after the ledger (`observe_windows`; tests inject faults this way).
    window_observers: Vec<Box<dyn WindowObserver + Send>>,
    /// The data-parallel ranks this trainer is one of (alone by default; [`Trainer::join`]).
    group: crate::dist::Group,
    /// Under ZeRO (`train.zero` ≥ 1): this rank's block of the parameters, whose moments `opt`
    /// holds.
    zero: Option<zero::Shard>,
    /// Under ZeRO, every rank gathers the moments whole after each step that is a multiple of
    /// this (`--checkpoint-every`; 0: never), so rank 0's checkpoint holds them all.
    gather_every: u64,
    /// Those whole moments (`m`, `v`), from the step's end until its after-step hook has run.
    gathered: Option<(Vec<Tensor>, Vec<Tensor>)>,
    base_batch: usize,
    /// Said once the run starts, after its header ([`Trainer::announce`]).
    announcements: Vec<Event>,
}

impl Trainer {
    /// Build the model, optimizer and data stream for `scenario` on `device`, after checking that the scenario is valid and fits; with a budget, the guard plans the first split.
    pub fn new(mut scenario: Scenario, device: Device) -> std::result::Result<Trainer, TrainError> {
        let cpu_load = crate::ops::cpu_load::OthersLoad::start();
        let prepared = crate::model::hf::prepare(&mut scenario)?;
        scenario.validate()?;
        let arch = match &prepared {
            Some((_, spec)) => spec.arch.clone(),
            None => crate::hf::Arch::engine(&scenario.model),
        };
        failures::check_model_fits(&scenario, &arch, &device)?;
        let corpus = Corpus::open_sizing(&mut scenario)?;
        let available = crate::memory::gpu::device_total(&device)
            .map(|total| (total, if device.is_cpu() { "host" } else { "GPU" }));
        let mut model = crate::model::open(&scenario, &device, available, &mut |_, _| {})?;
        let t = &scenario.train;
        let hyper = Hyper {
            beta1: t.beta1,
            beta2: t.beta2,
            eps: t.eps,
            weight_decay: t.weight_decay,
        };
        let mut opt = AdamW::new(&model.params, hyper)?;
        opt.place(
            offload::Placement::of(&Knobs::from_scenario(&scenario)),
            &mut model,
        )?;
        let memory = Ledger::new(crate::memory::gpu::meter_for(&device));
        let lean = crate::ops::kernels_from_env()?;
        let pool_choice = pool_governor::choice_from_env()?;
        let budget = t
            .memory_budget
            .resolve(crate::memory::gpu::device_total(&device))?;
        let guard = oom_guard::Guard::new(budget, t.guard_retries);
        let mut trainer = Trainer {
            lean,
            serial: false,
            noise: noise::NoiseTracker::new(t.noise_ema),
            adaptive: adaptive::AdaptiveK::default(),
            pool: pool_governor::PoolGovernor::new(pool_choice),
            cpu_load,
            memory,
            knobs: Knobs::from_scenario(&scenario),
            scaler: LossScaler::new(t.loss_scale, t.scale_growth_interval),
            base_batch: scenario.base_batch(1),
            scenario,
            device,
            model,
            opt,
            corpus,
            step: 0,
            lr_step: 0,
            cursor: 0,
            overflow_count: 0,
            after_step: Vec::new(),
            cli_controls: Vec::new(),
            guard,
            window_observers: Vec::new(),
            group: crate::dist::Group::solo(),
            zero: None,
            gather_every: 0,
            gathered: None,
            announcements: Vec::new(),
        };
        let start = trainer.estimate_config(&trainer.knobs);
        trainer.guard.plan_start(&start, trainer.step)?;
        Ok(trainer)
    }

    /// Send `event` when the run starts, after its header: what the run was built with that
    /// the user did not ask for in so many words (a resumed run's kept LR schedule).
    pub(crate) fn announce(&mut self, event: Event) {
        self.announcements.push(event);
    }

    /// The model's parameters, in the order of the optimizer's state and of checkpoints.
    pub fn params(&self) -> &[Param] {
        &self.model.params
    }

    /// The scenario the run was built from (its knobs' first values; `knobs` has those in force).
    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    /// The device the model and its gradients live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The model being trained.
    pub fn model(&self) -> &Gpt {
        &self.model
    }

    /// The optimizer, with its moments (for checkpoints and tests).
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    /// The f16 loss scaler's state.
    pub fn scaler(&self) -> &LossScaler {
        &self.scaler
    }

    /// The data source the windows and the validation set are drawn from.
    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// The knobs in force for the next window.
    pub fn knobs(&self) -> &Knobs {
        &self.knobs
    }

    /// Optimizer steps taken, skipped ones included.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The data-parallel ranks this trainer is one of (W; 1 alone).
    pub fn ranks(&self) -> usize {
        self.group.ranks()
    }

    /// Steps the LR schedule has advanced (skipped steps do not advance it).
    pub fn lr_step(&self) -> u64 {
        self.lr_step
    }

    /// Index of the next training sample.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// Steps skipped because their gradients were not finite.
    pub fn overflow_count(&self) -> u64 {
        self.overflow_count
    }

    /// The memory ledger: what the windows measured so far.
    pub fn memory(&self) -> &Ledger {
        &self.memory
    }

    /// The memory events of the last step, taken once (the run loop sends them; tests read them).
    pub fn take_memory_events(&mut self) -> Vec<crate::telemetry::MemoryEvent> {
        self.memory.take_events()
    }

    /// Measure later windows with `meter` instead of the device's own (a test's fake meter).
    pub fn measure_with(&mut self, meter: Box<dyn crate::memory::TotalMeter>) {
        self.memory = Ledger::new(meter);
    }

    /// Run the lean ops (CUDA's code path) even where the fused CPU kernels apply, as
    /// `GACCWB_KERNELS=lean` does from the start.
    pub fn force_lean_ops(&mut self, on: bool) {
        self.lean = on;
    }

    /// Run the fused CPU ops on the trainer's thread alone, as `GACCWB_CPU_POOL=serial` does in
    /// a run, in every step `train_step` takes. The results are the same bits; what changes is
    /// that no pool worker packs beside the trainer's thread, so every allocation comes in one
    /// order (the memory tests measure on it against the estimate at `Config::threads` = 1).
    pub fn force_serial_ops(&mut self, on: bool) {
        self.serial = on;
    }

    /// The `--control STEP:KIND=VALUE` timeline, reported with origin `cli`.
    pub fn cli_controls(&self) -> &[TimelineEntry] {
        &self.cli_controls
    }

    /// Apply `entries` at their steps with origin `cli` (`--control`).
    pub fn set_cli_controls(&mut self, entries: Vec<TimelineEntry>) {
        self.cli_controls = entries;
    }

    /// Run `hook` after every optimizer step (`--checkpoint-every` installs a saver).
    pub fn add_after_step(&mut self, hook: Box<dyn AfterStep>) {
        self.after_step.push(hook);
    }

    /// The counters a checkpoint saves.
    pub fn progress(&self) -> Progress {
        Progress {
            step: self.step,
            lr_step: self.lr_step,
            cursor: self.cursor,
            overflow_count: self.overflow_count,
        }
    }

    /// Continue a saved run: its weights, optimizer moments (`m`, `v`, in parameter order, on
    /// any device), AdamW's step count, loss scaler, knobs and counters replace this trainer's.
    pub(crate) fn resume(&mut self, saved: Saved) -> Result<()> {
        // Load into the plain placement (f32 weights and state on the device, no host copies),
        // then place as the saved knobs say: host copies are taken from the loaded weights.
        let plain = Knobs {
            offload: false,
            dtype: crate::control::Dtype::F32,
            ..saved.knobs.clone()
        };
        self.place_state(&plain)?;
        for (p, w) in self.model.params.iter().zip(&saved.weights) {
            p.var.set(&w.to_device(p.var.device())?)?;
        }
        self.opt
            .load_moments(&self.model.params, saved.m, saved.v, saved.adam_t)?;
        self.place_state(&saved.knobs)?;
        self.scaler = saved.scaler;
        self.knobs = saved.knobs;
        let p = saved.progress;
        (self.step, self.lr_step) = (p.step, p.lr_step);
        (self.cursor, self.overflow_count) = (p.cursor, p.overflow_count);
        // The restored tensors were written on this thread's stream; the trainer's thread must
        // see them complete before its first kernel reads them.
        self.device.synchronize()
    }

    /// The recording's first line. Its scenario carries the knobs in force, which for a run
    /// resumed from a checkpoint are the checkpoint's, not its scenario's first values.
    pub fn header(&self) -> Header {
        let mut config = self.scenario.clone();
        self.knobs.write_into(&mut config.train);
        Header {
            version: FORMAT_VERSION,
            config,
            device: device_name(&self.device),
            build: BuildInfo::current(crate::ops::pool::cpu_threads()),
            params: self.model.param_count(),
            family: self
                .scenario
                .model
                .path
                .as_ref()
                .map(|_| self.model.spec.arch.family.clone()),
            entropy_floor: self.corpus.entropy_floor(),
            tokenizer: self.corpus.tokenizer().cloned(),
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            ranks: self.group.is_parallel().then(|| self.group.ranks()),
            collectives: self.group.is_parallel().then(|| self.group.collectives()),
            memory_budget_bytes: self.guard.budget(),
            unified_memory: Some(self.memory.unified()),
            writer: None,
        }
    }

    /// The estimator's configuration of this run's model under the knobs `k`: its
    /// architecture, this device's memory, the kernels it runs.
    pub fn estimate_config(&self, k: &Knobs) -> crate::memory::estimate::Config {
        let unified = self.memory.unified();
        let arch = &self.model.spec.arch;
        let mut cfg =
            crate::memory::estimate::Config::for_arch(arch, &self.scenario.model, k, unified)
                .with_lora(&self.scenario.train);
        cfg.fused = unified && !self.lean;
        cfg
    }

    /// The analytic memory estimate for the knobs in force.
    pub fn memory_estimate(&self) -> crate::memory::estimate::Estimate {
        let cfg = self.estimate_config(&self.knobs);
        crate::memory::estimate::per_rank(
            crate::memory::estimate::estimate(&cfg),
            self.group.ranks(),
            self.zero_stage(),
            self.scatters_micro_batches(),
        )
    }

    /// Optimizer state on the device, and what offload holds in host memory.
    pub fn persistent_memory(&self) -> Persistent {
        let moments = self.opt.moment_bytes();
        if self.opt.offloaded {
            Persistent {
                optimizer_state: 0,
                offloaded: moments + self.opt.master_bytes(),
                gradients_on_host: self.opt.grads_on_host,
            }
        } else {
            Persistent {
                optimizer_state: moments,
                offloaded: 0,
                gradients_on_host: false,
            }
        }
    }

    /// The f32 master weights, in parameter order (on the host while offloaded in half
    /// precision, else the model's weights).
    pub fn master_weights(&self) -> Vec<Tensor> {
        self.opt.master_weights(&self.model.params)
    }

    /// Put the weights and the optimizer state where `knobs` say (`offload`).
    fn place_state(&mut self, knobs: &Knobs) -> Result<()> {
        self.opt
            .place(offload::Placement::of(knobs), &mut self.model)
    }

    /// Watch every later window (called after the ledger, in the order added).
    pub fn observe_windows(&mut self, observer: Box<dyn WindowObserver + Send>) {
        self.window_observers.push(observer);
    }

    /// Whether the next window takes the fused CPU ops with more than one thread to share them.
    pub fn runs_fused_cpu_in_parallel(&self) -> bool {
        self.device.is_cpu() && !self.lean && crate::ops::pool::cpu_threads() > 1
    }
}
