//! Inputs are inputs, reads are bounded, a follower notices a writer that is gone, a checkpoint
//! refuses tensors it was not saved with, and numbers from the user are bounded: each case is a
//! regression test named after its rule (docs/ROBUSTNESS.md lists them).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, gaccwb, TINY};

fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0, "mkfifo");
}

/// The files in `dir`, names only, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// `gaccwb run --headless` of the tiny model for `steps` steps, spawned in `dir`.
fn spawn_run(dir: &Path, steps: &str, extra: &[&str]) -> std::process::Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gaccwb"));
    c.current_dir(dir)
        .args(["run", "--headless", "--device", "cpu", "--steps", steps])
        .args(TINY.args())
        .args(extra)
        .env("RAYON_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().unwrap()
}

/// Waits until `path` holds at least `n` step events.
fn wait_for_steps(path: &Path, n: usize) {
    let started = Instant::now();
    while std::fs::read_to_string(path)
        .map(|t| t.matches("\"type\":\"step\"").count() < n)
        .unwrap_or(true)
    {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no steps in {path:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

// --- Inputs are inputs -----------------------------------------------------------------

/// `--record c.ctl --force --controls-from c.ctl` replaced the controls file.
#[test]
fn record_may_not_replace_the_controls_file_even_forced() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("c.ctl"), "").unwrap();
    let model = TINY.args();
    let mut args = vec!["run", "--headless", "--device", "cpu", "--steps", "2"];
    args.extend(model.iter().map(String::as_str));
    args.extend(["--record", "c.ctl", "--force", "--controls-from", "c.ctl"]);
    let (code, _, stderr) = gaccwb(&args, dir.path());
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("the controls file"), "{stderr}");
    assert_eq!(std::fs::read(dir.path().join("c.ctl")).unwrap(), b"");
}

/// `run --model DIR --record DIR/model.safetensors --force` replaced the model's weights with
/// the recording.
#[test]
fn record_may_not_replace_a_file_of_the_model_even_forced() {
    let dir = tempfile::tempdir().unwrap();
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/models/gpt2-tied");
    let model = dir.path().join("m");
    std::fs::create_dir(&model).unwrap();
    for name in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(source.join(name), model.join(name)).unwrap();
    }
    let weights = std::fs::read(model.join("model.safetensors")).unwrap();
    let run = [
        "run",
        "finetune",
        "--model",
        "m",
        "--set",
        "model.seq_len=16",
        "--headless",
        "--steps",
        "1",
    ];
    let record = [&run[..], &["--record", "m/model.safetensors", "--force"]].concat();
    let log = [&["--log", "m/config.json"], &run[..]].concat();
    for args in [record, log] {
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains("the model's file"), "{args:?}: {stderr}");
    }
    assert_eq!(
        std::fs::read(model.join("model.safetensors")).unwrap(),
        weights
    );
    assert!(std::fs::read_to_string(model.join("config.json"))
        .unwrap()
        .contains("gpt2"));
}

/// `compare --grid 'data.path="corpus.txt",…' --csv corpus.txt --force` overwrote the corpus.
#[test]
fn compare_outputs_may_not_replace_a_grid_items_data() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = "the corpus a grid item trains on\n".repeat(200);
    std::fs::write(dir.path().join("corpus.txt"), &corpus).unwrap();
    let grid = "data.path=\"corpus.txt\",data.source=\"file\",model.vocab=256";
    for out in ["--csv", "--svg"] {
        let args = [
            "compare",
            "baseline",
            "--grid",
            grid,
            "--steps",
            "1",
            out,
            "corpus.txt",
            "--force",
        ];
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 2, "{out}: {stderr}");
        assert!(
            stderr.contains("is an input of this run (the corpus"),
            "{stderr}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("corpus.txt")).unwrap(),
            corpus
        );
    }
}

/// A recording whose writes fail part-way (here the file-size limit, as a full disk fails
/// them) left the new partial file in place of the old one under `--force`.
#[test]
fn a_recording_that_cannot_be_written_whole_never_replaces_the_old_one() {
    let dir = tempfile::tempdir().unwrap();
    let old = b"{\"an old recording\": \"kept whole\"}\n".repeat(10);
    let record = dir.path().join("r.jsonl");
    std::fs::write(&record, &old).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_gaccwb"));
    c.current_dir(dir.path())
        .args(["run", "--headless", "--device", "cpu", "--steps", "0"])
        .args(TINY.args())
        .args(["--record", "r.jsonl", "--force"])
        .env("RAYON_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: runs in the child before exec; setrlimit and signal are async-signal-safe.
    unsafe {
        c.pre_exec(|| {
            // Writes past 64 KiB fail with EFBIG instead of raising SIGXFSZ.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: 64 << 10,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("r.jsonl"), "{stderr}");
    assert_eq!(
        std::fs::read(&record).unwrap(),
        old,
        "the old recording changed"
    );
    assert_eq!(names(dir.path()), ["r.jsonl"], "a temporary file was left");
}

// --- Bounded, non-blocking reads --------------------------------------------------------

/// `--controls-from FIFO` blocked before the run and left a 0-byte recording; a directory
/// was never read and the run exited 0.
#[test]
fn a_controls_file_that_is_a_fifo_or_a_directory_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("fifo"));
    std::fs::create_dir(dir.path().join("ctl.d")).unwrap();
    for (path, kind) in [("fifo", "a FIFO"), ("ctl.d", "a directory")] {
        let model = TINY.args();
        let mut args = vec!["run", "--headless", "--device", "cpu", "--steps", "2"];
        args.extend(model.iter().map(String::as_str));
        args.extend(["--record", "r.jsonl", "--controls-from", path]);
        let started = Instant::now();
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 2, "{path}: {stderr}");
        assert!(stderr.contains(kind) && stderr.contains(path), "{stderr}");
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(
            !dir.path().join("r.jsonl").exists(),
            "a recording was started"
        );
    }
}

/// A controls line that never ends grew without bound; an invalid UTF-8 line and a `pause`
/// (which would freeze a headless run for good) went unreported.
#[test]
fn controls_lines_that_cannot_be_taken_are_reported_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("c.ctl");
    let mut text = vec![b'x'; 200 << 10];
    text.extend(b"\n\xff\xfe\n{\"kind\": \"pause\"}\n{\"kind\": \"set_clip\", \"value\": 0.5}\n");
    std::fs::write(&ctl, text).unwrap();
    let child = spawn_run(
        dir.path(),
        "6",
        &["--record", "r.jsonl", "--controls-from", "c.ctl"],
    );
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("c.ctl:1: skipped: a line longer than 64 KiB"),
        "{stderr}"
    );
    assert!(
        stderr.contains("c.ctl:2: skipped: not UTF-8 text"),
        "{stderr}"
    );
    assert!(
        stderr.contains("c.ctl:3: skipped: a headless run has no screen"),
        "{stderr}"
    );
}

/// `estimate --config FIFO` blocked forever and `--config /dev/zero` read until memory ran out.
#[test]
fn estimate_refuses_a_config_that_is_a_fifo_or_endless_at_once() {
    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("config.json"));
    for path in ["config.json", "/dev/zero"] {
        let started = Instant::now();
        let (code, _, stderr) = gaccwb(&["estimate", "--config", path], dir.path());
        assert_eq!(code, 2, "{path}: {stderr}");
        assert!(stderr.contains("not a regular file"), "{stderr}");
        assert!(started.elapsed() < Duration::from_secs(30));
    }
}

/// `replay --follow /dev/zero` grew without bound; a FIFO blocked.
#[test]
fn replay_follow_refuses_an_endless_or_blocking_file() {
    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("fifo.jsonl"));
    for path in ["/dev/zero", "fifo.jsonl"] {
        let (code, _, stderr) = gaccwb(&["replay", "--follow", "--headless", path], dir.path());
        assert_ne!(code, 0, "{path}: {stderr}");
        assert!(stderr.contains("not a regular file"), "{stderr}");
    }
}

/// `replay --follow --headless REC` waited forever once REC's writer had died.
#[test]
fn replay_follow_ends_when_the_writer_is_gone_without_an_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut run = spawn_run(dir.path(), "0", &["--record", "r.jsonl"]);
    let record = dir.path().join("r.jsonl");
    wait_for_steps(&record, 2);
    run.kill().unwrap();
    run.wait().unwrap();
    let started = Instant::now();
    let (code, stdout, stderr) =
        gaccwb(&["replay", "--follow", "--headless", "r.jsonl"], dir.path());
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("without an end event"), "{stderr}");
    assert!(stderr.contains("has exited"), "{stderr}");
    assert!(stdout.contains("no end of the run in it"), "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// During a `--force` run, `replay --follow OLD` showed the old recording (complete, so it
/// ended at once) while the new run trained beside it.
#[test]
fn replay_follow_of_a_file_being_replaced_follows_the_new_run() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = common::headless_tiny(dir.path(), "2", &["--record", "r.jsonl"]);
    assert_eq!(code, 0, "{stderr}");
    let run = spawn_run(dir.path(), "40", &["--record", "r.jsonl", "--force"]);
    // The replacement exists once the new run has started recording.
    let started = Instant::now();
    while !names(dir.path()).iter().any(|n| n.starts_with(".r.jsonl.")) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{:?}",
            names(dir.path())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, stdout, stderr) =
        gaccwb(&["replay", "--follow", "--headless", "r.jsonl"], dir.path());
    assert!(run.wait_with_output().unwrap().status.success());
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("following that run"), "{stderr}");
    assert!(stdout.starts_with("40 steps (completed)"), "{stdout}");
}

// --- Checkpoints ------------------------------------------------------------------------

/// A checkpoint of `steps` steps saved into `dir/ck`.
fn checkpoint(dir: &Path, steps: &str) -> PathBuf {
    let args = ["--checkpoint-every", steps, "--checkpoint-dir", "ck"];
    let (code, _, stderr) = common::headless_tiny(dir, steps, &args);
    assert_eq!(code, 0, "{stderr}");
    dir.join("ck")
}

fn resume(dir: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["run", "--headless", "--device", "cpu", "--resume", "ck"];
    args.extend_from_slice(extra);
    gaccwb(&args, dir)
}

/// 500 overwritten weights in `step-*.safetensors` resumed "completed" with a loss of 270.
#[test]
fn a_checkpoint_whose_tensors_were_changed_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(dir.path(), "2");
    let tensors = ck.join("step-00000002.safetensors");
    let mut bytes = std::fs::read(&tensors).unwrap();
    let end = bytes.len();
    bytes[end - 2000..end].fill(0x41);
    std::fs::write(&tensors, bytes).unwrap();
    let (code, _, stderr) = resume(dir.path(), &["--steps", "4"]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("step-00000002.safetensors"), "{stderr}");
    assert!(stderr.contains("not the tensors"), "{stderr}");
}

/// A checkpoint of 2 ranks resumed on 1 silently (W·K·B changed).
#[test]
fn a_checkpoint_of_other_ranks_is_refused_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(dir.path(), "2");
    common::edit_checkpoint(&ck.join("checkpoint.json"), |j| j["ranks"] = 2.into());
    let (code, _, stderr) = resume(dir.path(), &["--steps", "4"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("saved by a run of 2 rank(s), resumed on 1"),
        "{stderr}"
    );
}

/// `--resume` past `--steps` said "completed"; `--resume DIR --checkpoint-every N` saved into
/// ./checkpoints; a killed save's `.step-N.safetensors.PID.tmp` stayed forever.
#[test]
fn a_resumed_run_saves_into_its_checkpoint_refuses_nothing_to_do_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(dir.path(), "2");
    let (code, _, stderr) = resume(dir.path(), &["--steps", "2"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("nothing is left to train"), "{stderr}");
    // Left by a process that no longer runs (pid 2^22 + 1 is above Linux's pid range).
    let stale = ck.join(".step-00000001.safetensors.4194305.tmp");
    std::fs::write(&stale, b"partial").unwrap();
    let (code, _, stderr) = resume(dir.path(), &["--steps", "4", "--checkpoint-every", "2"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(!dir.path().join("checkpoints").exists());
    assert!(
        ck.join("step-00000004.safetensors").exists(),
        "{:?}",
        names(&ck)
    );
    assert!(!stale.exists(), "{:?}", names(&ck));
}

// --- Numbers from the user ----------------------------------------------------------------

/// Each (arguments, text the refusal holds): exit 2, one line, before anything runs or prints.
#[test]
fn numbers_beyond_their_bounds_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 10] = [
        (&["bench", "--warmup", "18446744073709551615"], "--warmup"),
        (&["bench", "--steps", "18446744073709551615"], "--steps"),
        (
            &["bench", "--warmup", "18446744073709551615", "--json"],
            "--warmup",
        ),
        (&["bench", "--case", "1000000000,1"], "--case 1000000000,1"),
        (
            &[
                "bench", "--ranks", "2", "--case", "2,2", "--dtype", "f32,bf16",
            ],
            "--case, --dtype cannot be used with it",
        ),
        (
            &[
                "export",
                "x.jsonl",
                "--to",
                "cast",
                "-o",
                "x.cast",
                "--size",
                "65535x65535",
            ],
            "to 1000x1000",
        ),
        (
            &["estimate", "--ranks", "18446744073709551615"],
            "at most 65536",
        ),
        // The value as short as given, not 300 digits.
        (
            &["estimate", "--mfu", "1e-300"],
            "--mfu 1e-300: expected a fraction",
        ),
        (
            &["estimate", "--pcie-gbps", "1e300"],
            "--pcie-gbps 1e300: expected",
        ),
        (&["run", "--headless", "--ranks", "1025"], "at most 1024"),
    ];
    for (args, expected) in cases {
        let (code, stdout, stderr) = gaccwb(args, dir.path());
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?} printed: {stdout}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// `--budget 1.5` was 1 byte; a number beyond 2^64 said "must be at least 1 byte".
#[test]
fn a_budget_is_whole_bytes_or_a_size_with_a_unit() {
    let dir = tempfile::tempdir().unwrap();
    for (budget, expected) in [
        ("1.5", "whole number"),
        ("18446744073709551616", "beyond the largest budget"),
    ] {
        let (code, _, stderr) = common::headless_tiny(dir.path(), "1", &["--budget", budget]);
        assert_eq!(code, 2, "{budget}: {stderr}");
        assert!(stderr.contains(expected), "{budget}: {stderr}");
    }
}

/// The error named `--effective 4294967296` when no --effective was given, and `--ranks`
/// when the preset's `train.ranks` asked for ranks.
#[test]
fn errors_name_what_the_user_gave() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = gaccwb(
        &[
            "estimate",
            "--set",
            "train.micro_batch=65536",
            "--set",
            "train.accum_steps=65536",
        ],
        dir.path(),
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(!stderr.contains("--effective 4294967296"), "{stderr}");
    assert!(
        stderr.contains("train.micro_batch × train.accum_steps"),
        "{stderr}"
    );
    // Each cause is said once (a missing --config said "cannot read" twice).
    let (_, _, stderr) = gaccwb(&["estimate", "--config", "missing.json"], dir.path());
    assert_eq!(stderr.matches("cannot read").count(), 1, "{stderr}");
    if !cfg!(feature = "mpi") {
        let (code, _, stderr) = common::headless_tiny(dir.path(), "1", &["--set", "train.ranks=2"]);
        assert_eq!(code, 2, "{stderr}");
        assert!(
            stderr.contains("train.ranks 2 needs a gaccwb built with MPI"),
            "{stderr}"
        );
    }
}

/// A preset name with escape sequences reached the terminal raw through `estimate`.
#[test]
fn estimate_prints_no_escape_sequence_from_a_preset() {
    let dir = tempfile::tempdir().unwrap();
    let preset = "name = \"evil\\u001b[2J\\u001b]0;pwned\\u0007\"\n";
    std::fs::write(dir.path().join("evil.toml"), preset).unwrap();
    let (code, stdout, stderr) = gaccwb(&["estimate", "evil.toml"], dir.path());
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("evil"), "{stdout}");
    assert!(
        !stdout.contains('\u{1b}') && !stdout.contains('\u{7}'),
        "{stdout:?}"
    );
}

/// `estimate --gpu-model cpu --json` wrote the host's unbounded links as `null`.
#[test]
fn estimate_json_carries_no_null_for_a_number() {
    let dir = tempfile::tempdir().unwrap();
    let (code, stdout, stderr) = gaccwb(&["estimate", "--gpu-model", "cpu", "--json"], dir.path());
    assert_eq!(code, 0, "{stderr}");
    // `null` stands only for something absent (no blocker, no experts, no LoRA), never for a
    // number.
    fn nulls(v: &serde_json::Value, key: &str, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Null => out.push(key.to_string()),
            serde_json::Value::Object(m) => m.iter().for_each(|(k, v)| nulls(v, k, out)),
            serde_json::Value::Array(a) => a.iter().for_each(|v| nulls(v, key, out)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    nulls(&serde_json::from_str(&stdout).unwrap(), "", &mut found);
    let absent = [
        "blocker",
        "experts",
        "sliding",
        "wrapper",
        "lora",
        "engine_unavailable",
    ];
    assert!(
        found.iter().all(|k| absent.contains(&k.as_str())),
        "{found:?}"
    );
}

/// `--keys` was ignored headless, so a keymap that could not be read passed.
#[test]
fn a_bad_keymap_is_refused_headless_too() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keys.toml"), "[keys]\nquit = \"meta-q\"\n").unwrap();
    let (code, _, stderr) = common::headless_tiny(dir.path(), "1", &["--keys", "keys.toml"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("keys.toml:2"), "{stderr}");
}

/// A CSV export cut short (a write failing, here at the file-size limit) left a lone
/// `steps.csv` that refused the next export.
#[test]
fn a_csv_export_cut_short_leaves_none_of_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = common::headless_tiny(dir.path(), "3", &["--record", "r.jsonl"]);
    assert_eq!(code, 0, "{stderr}");
    let (code, _, stderr) = gaccwb(
        &["export", "r.jsonl", "--to", "csv", "-o", "whole"],
        dir.path(),
    );
    assert_eq!(code, 0, "{stderr}");
    let size = |name: &str| {
        std::fs::metadata(dir.path().join("whole").join(name))
            .unwrap()
            .len()
    };
    // A limit steps.csv fits under and memory.csv does not: the second file fails.
    let (steps, memory) = (size("steps.csv"), size("memory.csv"));
    assert!(steps < memory, "{steps} {memory}");
    let limit = (steps + memory) / 2;
    let mut c = Command::new(env!("CARGO_BIN_EXE_gaccwb"));
    c.current_dir(dir.path())
        .args(["export", "r.jsonl", "--to", "csv", "-o", "cut"]);
    // SAFETY: runs in the child before exec; setrlimit and signal are async-signal-safe.
    unsafe {
        c.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let l = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = c.output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(names(&dir.path().join("cut")), Vec::<String>::new());
}

// --- The exit-code table ----------------------------------------------------------------

/// One command per row of docs/ROBUSTNESS.md's exit-code table (the signal rows are
/// `robustness::sigterm_sigint_and_sighup_end_the_run_with_the_conventional_code`). A missing
/// `--config` exited 2 where the table says a file that cannot be read is 1.
#[test]
fn the_exit_code_table_holds_row_by_row() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = common::headless_tiny(dir.path(), "1", &["--record", "r.jsonl"]);
    assert_eq!(code, 0, "a completed run: {stderr}");
    std::fs::write(dir.path().join("out.csv"), "mine").unwrap();
    let rows: [(&[&str], i32); 9] = [
        // 1: a file that cannot be read or written, an export output that exists.
        (&["estimate", "--config", "missing.json"], 1),
        (&["replay", "--headless", "missing.jsonl"], 1),
        (&["export", "r.jsonl", "--to", "svg", "-o", "out.csv"], 1),
        // 2: a bad flag or value, a keymap, an existing --record, a non-regular output.
        (&["run", "--no-such-flag"], 2),
        (
            &[
                "run",
                "--headless",
                "--steps",
                "1",
                "--keys",
                "missing.toml",
            ],
            2,
        ),
        (
            &["run", "--headless", "--steps", "1", "--record", "r.jsonl"],
            2,
        ),
        (
            &["run", "--headless", "--steps", "1", "--set", "train.lr=-1"],
            2,
        ),
        (&["run", "--headless", "--steps", "1", "--record", "."], 2),
        (&["estimate", "--offload", "optimizer,optimizer"], 2),
    ];
    for (args, expected) in rows {
        let (code, _, stderr) = gaccwb(args, dir.path());
        assert_eq!(code, expected, "{args:?}: {stderr}");
    }
}
