//! How a run ends, and what it is told: every way a run can fail exits non-zero and says why;
//! output that cannot be written, signals and a stopped `compare` end cleanly; values a run
//! cannot honour are refused. Each case is a regression test (docs/ROBUSTNESS.md lists them).

use std::path::Path;
use std::time::Duration;

use assert_cmd::Command;
use gaccwb::record::{parse_recording, read_recording};
use gaccwb::telemetry::{EndReason, Event};

mod common;

use common::TINY;

fn gaccwb(args: &[&str], dir: &Path) -> (i32, String, String) {
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .current_dir(dir)
        .args(args)
        .timeout(Duration::from_secs(120))
        .output()
        .unwrap();
    common::outcome(args, out)
}

/// `run --headless` of the tiny model on the CPU for `steps` steps, recorded to `r.jsonl`.
fn headless(steps: &str, extra: &[&str], dir: &Path) -> (i32, String, String) {
    let model = TINY.args();
    let mut args = vec!["run", "--headless", "--device", "cpu", "--steps", steps];
    args.extend(model.iter().map(String::as_str));
    args.extend_from_slice(&["--record", "r.jsonl"]);
    args.extend_from_slice(extra);
    gaccwb(&args, dir)
}

fn end_reason(path: &Path) -> EndReason {
    match read_recording(path).unwrap().events.last() {
        Some(Event::End(e)) => e.reason.clone(),
        other => panic!("the recording does not end with `end`: {other:?}"),
    }
}

// M1: a run none of whose checkpoints could be written fails; the first failure is a warning.
#[test]
fn a_run_that_saves_no_checkpoint_fails() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ck"), "a file, not a directory").unwrap();
    let ck = ["--checkpoint-every", "2", "--checkpoint-dir", "ck"];
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

// M2: the fp16 loss-scale floor is a failure (it exited 0).
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

// M3: a run too short to reach the divergence window does not end "completed" on a NaN loss.
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

// M3: an edited checkpoint claiming more AdamW updates than steps is refused, not run into NaN.
#[test]
fn a_checkpoint_with_more_adam_updates_than_steps_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ck = ["--checkpoint-every", "1", "--checkpoint-dir", "ck"];
    let (code, _, stderr) = headless("2", &ck, dir.path());
    assert_eq!(code, 0, "{stderr}");
    let state = dir.path().join("ck/checkpoint.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    json["adam_t"] = serde_json::json!(4611686018427387903u64);
    std::fs::write(&state, json.to_string()).unwrap();
    let args = ["run", "--headless", "--resume", "ck", "--steps", "4"];
    let (code, stdout, stderr) = gaccwb(&args, dir.path());
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert!(
        stderr.contains("checkpoint.json") && stderr.contains("adam_t (4611686018427387903)"),
        "{stderr}"
    );
}

// Item 1: the recorded text stays what today's readers read.
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

// M9: names from a newer minor version (a control kind, an origin, an event type, an end
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

// M6: a noise-scale policy the run cannot measure is refused on the command line as in a preset.
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

// M8: an SVG export is well-formed XML whatever the preset's name holds; the cast's title too.
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
