//! Checkpoints: a run saved and resumed continues bit-identically on CPU; a torn save never
//! replaces a good checkpoint; bad checkpoints are refused with a clear message.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use gaccwb::checkpoint::{self, Policy};
use gaccwb::control::{Control, Dtype};
use gaccwb::scenario::{Scenario, TimelineEntry};
use gaccwb::telemetry::{Event, Level, StepEvent};
use gaccwb::train::{self, Trainer};

use crate::common;

use common::TINY;

const TOTAL: u64 = 6;
const SPLIT: u64 = 3;

/// Tiny model; the timeline changes K, the micro-batch, precision and offload around the split
/// (one entry exactly at it), so every piece of restored state matters.
fn scenario() -> Scenario {
    let mut s = TINY.scenario();
    s.train.micro_batch = 4;
    s.train.steps = TOTAL;
    s.train.decay_steps = TOTAL; // the schedule must not depend on where a run stops
    s.train.warmup = 2;
    s.train.scale_growth_interval = 2;
    let at = |step, control| TimelineEntry { step, control };
    s.timeline = vec![
        at(1, Control::SetDtype { value: Dtype::F16 }),
        at(2, Control::SetAccumSteps { value: 2 }),
        at(SPLIT, Control::SetMicroBatch { value: 2 }),
        at(SPLIT, Control::SetOffload { value: true }),
        at(4, Control::SetLossScale { value: 1024.0 }),
    ];
    s
}

/// Run a trainer to its end on the trainer thread, saving at `save_every` into `dir`.
fn run(mut trainer: Trainer, dir: &Path, save_every: u64) -> Vec<StepEvent> {
    trainer.add_after_step(
        Policy {
            every: save_every,
            dir: dir.to_path_buf(),
            inputs: Default::default(),
        }
        .after_step(checkpoint::claim_dir(dir, None, true).unwrap()),
    );
    let (mut handle, sink) = train::spawn_trainer(trainer).unwrap();
    drop(sink);
    let mut steps = Vec::new();
    while let Some(e) = handle.events.blocking_recv() {
        match e {
            Event::Step(s) => steps.push(s),
            // Saves log at info; the CPU pool's start line may too, on a loaded machine.
            Event::Log(l) => assert_eq!(l.level, Level::Info, "{l:?}"),
            Event::End(e) => {
                assert_eq!(e.reason, gaccwb::end::EndReason::Completed);
                break;
            }
            _ => {}
        }
    }
    handle.stop();
    steps
}

fn tensors(dir: &Path) -> HashMap<String, Tensor> {
    let state = checkpoint::read_state(dir).unwrap();
    candle_core::safetensors::load(dir.join(state.tensors), &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Everything but timings.
fn numbers(s: &StepEvent) -> (u64, u64, u64, u64, u64, usize, usize, bool, u64) {
    (
        s.step,
        s.loss.to_bits(),
        s.grad_norm.to_bits(),
        s.lr.to_bits(),
        s.loss_scale.to_bits(),
        s.accum_steps,
        s.micro_batch,
        s.skipped,
        s.tokens,
    )
}

#[test]
fn resumed_run_continues_bit_identically() {
    let straight_dir = tempfile::tempdir().unwrap();
    let first_dir = tempfile::tempdir().unwrap();
    let resumed_dir = tempfile::tempdir().unwrap();

    let straight = run(
        Trainer::new(scenario(), Device::Cpu).unwrap(),
        straight_dir.path(),
        TOTAL,
    );

    let mut first = scenario();
    first.train.steps = SPLIT;
    let head = run(
        Trainer::new(first, Device::Cpu).unwrap(),
        first_dir.path(),
        SPLIT,
    );
    let resumed =
        checkpoint::resume(first_dir.path(), Device::Cpu, |s| s.train.steps = TOTAL).unwrap();
    assert_eq!(resumed.step(), SPLIT);
    let tail = run(resumed, resumed_dir.path(), TOTAL);

    let joined: Vec<_> = head.iter().chain(&tail).map(numbers).collect();
    let expected: Vec<_> = straight.iter().map(numbers).collect();
    assert_eq!(
        joined, expected,
        "losses, norms, LR and loss scale match step for step"
    );

    let (a, b) = (tensors(straight_dir.path()), tensors(resumed_dir.path()));
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        assert!(bits(t) == bits(&b[name]), "{name} differs");
    }
    let (sa, sb) = (
        checkpoint::read_state(straight_dir.path()).unwrap(),
        checkpoint::read_state(resumed_dir.path()).unwrap(),
    );
    assert_eq!(
        (
            sa.step,
            sa.lr_step,
            sa.cursor,
            sa.adam_t,
            sa.loss_scale,
            &sa.knobs
        ),
        (
            sb.step,
            sb.lr_step,
            sb.cursor,
            sb.adam_t,
            sb.loss_scale,
            &sb.knobs
        )
    );
    assert!(sa.knobs.offload && sa.knobs.dtype == Dtype::F16);
}

/// A trainer under ZeRO stage `zero`, alone (its shard is every element, the moments still
/// cut into 1-D pieces), gathering its state whole at every save.
fn zero_trainer<E: std::fmt::Debug>(trainer: Result<Trainer, E>, every: u64) -> Trainer {
    let mut t = trainer.unwrap();
    t.join(gaccwb::dist::Group::solo()).unwrap();
    t.gather_state_every(every);
    t
}

/// Under ZeRO the checkpoint holds the moments whole, as ZeRO-0's does (the same tensors, bit
/// for bit), and a run resumed from it continues bit-identically.
#[test]
fn a_zero_run_saves_whole_moments_and_resumes_bit_identically() {
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let at = |zero: u8, steps: u64| {
        let mut s = TINY.scenario();
        (s.train.micro_batch, s.train.accum_steps) = (2, 2);
        (s.train.steps, s.train.decay_steps, s.train.zero) = (steps, TOTAL, zero);
        Trainer::new(s, Device::Cpu)
    };
    let plain = run(zero_trainer(at(0, TOTAL), TOTAL), dirs[0].path(), TOTAL);
    let sharded = run(zero_trainer(at(1, TOTAL), TOTAL), dirs[1].path(), TOTAL);
    let head = run(zero_trainer(at(1, SPLIT), SPLIT), dirs[2].path(), SPLIT);
    let resumed = checkpoint::resume(dirs[2].path(), Device::Cpu, |s| s.train.steps = TOTAL);
    let tail = run(zero_trainer(resumed, TOTAL), dirs[3].path(), TOTAL);

    let expected: Vec<_> = plain.iter().map(numbers).collect();
    assert_eq!(sharded.iter().map(numbers).collect::<Vec<_>>(), expected);
    let joined: Vec<_> = head.iter().chain(&tail).map(numbers).collect();
    assert_eq!(joined, expected);
    for dir in [&dirs[1], &dirs[3]] {
        assert_same_tensors(dirs[0].path(), dir.path());
    }
}

/// The last checkpoints in `reference` and `dir` hold the same tensors, bit for bit.
fn assert_same_tensors(reference: &Path, dir: &Path) {
    let (reference, saved) = (tensors(reference), tensors(dir));
    assert_eq!(saved.len(), reference.len());
    for (name, t) in &reference {
        assert_eq!(t.shape(), saved[name].shape(), "{name}");
        assert!(bits(t) == bits(&saved[name]), "{name} differs");
    }
}

/// On the lean ops (a GPU's code path, here on the CPU) ZeRO updates its pieces by the
/// Candle ops the unsharded step uses, not the fused CPU kernel: the same steps and the same
/// checkpoint as ZeRO-0 on those ops, bit for bit, in f32 and in bf16.
#[test]
fn zero_on_the_lean_ops_takes_zero_0s_steps() {
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
        let at = |zero: u8| {
            let mut s = TINY.scenario();
            (s.train.micro_batch, s.train.accum_steps, s.train.dtype) = (2, 2, dtype);
            (s.train.steps, s.train.decay_steps, s.train.zero) = (SPLIT, SPLIT, zero);
            let mut t = zero_trainer(Trainer::new(s, Device::Cpu), SPLIT);
            t.force_lean_ops(true);
            t
        };
        let plain = run(at(0), dirs[0].path(), SPLIT);
        let sharded = run(at(1), dirs[1].path(), SPLIT);
        let numbers_of = |r: &[StepEvent]| r.iter().map(numbers).collect::<Vec<_>>();
        assert_eq!(numbers_of(&sharded), numbers_of(&plain), "{dtype:?}");
        assert_same_tensors(dirs[0].path(), dirs[1].path());
    }
}

/// ZeRO shards the optimizer state; offloading it too is refused with the fix.
#[test]
fn zero_with_offload_is_refused_with_the_fix() {
    let mut s = TINY.scenario();
    (s.train.zero, s.train.offload) = (1, true);
    let mut t = Trainer::new(s, Device::Cpu).unwrap();
    let err = t.join(gaccwb::dist::Group::solo()).unwrap_err().to_string();
    assert!(err.contains("set train.offload = false"), "{err}");
}

#[test]
fn a_torn_save_leaves_the_previous_checkpoint_readable() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = scenario();
    s.train.steps = 2;
    run(Trainer::new(s, Device::Cpu).unwrap(), dir.path(), 1);
    let files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name != gaccwb::safe_write::LOCK_FILE)
        .collect();
    assert!(
        files.contains(&"step-00000002.safetensors".to_string()) && files.len() == 2,
        "old tensor files are removed: {files:?}"
    );
    // A crash mid-save leaves only temporary files behind.
    std::fs::write(dir.path().join(".checkpoint.json.tmp"), "{\"vers").unwrap();
    std::fs::write(dir.path().join(".step-00000003.safetensors.tmp"), [1, 2, 3]).unwrap();
    let state = checkpoint::read_state(dir.path()).unwrap();
    assert_eq!(state.step, 2);
    let t = checkpoint::resume(dir.path(), Device::Cpu, |_| {}).unwrap();
    assert_eq!(t.step(), 2);
}

#[test]
fn bad_checkpoints_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let err = checkpoint::resume(dir.path(), Device::Cpu, |_| {})
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("no checkpoint in"), "{err:#}");

    let mut s = scenario();
    s.train.steps = 1;
    run(Trainer::new(s, Device::Cpu).unwrap(), dir.path(), 1);
    let err = checkpoint::resume(dir.path(), Device::Cpu, |s| s.model.d_model = 64)
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("model shape"), "{err:#}");

    let state_path = dir.path().join("checkpoint.json");
    let text = std::fs::read_to_string(&state_path).unwrap();
    std::fs::write(
        &state_path,
        text.replace(
            &format!("\"version\": {}", checkpoint::CHECKPOINT_VERSION),
            "\"version\": 7",
        ),
    )
    .unwrap();
    let err = checkpoint::read_state(dir.path()).err().unwrap();
    assert!(format!("{err:#}").contains("newer"), "{err:#}");
}

#[test]
fn a_run_resumed_with_more_steps_keeps_its_lr_schedule_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = scenario();
    first.timeline.clear();
    first.train.steps = SPLIT;
    first.train.decay_steps = 0; // the schedule follows `steps`
    let head = run(Trainer::new(first, Device::Cpu).unwrap(), dir.path(), SPLIT);
    let resumed = checkpoint::resume(dir.path(), Device::Cpu, |s| s.train.steps = TOTAL).unwrap();
    assert_eq!(resumed.scenario().train.decay_steps, SPLIT);
    let (mut handle, sink) = train::spawn_trainer(resumed).unwrap();
    drop(sink);
    let (mut warnings, mut lrs) = (Vec::new(), Vec::new());
    while let Some(e) = handle.events.blocking_recv() {
        match e {
            Event::Log(l) if l.level == Level::Warn => warnings.push(l.message),
            Event::Step(s) => lrs.push(s.lr),
            Event::End(_) => break,
            _ => {}
        }
    }
    handle.stop();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("keeps that run's horizon") && w.contains("train.steps 6")),
        "{warnings:?}"
    );
    // Past the saved horizon the LR stays at the floor; a stretched schedule would rise.
    let last = head.last().unwrap().lr;
    assert_eq!(lrs.len() as u64, TOTAL - SPLIT);
    assert!(lrs.iter().all(|&lr| lr <= last), "{last} then {lrs:?}");
}

#[test]
fn cli_saves_every_n_steps_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let gaccwb = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_gaccwb"))
            .args(["run", "--headless", "--device", "cpu"])
            .args(args)
            .env("RAYON_NUM_THREADS", "1")
            .output()
            .unwrap()
    };
    let mut first = vec![
        "k-ramp",
        "--steps",
        "2",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
    ];
    first.push(ckpt.to_str().unwrap());
    let model = TINY.args();
    first.extend(model.iter().map(String::as_str));
    let out = gaccwb(&first);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(checkpoint::read_state(&ckpt).unwrap().step, 2);

    let out = gaccwb(&["--resume", ckpt.to_str().unwrap(), "--steps", "3"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("3 steps (completed)"), "{stdout}");

    let out = gaccwb(&["--resume", ckpt.to_str().unwrap(), "--set", "train.lr=1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("(drop --set)"));
}
