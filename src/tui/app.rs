//! The workbench's state: what the panes draw. `update` folds in one `Event`, `apply` turns an
//! `Action` into the `Control`s to send. No I/O here, so tests and replay drive it directly.

use std::collections::VecDeque;

use strum::VariantArray;

use crate::control::{Control, Knobs, Origin};
use crate::end::EndReason;
use crate::memory::StepFigure;
use crate::telemetry::{
    ControlEvent, DeviceEvent, EstimateEvent, Event, Header, Level, MemoryEvent, MemorySource,
    Phase, StepEvent,
};

use super::keymap::Action;

/// Steps kept in every history; older points fall off.
pub const DEFAULT_RETENTION: usize = 10_000;
/// Lines kept in the event log.
const LOG_RETENTION: usize = 500;
/// Narrowest and default time windows (steps shown by the charts).
const MIN_ZOOM: u64 = 16;
const DEFAULT_ZOOM: u64 = 256;

/// The panes, in focus order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::VariantArray)]
pub enum PaneId {
    DeviceMemory,
    Ledger,
    Loss,
    GradNorm,
    LossScale,
    Status,
    EventLog,
}

impl PaneId {
    fn index(self) -> usize {
        Self::VARIANTS.iter().position(|p| *p == self).unwrap_or(0)
    }

    fn shifted(self, by: isize) -> PaneId {
        let n = Self::VARIANTS.len() as isize;
        Self::VARIANTS[((self.index() as isize + by).rem_euclid(n)) as usize]
    }
}

/// How the charts' y axes are drawn (`s` cycles them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum YScale {
    /// From the lowest value to the highest.
    #[default]
    Linear,
    /// Within Tukey's far-out fences: a spike is drawn at the edge, the rest keeps its room.
    Robust,
    /// Logarithmic, at round decades.
    Log,
}

impl YScale {
    fn next(self) -> YScale {
        match self {
            YScale::Linear => YScale::Robust,
            YScale::Robust => YScale::Log,
            YScale::Log => YScale::Linear,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            YScale::Linear => "linear",
            YScale::Robust => "robust",
            YScale::Log => "log",
        }
    }
}

/// A device sample placed on the step axis.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DevicePoint {
    pub source: MemorySource,
    pub x: f64,
    pub used: u64,
    pub total: Option<u64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LogLine {
    pub step: u64,
    pub level: Level,
    pub text: String,
}

/// Where a replay stands (shown in the header line).
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayStatus {
    pub speed: f64,
    pub paused: bool,
    pub last_step: u64,
    /// Following a recording that is still being written (`replay --follow`).
    pub following: bool,
    /// Knob keys reach the run (`run --ranks N`: through rank 0's controls file).
    pub steerable: bool,
    /// Every event is shown and none is to come (a followed run has ended).
    pub finished: bool,
}

/// What the run has told the screen: the data store, rebuilt from events alone (a replay seek
/// starts it afresh). Nothing here depends on what the user is looking at.
#[derive(Clone, Debug)]
pub struct RunData {
    pub header: Option<Header>,
    pub knobs: Knobs,
    /// Controls sent but not yet reported applied, oldest first.
    pub pending: Vec<Control>,
    pub steps: VecDeque<StepEvent>,
    pub evals: VecDeque<(u64, f64)>,
    /// Each step's measured figure (the one rule in `memory::figure`).
    pub memory: VecDeque<StepFigure>,
    pub memory_source: Option<MemorySource>,
    pub device: VecDeque<DevicePoint>,
    pub device_unavailable: Option<String>,
    /// The latest step's fullest measured ledger (usually its backward phase).
    pub measured: Option<MemoryEvent>,
    /// The latest estimate of each phase.
    pub estimates: Vec<EstimateEvent>,
    /// Applied controls: (step, label), drawn as markers on the charts.
    pub markers: VecDeque<(u64, String)>,
    pub log: VecDeque<LogLine>,
    pub paused: bool,
    pub ended: Option<EndReason>,
    /// Changes the memory guard made (controls with origin `guard`).
    pub guard_actions: u64,
    pub retention: usize,
}

/// How the user is looking at the run: focus, zoom, overlays, and the session around it.
#[derive(Clone, Debug)]
pub struct ViewState {
    pub help: bool,
    pub frozen: Option<u64>,
    pub zoom: u64,
    pub focus: PaneId,
    pub expanded: bool,
    /// The grad-norm pane shows the gradient noise scale instead.
    pub noise_view: bool,
    /// The charts' y scale.
    pub y_scale: YScale,
    pub color: bool,
    pub recording: Option<String>,
    pub replay: Option<ReplayStatus>,
    pub quit: bool,
    /// Something visible changed since the last frame.
    pub dirty: bool,
}

/// The workbench's state: the run's data beside the view of it (the split `bottom` makes).
#[derive(Clone, Debug)]
pub struct App {
    pub run: RunData,
    pub view: ViewState,
}

impl Default for App {
    fn default() -> Self {
        App::new(DEFAULT_RETENTION)
    }
}

impl RunData {
    pub fn new(retention: usize) -> RunData {
        RunData {
            header: None,
            knobs: Knobs::from_scenario(&Default::default()),
            pending: Vec::new(),
            steps: VecDeque::new(),
            evals: VecDeque::new(),
            memory: VecDeque::new(),
            memory_source: None,
            device: VecDeque::new(),
            device_unavailable: None,
            measured: None,
            estimates: Vec::new(),
            markers: VecDeque::new(),
            log: VecDeque::new(),
            paused: false,
            ended: None,
            guard_actions: 0,
            retention: retention.max(1),
        }
    }
}

impl Default for ViewState {
    fn default() -> Self {
        ViewState {
            help: false,
            frozen: None,
            zoom: DEFAULT_ZOOM,
            focus: PaneId::Loss,
            expanded: false,
            noise_view: false,
            y_scale: YScale::Linear,
            color: true,
            recording: None,
            replay: None,
            quit: false,
            dirty: true,
        }
    }
}

impl App {
    pub fn new(retention: usize) -> App {
        App {
            run: RunData::new(retention),
            view: ViewState::default(),
        }
    }

    /// Drop the run's data but keep display settings (replay seeks rebuild from the start).
    pub fn reset_run(&mut self) {
        self.run = RunData::new(self.run.retention);
        self.view.frozen = None;
        self.view.quit = false;
        self.view.dirty = true;
    }

    /// Steps completed so far.
    pub fn last_step(&self) -> u64 {
        self.run.steps.back().map(|s| s.step).unwrap_or(0)
    }

    pub fn last(&self) -> Option<&StepEvent> {
        self.run.steps.back()
    }

    /// The last step the charts show: the frozen step, or the newest.
    pub fn view_end(&self) -> u64 {
        self.view.frozen.unwrap_or_else(|| self.last_step())
    }

    /// Knobs as they will be once every pending control is applied.
    pub fn target_knobs(&self) -> Knobs {
        let mut k = self.run.knobs.clone();
        for c in &self.run.pending {
            k.apply(c);
        }
        k
    }

    pub fn update(&mut self, event: &Event) {
        match event {
            Event::Header(h) => self.on_header(h),
            Event::Step(s) => self.on_step(s),
            Event::Control(c) => self.on_control(c),
            Event::Eval(e) => push_bounded(
                &mut self.run.evals,
                (e.step, e.val_loss),
                self.run.retention,
            ),
            Event::Memory(m) => self.on_memory(m),
            Event::Estimate(e) => {
                self.run.estimates.retain(|x| x.phase != e.phase);
                self.run.estimates.push(e.clone());
            }
            Event::Device(d) => self.on_device(d),
            Event::Log(l) => self.log(l.step, l.level, l.message.clone()),
            Event::End(e) => {
                let level = match e.reason.is_failure() {
                    true => Level::Error,
                    false => Level::Info,
                };
                self.log(e.step, level, format!("run ended: {}", e.reason));
                self.run.ended = Some(e.reason.clone());
            }
        }
        self.view.dirty = true;
    }

    fn on_header(&mut self, h: &Header) {
        self.run.knobs = Knobs::from_scenario(&h.config);
        self.run.header = Some(h.clone());
    }

    fn on_step(&mut self, s: &StepEvent) {
        if s.skipped {
            self.log(
                s.step,
                Level::Warn,
                format!(
                    "overflow: step skipped, loss scale 2^{:.0} → halved",
                    s.loss_scale.log2()
                ),
            );
        }
        push_bounded(&mut self.run.steps, s.clone(), self.run.retention);
    }

    fn on_control(&mut self, c: &ControlEvent) {
        self.run.knobs.apply(&c.control);
        match c.control {
            Control::Pause => self.run.paused = true,
            Control::Resume => self.run.paused = false,
            Control::SingleStep => self.run.paused = true,
            _ => {}
        }
        // Only the very change is done: a newer value for the same knob may still be on its way.
        if let Some(i) = self.run.pending.iter().position(|p| *p == c.control) {
            self.run.pending.remove(i);
        }
        let origin = match c.origin {
            Origin::Key => "key",
            Origin::Scenario => "preset",
            Origin::Cli => "cli",
            Origin::Guard => "guard",
            Origin::Policy => "policy",
        };
        if c.origin == Origin::Guard && matches!(c.control, Control::SetMicroBatch { .. }) {
            self.run.guard_actions += 1;
        }
        let label = c.control.describe();
        self.log(c.step, Level::Info, format!("{label} applied ({origin})"));
        if !c.control.is_flow() {
            push_bounded(&mut self.run.markers, (c.step, label), self.run.retention);
        }
    }

    fn on_memory(&mut self, m: &MemoryEvent) {
        self.run.memory_source = Some(m.source);
        match self.run.memory.back_mut() {
            Some(figure) if figure.step == m.step => figure.absorb(m),
            _ => push_bounded(&mut self.run.memory, StepFigure::new(m), self.run.retention),
        }
        // The ledger shows the fullest moment of a finished step (usually backward), not the
        // quiet end, and not a step still half-way through.
        if let Some(latest) = self.run.memory.back() {
            if latest.complete || self.run.measured.is_none() {
                self.run.measured = Some(latest.fullest.clone());
            }
        }
    }

    fn on_device(&mut self, d: &DeviceEvent) {
        if let Some(reason) = &d.unavailable {
            if self.run.device_unavailable.as_deref() != Some(reason) {
                self.log(self.last_step(), Level::Warn, reason.clone());
            }
            self.run.device_unavailable = Some(reason.clone());
            return;
        }
        let Some(used) = d.used else { return };
        self.run.device_unavailable = None;
        let point = DevicePoint {
            source: d.source,
            x: self.last_step() as f64,
            used,
            total: d.total,
        };
        push_bounded(&mut self.run.device, point, self.run.retention);
    }

    fn log(&mut self, step: u64, level: Level, text: String) {
        push_bounded(
            &mut self.run.log,
            LogLine { step, level, text },
            LOG_RETENTION,
        );
    }

    /// Act on a key's action. Knob actions become controls for the trainer (also held as
    /// pending until the trainer reports them); display actions change the view only.
    /// Recording and replay actions belong to the loop that owns the file or the replay.
    pub fn apply(&mut self, action: Action) -> Vec<Control> {
        self.view.dirty = true;
        if self.view.help && !matches!(action, Action::Help | Action::Quit) {
            // Any key closes the overlay without acting.
            self.view.help = false;
            return Vec::new();
        }
        if let Some(why) = self.cannot_act(action) {
            // Every key answers: one that cannot act here says so, and changes nothing.
            self.log(self.last_step(), Level::Warn, why);
            return Vec::new();
        }
        let controls = match action {
            Action::Help => {
                self.view.help = !self.view.help;
                Vec::new()
            }
            Action::Quit => {
                self.view.quit = true;
                Vec::new()
            }
            Action::Freeze => {
                self.view.frozen = match self.view.frozen {
                    Some(_) => None,
                    None => Some(self.last_step()),
                };
                Vec::new()
            }
            Action::ZoomIn => {
                self.view.zoom = (self.view.zoom / 2).max(MIN_ZOOM);
                Vec::new()
            }
            Action::ZoomOut => {
                self.view.zoom =
                    (self.view.zoom * 2).min(self.run.retention.max(MIN_ZOOM as usize) as u64);
                Vec::new()
            }
            Action::Expand => {
                self.view.expanded = !self.view.expanded;
                Vec::new()
            }
            Action::FocusNext => {
                self.view.focus = self.view.focus.shifted(1);
                Vec::new()
            }
            Action::FocusPrev => {
                self.view.focus = self.view.focus.shifted(-1);
                Vec::new()
            }
            Action::NoiseView => {
                self.view.noise_view = !self.view.noise_view;
                Vec::new()
            }
            Action::ScaleCycle => {
                self.view.y_scale = self.view.y_scale.next();
                Vec::new()
            }
            Action::RecordToggle
            | Action::SeekBack
            | Action::SeekForward
            | Action::SpeedDown
            | Action::SpeedUp => Vec::new(),
            Action::FitNow if self.view.replay.is_none() => match super::fit::fit_controls(self) {
                Ok(controls) => controls,
                Err(why) => {
                    self.log(self.last_step(), Level::Warn, why);
                    Vec::new()
                }
            },
            knob => self.knob_controls(knob),
        };
        if self.view.replay.as_ref().is_some_and(|r| !r.steerable) {
            // A replay is read-only: the file already says what happened.
            return Vec::new();
        }
        for c in &controls {
            self.run.pending.retain(|p| !supersedes(c, p));
            self.run.pending.push(c.clone());
        }
        controls
    }

    /// Why `action` cannot act in this session, if it cannot: seeking and speed in a live run,
    /// run-changing keys in a replay that cannot steer, a data-parallel knob without ranks.
    fn cannot_act(&self, action: Action) -> Option<String> {
        let what = action.describe();
        let steerable = self.view.replay.as_ref().map(|r| r.steerable);
        match steerable {
            None if action.replay_only() => {
                let what = what.trim_start_matches("replay: ");
                return Some(format!(
                    "{what}: only in a replay (gaccwb replay FILE); nothing changed"
                ));
            }
            Some(false) if action.live_only() => {
                return Some(format!(
                    "{what}: a replay shows what was recorded; nothing changed"
                ))
            }
            Some(true) if matches!(action, Action::FitNow | Action::RecordToggle) => {
                return Some(format!(
                    "{what}: this screen follows rank 0's recording; nothing changed"
                ))
            }
            _ => {}
        }
        let turned = action
            .knob()
            .map(|k| (k.turn)(&self.target_knobs(), &self.configured_knobs()));
        let ranks = self.run.header.as_ref().and_then(|h| h.ranks).unwrap_or(1);
        match turned {
            Some(c) if c.needs_ranks() && ranks < 2 => Some(format!(
                "{what}: this run is one process, so there are no ranks to share the work \
                 (gaccwb run --ranks N); nothing changed"
            )),
            Some(c) => crate::scenario::validate_control(&c)
                .err()
                .map(|e| format!("{what}: {e}; nothing changed")),
            None => None,
        }
    }

    fn knob_controls(&self, action: Action) -> Vec<Control> {
        let k = self.target_knobs();
        let control = match action {
            Action::Knob(_) => match action.knob() {
                Some(turn) => (turn.turn)(&k, &self.configured_knobs()),
                None => return Vec::new(),
            },
            Action::PauseResume if self.target_paused() => Control::Resume,
            Action::PauseResume => Control::Pause,
            Action::SingleStep => Control::SingleStep,
            _ => return Vec::new(),
        };
        if k.accum_steps == 0 || crate::scenario::validate_control(&control).is_err() {
            return Vec::new();
        }
        vec![control]
    }

    /// Paused once the pending flow controls are applied.
    fn target_paused(&self) -> bool {
        self.run
            .pending
            .iter()
            .rev()
            .find_map(|c| match c {
                Control::Pause | Control::SingleStep => Some(true),
                Control::Resume => Some(false),
                _ => None,
            })
            .unwrap_or(self.run.paused)
    }

    /// The knobs the run was configured with (what a toggle turns back on, e.g. the clip).
    fn configured_knobs(&self) -> Knobs {
        match &self.run.header {
            Some(h) => Knobs::from_scenario(&h.config),
            None => self.run.knobs.clone(),
        }
    }

    /// The estimate to set beside the measured ledger: the same phase (backward before any
    /// measurement, the phase that usually peaks).
    pub fn estimate(&self) -> Option<&EstimateEvent> {
        let phase = self
            .run
            .measured
            .as_ref()
            .map_or(Phase::Backward, |m| m.phase);
        self.run.estimates.iter().find(|e| e.phase == phase)
    }

    /// The latest memory event says device and host memory are one (a CPU run).
    /// Whether host and device are one memory: the trainer's ledger says so in the header (a
    /// recording older than that field, in its memory events).
    pub fn unified_memory(&self) -> bool {
        match self.run.header.as_ref().and_then(|h| h.unified_memory) {
            Some(unified) => unified,
            None => self.run.measured.as_ref().is_some_and(|m| m.unified),
        }
    }

    pub fn device_name(&self) -> &str {
        self.run
            .header
            .as_ref()
            .map(|h| h.device.as_str())
            .unwrap_or("?")
    }

    /// The newest noise-scale estimate, and the step it came with.
    pub fn latest_noise(&self) -> Option<(u64, &crate::telemetry::NoiseEvent)> {
        self.run
            .steps
            .iter()
            .rev()
            .filter(|s| s.step <= self.view_end())
            .find_map(|s| s.noise.as_ref().map(|n| (s.step, n)))
    }

    pub fn is_cpu(&self) -> bool {
        self.device_name() == "cpu"
    }
}

/// A newer change to the same knob (or the same pause state) replaces an older pending one.
fn supersedes(new: &Control, old: &Control) -> bool {
    let flow = |c: &Control| matches!(c, Control::Pause | Control::Resume | Control::SingleStep);
    std::mem::discriminant(new) == std::mem::discriminant(old) || (flow(new) && flow(old))
}

fn push_bounded<T>(q: &mut VecDeque<T>, item: T, cap: usize) {
    q.push_back(item);
    while q.len() > cap {
        q.pop_front();
    }
}

#[cfg(test)]
mod tests;
