//! Files: every file gaccwb creates is a regular file it may write, and every file it reads is
//! bounded. Each test is a break-it case run against the binary, and checks the exit code and
//! what is on disk before and after. Tests that make device nodes need root: elsewhere they say
//! why they skipped, and under `CI=true` they fail instead.

use std::ffi::CString;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common;

use common::{gaccwb, TINY};

/// `run --headless` of the tiny model for 2 steps, with `extra` arguments.
fn headless(extra: &[&str], dir: &Path) -> (i32, String, String) {
    common::headless_tiny(dir, "2", extra)
}

fn c_path(path: &Path) -> CString {
    CString::new(path.to_str().unwrap()).unwrap()
}

fn mkfifo(path: &Path) {
    let c = c_path(path);
    // SAFETY: a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0, "mkfifo");
}

/// A character device like `/dev/null` (1, 3) at `path`, or `false` when this process may not
/// make one (not root): the reason is printed, and under `CI=true` that is a failure.
fn null_device(path: &Path) -> bool {
    let c = c_path(path);
    // SAFETY: a NUL-terminated path that lives across the call.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    if rc == 0 {
        return true;
    }
    let why = std::io::Error::last_os_error();
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "CI=true but mknod {} failed ({why}): this test needs root",
        path.display()
    );
    eprintln!("skipped: mknod needs root ({why})");
    false
}

fn is_char_device(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_char_device())
}

fn is_fifo(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_fifo())
}

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A recording of a 2-step tiny run at `dir/name`.
fn recording(dir: &Path, name: &str) -> PathBuf {
    let (code, _, stderr) = headless(&["--record", name], dir);
    assert_eq!(code, 0, "{stderr}");
    dir.join(name)
}

/// A preset file in `dir` (the runs that use it are refused before they start).
fn preset_file(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.toml");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("presets/baseline.toml"),
        &path,
    )
    .unwrap();
    path
}

/// Each command, aimed with `--force` at a special file `target` in `dir`, is refused with exit
/// 2 (1 for export, which reports output problems as failures) naming the kind, and `target`
/// is still what it was.
fn refused_at(dir: &Path, target: &str, kind: &str, still: fn(&Path) -> bool) {
    recording(dir, "rec.jsonl");
    let cases: [&[&str]; 5] = [
        &["run", "--headless", "--steps", "2", "--record", target],
        &["export", "rec.jsonl", "--to", "svg", "-o", target],
        &["export", "rec.jsonl", "--to", "cast", "-o", target],
        &["compare", "--grid", "B=2", "--steps", "2", "--csv", target],
        &["compare", "--grid", "B=2", "--steps", "2", "--svg", target],
    ];
    for case in cases {
        let mut args = case.to_vec();
        args.push("--force");
        let (code, _, stderr) = gaccwb(&args, dir);
        assert_ne!(code, 0, "{args:?} succeeded");
        assert!(
            stderr.contains(kind) && stderr.contains("not a regular file"),
            "{args:?}: {stderr}"
        );
        assert!(still(&dir.join(target)), "{args:?} replaced {target}");
    }
}

// `--force` never replaces a device node with a regular file.
#[test]
fn force_leaves_a_device_node_a_device_node() {
    let dir = tempfile::tempdir().unwrap();
    if !null_device(&dir.path().join("dev")) {
        return;
    }
    // The repro first, with its exit code.
    let (code, _, stderr) = headless(&["--record", "dev", "--force"], dir.path());
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("dev is a character device"), "{stderr}");
    assert!(is_char_device(&dir.path().join("dev")));
    refused_at(dir.path(), "dev", "character device", is_char_device);
}

// Without root: a FIFO is not replaced either.
#[test]
fn force_leaves_a_fifo_a_fifo() {
    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("fifo"));
    refused_at(dir.path(), "fifo", "FIFO", is_fifo);
}

// `compare`'s --record-dir and a checkpoint directory holding device nodes.
#[test]
fn record_dir_and_checkpoint_files_that_are_devices_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("keep")).unwrap();
    std::fs::create_dir_all(d.join("ck")).unwrap();
    if !null_device(&d.join("keep/01-B2.jsonl")) || !null_device(&d.join("ck/checkpoint.json")) {
        return;
    }
    let compare = [
        "compare",
        "--grid",
        "B=2",
        "--steps",
        "2",
        "--record-dir",
        "keep",
        "--force",
    ];
    let (code, _, stderr) = gaccwb(&compare, d);
    assert_ne!(code, 0, "{stderr}");
    assert!(stderr.contains("character device"), "{stderr}");
    assert!(is_char_device(&d.join("keep/01-B2.jsonl")));

    let ck = [
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        "ck",
        "--force",
    ];
    let (code, _, stderr) = headless(&ck, d);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("character device"), "{stderr}");
    assert!(is_char_device(&d.join("ck/checkpoint.json")));
}

// A second run saving into a directory a running run saves into is refused, naming it.
#[test]
fn a_second_run_cannot_share_a_checkpoint_directory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = TINY.args();
    let mut first = std::process::Command::new(assert_cmd::cargo::cargo_bin("gaccwb"))
        .current_dir(d)
        .args(["run", "--headless", "--device", "cpu", "--steps", "0"])
        .args(&model)
        .args(["--checkpoint-every", "100000", "--checkpoint-dir", "s"])
        .args(["--record", "first.jsonl"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The recording is opened after the checkpoint directory is claimed.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !d.join("first.jsonl").exists() {
        assert!(Instant::now() < deadline, "the first run did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = headless(&["--checkpoint-every", "1", "--checkpoint-dir", "s"], d);
    // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped.
    unsafe { libc::kill(first.id() as i32, libc::SIGTERM) };
    let status = first.wait().unwrap();
    let (code, _, stderr) = second;
    assert_eq!(code, 2, "the second run was not refused: {stderr}");
    assert!(
        stderr.contains(&format!("pid {}", first.id())),
        "the holder is not named: {stderr}"
    );
    assert!(
        !d.join("s/checkpoint.json").exists(),
        "the second run saved"
    );
    assert_eq!(status.code(), Some(143));
}

// --log never appends to one of the run's inputs.
#[test]
fn log_may_not_name_an_input() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    preset_file(d);
    std::fs::write(d.join("data.txt"), "some text to train on, ".repeat(200)).unwrap();
    std::fs::write(d.join("keys.toml"), "[keys]\nquit = \"Q\"\n").unwrap();
    recording(d, "rec.jsonl");
    let (code, _, stderr) = headless(&["--checkpoint-every", "2", "--checkpoint-dir", "ck"], d);
    assert_eq!(code, 0, "{stderr}");
    let model = TINY.args();
    let model: Vec<&str> = model.iter().map(String::as_str).collect();
    fn run<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut a = vec!["run", "--headless", "--device", "cpu", "--steps", "2"];
        a.extend_from_slice(extra);
        a
    }
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("tiny.toml", {
            let mut a = run(&["tiny.toml"]);
            a.extend(&model);
            a
        }),
        ("data.txt", {
            let mut a = run(&["--data", "data.txt"]);
            a.extend(&model);
            a
        }),
        ("keys.toml", {
            let mut a = run(&["--keys", "keys.toml"]);
            a.extend(&model);
            a
        }),
        (
            "ck/checkpoint.json",
            vec!["run", "--headless", "--resume", "ck", "--steps", "3"],
        ),
        (
            "rec.jsonl",
            vec!["export", "rec.jsonl", "--to", "svg", "-o", "x.svg"],
        ),
        ("rec.jsonl", vec!["replay", "--headless", "rec.jsonl"]),
    ];
    for (input, args) in cases {
        let before = std::fs::read(d.join(input)).unwrap();
        // `--log` after the command: before it, `gaccwb --log F run` reads `run` as a preset.
        let mut with_log = args.clone();
        with_log.extend(["--log", input]);
        let (code, _, stderr) = gaccwb(&with_log, d);
        assert_eq!(code, 2, "{with_log:?}: {stderr}");
        assert!(
            stderr.contains("is an input of this run"),
            "{with_log:?}: {stderr}"
        );
        assert_eq!(
            std::fs::read(d.join(input)).unwrap(),
            before,
            "{input} changed"
        );
    }
}

// `compare`'s --csv/--svg never replace the preset it reads.
#[test]
fn compare_outputs_may_not_replace_the_preset() {
    let dir = tempfile::tempdir().unwrap();
    let preset = preset_file(dir.path());
    let before = std::fs::read(&preset).unwrap();
    for flag in ["--csv", "--svg"] {
        let args = [
            "compare",
            "tiny.toml",
            "--grid",
            "B=2",
            "--steps",
            "2",
            flag,
            "tiny.toml",
            "--force",
        ];
        let (code, _, stderr) = gaccwb(&args, dir.path());
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains("the preset"), "{stderr}");
        assert_eq!(std::fs::read(&preset).unwrap(), before);
    }
}

// A CSV export never replaces the recording it reads, even when it is one of its outputs.
#[test]
fn csv_export_may_not_replace_its_recording() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("d")).unwrap();
    let rec = recording(d, "d/steps.csv");
    let before = std::fs::read(&rec).unwrap();
    let args = ["export", "d/steps.csv", "--to", "csv", "-o", "d", "--force"];
    let (code, _, stderr) = gaccwb(&args, d);
    assert_ne!(code, 0, "{stderr}");
    assert!(stderr.contains("the recording"), "{stderr}");
    assert_eq!(std::fs::read(&rec).unwrap(), before);
    assert_eq!(listing(&d.join("d")), ["steps.csv"], "nothing else written");
}

// --record naming a directory is refused, and nothing is left behind.
#[test]
fn record_to_a_directory_is_refused_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("somedir")).unwrap();
    let (code, stdout, stderr) = headless(&["--record", "somedir", "--force"], d);
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stderr.contains("somedir is a directory"), "{stderr}");
    assert_eq!(listing(d), ["somedir"]);
    assert!(listing(&d.join("somedir")).is_empty());
}

// A tokenizer file that never ends, or a FIFO, is refused at once with its path.
#[test]
fn an_endless_or_blocking_tokenizer_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("data.txt"), "some text to train on, ".repeat(200)).unwrap();
    mkfifo(&d.join("tok.fifo"));
    for file in ["/dev/zero", "tok.fifo"] {
        let set = format!("data.tokenizer_file=\"{file}\"");
        let started = Instant::now();
        let (code, _, stderr) = headless(
            &[
                "--data",
                "data.txt",
                "--set",
                "data.tokenizer=\"bpe\"",
                "--set",
                &set,
            ],
            d,
        );
        assert_ne!(code, 0, "{stderr}");
        assert!(
            stderr.contains(file) && stderr.contains("not a regular file"),
            "{stderr}"
        );
        assert!(started.elapsed() < Duration::from_secs(30));
    }
}

// --log naming a FIFO nobody reads, or a device that is not a terminal, is refused at once.
#[test]
fn log_to_a_fifo_or_a_device_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    mkfifo(&d.join("log.fifo"));
    for log in ["log.fifo", "/dev/null"] {
        for command in [&["estimate"][..], &["run", "--headless", "--steps", "1"]] {
            let mut args = command.to_vec();
            args.extend(["--log", log]);
            let (code, _, stderr) = gaccwb(&args, d);
            assert_eq!(code, 2, "{args:?}: {stderr}");
            assert!(stderr.contains("not a regular file"), "{args:?}: {stderr}");
        }
    }
    assert!(is_fifo(&d.join("log.fifo")));
}
