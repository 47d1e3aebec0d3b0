//! The trainer thread's loop: header, then at every boundary the timeline's and the user's
//! controls, one step, its events, the after-step hooks and evaluation, until the run ends.

use std::ops::ControlFlow;

use candle_core::Result;
use tokio::sync::mpsc::UnboundedReceiver;

use super::{adaptive, failures, oom_guard, EventSink, Interrupt, TrainError, Trainer};
use crate::control::{Control, ControlMsg, Origin};
use crate::data::{Batch, Sample, Split};
use crate::end::EndReason;
use crate::telemetry::{ControlEvent, EndEvent, EvalEvent, Event, StepEvent};

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
        let step = match step_or_end(&mut trainer, &mut flow, &mut controls, serial, &sink) {
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
        return ControlFlow::Break(EndReason::error(&e));
    }
    apply_due(trainer, flow, sink);
    if trainer.group.is_parallel() {
        let fingerprint = trainer.knobs_fingerprint();
        match trainer.group.agree(trainer.step, flow.stop, fingerprint) {
            Ok(stop) => flow.stop = stop,
            Err(e) => return ControlFlow::Break(EndReason::error(&e)),
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

/// One optimizer step on the chosen side of the CPU pool, or the reason the run ends: a stop
/// between micro-batches or a failed window.
fn step_or_end(
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
        Err(Interrupt::Failed(e)) => ControlFlow::Break(EndReason::error(&e)),
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

fn run_after_step(trainer: &mut Trainer, sink: &EventSink) -> Option<EndReason> {
    let mut hooks = std::mem::take(&mut trainer.after_step);
    let end = hooks
        .iter_mut()
        .find_map(|hook| hook.after_step(trainer, sink));
    trainer.after_step = hooks;
    end
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

impl Trainer {
    /// Apply a knob change now (the caller makes sure "now" is a window boundary).
    pub fn apply_control(&mut self, c: &Control) -> std::result::Result<(), TrainError> {
        self.check_under_zero(c)?;
        crate::scenario::validate_control(c)?;
        crate::scenario::check_needs(c, self.knobs.noise)?;
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
    fn policy_control(&mut self, step: &StepEvent) -> Vec<ControlMsg> {
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
