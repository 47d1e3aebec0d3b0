//! `gaccwb compare` from the command line: its peaks against the peaks a separate `gaccwb run`
//! of the same configuration records, and a bad grid is a one-line usage error.
//!
//! The counting allocator measures the whole process, so a figure includes what the process
//! holds besides the training: a headless run's session (its recorder, event channel and step
//! history) is not in `compare`'s process. What the training holds is the same to the byte;
//! the peaks differ by that session's heap alone, in `other`.

use std::path::Path;
use std::time::Duration;

use assert_cmd::Command;
use gaccwb::memory::{step_figures, StepFigure};
use gaccwb::record::read_recording;
use gaccwb::telemetry::{Categories, Event, MemoryEvent};

mod common;

/// A tiny model: the `--set`s of the run, the same items in the grid.
const TINY: &[&str] = &[
    "model.vocab=64",
    "model.d_model=32",
    "model.layers=2",
    "model.heads=2",
    "model.seq_len=16",
    "train.eval_every=0",
];

fn gaccwb(args: &[&str], dir: &Path) -> (i32, String, String) {
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .current_dir(dir)
        // One thread: how many threads' `gemm` packing overlaps in a backward is timing, and
        // the comparison is to the byte.
        .env("RAYON_NUM_THREADS", "1")
        .args(args)
        .timeout(Duration::from_secs(300))
        .output()
        .unwrap();
    common::outcome(args, out)
}

/// The step figure with the highest peak in a recording, read as `compare` reads its own
/// (`memory::figure`).
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
    step_figures(&events)
        .into_iter()
        .max_by_key(|f| f.peak)
        .expect("the recording has memory events")
}

/// Bytes outside any training category that a headless run's session may hold: its recorder's
/// buffer, event channel and history (about 84 KB measured on the tiny model of this test).
const SESSION_HEAP: u64 = 128 << 10;

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
    let tiny = TINY.join(",");
    let grid = configs
        .iter()
        .map(|(items, _)| format!("{items},{tiny}"))
        .collect::<Vec<_>>()
        .join("; ");
    let (code, stdout, stderr) = gaccwb(
        &[
            "compare", "baseline", "--grid", &grid, "--steps", "2", "--json",
        ],
        dir.path(),
    );
    assert_eq!(code, 0, "{stderr}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("compare --json: {e}\n{stdout}"));
    assert_eq!(rows.len(), configs.len(), "{stdout}");

    for (i, ((items, sets), row)) in configs.iter().zip(&rows).enumerate() {
        let record = format!("run-{i}.jsonl");
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
        for set in TINY.iter().chain(sets.iter()) {
            args.extend(["--set", set]);
        }
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 0, "{items}: {stderr}");
        let recorded = recorded_peak(&dir.path().join(&record));
        let compared = row["measured_peak"].as_u64().unwrap();
        let ledger: Categories = serde_json::from_value(row["measured_ledger"].clone()).unwrap();
        let run_ledger = recorded.measured_ledger();
        println!(
            "{items}: peak compare {compared} B, run --record {} B; other {} vs {} B",
            recorded.peak, ledger.other, run_ledger.other
        );
        // Every training category is the same bytes.
        let training = |c: &Categories| Categories { other: 0, ..*c };
        assert_eq!(training(&ledger), training(&run_ledger), "{items}");
        // The peaks differ by what `other` holds beyond the training: the session's heap.
        let gap = recorded.peak as i64 - compared as i64;
        assert_eq!(
            gap,
            run_ledger.other as i64 - ledger.other as i64,
            "{items}: the peaks differ in `other` alone"
        );
        assert!(
            (0..SESSION_HEAP as i64).contains(&gap),
            "{items}: {gap} B beyond the session's heap"
        );
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
