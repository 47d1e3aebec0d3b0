//! The engine: windows of K micro-batches, loss normalisation, loss scaling, clipping, AdamW.
//!
//! One optimizer step, top to bottom (`Trainer::train_step`):
//! 1. take the window's B·K samples (the data stream does not depend on how it is split);
//! 2. for each micro-batch: forward, token-sum loss × weight × loss scale, backward, fold into
//!    the accumulation buffer ([`window`]; memory, timing and the noise scale are its observers);
//! 3. at the boundary: unscale once → non-finite check → global L2 norm → clip → AdamW step (or
//!    skip on overflow) → loss-scaler update → clear the buffer;
//! 4. apply controls that arrived, so they take effect for the next window only.
//!
//! The trainer knows nothing of terminals: it reads `ControlMsg`s and writes `Event`s.

pub mod adamw;
pub mod adaptive;
pub mod failures;
pub mod inplace;
pub mod noise;
pub mod offload;
pub mod oom_guard;
pub mod pool_governor;
pub mod scaler;
pub mod schedule;
pub mod window;
pub mod zero;

use std::ops::ControlFlow;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use candle_core::{Device, Result, Tensor};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::data::{Batch, Corpus, Sample, Split};
use crate::device::device_name;
use crate::memory::{Ledger, Persistent};
use crate::model::{Gpt, Param};
use crate::scenario::{Scenario, TimelineEntry};
use crate::telemetry::{
    BuildInfo, Control, ControlEvent, ControlMsg, EndEvent, EndReason, EvalEvent, Event, Header,
    Origin, PhaseMs, StepEvent, FORMAT_VERSION,
};
pub use crate::telemetry::{EventSink, Knobs};
use adamw::{AdamW, Hyper};
use scaler::LossScaler;
pub use window::{
    rank_window_gradients, window_gradients, window_gradients_observed, Interrupt, Share,
    WindowGrads, WindowObserver,
};

/// Global L2 norm over a set of tensors, in f64 on the host.
pub fn global_norm(tensors: &[Tensor]) -> Result<f64> {
    let mut sum = 0f64;
    // Per-tensor sums of squares left on the device, read back together: one host sync.
    let mut on_device = Vec::new();
    for t in tensors {
        if crate::ops::fused_domain(&[t]) {
            sum += crate::ops::fused::sum_squares(t)?;
            continue;
        }
        on_device.push(t.sqr()?.sum_all()?.to_dtype(candle_core::DType::F32)?);
    }
    if !on_device.is_empty() {
        let sums = Tensor::stack(&on_device, 0)?.to_vec1::<f32>()?;
        sum += sums.iter().map(|&s| f64::from(s)).sum::<f64>();
    }
    Ok(sum.sqrt())
}

/// Relative L2 error of `a` against `reference`.
pub fn relative_error(a: &[Tensor], reference: &[Tensor]) -> Result<f64> {
    inplace::relative_error(a, reference)
}

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

/// A saved run's state, for [`Trainer::resume`].
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

/// What the step event takes from a finished window (every rank's, under data parallel).
struct WindowSummary {
    loss: f64,
    tokens: u64,
    forward_ms: f64,
    backward_ms: f64,
    /// Gradient bytes the window sent to the host (offload with host accumulation).
    transferred: u64,
}

impl WindowSummary {
    fn of(w: &WindowGrads, tokens: u64) -> WindowSummary {
        WindowSummary {
            loss: w.loss,
            tokens,
            transferred: w.transferred,
            forward_ms: w.forward_ms,
            backward_ms: w.backward_ms,
        }
    }
}

/// What the boundary did.
struct Update {
    grad_norm: f64,
    grad_norm_clipped: f64,
    lr: f64,
    skipped: bool,
    grad_error: Option<f64>,
    /// Bytes the update moved between host and device (`AdamW::step`).
    transferred: u64,
}

/// The step's times, taken once the boundary's work has finished on the device.
struct StepTiming {
    optimizer_ms: f64,
    step_ms: f64,
}

fn run_after_step(trainer: &mut Trainer, sink: &EventSink) -> Option<EndReason> {
    let mut hooks = std::mem::take(&mut trainer.after_step);
    let end = hooks
        .iter_mut()
        .find_map(|hook| hook.after_step(trainer, sink));
    trainer.after_step = hooks;
    end
}

/// The training state of one run: model, optimizer, loss scaler, data stream, knobs in force,
/// counters and the observers of its windows. Its fields are private: the run loop, the guard,
/// checkpoints and tests act through the methods below.
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
    pub fn new(mut scenario: Scenario, device: Device) -> anyhow::Result<Trainer> {
        let cpu_load = crate::ops::cpu_load::OthersLoad::start();
        let prepared = crate::model::hf::prepare(&mut scenario)?;
        scenario.validate().map_err(anyhow::Error::msg)?;
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
    pub fn announce(&mut self, event: Event) {
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
    pub fn resume(&mut self, saved: Saved) -> Result<()> {
        // Load into the plain placement (f32 weights and state on the device, no host copies),
        // then place as the saved knobs say: host copies are taken from the loaded weights.
        let plain = Knobs {
            offload: false,
            dtype: crate::telemetry::Dtype::F32,
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

    /// Train as one rank of `group` (data parallel): every rank must join a trainer built from
    /// the same scenario, before the first step.
    pub fn join(&mut self, group: crate::dist::Group) -> anyhow::Result<()> {
        self.base_batch = self.scenario.base_batch(group.ranks());
        self.group = group;
        if self.knobs.zero > 0 {
            // From the whole moments a fresh model or a checkpoint holds: this rank's pieces.
            self.set_zero(self.knobs.zero, self.knobs.zero2_accumulate)?;
        }
        Ok(())
    }

    /// Move to ZeRO stage `stage` with ZeRO-2 accumulating as `accumulate`, at a boundary: the
    /// moments keep their values, cut into this rank's pieces (from stage 0) or gathered whole
    /// again (to stage 0).
    pub fn set_zero(
        &mut self,
        stage: u8,
        accumulate: crate::dist::Zero2Accumulate,
    ) -> anyhow::Result<()> {
        let refuse = |why: &str| anyhow::anyhow!("train.zero = {stage}: {why}");
        if stage > 2 {
            return Err(refuse("stages are 0, 1 and 2"));
        }
        if stage > 0 && self.knobs.offload {
            return Err(refuse(
                "ZeRO shards the optimizer state instead of offloading it; set train.offload = false",
            ));
        }
        if stage == 2 && self.pitfall_on() {
            return Err(refuse(
                "stage 2 shards the gradient, but a pitfall's error needs the whole reference \
                 gradient; measure pitfalls at train.zero = 0 or 1",
            ));
        }
        let scatters = accumulate == crate::dist::Zero2Accumulate::ReduceScatter;
        if stage == 2 && scatters && self.knobs.noise {
            return Err(refuse(
                "with zero2_accumulate = \"reduce-scatter\" no rank holds its whole window \
                 gradient, which the noise scale measures; set train.noise = false",
            ));
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
        self.knobs.zero = stage;
        self.knobs.zero2_accumulate = accumulate;
        Ok(())
    }

    /// Under ZeRO: offload is refused (the moments are sharded instead), and under stage 2 a
    /// pitfall (its reference gradient is whole).
    fn check_under_zero(&self, c: &Control) -> anyhow::Result<()> {
        let stage = self.zero_stage();
        let refused = match c {
            Control::SetOffload { value: true } => stage > 0,
            Control::SetLossNorm { value } => {
                stage == 2 && *value != crate::telemetry::LossNorm::Tokens
            }
            Control::SetZeroGrad { value } => {
                stage == 2 && *value != crate::telemetry::ZeroGrad::PerWindow
            }
            _ => false,
        };
        if refused {
            anyhow::bail!("not under train.zero = {stage}: {}", c.describe());
        }
        Ok(())
    }

    /// Whether a pitfall (loss normalisation, zero-grad, cross-rank mean) is switched on.
    fn pitfall_on(&self) -> bool {
        self.knobs.loss_norm != crate::telemetry::LossNorm::Tokens
            || self.knobs.zero_grad != crate::telemetry::ZeroGrad::PerWindow
            || self.scenario.train.rank_loss_norm != crate::dist::RankLossNorm::Tokens
    }

    /// The ZeRO stage in force (0 without sharding).
    fn zero_stage(&self) -> u8 {
        if self.zero.is_some() {
            self.knobs.zero
        } else {
            0
        }
    }

    /// Whether ZeRO-2 reduce-scatters every micro-batch's gradients.
    fn scatters_micro_batches(&self) -> bool {
        self.zero_stage() == 2
            && self.knobs.zero2_accumulate == crate::dist::Zero2Accumulate::ReduceScatter
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
    fn gather_if_due(&mut self) -> Result<()> {
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
    pub fn place_state(&mut self, knobs: &Knobs) -> Result<()> {
        self.opt
            .place(offload::Placement::of(knobs), &mut self.model)
    }

    /// The loss scale in force: only f16 scales.
    pub fn loss_scale(&self) -> f64 {
        if self.knobs.dtype.needs_loss_scaling() {
            self.scaler.scale
        } else {
            1.0
        }
    }

    /// Why the run must end, once f16 gradients keep overflowing at the loss-scale floor.
    pub fn overflow_exhausted(&self) -> Option<EndReason> {
        (self.knobs.dtype.needs_loss_scaling() && self.scaler.exhausted())
            .then(|| EndReason::LossScaleExhausted(self.scaler.exhausted_reason()))
    }

    /// Learning rate for the next step: schedule × LR rule for the current effective batch.
    ///
    /// The schedule's clock is `lr_step`, the applied steps: a skipped (overflowed) step changed
    /// no weight, so it spends no schedule. Warm-up and the decay horizon (`decay_steps`, else
    /// `steps`) are counted in applied steps too, so a run of `steps` optimizer steps with s
    /// skipped ends s applied steps short of the horizon, its last LR a little above the floor.
    /// (PyTorch gives the same when `scheduler.step()` follows only the steps `GradScaler` took.)
    pub fn lr(&self) -> f64 {
        let t = &self.scenario.train;
        let decay_steps = if t.decay_steps > 0 {
            t.decay_steps
        } else {
            t.steps
        };
        self.knobs.lr
            * schedule::schedule(self.lr_step, t.warmup, decay_steps, t.min_lr_ratio)
            * self
                .knobs
                .lr_rule
                .factor(self.global_batch(), self.base_batch)
    }

    /// This rank's samples of the next window; advances the data cursor past every rank's.
    /// Rank r trains samples `[r·K·B, (r+1)·K·B)` of the window's W·K·B, so W ranks at K see
    /// the samples one process at W·K sees.
    pub fn next_window(&mut self) -> Vec<Sample> {
        let n = self.knobs.effective_batch() as u64;
        let start = self.cursor + self.group.rank() as u64 * n;
        let samples = (start..start + n)
            .map(|i| self.corpus.sample(Split::Train, i))
            .collect();
        self.cursor += self.global_batch() as u64;
        samples
    }

    /// One optimizer step: the window's gradients, then the update at the boundary. `between`
    /// runs before each micro-batch; returning false abandons the window (the data cursor is
    /// rewound, nothing is applied).
    pub fn train_step(
        &mut self,
        mut between: impl FnMut() -> bool,
    ) -> std::result::Result<StepEvent, Interrupt> {
        let _kernels = crate::ops::force_lean(self.lean);
        let started = Instant::now();
        if self.device.is_cpu() {
            crate::ops::workspace::reserve();
        }
        let scale = self.loss_scale();
        let (mut window, window_tokens) = self.window_with_retries(scale, &mut between)?;
        self.sum_over_ranks(&mut window)?;
        self.pool_noise_over_ranks(&mut window, scale)?;
        let optimizer_started = Instant::now();
        self.memory.optimizer_start(&window.buffer());
        let norms = window.noise.take();
        let summary = WindowSummary::of(&window, window_tokens);
        let update = self.apply_window(window, scale)?;
        self.device.synchronize()?;
        let noise = self.noise.observe(norms.as_ref(), update.skipped);
        self.memory
            .finish_window(self.step, self.persistent_memory());
        // Inside the step's time, as its bytes and collective time are.
        self.gather_if_due()?;
        let timing = StepTiming {
            optimizer_ms: optimizer_started.elapsed().as_secs_f64() * 1e3,
            step_ms: started.elapsed().as_secs_f64() * 1e3,
        };
        let comm = self.group.is_parallel().then(|| {
            let sync = self.knobs.sync;
            self.group.finish_window(sync, self.memory.last_step_peak())
        });
        Ok(self.step_event(summary, update, timing, scale, noise, comm))
    }

    /// Under data parallel, the window's sums over the ranks: the gradients (unless every
    /// micro-batch's already were), the pitfall's reference, and the loss. Every rank then
    /// holds the same buffer and takes the same step.
    fn sum_over_ranks(&mut self, window: &mut WindowGrads) -> Result<()> {
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
        if self.zero_stage() < 2 && self.knobs.sync == crate::dist::SyncEvery::Window {
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
    fn pool_noise_over_ranks(&mut self, window: &mut WindowGrads, scale: f64) -> Result<()> {
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
    fn knobs_fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        serde_json::to_string(&self.knobs)
            .unwrap_or_default()
            .hash(&mut h);
        h.finish()
    }

    /// The window's gradients, and its counted tokens (every rank's). A window that runs out of
    /// memory is retried from the same cursor at a smaller micro-batch (`oom_guard`); its partial
    /// gradients are dropped with the failed attempt. Under data parallel a failure ends the
    /// run: one rank cannot retry alone while the others wait in a collective.
    fn window_with_retries(
        &mut self,
        scale: f64,
        between: &mut impl FnMut() -> bool,
    ) -> std::result::Result<(WindowGrads, u64), Interrupt> {
        let cursor = self.cursor;
        let mut failures_at_one = 0;
        loop {
            let samples = self.next_window();
            let params = self.model.vars().map(|v| v.as_tensor().clone()).collect();
            let frozen = self.model.frozen.iter().map(|p| p.var.as_tensor().clone());
            self.memory
                .begin_window(params, frozen.collect(), self.persistent_memory());
            match self.window_attempt(&samples, scale, &mut *between) {
                Ok(w) => return Ok(w),
                Err(e) if self.group.is_parallel() => return Err(e),
                Err(e) => {
                    self.cursor = cursor;
                    let after =
                        self.guard
                            .after_failure(&self.knobs, self.step, e, &mut failures_at_one);
                    match after {
                        oom_guard::AfterFailure::Retry(now) => self.apply_at_once(&now),
                        oom_guard::AfterFailure::GiveUp(e) => return Err(e),
                    }
                }
            }
        }
    }

    /// Knob changes that cannot wait for the boundary: the guard's smaller split for the retry
    /// of a window that ran out of memory (already checked by the guard, announced by it).
    fn apply_at_once(&mut self, controls: &[Control]) {
        for c in controls {
            self.knobs.apply(c);
        }
    }

    /// One attempt at the window's gradients, watched by the ledger and the observers added
    /// with [`Trainer::observe_windows`].
    fn window_attempt(
        &mut self,
        samples: &[Sample],
        scale: f64,
        between: impl FnMut() -> bool,
    ) -> std::result::Result<(WindowGrads, u64), Interrupt> {
        let step = self.step + 1;
        for o in &mut self.window_observers {
            o.window_start(step)?;
        }
        let rank_tokens = Share::tokens_of(samples);
        let window_tokens = self.group.sum_tokens(rank_tokens);
        let scatter = self.zero.as_ref().filter(|_| self.scatters_micro_batches());
        let mut share = Share {
            window_tokens,
            rank_tokens,
            rank_loss_norm: self.scenario.train.rank_loss_norm,
            sync: self.knobs.sync,
            scatter,
            group: &mut self.group,
        };
        let mut observers: Vec<&mut dyn WindowObserver> = vec![&mut self.memory];
        for o in &mut self.window_observers {
            observers.push(o.as_mut());
        }
        let window = rank_window_gradients(
            &self.model,
            samples,
            &self.knobs,
            scale,
            &self.device,
            between,
            &mut observers,
            &mut share,
        )?;
        Ok((window, window_tokens))
    }

    /// Watch every later window (called after the ledger, in the order added).
    pub fn observe_windows(&mut self, observer: Box<dyn WindowObserver + Send>) {
        self.window_observers.push(observer);
    }

    /// Whether the next window takes the fused CPU ops with more than one thread to share them.
    pub fn runs_fused_cpu_in_parallel(&self) -> bool {
        self.device.is_cpu() && !self.lean && crate::ops::pool::cpu_threads() > 1
    }

    /// The boundary: unscale → non-finite check → norm → clip → step or skip → scaler update.
    fn apply_window(&mut self, w: WindowGrads, scale: f64) -> Result<Update> {
        let mut grads = w.grads;
        // The pitfall's error is a ratio, the same before unscaling (one factor on both
        // buffers), so the reference is never unscaled and is freed before the step.
        let grad_error = match w.reference {
            Some(r) => Some(relative_error(&grads, &r)?),
            None => None,
        };
        if scale != 1.0 {
            inplace::scale_in_place(&mut grads, 1.0 / scale)?;
        }
        let grad_norm = self.grad_norm(&grads)?;
        let finite = grad_norm.is_finite();
        let lr = self.lr();
        let mut grad_norm_clipped = grad_norm;
        let mut transferred = 0;
        if finite {
            match self.knobs.clip {
                Some(max) if grad_norm > max => {
                    inplace::scale_in_place(&mut grads, max / grad_norm)?;
                    grad_norm_clipped = self.grad_norm(&grads)?;
                }
                _ => {}
            }
            transferred = self.optimizer_step(&grads, lr)?;
            self.lr_step += 1;
        } else {
            self.overflow_count += 1;
        }
        if self.knobs.dtype.needs_loss_scaling() {
            self.scaler.update(finite);
        }
        self.step += 1;
        Ok(Update {
            grad_norm,
            grad_norm_clipped,
            lr,
            skipped: !finite,
            grad_error: grad_error.filter(|_| finite),
            transferred,
        })
    }

    /// The global L2 norm of the window's gradient: under ZeRO-2 each rank holds its pieces, so
    /// their squares are summed over the ranks.
    fn grad_norm(&mut self, grads: &[Tensor]) -> Result<f64> {
        let norm = global_norm(grads)?;
        if self.zero_stage() != 2 || !self.group.is_parallel() {
            return Ok(norm);
        }
        let mut squares = [norm * norm];
        self.group.sum_scalars(&mut squares);
        Ok(squares[0].sqrt())
    }

    /// AdamW on every parameter, or under ZeRO on this rank's pieces, then the all-gather.
    /// Returns the bytes that crossed between host and device (offload, `AdamW::step`).
    fn optimizer_step(&mut self, grads: &[Tensor], lr: f64) -> Result<u64> {
        let Some(shard) = &self.zero else {
            return self.opt.step(&self.model.params, grads, lr);
        };
        let pieces = match self.knobs.zero {
            2 => grads.to_vec(),
            _ => shard.pieces_of(grads)?,
        };
        zero::step(
            &mut self.opt,
            shard,
            &self.model.params,
            &pieces,
            lr,
            &mut self.group,
        )?;
        // ZeRO runs without offload: no model state crosses between host and device.
        Ok(0)
    }

    /// The step's event, built once from what the window and the boundary returned.
    fn step_event(
        &self,
        window: WindowSummary,
        update: Update,
        timing: StepTiming,
        loss_scale: f64,
        noise: Option<crate::telemetry::NoiseEvent>,
        comm: Option<crate::dist::CommEvent>,
    ) -> StepEvent {
        StepEvent {
            step: self.step,
            loss: window.loss,
            grad_norm: update.grad_norm,
            grad_norm_clipped: update.grad_norm_clipped,
            lr: update.lr,
            accum_steps: self.knobs.accum_steps,
            micro_batch: self.knobs.micro_batch,
            tokens: window.tokens,
            tokens_per_s: window.tokens as f64 / (timing.step_ms / 1e3),
            step_ms: timing.step_ms,
            cpu_threads: self
                .runs_fused_cpu_in_parallel()
                .then(crate::ops::pool::threads),
            skipped: update.skipped,
            loss_scale,
            overflow_count: self.overflow_count,
            dtype: self.knobs.dtype,
            offload: self.knobs.offload,
            host_device_bytes: window.transferred + update.transferred,
            clip: self.knobs.clip,
            phase_ms: PhaseMs {
                forward: window.forward_ms,
                backward: window.backward_ms,
                optimizer: timing.optimizer_ms,
            },
            grad_error: update.grad_error,
            noise,
            comm,
        }
    }

    /// Apply a knob change now (the caller makes sure "now" is a window boundary).
    pub fn apply_control(&mut self, c: &Control) -> anyhow::Result<()> {
        self.check_under_zero(c)?;
        crate::scenario::validate_control(c).map_err(anyhow::Error::msg)?;
        crate::scenario::check_needs(c, self.knobs.noise).map_err(anyhow::Error::msg)?;
        failures::check_knob_change(self, c)?;
        match *c {
            Control::SetOffload { .. } | Control::SetDtype { .. } => {
                let mut next = self.knobs.clone();
                next.apply(c);
                self.place_state(&next)?;
            }
            Control::SetLossScale { value } => self.scaler.force(value),
            Control::SetZero { value } => self.set_zero(value, self.knobs.zero2_accumulate)?,
            Control::SetZero2Accumulate { value } => self.set_zero(self.knobs.zero, value)?,
            _ => {}
        }
        self.knobs.apply(c);
        Ok(())
    }

    /// The adaptive policy's change after this window, if it asks for one: it chooses B·K, and
    /// the split keeps the guard's micro-batch (or the largest divisor of the new B·K below it).
    pub fn policy_control(&mut self, step: &StepEvent) -> Vec<ControlMsg> {
        let t = &self.scenario.train;
        let limits = adaptive::Limits {
            min: t.accum_min,
            max: t.accum_max,
            patience: t.accum_patience,
        };
        let reference = self.guard.reference_micro_batch(self.knobs.micro_batch);
        let ranks = self.group.ranks();
        let Some(k) = self
            .adaptive
            .decide(self.knobs.accum_policy, limits, step, reference, ranks)
        else {
            return Vec::new();
        };
        let (b, k) = oom_guard::split(reference * k, self.knobs.micro_batch);
        let mut controls = Vec::new();
        if b != self.knobs.micro_batch {
            controls.push(Control::SetMicroBatch { value: b });
        }
        controls.push(Control::SetAccumSteps { value: k });
        controls
            .into_iter()
            .map(|control| ControlMsg {
                control,
                origin: Origin::Policy,
            })
            .collect()
    }

    /// Mean validation loss per counted token over a fixed set of validation samples
    /// (`eval_samples`), run in micro-batches of the B in force.
    pub fn evaluate(&self) -> Result<f64> {
        let _kernels = crate::ops::force_lean(self.lean);
        let indices: Vec<u64> = self.eval_samples().collect();
        let (mut sum, mut tokens) = (0f64, 0u64);
        for chunk in indices.chunks(self.knobs.micro_batch.max(1)) {
            let samples: Vec<Sample> = chunk
                .iter()
                .map(|&i| self.corpus.sample(Split::Val, i))
                .collect();
            let batch = Batch::new(&samples, &self.device)?;
            let fwd = self
                .model
                .forward(&batch.inputs, self.knobs.dtype.candle(), false)?;
            sum += f64::from(
                fwd.nll_sum(&batch.targets, &batch.mask)?
                    .to_scalar::<f32>()?,
            );
            tokens += batch.tokens;
        }
        Ok(sum / tokens.max(1) as f64)
    }

    /// The validation samples: `eval_batches` × the run's starting micro-batch, fixed for the
    /// whole run, so a change of B or K never changes what the validation curve measures.
    pub fn eval_samples(&self) -> std::ops::Range<u64> {
        let t = &self.scenario.train;
        0..(t.eval_batches * t.micro_batch) as u64
    }
}

/// A trainer running on its own thread.
pub struct TrainerHandle {
    /// Controls for the trainer; they act at the next window boundary (Stop between micro-batches).
    pub controls: UnboundedSender<ControlMsg>,
    /// Everything the trainer reports, in order.
    pub events: UnboundedReceiver<Event>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TrainerHandle {
    /// Send `control` with `origin`; a trainer that has ended ignores it.
    pub fn send(&self, control: Control, origin: Origin) {
        let _ = self.controls.send(ControlMsg { control, origin });
    }

    /// Ask the trainer to stop and wait for its thread.
    pub fn stop(&mut self) {
        self.send(Control::Stop, Origin::Key);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TrainerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Build the trainer here (so bad input fails before any thread starts), then run it on its
/// own thread. Returns its handle and a sender into the same event stream for other producers
/// (the device sampler).
pub fn spawn(scenario: Scenario, device: Device) -> anyhow::Result<(TrainerHandle, EventSink)> {
    spawn_trainer(Trainer::new(scenario, device)?)
}

/// `spawn` for a trainer built (or resumed from a checkpoint) by the caller.
pub fn spawn_trainer(trainer: Trainer) -> anyhow::Result<(TrainerHandle, EventSink)> {
    // The model and optimizer state were created on this thread; the trainer's thread must
    // find them complete (on CUDA, work queued here may still be in flight).
    trainer
        .device
        .synchronize()
        .context("synchronizing the device before the trainer thread starts")?;
    let (ctx, crx) = unbounded_channel();
    let (etx, erx) = unbounded_channel();
    let sink = EventSink::new(etx);
    let thread_sink = sink.clone();
    let thread = std::thread::Builder::new()
        .name("gaccwb-trainer".into())
        .spawn(move || failures::run_catching_panics(trainer, crx, thread_sink))
        .context("starting the trainer thread")?;
    Ok((
        TrainerHandle {
            controls: ctx,
            events: erx,
            thread: Some(thread),
        },
        sink,
    ))
}

/// The trainer thread: header, then steps until done, stopped or failed, then `end`.
pub fn run(trainer: Trainer, controls: UnboundedReceiver<ControlMsg>, sink: EventSink) {
    run_returning(trainer, controls, sink);
}

/// `run`, handing the trainer back at the end (tests compare its weights).
pub fn run_returning(
    mut trainer: Trainer,
    mut controls: UnboundedReceiver<ControlMsg>,
    sink: EventSink,
) -> Trainer {
    let mut flow = Flow {
        paused: false,
        single_step: false,
        stop: false,
        pending: Vec::new(),
        timeline_done: None,
    };
    sink.send(Event::Header(trainer.header()));
    if let Some(line) = trainer.corpus.provenance() {
        sink.send(Event::info(0, line));
    }
    send_estimate(&trainer, &sink);
    let mut divergence = failures::Divergence::new(trainer.scenario.train.max_nonfinite_windows);
    send_all(&sink, trainer.guard.take_announcements());
    send_all(&sink, std::mem::take(&mut trainer.announcements));
    let reason = loop {
        match boundary(&mut trainer, &mut flow, &mut controls, &sink) {
            ControlFlow::Break(end) => break end,
            ControlFlow::Continue(Next::Wait) => continue,
            ControlFlow::Continue(Next::Step) => flow.single_step = false,
        }
        let serial = choose_pool(&mut trainer, &sink);
        let step = match window_step(&mut trainer, &mut flow, &mut controls, serial, &sink) {
            ControlFlow::Continue(step) => step,
            ControlFlow::Break(end) => break end,
        };
        let after = after_window(
            &mut trainer,
            &mut flow,
            &mut divergence,
            serial,
            step,
            &sink,
        );
        if let ControlFlow::Break(end) = after {
            break end;
        }
    };
    let reason = finish(&mut trainer, reason, &divergence, &sink);
    if reason.is_failure() {
        failures::send_error(&sink, trainer.step, &reason.to_string());
    }
    sink.send(Event::End(EndEvent {
        step: trainer.step,
        reason,
    }));
    trainer
}

/// What the run does after a boundary that did not end it.
enum Next {
    /// Train the next window.
    Step,
    /// Paused: a control arrived; visit the boundary again to apply it.
    Wait,
}

/// At a window boundary: take the controls that arrived, apply what is due, and end the run when
/// asked or done. A paused run waits here for the next control.
fn boundary(
    trainer: &mut Trainer,
    flow: &mut Flow,
    controls: &mut UnboundedReceiver<ControlMsg>,
    sink: &EventSink,
) -> ControlFlow<EndReason, Next> {
    flow.drain(controls);
    if let Err(e) = share_pending(trainer, flow, sink) {
        return ControlFlow::Break(EndReason::Error(e.to_string()));
    }
    apply_due(trainer, flow, sink);
    if trainer.group.is_parallel() {
        let fingerprint = trainer.knobs_fingerprint();
        match trainer.group.agree(trainer.step, flow.stop, fingerprint) {
            Ok(stop) => flow.stop = stop,
            Err(e) => return ControlFlow::Break(EndReason::Error(e.to_string())),
        }
    }
    let total = trainer.scenario.train.steps;
    if flow.stop {
        return ControlFlow::Break(EndReason::Stopped);
    }
    if total > 0 && trainer.step >= total {
        return ControlFlow::Break(EndReason::Completed);
    }
    if flow.paused && !flow.single_step {
        return match controls.blocking_recv() {
            Some(msg) => {
                flow.pending.push(msg);
                ControlFlow::Continue(Next::Wait)
            }
            None => ControlFlow::Break(EndReason::Stopped),
        };
    }
    ControlFlow::Continue(Next::Step)
}

/// One optimizer step on the chosen side of the CPU pool; a stop between micro-batches or a
/// failed window ends the run.
fn window_step(
    trainer: &mut Trainer,
    flow: &mut Flow,
    controls: &mut UnboundedReceiver<ControlMsg>,
    serial: bool,
    sink: &EventSink,
) -> ControlFlow<EndReason, StepEvent> {
    // Ranks stop together, at a boundary (`boundary` agrees on it): one rank leaving a window
    // would leave the others waiting in its collectives.
    let alone = !trainer.group.is_parallel();
    let step = {
        let _pool = crate::ops::pool::serial(serial);
        trainer.train_step(|| {
            flow.drain(controls);
            !(flow.stop && alone)
        })
    };
    send_all(sink, trainer.guard.take_announcements());
    match step {
        Ok(step) => ControlFlow::Continue(step),
        Err(Interrupt::Stop) => ControlFlow::Break(EndReason::Stopped),
        Err(Interrupt::Failed(e)) => ControlFlow::Break(EndReason::Error(e.to_string())),
    }
}

/// Everything after a window's optimizer step: its events, the guard and the policy, the
/// after-step hook, evaluation, and whether the run must end.
fn after_window(
    trainer: &mut Trainer,
    flow: &mut Flow,
    divergence: &mut failures::Divergence,
    serial: bool,
    step: StepEvent,
    sink: &EventSink,
) -> ControlFlow<EndReason> {
    let n = step.step;
    let positions = step.micro_batch * step.accum_steps * trainer.scenario.model.seq_len;
    if let Some(line) = trainer.pool.observe(serial, step.step_ms, positions as u64) {
        sink.send(Event::info(n, line));
    }
    let diverged = divergence.observe(&step);
    flow.pending.extend(trainer.policy_control(&step));
    if !sink.send(Event::Step(step)) {
        if !trainer.group.is_parallel() {
            return ControlFlow::Break(EndReason::Stopped);
        }
        flow.stop = true;
    }
    let memory = trainer.memory.take_events();
    let guard_log = trainer
        .guard
        .after_step(&trainer.knobs, trainer.step, &memory);
    send_all(sink, memory.into_iter().map(Event::Memory).chain(guard_log));
    let hook_end = run_after_step(trainer, sink);
    // The checkpoint has the whole moments it needed; under ZeRO they would undo the savings.
    trainer.gathered = None;
    if let Some(end) = diverged.or(hook_end) {
        return ControlFlow::Break(end);
    }
    {
        let _pool = crate::ops::pool::serial(trainer.pool.serial());
        maybe_evaluate(trainer, n, sink);
    }
    match trainer.overflow_exhausted() {
        Some(end) => ControlFlow::Break(end),
        None => ControlFlow::Continue(()),
    }
}

/// The reason the run ends with, once the after-step hook had its say and a run that ends on a
/// non-finite loss is called diverged however short it was.
fn finish(
    trainer: &mut Trainer,
    reason: EndReason,
    divergence: &failures::Divergence,
    sink: &EventSink,
) -> EndReason {
    let reason = match reason {
        EndReason::Completed | EndReason::Stopped => divergence.at_end().unwrap_or(reason),
        other => other,
    };
    let mut hooks = std::mem::take(&mut trainer.after_step);
    let reason = hooks
        .iter_mut()
        .fold(reason, |reason, hook| hook.at_end(trainer, sink, reason));
    trainer.after_step = hooks;
    reason
}

/// Flow state and knob changes waiting for the boundary.
struct Flow {
    paused: bool,
    single_step: bool,
    stop: bool,
    pending: Vec<ControlMsg>,
    /// The last step whose timeline entries were applied.
    timeline_done: Option<u64>,
}

impl Flow {
    /// Take what has arrived; flow controls act at once, knob changes wait.
    fn drain(&mut self, controls: &mut UnboundedReceiver<ControlMsg>) {
        loop {
            match controls.try_recv() {
                Ok(msg) if msg.control == Control::Stop => self.stop = true,
                Ok(msg) => self.pending.push(msg),
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                    self.stop = true;
                    break;
                }
            }
        }
    }
}

/// Under data parallel, rank 0's waiting controls become every rank's (keys reach rank 0
/// only). Pausing is not shared: a paused rank would wait for a key the others never get.
fn share_pending(
    trainer: &mut Trainer,
    flow: &mut Flow,
    sink: &EventSink,
) -> std::result::Result<(), crate::dist::DistError> {
    if !trainer.group.is_parallel() {
        return Ok(());
    }
    let (pausing, shared): (Vec<ControlMsg>, Vec<ControlMsg>) = std::mem::take(&mut flow.pending)
        .into_iter()
        .partition(|m| {
            matches!(
                m.control,
                Control::Pause | Control::Resume | Control::SingleStep
            )
        });
    for m in pausing {
        sink.send(Event::warn(
            trainer.step,
            format!(
                "{} ignored: ranks cannot pause (the others would wait in a collective)",
                m.control.describe()
            ),
        ));
    }
    flow.pending = trainer.group.share_controls(shared)?;
    Ok(())
}

/// At a boundary: the timeline's controls for this step, then what arrived, in order.
fn apply_due(trainer: &mut Trainer, flow: &mut Flow, sink: &EventSink) {
    let step = trainer.step;
    // A paused run visits the same boundary repeatedly; its timeline entries fire once.
    let scripted: Vec<ControlMsg> = if flow.timeline_done == Some(step) {
        Vec::new()
    } else {
        flow.timeline_done = Some(step);
        let scenario = trainer
            .scenario
            .timeline
            .iter()
            .map(|e| (e, Origin::Scenario));
        let cli = trainer.cli_controls.iter().map(|e| (e, Origin::Cli));
        scenario
            .chain(cli)
            .filter(|(e, _)| e.step == step)
            .map(|(e, origin)| ControlMsg {
                control: e.control.clone(),
                origin,
            })
            .collect()
    };
    let guarded = trainer
        .guard
        .take_queued()
        .into_iter()
        .map(|control| ControlMsg {
            control,
            origin: Origin::Guard,
        });
    let mut memory_changed = false;
    for msg in scripted
        .into_iter()
        .chain(std::mem::take(&mut flow.pending))
        .chain(guarded)
    {
        match msg.control {
            Control::Pause => flow.paused = true,
            Control::Resume => flow.paused = false,
            Control::SingleStep => {
                flow.paused = true;
                flow.single_step = true;
            }
            Control::Stop => flow.stop = true,
            _ => {
                let b_before = trainer.knobs.micro_batch;
                let applied = trainer.apply_control(&msg.control);
                if applied.is_ok() {
                    trainer
                        .guard
                        .note_applied(msg.origin, &msg.control, b_before);
                }
                if let Err(e) = applied {
                    let message = format!("control {} rejected: {e}", msg.control.describe());
                    sink.send(Event::warn(step, message));
                    continue;
                }
                memory_changed |= crate::memory::estimate::changes_memory(&msg.control);
            }
        }
        sink.send(Event::Control(ControlEvent {
            step,
            origin: msg.origin,
            control: msg.control,
        }));
    }
    if memory_changed {
        send_estimate(trainer, sink);
    }
}

fn send_all(sink: &EventSink, events: impl IntoIterator<Item = Event>) {
    for e in events {
        sink.send(e);
    }
}

/// The predicted ledger (`estimate` events) for the windows from the next step on.
fn send_estimate(trainer: &Trainer, sink: &EventSink) {
    for e in trainer.memory_estimate().events(trainer.step) {
        sink.send(Event::Estimate(e));
    }
}

/// Whether the next window runs without the CPU pool: the governor's choice, given the latest
/// reading of other processes' load (logged when it sets the start).
fn choose_pool(trainer: &mut Trainer, sink: &EventSink) -> bool {
    let applies = trainer.runs_fused_cpu_in_parallel();
    let reading = applies.then(|| trainer.cpu_load.take()).flatten();
    if let Some(reading) = reading {
        let cpus = trainer.cpu_load.cpus();
        if let Some(message) = trainer.pool.load(reading.others, cpus) {
            sink.send(Event::info(trainer.step, message));
        }
    }
    trainer.pool.next_serial(applies)
}

fn maybe_evaluate(trainer: &Trainer, step: u64, sink: &EventSink) {
    let every = trainer.scenario.train.eval_every;
    if every == 0 || !step.is_multiple_of(every) || !trainer.corpus.has_validation() {
        return;
    }
    match trainer.evaluate() {
        Ok(val_loss) => sink.send(Event::Eval(EvalEvent { step, val_loss })),
        Err(e) => sink.send(Event::warn(step, format!("evaluation failed: {e}"))),
    };
}
