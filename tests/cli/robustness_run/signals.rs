//! Signals, closed pipes, unwritable output and few file descriptors: a run ends cleanly,
//! leaves no child behind, and says why.

use super::*;

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
        // The reader is gone before the child starts (`| true` that already exited): closed
        // after spawning, a quick command could fill the pipe's buffer first and exit 0.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = spawn(args, dir.path(), tiny)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
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
pub(super) fn tiny_preset(dir: &Path) -> &'static str {
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
pub(super) fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
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
