//! Checkpoints: everything a run needs to continue bit-identically.
//!
//! A checkpoint directory holds `checkpoint.json` (format, step counters, data cursor, knobs,
//! loss scaler, AdamW step count, the scenario, and the name of the tensor file) and
//! `step-NNNNNNNN.safetensors` (model weights `param/NAME`, AdamW moments `adam_m/NAME` and
//! `adam_v/NAME`, all f32). Both are written to a temporary file, synced and renamed into place,
//! tensors first: `checkpoint.json` only ever names a complete tensor file, so a crash at any
//! moment leaves the previous checkpoint or the new one, never a torn one.
//!
//! A run that saves holds an `flock` on its directory from start to end ([`claim_dir`]), so two
//! runs never save into one directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::control::{Control, Knobs};
use crate::end::EndReason;
use crate::safe_write::{self, DirLock, Inputs, Overwrite};
use crate::scenario::Scenario;
use crate::telemetry::{Event, EventSink, Level};
use crate::train::scaler::LossScaler;
use crate::train::{AfterStep, Progress, Saved, Trainer};

/// Version of the checkpoint layout; a newer one is refused. Version 2 added the tensor file's
/// hash and the ranks; version 1 files are still read (without those checks).
pub const CHECKPOINT_VERSION: u32 = 2;
const STATE_FILE: &str = "checkpoint.json";

mod error;
mod integrity;
pub use error::{CheckpointError, StateError};
pub use integrity::check_ranks;
use integrity::{is_abandoned_save, sha256_hex};

/// When and where a running trainer saves.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// Save after every `every` optimizer steps.
    pub every: u64,
    /// The directory the state and tensor files go to (locked for the run's life).
    pub dir: PathBuf,
    /// Files the run reads, never replaced by a save (the checkpoint being resumed is not one:
    /// the run continues it).
    pub inputs: Inputs,
}

/// The small JSON half of a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// The checkpoint format's version; a newer one is refused on resume.
    pub version: u32,
    /// Optimizer steps taken, skipped ones included.
    pub step: u64,
    /// Steps the LR schedule has advanced.
    pub lr_step: u64,
    /// Index of the next training sample: the resumed run continues the data stream here.
    pub cursor: u64,
    /// Steps skipped on non-finite gradients.
    pub overflow_count: u64,
    /// AdamW's applied steps (its bias correction).
    pub adam_t: u64,
    /// The f16 loss scale in force.
    pub loss_scale: f64,
    /// Clean steps between loss-scale increases.
    pub scale_growth_interval: u64,
    /// Clean steps since the scale last changed.
    pub scale_clean_steps: u64,
    /// The knobs in force when saved (they may differ from the scenario's first values).
    pub knobs: Knobs,
    /// The run's scenario, as it started.
    pub scenario: Scenario,
    /// The tensor file in the same directory.
    pub tensors: String,
    /// SHA-256 of the tensor file, lowercase hex: a resume refuses tensors that are not the
    /// ones this state was saved with. Absent in version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors_sha256: Option<String>,
    /// Data-parallel ranks (W) of the run that saved: W·K·B samples per window and the data
    /// order depend on it. Absent in version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<usize>,
}

impl Policy {
    /// The trainer's after-step hook that saves by this policy; it keeps `lock` (from
    /// [`claim_dir`]) for as long as the trainer lives.
    pub fn after_step(self, lock: DirLock) -> Box<dyn AfterStep> {
        Box::new(Saver {
            policy: self,
            _lock: lock,
            tried: 0,
            saved: 0,
            first_error: None,
        })
    }
}

/// `--save-model DIR`: at the end of a run that completed or was stopped, the model in Hugging
/// Face's layout (`model::save`), or under LoRA its adapter as PEFT writes it (`merge`: the
/// adapters folded into a whole model instead); a failed save fails the run.
pub struct ModelSave {
    /// The directory.
    pub dir: PathBuf,
    /// What may be replaced there (never an input of the run).
    pub rules: Overwrite,
    /// Under LoRA, save the merged model rather than the adapter.
    pub merge: bool,
}

impl ModelSave {
    /// Save `trainer`'s model; the event's text says what was written.
    fn save(&self, trainer: &Trainer) -> Result<String, CheckpointError> {
        let model = trainer.model();
        let weights = trainer.master_weights();
        let family = model.spec.naming_family().to_string();
        let t = &trainer.scenario().train;
        if model.frozen.is_empty() || self.merge {
            let merged;
            let (model, weights) = match model.frozen.is_empty() {
                true => (model, weights),
                false => {
                    merged = model.merged(&weights)?;
                    let w = merged.vars().map(|v| v.as_tensor().clone()).collect();
                    (&merged, w)
                }
            };
            let saved = crate::model::save::save(model, &weights, &self.dir, &self.rules)?;
            return Ok(format!(
                "model saved to {} ({} tensors, {:.1} MB, {family} layout{})",
                saved.dir.display(),
                saved.tensors,
                saved.bytes as f64 / 1e6,
                if self.merge { ", adapters merged" } else { "" }
            ));
        }
        let lora = crate::model::lora::Lora::of(t);
        let n = crate::model::lora::save_adapter(model, &lora, &weights, &self.dir, &self.rules)?;
        Ok(format!(
            "LoRA adapter saved to {} ({n} tensors, PEFT's layout; load it with --adapter)",
            self.dir.display()
        ))
    }
}

impl AfterStep for ModelSave {
    fn after_step(&mut self, _: &Trainer, _: &EventSink) -> Option<EndReason> {
        None
    }

    fn at_end(&mut self, trainer: &Trainer, sink: &EventSink, reason: EndReason) -> EndReason {
        if !matches!(reason, EndReason::Completed | EndReason::Stopped) {
            sink.send(Event::warn(
                trainer.step(),
                format!(
                    "the model was not saved to {}: the run {reason}",
                    self.dir.display()
                ),
            ));
            return reason;
        }
        match self.save(trainer) {
            Ok(line) => {
                sink.send(Event::info(trainer.step(), line));
                reason
            }
            Err(e) => EndReason::Error(format!("saving the model: {}", crate::end::chain(&e))),
        }
    }
}

/// Saves by the policy and counts: the first failed save is a warning, a second one before
/// any save succeeded ends the run, and a run that tried and saved nothing fails.
struct Saver {
    policy: Policy,
    /// Held for the trainer's life: no other run saves into the directory meanwhile.
    _lock: DirLock,
    tried: u64,
    saved: u64,
    first_error: Option<String>,
}

impl AfterStep for Saver {
    fn after_step(&mut self, trainer: &Trainer, sink: &EventSink) -> Option<EndReason> {
        let every = self.policy.every;
        if every == 0 || !trainer.step().is_multiple_of(every) {
            return None;
        }
        self.tried += 1;
        let error = match save_into(trainer, &self.policy.dir, &self.policy.inputs) {
            Ok(path) => {
                self.saved += 1;
                let message = format!(
                    "checkpoint at step {} saved to {}",
                    trainer.step(),
                    path.display()
                );
                sink.send(Event::info(trainer.step(), message));
                return None;
            }
            Err(e) => crate::end::chain(&e),
        };
        let first = self
            .first_error
            .get_or_insert_with(|| error.clone())
            .clone();
        if self.saved == 0 && self.tried >= 2 {
            return Some(self.failure(&first));
        }
        let (level, consequence) = match self.saved {
            0 => (Level::Warn, "; the run fails if the next one fails too"),
            _ => (Level::Error, "; the last saved checkpoint stays"),
        };
        let message = format!(
            "checkpoint at step {} failed: {error}{consequence}",
            trainer.step()
        );
        sink.send(Event::log(trainer.step(), level, message));
        None
    }

    fn at_end(&mut self, _: &Trainer, _: &EventSink, reason: EndReason) -> EndReason {
        match (&reason, &self.first_error) {
            (EndReason::Completed | EndReason::Stopped, Some(first)) if self.saved == 0 => {
                self.failure(first)
            }
            _ => reason,
        }
    }
}

impl Saver {
    fn failure(&self, first: &str) -> EndReason {
        EndReason::CheckpointingFailed(format!(
            "none of the {} checkpoint(s) tried could be written to {} (first: {first})",
            self.tried,
            self.policy.dir.display()
        ))
    }
}

/// Write the trainer's state into `dir` (created if missing); returns the state file's path.
pub fn save(trainer: &Trainer, dir: &Path) -> Result<PathBuf, CheckpointError> {
    save_into(trainer, dir, &Inputs::default())
}

/// `save`, never replacing one of `inputs`.
fn save_into(trainer: &Trainer, dir: &Path, inputs: &Inputs) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(|err| CheckpointError::CreateDir {
        dir: dir.to_path_buf(),
        err,
    })?;
    let rules = Overwrite::new(true, inputs.clone());
    let tensors_name = format!("step-{:08}.safetensors", trainer.step());
    let tensor_path = dir.join(&tensors_name);
    let tensors = safetensors::serialize(tensor_map(trainer)?, None).map_err(|err| {
        CheckpointError::Serialise {
            path: tensor_path.clone(),
            err,
        }
    })?;
    safe_write::write_file(&tensor_path, &tensors, "checkpoint", &rules)?;
    let tensors_sha256 = sha256_hex(&tensors);
    drop(tensors);

    let progress = trainer.progress();
    let state = State {
        version: CHECKPOINT_VERSION,
        step: progress.step,
        lr_step: progress.lr_step,
        cursor: progress.cursor,
        overflow_count: progress.overflow_count,
        adam_t: trainer.optimizer().t,
        loss_scale: trainer.scaler().scale,
        scale_growth_interval: trainer.scaler().growth_interval,
        scale_clean_steps: trainer.scaler().clean_steps,
        knobs: trainer.knobs().clone(),
        scenario: trainer.scenario().clone(),
        tensors: tensors_name.clone(),
        tensors_sha256: Some(tensors_sha256),
        ranks: Some(trainer.ranks()),
    };
    let state_path = dir.join(STATE_FILE);
    let json = serde_json::to_vec_pretty(&state)?;
    safe_write::write_file(&state_path, &json, "checkpoint", &rules)?;
    remove_stale_tensor_files(dir, &tensors_name);
    Ok(state_path)
}

fn tensor_map(trainer: &Trainer) -> Result<HashMap<String, Tensor>, CheckpointError> {
    let mut map = HashMap::new();
    let master = trainer.master_weights();
    // Under ZeRO each rank holds a piece of the moments; the ranks gathered them whole at the
    // end of a step the policy saves at, so the file is the one a ZeRO-0 run writes.
    let (m, v) = trainer
        .whole_moments()
        .ok_or_else(|| CheckpointError::NotGathered {
            step: trainer.step(),
            stage: trainer.knobs().zero,
        })?;
    for (i, p) in trainer.params().iter().enumerate() {
        map.insert(format!("param/{}", p.name), master[i].clone());
        map.insert(format!("adam_m/{}", p.name), m[i].clone());
        map.insert(format!("adam_v/{}", p.name), v[i].clone());
    }
    Ok(map)
}

/// Older tensor files are no longer referenced once the new state file is in place; the
/// temporary files of saves a killed run left (`.step-N.safetensors.PID.tmp`, whose PID is no
/// longer running) are removed too.
fn remove_stale_tensor_files(dir: &Path, keep: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let regular = entry.file_type().is_ok_and(|t| t.is_file());
        let old = name.starts_with("step-") && name.ends_with(".safetensors") && name != keep;
        if regular && (old || is_abandoned_save(&name)) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The files of the checkpoint in `dir` (state and tensors), added to a resuming run's inputs.
pub fn add_inputs(dir: &Path, inputs: &mut Inputs) {
    inputs.add("the checkpoint", &dir.join(STATE_FILE));
    if let Ok(state) = read_state(dir) {
        inputs.add("the checkpoint", &dir.join(state.tensors));
    }
}

/// The state file of the checkpoint in `dir`.
pub fn read_state(dir: &Path) -> Result<State, CheckpointError> {
    let path = dir.join(STATE_FILE);
    let limit = crate::limits::MAX_CHECKPOINT_STATE_BYTES;
    let text =
        crate::limits::read_bounded_text(&path, limit, "checkpoint state").map_err(|err| {
            CheckpointError::Missing {
                dir: dir.to_path_buf(),
                path: path.clone(),
                err: Box::new(err),
            }
        })?;
    let state: State =
        serde_json::from_str(&text).map_err(|err| CheckpointError::NotACheckpoint {
            path: path.clone(),
            err,
        })?;
    if state.version > CHECKPOINT_VERSION {
        return Err(CheckpointError::Newer {
            path,
            version: state.version,
        });
    }
    check_state(&state).map_err(|err| CheckpointError::State { path, err })?;
    Ok(state)
}

/// The values of an edited or damaged state file, checked with the rules presets follow.
fn check_state(state: &State) -> Result<(), StateError> {
    use crate::limits::{at_most, check_window, MAX_INTEGER};
    state.scenario.validate().map_err(StateError::Scenario)?;
    let k = &state.knobs;
    for c in [
        Control::SetAccumSteps {
            value: k.accum_steps,
        },
        Control::SetMicroBatch {
            value: k.micro_batch,
        },
        Control::SetClip { value: k.clip },
        Control::SetLr { value: k.lr },
        Control::SetLossScale {
            value: state.loss_scale,
        },
    ] {
        crate::scenario::validate_control(&c).map_err(StateError::Knob)?;
    }
    check_window(k.micro_batch, k.accum_steps, state.scenario.model.seq_len)
        .map_err(StateError::Window)?;
    // Counters are advanced by at most a window each step; leave room so they never wrap.
    let counters = [
        ("step", state.step),
        ("lr_step", state.lr_step),
        ("cursor", state.cursor),
        ("overflow_count", state.overflow_count),
        ("adam_t", state.adam_t),
        ("scale_growth_interval", state.scale_growth_interval),
        ("scale_clean_steps", state.scale_clean_steps),
    ];
    for (key, value) in counters {
        at_most(key, value, MAX_INTEGER >> 1)?;
    }
    // Each optimizer step advances these by at most one (a skipped step not at all).
    for (key, value) in [
        ("adam_t", state.adam_t),
        ("lr_step", state.lr_step),
        ("overflow_count", state.overflow_count),
    ] {
        if value > state.step {
            return Err(StateError::AheadOfStep {
                key,
                value,
                step: state.step,
            });
        }
    }
    if state.tensors.contains(['/', '\\']) || state.tensors.starts_with('.') {
        return Err(StateError::TensorsOutside(state.tensors.clone()));
    }
    Ok(())
}

/// Before a run saves into `dir`: lock it (created if missing) for the run's life, refused while
/// another run holds it (its pid named); and refuse a directory holding another run's
/// checkpoints (saving would replace them and delete their tensor files) unless it is the one
/// being resumed or the user said `--force`.
pub fn claim_dir(
    dir: &Path,
    resumed_from: Option<&Path>,
    force: bool,
) -> Result<DirLock, CheckpointError> {
    let lock = safe_write::lock_dir(dir).map_err(|e| match e {
        safe_write::WriteError::Locked { holder, .. } => CheckpointError::Locked {
            dir: dir.to_path_buf(),
            holder,
        },
        e => CheckpointError::Dir(e),
    })?;
    // A save replaces the state file; say now, not at every save, when it is not a file.
    safe_write::check(&dir.join(STATE_FILE), "checkpoint", &Overwrite::ours())?;
    if force || !holds_checkpoint(dir) {
        return Ok(lock);
    }
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if resumed_from.is_some_and(|r| same(r, dir)) {
        return Ok(lock);
    }
    let step = read_state(dir).map(|s| s.step.to_string());
    Err(CheckpointError::Occupied {
        dir: dir.to_path_buf(),
        step: step.unwrap_or_else(|_| "?".into()),
    })
}

/// `dir` has a state file or a tensor file this module wrote.
fn holds_checkpoint(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        name == STATE_FILE || (name.starts_with("step-") && name.ends_with(".safetensors"))
    })
}

/// A trainer rebuilt from the checkpoint in `dir`, ready to continue where it stopped.
/// `adjust` may change the scenario first (e.g. more steps); model shape changes are refused.
pub fn resume(
    dir: &Path,
    device: Device,
    adjust: impl FnOnce(&mut Scenario),
) -> Result<Trainer, CheckpointError> {
    let state = read_state(dir)?;
    let mut scenario = state.scenario.clone();
    adjust(&mut scenario);
    if scenario.model != state.scenario.model {
        return Err(CheckpointError::ModelChanged);
    }
    let schedule = keep_schedule(&state.scenario, &mut scenario, state.step);
    let mut trainer = Trainer::new(scenario, device)?;
    restore(&mut trainer, dir, &state)?;
    if let Some(message) = schedule {
        trainer.announce(Event::warn(state.step, message));
    }
    Ok(trainer)
}

/// A resumed run given another `train.steps` (`--steps`): with `decay_steps` 0 the cosine decay
/// follows `steps`, so the LR would jump mid-run to where a longer schedule stands (2.0e-4 at
/// step 60 of 60 became 4.9e-3 at step 61 of 120). The saved run's horizon is kept instead
/// (`decay_steps` set to its `steps`): up to it the run continues as saved, after it the LR
/// stays at its floor. Returns what to tell the user; `None` when nothing changes.
fn keep_schedule(saved: &Scenario, resumed: &mut Scenario, step: u64) -> Option<String> {
    let (was, now) = (saved.train.steps, resumed.train.steps);
    if was == now || saved.train.decay_steps != 0 || resumed.train.decay_steps != 0 {
        return None;
    }
    if was == 0 {
        // No horizon to keep: an open-ended run never decayed.
        return Some(format!(
            "resumed at step {step} of a run without a step limit (constant LR after warm-up) \
             with train.steps {now}: the LR now follows a cosine decay ending at step {now}"
        ));
    }
    resumed.train.decay_steps = was;
    let after = match now > was {
        true => format!(
            ", then stays at its floor ({} × lr) to step {now}",
            saved.train.min_lr_ratio
        ),
        false => String::new(),
    };
    Some(format!(
        "resumed at step {step} with train.steps {now} (the checkpoint's run had {was}): the LR \
         schedule keeps that run's horizon (train.decay_steps = {was}), its cosine decay ending \
         at step {was}{after}"
    ))
}

/// Load weights, optimizer state, scaler, knobs and counters into a freshly built trainer.
pub fn restore(trainer: &mut Trainer, dir: &Path, state: &State) -> Result<(), CheckpointError> {
    let path = dir.join(&state.tensors);
    // Candle maps the file: a FIFO or a device there would block or never end (refused by
    // the hash's read, which opens it as an input).
    integrity::verify_tensors(dir, state)?;
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).map_err(|err| {
        CheckpointError::LoadTensors {
            path: path.clone(),
            err,
        }
    })?;
    let mut take = |key: String, like: &Tensor| -> Result<Tensor, CheckpointError> {
        let Some(t) = tensors.remove(&key) else {
            let path = path.clone();
            return Err(CheckpointError::MissingTensor { path, key });
        };
        if t.shape() != like.shape() {
            return Err(CheckpointError::Shape {
                path: path.clone(),
                key,
                found: t.shape().clone(),
                needed: like.shape().clone(),
            });
        }
        Ok(t)
    };
    let params = trainer.params();
    let mut each = |prefix: &str| -> Result<Vec<Tensor>, CheckpointError> {
        params
            .iter()
            .map(|p| take(format!("{prefix}/{}", p.name), p.var.as_tensor()))
            .collect()
    };
    let (weights, m, v) = (each("param")?, each("adam_m")?, each("adam_v")?);
    trainer.resume(Saved {
        weights,
        m,
        v,
        adam_t: state.adam_t,
        scaler: LossScaler {
            scale: state.loss_scale,
            growth_interval: state.scale_growth_interval,
            clean_steps: state.scale_clean_steps,
            floor_overflows: 0,
        },
        knobs: state.knobs.clone(),
        progress: Progress {
            step: state.step,
            lr_step: state.lr_step,
            cursor: state.cursor,
            overflow_count: state.overflow_count,
        },
    })?;
    Ok(())
}
