//! Ranks that die, hang or disagree, and ranks started by `run --ranks` on and off the screen.

use super::*;

/// The process id of rank `rank` among the processes whose command line holds `marker`.
fn rank_pid(marker: &str, rank: usize) -> Option<u32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let path = e.ok()?.path();
        let pid: u32 = path.file_name()?.to_str()?.parse().ok()?;
        let cmdline = std::fs::read(path.join("cmdline")).ok()?;
        let environ = std::fs::read(path.join("environ")).ok()?;
        let has = |bytes: &[u8], s: &str| bytes.split(|&b| b == 0).any(|p| p == s.as_bytes());
        let ours = cmdline.split(|&b| b == 0).any(|p| p == marker.as_bytes());
        (ours && !cmdline.starts_with(b"mpirun") && has(&environ, &want)).then_some(pid)
    })
}

/// Starts a long two-rank run recording into `record`, and waits for its second step.
pub(crate) fn start_long_run(dir: &Path, record: &str, extra: &[&str]) -> (Child, u32) {
    let mut all = vec!["--record", record];
    all.extend_from_slice(extra);
    let child = spawn(mpirun_command(dir, 2, &run_args(100_000, &all)));
    let path = dir.join(record);
    let started = Instant::now();
    while std::fs::read_to_string(&path)
        .map(|t| t.matches("\"type\":\"step\"").count() < 2)
        .unwrap_or(true)
    {
        assert!(started.elapsed() < Duration::from_secs(120), "no steps");
        std::thread::sleep(Duration::from_millis(50));
    }
    let marker = path.file_name().unwrap().to_str().unwrap().to_string();
    let pid = rank_pid(&marker, 1).expect("rank 1's process");
    (child, pid)
}

pub(crate) fn signal(pid: u32, sig: &str) {
    Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
}

/// Every line of rank 0's recording is whole, and its steps run 1, 2, … without a gap.
fn assert_recording_whole(path: &Path) {
    let numbers: Vec<u64> = steps(path)
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    assert!(numbers.len() >= 2);
    assert!(
        numbers.iter().copied().eq(1..=numbers.len() as u64),
        "{numbers:?}"
    );
}

#[test]
fn a_killed_rank_ends_the_job_naming_it_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let (child, pid) = start_long_run(dir.path(), "killed.jsonl", &[]);
    signal(pid, "-KILL");
    let (code, text, took) = wait(child, Duration::from_secs(60));
    eprintln!("the job ended {took:?} after rank 1 was killed");
    assert_ne!(code, 0, "{text}");
    assert!(text.contains("rank 1"), "the rank is not named:\n{text}");
    assert!(took < Duration::from_secs(10), "took {took:?}:\n{text}");
    assert_recording_whole(&dir.path().join("killed.jsonl"));
}

#[test]
fn a_stuck_rank_ends_the_job_when_the_collective_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let timeout = ["--set", "train.comm_timeout=2"];
    let (child, pid) = start_long_run(dir.path(), "stuck.jsonl", &timeout);
    signal(pid, "-STOP");
    let (code, text, took) = wait(child, Duration::from_secs(60));
    eprintln!("the job ended {took:?} after rank 1 was stopped");
    signal(pid, "-KILL");
    assert_ne!(code, 0, "{text}");
    assert!(
        text.contains("rank 0") && text.contains("no answer from the other ranks in 2 s"),
        "{text}"
    );
    assert!(took < Duration::from_secs(15), "took {took:?}:\n{text}");
    assert_recording_whole(&dir.path().join("stuck.jsonl"));
}

/// Open MPI's `A : B` starts rank 0 with one clip and rank 1 with another: the ranks say so
/// before they start, rather than training different models.
#[test]
fn ranks_that_disagree_on_knobs_stop_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = mpirun_command(dir.path(), 1, &run_args(3, &["--set", "train.clip=1"]));
    c.args([":", "-n", "1", env!("CARGO_BIN_EXE_gaccwb")])
        .args(run_args(3, &["--set", "train.clip=2"]));
    let (code, text, _) = wait(spawn(c), Duration::from_secs(120));
    assert_ne!(code, 0, "{text}");
    assert!(
        text.contains("scenario.train.clip is 2.0 here, 1.0 on rank 0"),
        "{text}"
    );
}

#[test]
fn ranks_run_headless() {
    let dir = tempfile::tempdir().unwrap();
    let (code, text) = mpirun(dir.path(), 2, &["run".to_string()]);
    assert_ne!(code, 0, "{text}");
    assert!(text.contains("add --headless"), "{text}");
}

/// `run --ranks 2 --headless` is mpirun of the same command line: two ranks, rank 0 recording.
#[test]
fn run_ranks_headless_starts_the_ranks_itself() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = run_args(3, &["--record", "ranks.jsonl"]);
    args.extend(["--ranks".into(), "2".into()]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = assert_cmd::Command::cargo_bin("gaccwb")
        .unwrap()
        .current_dir(dir.path())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1")
        .args(&refs)
        .timeout(Duration::from_secs(240))
        .output()
        .unwrap();
    let (code, out, err) = common::outcome(&refs, out);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("2 ranks (sync per window)"), "{out}");
    let all = events(&dir.path().join("ranks.jsonl"));
    assert_eq!(all[0]["ranks"], 2);
    // CPU ranks: MPI carries the gradients.
    assert_eq!(all[0]["collectives"], "mpi");
    assert_eq!(steps(&dir.path().join("ranks.jsonl")).len(), 3);
}

/// `run --ranks 2` on the screen follows rank 0: the Communication pane, W in the Controls pane,
/// a knob key applied on every rank (a rank left behind would fail the next boundary's check),
/// and quitting ends the ranks.
#[test]
fn run_ranks_on_the_screen_shows_communication_and_quits_the_ranks() {
    common::tmux::require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let tmux = common::tmux::Tmux::start("ranks");
    let record = dir.path().join("screen.jsonl");
    let mut args = run_args(100_000, &["--set", "train.accum_steps=2"]);
    args.retain(|a| a != "--headless");
    let command = format!(
        "cd {}; OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 \
         {} {} --ranks 2 --record {}; echo EXIT=$?",
        dir.path().display(),
        env!("CARGO_BIN_EXE_gaccwb"),
        args.join(" "),
        record.display()
    );
    tmux.send(&[&command, "Enter"]);
    let s = tmux.wait_for("communication", Duration::from_secs(120), |s| {
        s.contains("Comm · 2 mpi ranks · per window") && s.contains("sent/rank")
    });
    assert!(s.contains("W 2") && s.contains("FOLLOWING"), "{s}");
    tmux.send(&["+"]);
    let s = tmux.wait_for("K=4 applied", Duration::from_secs(60), |s| {
        s.contains("K 4  B 8  W 2  eff 64") && s.contains("K=4 applied (key)")
    });
    let applied_at = s
        .lines()
        .find(|l| l.contains("K=4 applied (key)"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .expect("the step it was applied at");
    let later = |s: &str| {
        s.lines()
            .next()
            .and_then(|l| {
                l.split("step ")
                    .nth(1)?
                    .split('/')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .is_some_and(|n| n > applied_at + 2)
    };
    tmux.wait_for("steps after the change", Duration::from_secs(60), later);
    tmux.send(&["q"]);
    // The status may follow a prompt on its line ("e2e$ EXIT=0"); the typed command's
    // "EXIT=$?" is not one.
    let exit = |s: &str| {
        s.split_whitespace().find_map(|w| {
            let code = w.strip_prefix("EXIT=")?;
            let digits = !code.is_empty() && code.bytes().all(|b| b.is_ascii_digit());
            digits.then(|| code.to_string())
        })
    };
    let s = tmux.wait_for("the end", Duration::from_secs(60), |s| exit(s).is_some());
    assert_eq!(exit(&s).as_deref(), Some("0"), "{s}");
    // The ranks stopped together: rank 0's recording ends with its end event.
    let all = events(&record);
    assert_eq!(all.last().unwrap()["type"], "end", "{:?}", all.last());
    tmux.assert_shell_usable();
}
