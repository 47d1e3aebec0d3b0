//! How a run ends, and what it is told: every way a run can fail exits non-zero and says why;
//! output that cannot be written, signals and a stopped `compare` end cleanly; values a run
//! cannot honour are refused. Each case is a regression test (docs/ROBUSTNESS.md lists them).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use gaccwb::record::{parse_recording, read_recording};
use gaccwb::telemetry::{EndReason, Event};

use crate::common;

use common::{gaccwb, TINY};

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

/// `gaccwb ARGS` started in `dir` with the tiny model's `--set`s appended when `tiny`.
fn spawn(args: &[&str], dir: &Path, tiny: bool) -> std::process::Command {
    let mut command = std::process::Command::new(assert_cmd::cargo::cargo_bin("gaccwb"));
    command.current_dir(dir).args(args);
    if tiny {
        command.args(TINY.args());
    }
    command
}

/// Wait for `child` at most `secs` seconds; its exit code (-1 for a signal).
fn wait_at_most(child: &mut std::process::Child, secs: u64) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("gaccwb did not end within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Block until `path` holds a recorded step (the run is training).
fn wait_for_a_step(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !std::fs::read_to_string(path)
        .unwrap_or_default()
        .contains("\"type\":\"step\"")
    {
        assert!(Instant::now() < deadline, "no step in {}", path.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn signal(pid: u32, signo: i32) {
    // SAFETY: kill only sends a signal to a process this test started.
    unsafe { libc::kill(pid as i32, signo) };
}

// A closed stdout ends the program quietly with 1; a full disk with one line and 1.
#[test]
fn output_that_cannot_be_written_ends_with_1_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let run = ["run", "--headless", "--device", "cpu", "--steps", "2"];
    let asset = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/accumulate-to-fit.jsonl");
    let asset = asset.to_str().unwrap();
    let replay = ["replay", "--headless", asset];
    for (args, tiny) in [
        (&run[..], true),
        (&replay[..], false),
        (&["estimate"][..], false),
    ] {
        let mut child = spawn(args, dir.path(), tiny)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader went away: `| true`
        let out = child.wait_with_output().unwrap();
        let (code, _, stderr) = common::outcome(args, out);
        assert_eq!(code, 1, "{args:?}: {stderr}");
        assert!(
            !stderr.contains("standard output"),
            "{args:?}: quiet: {stderr}"
        );

        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = spawn(args, dir.path(), tiny).stdout(full).output().unwrap();
        let (code, _, stderr) = common::outcome(args, out);
        assert_eq!(code, 1, "{args:?}: {stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert_eq!(
            last, "gaccwb: cannot write to standard output: No space left on device (os error 28)",
            "{args:?}"
        );
    }
}

// With few file descriptors left the signal set-up cannot panic.
#[test]
fn few_file_descriptors_are_no_panic() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["run", "--headless", "--device", "cpu", "--steps", "1"];
    for limit in [6u64, 7, 8] {
        let mut command = spawn(&args, dir.path(), true);
        // SAFETY: the closure runs in the forked child before exec and calls only setrlimit.
        unsafe {
            use std::os::unix::process::CommandExt;
            command.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: limit,
                    rlim_max: limit,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (code, _, stderr) = common::outcome(&args, command.output().unwrap());
        assert!(code == 0 || code == 1, "ulimit -n {limit}: {code} {stderr}");
    }
}

// A headless run whose stdout and stderr are closed pipes still ends on SIGTERM.
#[test]
fn sigterm_ends_a_run_whose_output_is_a_closed_pipe() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "run",
        "--headless",
        "--device",
        "cpu",
        "--steps",
        "0",
        "--record",
        "r.jsonl",
    ];
    let mut child = spawn(&args, dir.path(), true)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    wait_for_a_step(&dir.path().join("r.jsonl"));
    signal(child.id(), libc::SIGTERM);
    assert_eq!(wait_at_most(&mut child, 60), 143);
    assert_eq!(
        end_reason(&dir.path().join("r.jsonl")),
        EndReason::Signalled(libc::SIGTERM)
    );
}

/// The tiny model as a preset file, for `compare` (which takes a preset, not `--set`s).
fn tiny_preset(dir: &Path) -> &'static str {
    let m = TINY;
    let text = format!(
        "name = \"tiny\"\n[model]\nvocab = {}\nd_model = {}\nlayers = {}\nheads = {}\nseq_len = {}\n\
         [train]\neval_every = 0\n",
        m.vocab, m.d_model, m.layers, m.heads, m.seq_len
    );
    std::fs::write(dir.join("tiny.toml"), text).unwrap();
    "tiny.toml"
}

/// The pids of `pid`'s children.
fn children(pid: u32) -> Vec<u32> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

// `compare` forwards the signal to its run, waits, removes its temporary directory, prints
// the rows finished and exits 128 + n; no run outlives it.
#[test]
fn a_signal_stops_compare_and_its_run_and_cleans_up() {
    for (signo, code) in [
        (libc::SIGTERM, 143),
        (libc::SIGINT, 130),
        (libc::SIGHUP, 129),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        let preset = tiny_preset(dir.path());
        // The first configuration stops after 2 steps (its own train.steps); the second runs on.
        let grid = "B=2,train.steps=2; B=4";
        let args = [
            "compare", preset, "--device", "cpu", "--grid", grid, "--steps", "1000000",
        ];
        let mut child = spawn(&args, dir.path(), false)
            .env("TMPDIR", &tmp)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        let run = loop {
            let recordings: Vec<_> = walk(&tmp)
                .into_iter()
                .filter(|p| p.ends_with("02-B4.jsonl"))
                .collect();
            if let Some(r) = recordings.first() {
                wait_for_a_step(r);
                break children(child.id())[0];
            }
            assert!(Instant::now() < deadline, "the second run never started");
            std::thread::sleep(Duration::from_millis(50));
        };
        signal(child.id(), signo);
        assert_eq!(wait_at_most(&mut child, 60), code);
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            stdout
                .lines()
                .nth(1)
                .unwrap_or_default()
                .starts_with("B=2,train.steps=2"),
            "{stdout}"
        );
        assert!(
            stderr.contains("compare stopped after 1 of 2 configurations"),
            "{stderr}"
        );
        assert!(
            !Path::new(&format!("/proc/{run}")).exists(),
            "the run outlived compare"
        );
        assert!(walk(&tmp).is_empty(), "left behind: {:?}", walk(&tmp));
    }
}

/// Every file and directory under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        }
        out.push(path);
    }
    out
}

// Loose validation: a signal while the tokenizer trains ends the run with a message.
#[test]
fn a_signal_before_the_run_starts_says_so() {
    let dir = tempfile::tempdir().unwrap();
    // A text of its own, so the tokenizer is trained (not found in a cache) for a few seconds.
    let mut words = Vec::new();
    let mut x = 12345u64;
    for _ in 0..300_000 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = 2 + (x >> 60) as usize % 8;
        words.push(
            (0..len)
                .map(|i| (b'a' + ((x >> (i * 5)) % 26) as u8) as char)
                .collect::<String>(),
        );
    }
    std::fs::write(dir.path().join("corpus.txt"), words.join(" ")).unwrap();
    let args = [
        "run",
        "text-bpe",
        "--headless",
        "--device",
        "cpu",
        "--data",
        "corpus.txt",
        "--set",
        "data.vocab=8000",
    ];
    let mut child = spawn(&args, dir.path(), false)
        .env("XDG_CACHE_HOME", dir.path().join("cache"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    signal(child.id(), libc::SIGTERM);
    assert_eq!(wait_at_most(&mut child, 60), 143);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("stopped by SIGTERM before the run started"),
        "{stderr}"
    );
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
        workspace: gaccwb::ops::workspace::slab_bytes() * gaccwb::ops::pool::cpu_threads() as u64,
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
