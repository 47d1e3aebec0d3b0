//! One process tree: ranks and `mpirun` die with whatever started them, refusals reach every
//! rank at once, ranks started with different runs are refused before anything is allocated,
//! and a rank that stops leaves rank 0's recording with its `end`. After each test nothing of
//! it runs and the temporary directory holds nothing of it.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::faults::{signal, start_long_run};
use super::{events, mpirun_command, run_args, spawn, steps, wait};

/// Processes whose command line holds `marker` (a test's own temporary path).
fn processes_with(marker: &str) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            // A zombie has an empty command line: it is gone, waiting to be reaped.
            (text.contains(marker) && pid != std::process::id()).then_some((pid, text))
        })
        .collect()
}

/// Waits up to `limit` for every process holding `marker` to be gone.
fn assert_all_gone(marker: &str, limit: Duration) {
    let started = Instant::now();
    loop {
        let left = processes_with(marker);
        if left.is_empty() {
            return;
        }
        if started.elapsed() > limit {
            for (pid, _) in &left {
                signal(*pid, "-KILL");
            }
            panic!("still running {limit:?} later: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The launcher's scratch directories in the temporary directory, of `pid`.
fn scratch_of(pid: u32) -> bool {
    std::env::temp_dir()
        .join(format!("gaccwb-ranks-{pid}"))
        .exists()
}

/// `gaccwb run … --ranks 2` in `dir`, headless, recording to `r.jsonl`, `steps` long.
fn launcher(dir: &Path, steps: u32, extra: &[&str]) -> Child {
    let mut args = run_args(steps, &["--record", "r.jsonl"]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--ranks".into(), "2".into()]);
    Command::new(env!("CARGO_BIN_EXE_gaccwb"))
        .current_dir(dir)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("RAYON_NUM_THREADS", "1")
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait_for_steps(path: &Path, n: usize) {
    let started = Instant::now();
    while std::fs::read_to_string(path)
        .map(|t| t.matches("\"type\":\"step\"").count() < n)
        .unwrap_or(true)
    {
        assert!(started.elapsed() < Duration::from_secs(180), "no steps");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn last_event(path: &Path) -> serde_json::Value {
    events(path).pop().unwrap()
}

/// SIGTERM, SIGINT and SIGHUP to `run --ranks 2 --headless`: the launcher exited at once and
/// `mpirun` and both ranks trained on. Now each rank gets the signal as it came, stops at the
/// next boundary, and the launcher exits 128 + n; SIGKILL to the launcher ends every rank too.
#[test]
fn every_rank_ends_with_its_launcher_on_every_signal() {
    for (sig, code, reason) in [
        ("-TERM", Some(143), "stopped by SIGTERM"),
        ("-INT", Some(130), "stopped by SIGINT"),
        ("-HUP", Some(129), "stopped by SIGHUP"),
        ("-KILL", None, ""),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().to_str().unwrap().to_string();
        let mut child = launcher(dir.path(), 100_000, &[]);
        let pid = child.id();
        let record = dir.path().join("r.jsonl");
        wait_for_steps(&record, 2);
        signal(pid, sig);
        let started = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{sig}: no exit"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_all_gone(&marker, Duration::from_secs(30));
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(status.code(), code, "{sig}: {stderr}");
        assert!(!stderr.contains("before the run started"), "{stderr}");
        if code.is_some() {
            let end = last_event(&record);
            assert_eq!(end["type"], "end", "{sig}: {end}");
            assert_eq!(end["reason"], reason, "{sig}");
        }
        assert!(!scratch_of(pid));
    }
}

/// A refusal only rank 0 checks (an existing --record) was a 60 s wait on `comm_timeout`,
/// then "no answer", with rank 0's message never shown. Under mpirun every rank ends at once
/// with it; `--ranks` refuses before starting any rank.
#[test]
fn a_refusal_of_rank_0_ends_every_rank_at_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("taken.jsonl"), "mine\n").unwrap();
    let args = run_args(5, &["--record", "taken.jsonl"]);
    let (code, text, took) = wait(
        spawn(mpirun_command(dir.path(), 2, &args)),
        Duration::from_secs(120),
    );
    assert_ne!(code, 0, "{text}");
    assert!(text.contains("taken.jsonl already exists"), "{text}");
    assert!(!text.contains("no answer"), "{text}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    let mut args = run_args(5, &["--record", "taken.jsonl"]);
    args.extend(["--ranks".into(), "2".into()]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, _, err) = crate::common::gaccwb_in(dir.path(), &refs, 60);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("taken.jsonl already exists"), "{err}");
    assert_eq!(
        std::fs::read(dir.path().join("taken.jsonl")).unwrap(),
        b"mine\n"
    );
}

/// Ranks started with different model shapes corrupted the heap ("double free or
/// corruption"); different --steps left rank 1 waiting 60 s while the recording said
/// "completed"; a different seed was accepted. Each is refused before anything is built.
#[test]
fn ranks_started_with_different_runs_are_refused_before_anything_is_built() {
    // Each rank's steps and extra arguments, and the refusal's text.
    type Start = (u32, &'static [&'static str]);
    let cases: [(Start, Start, &str); 3] = [
        (
            (3, &[]),
            (3, &["--set", "model.d_model=64"]),
            "scenario.model.d_model is 64 here, 32 on rank 0",
        ),
        (
            (5, &[]),
            (8, &[]),
            "scenario.train.steps is 8 here, 5 on rank 0",
        ),
        (
            (3, &["--seed", "1"]),
            (3, &["--seed", "2"]),
            "seed is 2 here, 1 on rank 0",
        ),
    ];
    for ((steps_a, first), (steps_b, second), expected) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut c = mpirun_command(dir.path(), 1, &run_args(steps_a, first));
        c.args([":", "-n", "1", env!("CARGO_BIN_EXE_gaccwb")])
            .args(run_args(steps_b, second));
        let (code, text, took) = wait(spawn(c), Duration::from_secs(120));
        assert_ne!(code, 0, "{text}");
        assert!(text.contains(expected), "{text}");
        assert!(
            text.contains("was started with another run than rank 0"),
            "{text}"
        );
        // The refusing rank printed its message once, before the ranks ended together.
        assert_eq!(text.matches(expected).count(), 1, "{text}");
        assert!(!text.contains("(printed above)"), "{text}");
        for crash in [
            "double free",
            "corruption",
            "free():",
            "signal 6",
            "Aborted",
        ] {
            assert!(!text.contains(crash), "{crash}: {text}");
        }
        assert!(took < Duration::from_secs(30), "took {took:?}: {text}");
    }
}

/// A rank stopped (SIGSTOP) left rank 0's recording without an `end` once the collective
/// timed out: the recording now ends saying which collective had no answer.
#[test]
fn a_stopped_rank_leaves_rank_0s_recording_with_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let record = "stopped.jsonl";
    let extra = ["--set", "train.comm_timeout=2"];
    let (child, pid) = start_long_run(dir.path(), record, &extra);
    signal(pid, "-STOP");
    let (code, text, _) = wait(child, Duration::from_secs(60));
    signal(pid, "-KILL");
    assert_ne!(code, 0, "{text}");
    let end = last_event(&dir.path().join(record));
    assert_eq!(end["type"], "end", "{end}");
    let reason = end["reason"].as_str().unwrap();
    assert!(
        reason.contains("no answer from the other ranks"),
        "{reason}"
    );
    assert!(!steps(&dir.path().join(record)).is_empty());
}

/// `compare --grid "train.ranks=2"` killed with SIGKILL orphaned the ranks; with SIGTERM it
/// did not exit within 30 s and left its recordings in the temporary directory.
#[test]
fn compare_rows_of_ranks_end_with_compare() {
    for (sig, code) in [("-TERM", Some(143)), ("-KILL", None)] {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().to_str().unwrap().to_string();
        let recordings = dir.path().join("rows");
        let grid = format!("train.ranks=2,{}", crate::common::TINY.sets().join(","));
        let mut child = Command::new(env!("CARGO_BIN_EXE_gaccwb"))
            .current_dir(dir.path())
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
            .env("RAYON_NUM_THREADS", "1")
            .args([
                "compare", "baseline", "--device", "cpu", "--steps", "100000",
            ])
            .args(["--grid", &grid, "--record-dir"])
            .arg(&recordings)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while !std::fs::read_dir(&recordings).is_ok_and(|d| {
            d.flatten().any(|e| {
                std::fs::read_to_string(e.path())
                    .is_ok_and(|t| t.matches("\"type\":\"step\"").count() >= 2)
            })
        }) {
            assert!(started.elapsed() < Duration::from_secs(180), "no steps");
            std::thread::sleep(Duration::from_millis(100));
        }
        signal(child.id(), sig);
        let started = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{sig}: compare runs on"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(status.code(), code, "{sig}");
        assert_all_gone(&marker, Duration::from_secs(30));
    }
}

/// The screen of `run --ranks 2` killed with SIGKILL left `mpirun` and both ranks training
/// and a scratch recording growing in the temporary directory; space froze the display while
/// the ranks trained on.
#[test]
fn killing_the_screen_of_ranks_ends_every_rank_and_leaves_no_scratch() {
    crate::common::tmux::require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().to_str().unwrap().to_string();
    let tmux = crate::common::tmux::Tmux::start("ranks-kill");
    let mut args = run_args(100_000, &[]);
    args.retain(|a| a != "--headless");
    let command = format!(
        "cd {}; OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
         OMPI_MCA_rmaps_base_oversubscribe=1 RAYON_NUM_THREADS=1 {} {} --ranks 2 \
         --checkpoint-dir {marker}/unused; echo EXIT=$?",
        dir.path().display(),
        env!("CARGO_BIN_EXE_gaccwb"),
        args.join(" "),
    );
    tmux.send(&[&command, "Enter"]);
    tmux.wait_for("the ranks' steps", Duration::from_secs(180), |s| {
        s.contains("FOLLOWING") && s.contains("Comm · 2 mpi ranks")
    });
    tmux.send(&["Space"]);
    tmux.wait_for("the note on pausing", Duration::from_secs(30), |s| {
        s.contains("the ranks cannot pause")
    });
    let launcher = processes_with(&marker)
        .into_iter()
        .find(|(_, cmd)| cmd.contains("--ranks 2"))
        .expect("the launcher")
        .0;
    signal(launcher, "-KILL");
    assert_all_gone(&marker, Duration::from_secs(30));
    assert!(!scratch_of(launcher), "the scratch directory was left");
}
