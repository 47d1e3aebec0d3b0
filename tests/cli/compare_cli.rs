//! `gaccwb compare` from the command line: its peaks against the peaks a separate `gaccwb run`
//! of the same configuration records, and a bad grid is a one-line usage error.

use std::path::Path;
use std::time::Duration;

use assert_cmd::Command;
use gaccwb::memory::{highest_figure, step_figures, StepFigure};
use gaccwb::record::read_recording;
use gaccwb::telemetry::{Categories, Event, MemoryEvent};

use crate::common;

fn gaccwb(args: &[&str], dir: &Path) -> (i32, String, String) {
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .current_dir(dir)
        // One thread: how many threads' `gemm` packing overlaps in a backward is timing, which
        // would move a peak by kilobytes.
        .env("RAYON_NUM_THREADS", "1")
        .args(args)
        .timeout(Duration::from_secs(300))
        .output()
        .unwrap();
    common::outcome(args, out)
}

/// How far apart two runs of one configuration may measure. The counting allocator sees the
/// whole process, and while the trainer steps, the main thread still holds or formats the
/// previous step's event line (its length depends on the timings it prints): on one 2-core
/// machine the same command, run six times, put step 2's forward at 3,024,597 or 3,024,734 B and
/// its backward peak at 3,283,112 or 3,283,249 B. Compare holding anything of its own in the
/// run's process would be tens of kilobytes (84 KB before each configuration had a process).
const JITTER: u64 = 4096;

fn assert_near(a: u64, b: u64, what: &str) {
    assert!(
        a.abs_diff(b) < JITTER,
        "{what}: {a} and {b} B, {} B apart",
        a.abs_diff(b)
    );
}

/// The step figure with the highest peak in a recording, read by the rule every consumer uses.
fn recorded_peak(path: &Path) -> StepFigure {
    let recording = read_recording(path).unwrap();
    let events: Vec<MemoryEvent> = recording
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Memory(m) => Some(m.clone()),
            _ => None,
        })
        .collect();
    highest_figure(step_figures(&events)).expect("the recording has memory events")
}

#[test]
fn compare_peaks_are_the_peaks_a_separate_run_records() {
    let dir = tempfile::tempdir().unwrap();
    // (grid items, the same configuration as `--set`s)
    let configs: [(&str, &[&str]); 2] = [
        ("B=4,K=1", &["train.micro_batch=4", "train.accum_steps=1"]),
        (
            "B=2,K=2,ckpt",
            &[
                "train.micro_batch=2",
                "train.accum_steps=2",
                "train.checkpointing=\"blocks\"",
            ],
        ),
    ];
    // The tiny model: `--set`s of the separate run, the same items in the grid.
    let tiny = common::TINY.sets();
    let tiny_items = tiny.join(",");
    let grid = configs
        .iter()
        .map(|(items, _)| format!("{items},{tiny_items}"))
        .collect::<Vec<_>>()
        .join("; ");
    let (code, stdout, stderr) = gaccwb(
        &[
            "compare",
            "baseline",
            "--grid",
            &grid,
            "--steps",
            "2",
            "--json",
            "--record-dir",
            "cmp",
        ],
        dir.path(),
    );
    assert_eq!(code, 0, "{stderr}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("compare --json: {e}\n{stdout}"));
    assert_eq!(rows.len(), configs.len(), "{stdout}");
    std::fs::create_dir(dir.path().join("run")).unwrap();

    for (i, ((items, sets), row)) in configs.iter().zip(&rows).enumerate() {
        let compared = row["measured_peak"].as_u64().unwrap();
        let ledger: Categories = serde_json::from_value(row["measured_ledger"].clone()).unwrap();

        // The command compare printed runs as it is: nothing in it names compare's folders.
        let command: Vec<String> = serde_json::from_value(row["command"].clone()).unwrap();
        assert!(!command.iter().any(|a| a == "--record"), "{command:?}");
        let args: Vec<&str> = command.iter().map(String::as_str).collect();
        let (code, stdout, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 0, "{items}: the command verbatim: {stderr}");
        assert!(stdout.contains("2 steps (completed)"), "{items}: {stdout}");

        // With a recording to a path as long as the one compare used: the process holds its
        // arguments, so this is the run compare's row stands for, within `JITTER`.
        let kept = row["recording"]
            .as_str()
            .expect("--record-dir keeps the recording");
        assert!(kept.starts_with("cmp/"), "{kept}");
        let record = kept.replacen("cmp", "run", 1);
        let mut args = args.clone();
        args.extend(["--record", &record]);
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 0, "{items}: {stderr}");
        let rerun = recorded_peak(&dir.path().join(&record));
        assert_near(compared, rerun.peak, &format!("{items}: the peak"));
        let rerun_ledger = rerun.measured_ledger();
        for (a, b) in ledger.values().into_iter().zip(rerun_ledger.values()) {
            assert_near(
                a,
                b,
                &format!("{items}: {ledger:?} against {rerun_ledger:?}"),
            );
        }

        // The same configuration written by hand: other arguments, so `other` may differ by
        // the heap they take; the training's bytes are the same.
        let record = format!("hand-{i}.jsonl");
        let mut args = vec![
            "run",
            "baseline",
            "--headless",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--record",
            &record,
        ];
        for set in tiny.iter().map(String::as_str).chain(sets.iter().copied()) {
            args.extend(["--set", set]);
        }
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 0, "{items}: {stderr}");
        let by_hand = recorded_peak(&dir.path().join(&record));
        let gap = by_hand.peak as i64 - compared as i64;
        println!(
            "{items}: peak compare {compared} B, its command rerun {} B, by hand {} B ({gap:+} B)",
            rerun.peak, by_hand.peak
        );
        let training = |c: &Categories| Categories { other: 0, ..*c }.values();
        let hand_ledger = by_hand.measured_ledger();
        for (a, b) in training(&ledger).into_iter().zip(training(&hand_ledger)) {
            assert_near(
                a,
                b,
                &format!("{items}: {ledger:?} against {hand_ledger:?}"),
            );
        }
        assert_near(compared, by_hand.peak, &format!("{items}: by hand"));
    }
}

#[test]
fn a_bad_grid_entry_exits_2_with_one_line_naming_its_position() {
    let dir = tempfile::tempdir().unwrap();
    for (grid, entry, column, hint) in [
        ("B=32,K=1; B=4,offlaod", 2, 15, "did you mean `offload`"),
        (
            "B=4; K=2; B=2,K=4,ckpt,train.acum_steps=2",
            3,
            24,
            "accum_steps",
        ),
    ] {
        let (code, stdout, stderr) = gaccwb(
            &["compare", "baseline", "--grid", grid, "--steps", "1"],
            dir.path(),
        );
        assert_eq!(code, 2, "{grid}: {stderr}");
        assert!(stdout.is_empty(), "{grid}: nothing trained: {stdout}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{grid}: one line: {stderr}");
        let want = format!("--grid entry {entry} (column {column})");
        assert!(lines[0].contains(&want), "{grid}: {want}: {stderr}");
        assert!(lines[0].contains(hint), "{grid}: {hint}: {stderr}");
    }
}

#[test]
fn lora_against_full_fine_tuning_frees_the_gradient_and_optimizer_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/models/llama-tied");
    let (code, stdout, stderr) = gaccwb(
        &[
            "compare",
            "lora-vs-full",
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "2",
            "--device",
            "cpu",
            "--json",
            "--grid",
            "model.seq_len=16,train.lora_rank=4; model.seq_len=16,train.lora_rank=0",
        ],
        dir.path(),
    );
    assert_eq!(code, 0, "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    let ledger = |i: usize| -> Categories {
        serde_json::from_value(rows[i]["measured_ledger"].clone()).unwrap()
    };
    let (lora, full) = (ledger(0), ledger(1));
    // Full: every weight trained, none frozen. LoRA: the base frozen, and the gradients and
    // AdamW's state only the adapters', a small share of the full run's.
    assert_eq!(full.frozen, 0);
    assert_eq!(lora.frozen, full.parameters, "the base, frozen in f32");
    assert!(
        lora.optimizer_state * 5 < full.optimizer_state,
        "{lora:?} vs {full:?}"
    );
    assert!(
        lora.gradients * 5 < full.gradients.max(1),
        "{lora:?} vs {full:?}"
    );
    assert!(rows
        .iter()
        .all(|r| r["train_loss"].as_f64().unwrap().is_finite()));
}
