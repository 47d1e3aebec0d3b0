//! How a run ends, and what it is told: every way a run can fail exits non-zero and says why;
//! output that cannot be written, signals and a stopped `compare` end cleanly; values a run
//! cannot honour are refused. Each case is a regression test (docs/ROBUSTNESS.md lists them).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use gaccwb::end::EndReason;
use gaccwb::record::{parse_recording, read_recording};
use gaccwb::telemetry::Event;

use crate::common;

use common::{gaccwb, TINY};
use signals::{tiny_preset, walk};

mod signals;

/// `run --headless` of the tiny model on the CPU for `steps` steps, recorded to `r.jsonl`.
fn headless(steps: &str, extra: &[&str], dir: &Path) -> (i32, String, String) {
    let args: Vec<&str> = ["--record", "r.jsonl"]
        .iter()
        .chain(extra)
        .copied()
        .collect();
    common::headless_tiny(dir, steps, &args)
}

fn end_reason(path: &Path) -> EndReason {
    match read_recording(path).unwrap().events.last() {
        Some(Event::End(e)) => e.reason.clone(),
        other => panic!("the recording does not end with `end`: {other:?}"),
    }
}

// A run none of whose checkpoints could be written fails; the first failure is a warning.
#[test]
fn a_run_that_saves_no_checkpoint_fails() {
    let dir = tempfile::tempdir().unwrap();
    // Directories where the first two tensor files go: each save fails (a directory of another
    // run's checkpoint, so --force).
    for step in [2, 4] {
        std::fs::create_dir_all(dir.path().join(format!("ck/step-{step:08}.safetensors"))).unwrap();
    }
    let ck = [
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        "ck",
        "--force",
    ];
    // One save tried (step 2), and it failed: the run goes on to its end, then fails.
    let (code, stdout, stderr) = headless("3", &ck, dir.path());
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert!(
        stderr.contains("warning at step 2: checkpoint at step 2 failed"),
        "{stderr}"
    );
    let reason = end_reason(&dir.path().join("r.jsonl"));
    assert!(
        matches!(&reason, EndReason::CheckpointingFailed(m) if m.contains("none of the 1")),
        "{reason}"
    );
    assert!(stderr.contains("checkpointing failed"), "{stderr}");
    // A second failure before any save succeeded ends the run there, not at step 40.
    std::fs::remove_file(dir.path().join("r.jsonl")).unwrap();
    let (code, stdout, stderr) = headless("40", &ck, dir.path());
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert!(
        stdout.starts_with("4 steps (error: checkpointing failed"),
        "{stdout}"
    );
}

// The fp16 loss-scale floor is a failure (it exited 0).
#[test]
fn a_run_stopped_at_the_loss_scale_floor_fails() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.dtype=\"f16\"",
        "train.lr=1e4",
        "train.warmup=0",
        "train.clip=1e9",
    ];
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", *s]).collect();
    let (code, stdout, stderr) = headless("60", &args, dir.path());
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert!(
        stderr.contains("training failed: gradients overflowed"),
        "{stderr}"
    );
    let reason = end_reason(&dir.path().join("r.jsonl"));
    assert!(
        matches!(reason, EndReason::LossScaleExhausted(_)),
        "{reason}"
    );
}

// A run too short to reach the divergence window does not end "completed" on a NaN loss.
#[test]
fn a_short_run_ending_on_a_nan_loss_is_diverged() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--set", "train.lr=1e30", "--set", "train.warmup=0"];
    let (code, stdout, stderr) = headless("5", &args, dir.path());
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert!(stdout.contains("loss NaN"), "{stdout}");
    let reason = end_reason(&dir.path().join("r.jsonl"));
    assert!(
        matches!(&reason, EndReason::Diverged(m) if m.contains("last step (5)")),
        "{reason}"
    );
}

// An edited checkpoint claiming more AdamW updates than steps is refused, not run into NaN.
#[test]
fn a_checkpoint_with_more_adam_updates_than_steps_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ck = ["--checkpoint-every", "1", "--checkpoint-dir", "ck"];
    let (code, _, stderr) = headless("2", &ck, dir.path());
    assert_eq!(code, 0, "{stderr}");
    common::edit_checkpoint(&dir.path().join("ck/checkpoint.json"), |json| {
        json["adam_t"] = serde_json::json!(4611686018427387903u64);
    });
    let args = ["run", "--headless", "--resume", "ck", "--steps", "4"];
    let (code, stdout, stderr) = gaccwb(&args, dir.path());
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert!(
        stderr.contains("checkpoint.json") && stderr.contains("adam_t (4611686018427387903)"),
        "{stderr}"
    );
}

// The recorded text stays what today's readers read.
#[test]
fn end_reasons_in_recordings_keep_their_text() {
    let asset = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/accumulate-to-fit.jsonl");
    let text = std::fs::read_to_string(&asset).unwrap();
    let last = text.lines().last().unwrap();
    let rec = read_recording(&asset).unwrap();
    let Some(Event::End(end)) = rec.events.last() else {
        panic!("no end event in {}", asset.display());
    };
    assert_eq!(end.reason, EndReason::Completed);
    assert_eq!(
        serde_json::to_string(&Event::End(end.clone())).unwrap(),
        last
    );
}

/// A recording of this version with `lines` after its header, as a newer version could write.
fn with_lines(header_edit: impl FnOnce(&mut serde_json::Value), lines: &[&str]) -> Vec<u8> {
    let asset = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/accumulate-to-fit.jsonl");
    let text = std::fs::read_to_string(asset).unwrap();
    let mut header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    header_edit(&mut header);
    let mut out = header.to_string();
    for line in lines {
        out.push('\n');
        out.push_str(line);
    }
    out.push('\n');
    out.into_bytes()
}

// Names from a newer minor version (a control kind, an origin, an event type, an end
// reason, a timeline entry) are skipped with one warning; they were refused whole.
#[test]
fn a_newer_recordings_unknown_names_are_skipped_with_a_warning() {
    let bytes = with_lines(
        |h| {
            let timeline = h["config"]["timeline"].as_array_mut().unwrap();
            timeline.push(serde_json::json!({"step": 5, "control": {"kind": "set_future"}}));
        },
        &[
            r#"{"type":"control","step":1,"origin":"remote","control":{"kind":"set_clip","value":1.0}}"#,
            r#"{"type":"control","step":2,"origin":"key","control":{"kind":"set_future","value":3}}"#,
            r#"{"type":"control","step":3,"origin":"key","control":{"kind":"set_accum_steps","value":4}}"#,
            r#"{"type":"hologram","step":3}"#,
            r#"{"type":"end","step":3,"reason":"paused forever"}"#,
        ],
    );
    let rec = parse_recording(&bytes, "new.jsonl").unwrap();
    let controls = rec
        .events
        .iter()
        .filter(|e| matches!(e, Event::Control(_)))
        .count();
    assert_eq!(controls, 1, "only the known control is kept");
    assert_eq!(rec.header.config.timeline.len(), 2);
    assert_eq!(rec.warnings.len(), 1, "{:?}", rec.warnings);
    assert!(rec.warnings[0].contains("skipped 4"), "{:?}", rec.warnings);
    assert!(matches!(rec.events.last(), Some(Event::End(_))));
    // A malformed line is still an error naming its line.
    let bad = with_lines(|_| {}, &[r#"{"type":"control","step":"x"}"#]);
    let err = parse_recording(&bad, "bad.jsonl").unwrap_err().to_string();
    assert!(err.starts_with("bad.jsonl:2: bad control event"), "{err}");
}

// A noise-scale policy the run cannot measure is refused on the command line as in a preset.
#[test]
fn a_noise_scale_policy_without_the_noise_scale_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--set",
        "train.noise=false",
        "--control",
        "2:set_accum_policy=noise-scale",
    ];
    let (code, _, stderr) = headless("3", &args, dir.path());
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("needs train.noise = true"), "{stderr}");
    assert!(!dir.path().join("r.jsonl").exists());
}

// An SVG export is well-formed XML whatever the preset's name holds; the cast's title too.
#[test]
fn exports_carry_no_control_characters_from_the_recording() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = with_lines(
        |h| {
            h["config"]["name"] = "evil\u{1b}]0;pwned\u{7}\u{1}\u{8}name".into();
            h["config"]["description"] = "tab\there\u{1b}[31m red".into();
        },
        &[r#"{"type":"end","step":0,"reason":"completed"}"#],
    );
    std::fs::write(dir.path().join("in.jsonl"), bytes).unwrap();
    for (format, out) in [("svg", "out.svg"), ("cast", "out.cast")] {
        let args = ["export", "in.jsonl", "--to", format, "-o", out];
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 0, "{format}: {stderr}");
        let text = std::fs::read_to_string(dir.path().join(out)).unwrap();
        let first = if format == "cast" {
            text.lines().next().unwrap().to_string()
        } else {
            text.clone()
        };
        let bad: Vec<char> = first
            .chars()
            .filter(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r'))
            .collect();
        assert!(bad.is_empty(), "{format}: control characters {bad:?}");
        assert!(
            !first.contains("pwned") && !first.contains("\\u00"),
            "{first}"
        );
        assert!(first.contains("evilname"), "{format}");
    }
}

// The policy chooses B·K, the guard the split: a guard split to B=1 does not let the
// policy shrink B·K below accum_min × the B it split (it went B=1,K=2: B·K 4 → 2).
#[test]
fn the_guard_split_does_not_move_the_policys_effective_batch() {
    use gaccwb::memory::estimate::{estimate, Config};
    let dir = tempfile::tempdir().unwrap();
    let preset = gaccwb::presets::resolve("adaptive-k").unwrap();
    // The workspace of a fresh `gaccwb run` (its trainer's slab and the pool's), not this
    // process's: other tests of this binary train in process and hold slabs of their own.
    let cfg = Config {
        workspace: gaccwb::ops::workspace::slab_bytes() * gaccwb::ops::cpu_threads() as u64,
        ..Config::from_scenario(&preset, true).unwrap()
    };
    let peak = |micro_batch, accum_steps| {
        estimate(&Config {
            micro_batch,
            accum_steps,
            ..cfg.clone()
        })
        .peak()
    };
    // Between the predicted peaks of B=1,K=4 and B=2,K=2: the guard starts at B=1.
    let budget = ((peak(1, 4) + peak(2, 2)) / 2).to_string();
    let args = [
        "run",
        "adaptive-k",
        "--headless",
        "--device",
        "cpu",
        "--steps",
        "60",
        "--set",
        "train.accum_patience=2",
        "--budget",
        &budget,
        "--record",
        "r.jsonl",
    ];
    let (code, _, stderr) = gaccwb(&args, dir.path());
    assert_eq!(code, 0, "{stderr}");
    let splits: Vec<(u64, usize, usize)> = read_recording(&dir.path().join("r.jsonl"))
        .unwrap()
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) => Some((s.step, s.micro_batch, s.accum_steps)),
            _ => None,
        })
        .collect();
    assert_eq!((splits[0].1, splits[0].2), (1, 4), "{splits:?}");
    assert!(splits.iter().all(|&(_, b, k)| b * k >= 4), "{splits:?}");
}

/// A checkpoint of the tiny model at step 2 in `ck`, made with `extra`.
fn checkpoint_at_2(dir: &Path, extra: &[&str]) {
    let mut args = vec!["--checkpoint-every", "2", "--checkpoint-dir", "ck"];
    args.extend_from_slice(extra);
    let (code, _, stderr) = headless("2", &args, dir);
    assert_eq!(code, 0, "{stderr}");
    std::fs::remove_file(dir.join("r.jsonl")).unwrap();
}

// --resume refuses what it would ignore (a preset, --seed, --budget, a past --control).
#[test]
fn resume_refuses_what_it_would_silently_ignore() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint_at_2(dir.path(), &[]);
    let resume = [
        "run",
        "--headless",
        "--device",
        "cpu",
        "--resume",
        "ck",
        "--steps",
        "4",
    ];
    for (extra, expected) in [
        (&["adaptive-k"][..], "drop a preset"),
        (&["--seed", "9"][..], "drop --seed"),
        (&["--budget", "1 GiB"][..], "drop --budget"),
        (
            &["--control", "1:set_accum_steps=2"][..],
            "checkpoint is at step 2",
        ),
    ] {
        let mut args = resume.to_vec();
        args.extend_from_slice(extra);
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 2, "{extra:?}: {stderr}");
        assert!(stderr.contains(expected), "{extra:?}: {stderr}");
    }
    let mut args = resume.to_vec();
    args.extend_from_slice(&["--control", "2:set_accum_steps=2"]);
    let (code, stdout, stderr) = gaccwb(&args, dir.path());
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("K=2"), "{stdout}");
}

// A resumed run's header carries the knobs in force, not the scenario's first values.
#[test]
fn a_resumed_recording_header_has_the_knobs_in_force() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint_at_2(dir.path(), &["--control", "0:set_checkpointing=every-2"]);
    let args = [
        "run",
        "--headless",
        "--device",
        "cpu",
        "--resume",
        "ck",
        "--steps",
        "3",
        "--record",
        "r2.jsonl",
    ];
    let (code, _, stderr) = gaccwb(&args, dir.path());
    assert_eq!(code, 0, "{stderr}");
    let header = read_recording(&dir.path().join("r2.jsonl")).unwrap().header;
    assert_eq!(header.config.train.checkpointing.name(), "every-2");
}

// Loose validation: values that were accepted and then ignored, changed or misreported.
#[test]
fn loose_values_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let asset = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/accumulate-to-fit.jsonl");
    let asset = asset.to_str().unwrap();
    let preset = tiny_preset(dir.path());
    let model = TINY.args();
    let mut run: Vec<&str> = vec!["run", "--headless", "--device", "cpu", "--steps", "1"];
    run.extend(model.iter().map(String::as_str));
    let with = |extra: &[&'static str]| -> Vec<&str> {
        let mut args = run.clone();
        args.extend_from_slice(extra);
        args
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["estimate", "--effective", "0"], "--effective 0"),
        (with(&["--budget", ""]), "empty"),
        (with(&["--checkpoint-every", "0"]), "--checkpoint-every"),
        (with(&["--control", "5:stop=1"]), "`stop` takes no value"),
        (
            with(&["--set", "train.lr=1e309"]),
            "beyond the largest number",
        ),
        (
            vec!["compare", preset, "--grid", "B=2,B=4"],
            "sets train.micro_batch again",
        ),
        (
            vec![
                "compare",
                preset,
                "--grid",
                "B=2",
                "--steps",
                "18446744073709551615",
            ],
            "must be at most 9223372036854775807",
        ),
        (
            vec![
                "export", asset, "--to", "cast", "-o", "c.cast", "--speed", "0",
            ],
            "expected a positive number",
        ),
        (
            vec![
                "export",
                asset,
                "--to",
                "cast",
                "-o",
                "c.cast",
                "--speed=-1",
            ],
            "expected a positive number",
        ),
        (
            vec![
                "export", asset, "--to", "cast", "-o", "c.cast", "--speed", "NaN",
            ],
            "expected a positive number",
        ),
        (
            with(&["--record", "x.jsonl", "--log", "x.jsonl"]),
            "name the same file",
        ),
    ];
    for (args, expected) in cases {
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    let left: Vec<_> = walk(dir.path())
        .into_iter()
        .filter(|p| !p.ends_with("tiny.toml"))
        .collect();
    assert!(
        left.is_empty(),
        "nothing is written for a refused command: {left:?}"
    );
}
