//! Data parallel over MPI: ranks started by `mpirun`, checked against one process.
//!
//! Built only with `--features mpi` (CI's `mpi` stage: `cargo test --features mpi --test
//! data_parallel`). It needs Open MPI's `mpirun` on PATH and fails, not skips, without it.

#![cfg(feature = "mpi")]

mod common;
#[path = "data_parallel/process_tree.rs"]
mod process_tree;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::TINY;
use serde_json::Value;

/// The tiny model for `steps` steps from its first, with every other argument given.
fn run_args(steps: u32, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["run", "--headless", "--device", "cpu", "--steps"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(steps.to_string());
    args.extend(TINY.args());
    args.extend(["--set".into(), "train.warmup=0".into()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// `mpirun` for `ranks` copies of gaccwb with `args`, in `dir`. Root may launch (CI runs as
/// root); one thread per rank, as the machine has few cores.
fn mpirun_command(dir: &Path, ranks: usize, args: &[String]) -> Command {
    let mut c = Command::new("mpirun");
    c.current_dir(dir)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1")
        .args(["--oversubscribe", "-n", &ranks.to_string()])
        .arg(env!("CARGO_BIN_EXE_gaccwb"))
        .args(args);
    c
}

fn spawn(mut c: Command) -> Child {
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start mpirun: install Open MPI (Debian: openmpi-bin libopenmpi-dev)")
}

/// Waits for `child` at most `limit`; kills it past that. (exit code, stdout + stderr, time).
fn wait(mut child: Child, limit: Duration) -> (i32, String, Duration) {
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("mpirun still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = started.elapsed();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("panicked"), "a rank panicked:\n{text}");
    (status.code().unwrap_or(-1), text, took)
}

fn mpirun(dir: &Path, ranks: usize, args: &[String]) -> (i32, String) {
    mpirun_in_env(dir, ranks, args, &[])
}

/// `mpirun` with `env` set for every rank.
fn mpirun_in_env(dir: &Path, ranks: usize, args: &[String], env: &[(&str, &str)]) -> (i32, String) {
    let mut command = mpirun_command(dir, ranks, args);
    command.envs(env.iter().copied());
    let (code, text, _) = wait(spawn(command), Duration::from_secs(240));
    (code, text)
}

fn alone(dir: &Path, args: &[String]) -> (i32, String) {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = common::gaccwb_in(dir, &refs, 240);
    (code, out + &err)
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn steps(path: &Path) -> Vec<Value> {
    events(path)
        .into_iter()
        .filter(|e| e["type"] == "step")
        .collect()
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-30)
}

/// The tensors of the last checkpoint in `dir` whose names start with `prefix` (`param/`,
/// `adam_m/`, `adam_v/`), by name.
fn saved(dir: &Path, prefix: &str) -> Vec<(String, Vec<f32>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    let last = files.last().expect("no checkpoint saved");
    let tensors = candle_core::safetensors::load(last, &candle_core::Device::Cpu).unwrap();
    let mut named: Vec<(String, Vec<f32>)> = tensors
        .into_iter()
        .filter(|(name, _)| name.starts_with(prefix))
        .map(|(name, t)| (name, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// The parts of a parameter two summation orders must agree on. The key bias (the middle third
/// of `qkv.b`) is left out: softmax is invariant to adding q·b_k to every score of a row, so its
/// gradient is zero in exact arithmetic and pure rounding noise in floating point, which AdamW
/// normalises into steps of about the learning rate. Any other order of the same sums (W, K,
/// threads) moves it; nothing downstream depends on it.
fn comparable<'a>(
    param: &str,
    a: &'a [f32],
    b: &'a [f32],
) -> Vec<(&'static str, &'a [f32], &'a [f32])> {
    if !param.ends_with("attn.qkv.b") {
        return vec![("", a, b)];
    }
    let d = a.len() / 3;
    vec![
        (" (query bias)", &a[..d], &b[..d]),
        (" (value bias)", &a[2 * d..], &b[2 * d..]),
    ]
}

/// Relative L2 distance of `b` from `a`.
fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        diff += (f64::from(*x) - f64::from(*y)).powi(2);
        norm += f64::from(*x).powi(2);
    }
    (diff / norm.max(1e-30)).sqrt()
}

/// W = 2 at K = 2 against W = 1 at K = 4 (B = 2): the same samples, so the same loss at every
/// step and the same weights at the end, whether the ranks sum once per window or after every
/// micro-batch.
#[test]
fn two_ranks_at_k2_train_what_one_process_trains_at_k4() {
    let dir = tempfile::tempdir().unwrap();
    let common = ["--set", "train.micro_batch=2", "--checkpoint-every", "5"];
    let run = |name: &str, k: &str, sync: &str| {
        let mut extra = common.to_vec();
        let (accum, sync, record) = (
            format!("train.accum_steps={k}"),
            format!("train.sync={sync}"),
            format!("{name}.jsonl"),
        );
        extra.extend(["--set", &accum, "--set", &sync, "--record", &record]);
        extra.extend(["--checkpoint-dir", name]);
        run_args(5, &extra)
    };
    let (code, text) = alone(dir.path(), &run("one", "4", "window"));
    assert_eq!(code, 0, "{text}");
    for (name, sync) in [("window", "window"), ("micro", "micro-batch")] {
        let (code, text) = mpirun(dir.path(), 2, &run(name, "2", sync));
        assert_eq!(code, 0, "{text}");
    }
    let one = steps(&dir.path().join("one.jsonl"));
    assert_eq!(one.len(), 5);
    for name in ["window", "micro"] {
        let two = steps(&dir.path().join(format!("{name}.jsonl")));
        assert_eq!(two.len(), one.len(), "{name}");
        for (a, b) in one.iter().zip(&two) {
            assert_eq!(a["tokens"], b["tokens"], "{name}: step {}", a["step"]);
            let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
            assert!(
                close(la, lb, 1e-6),
                "{name}: step {}: {la} vs {lb}",
                a["step"]
            );
            // The noise scale pools the ranks: both ranks' micro-batches are the small batches.
            for field in ["raw_g2", "raw_trace"] {
                let (na, nb) = (&a["noise"][field], &b["noise"][field]);
                let (na, nb) = (na.as_f64().unwrap(), nb.as_f64().unwrap());
                assert!(
                    close(na, nb, 1e-5),
                    "{name}: step {}: noise {field} {na} vs {nb}",
                    a["step"]
                );
            }
        }
        let (e, at) = largest_difference(&dir.path().join("one"), &dir.path().join(name), "param/");
        eprintln!("{name} against one process: largest relative L2 of the weights {e:e} ({at})");
        assert!(e <= 1e-6, "{name}: {at} differs by {e:e}");
    }
}

/// Two ranks at K = 1 measure the noise scale (each rank's micro-batch is a small batch), and
/// the noise-scale policy decides for both: rank 0's change of K reaches rank 1 at the same
/// boundary (a rank left behind would fail the next boundary's knob check).
#[test]
fn the_noise_scale_policy_steers_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let args = run_args(
        4,
        &[
            "--set",
            "train.micro_batch=2",
            "--set",
            "train.accum_steps=1",
            "--set",
            "train.accum_policy=noise-scale",
            "--record",
            "policy.jsonl",
        ],
    );
    let (code, text) = mpirun(dir.path(), 2, &args);
    assert_eq!(code, 0, "{text}");
    let all = steps(&dir.path().join("policy.jsonl"));
    assert_eq!(all.len(), 4);
    assert!(all[0]["noise"]["raw_g2"].is_f64(), "{}", all[0]);
    // K = 1 is below accum_min (2): the policy raises it at the first boundary.
    let ks: Vec<u64> = all
        .iter()
        .map(|s| s["accum_steps"].as_u64().unwrap())
        .collect();
    assert_eq!(ks, [1, 2, 2, 2]);
}

/// Bytes per window under the ring rule: the gradients once (4 bytes per parameter) with
/// `sync = window`, K times with `micro-batch`, plus the two 8-byte scalars (tokens, loss).
#[test]
fn bytes_per_window_follow_the_payload_rule() {
    let dir = tempfile::tempdir().unwrap();
    let k = 3u64;
    for sync in ["window", "micro-batch"] {
        let record = format!("{sync}.jsonl");
        let sets = [
            format!("train.accum_steps={k}"),
            "train.micro_batch=2".to_string(),
            format!("train.sync={sync}"),
        ];
        let mut extra = vec!["--record", &record];
        for s in &sets {
            extra.extend(["--set", s]);
        }
        let (code, text) = mpirun(dir.path(), 2, &run_args(3, &extra));
        assert_eq!(code, 0, "{text}");
        let all = events(&dir.path().join(&record));
        assert_eq!(all[0]["ranks"], 2);
        let params = all[0]["params"].as_u64().unwrap();
        let reduces = if sync == "window" { 1 } else { k };
        // W = 2: each rank sends (W − 1)/W of the buffer twice, i.e. the buffer once.
        let expected = reduces * 4 * params + 8 + 8;
        for s in steps(&dir.path().join(&record)) {
            let comm = &s["comm"];
            assert_eq!(comm["sync"], sync);
            for rank in comm["per_rank"].as_array().unwrap() {
                assert_eq!(rank["sent_bytes"].as_u64(), Some(expected), "{sync}: {s}");
                assert_eq!(rank["received_bytes"].as_u64(), Some(expected), "{sync}");
                assert_eq!(rank["gradient_reduces"].as_u64(), Some(reduces), "{sync}");
            }
            assert_eq!(comm["peak_bytes"].as_array().unwrap().len(), 2);
        }
    }
}

/// Each rank's own per-token mean, averaged over the ranks, is off when the ranks' slices hold
/// different token counts, and exact when they hold the same.
#[test]
fn the_cross_rank_mean_of_means_is_measured_as_grad_error() {
    let dir = tempfile::tempdir().unwrap();
    let grad_errors = |name: &str, extra: &[&str]| -> Vec<f64> {
        let record = format!("{name}.jsonl");
        let mut all = vec![
            "--set",
            "train.rank_loss_norm=mean-of-means",
            "--set",
            "train.accum_steps=2",
            "--set",
            "train.micro_batch=2",
            "--record",
            &record,
        ];
        all.extend_from_slice(extra);
        let (code, text) = mpirun(dir.path(), 2, &run_args(3, &all));
        assert_eq!(code, 0, "{text}");
        steps(&dir.path().join(&record))
            .iter()
            .map(|s| {
                s["grad_error"]
                    .as_f64()
                    .expect("no grad_error under a pitfall")
            })
            .collect()
    };
    let uneven = grad_errors("uneven", &[]);
    assert!(uneven.iter().all(|&e| e > 1e-3), "{uneven:?}");
    let full = format!("data.min_doc_len={}", TINY.seq_len);
    let even = grad_errors("even", &["--set", &full]);
    assert!(even.iter().all(|&e| e < 1e-6), "{even:?}");
}

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
fn start_long_run(dir: &Path, record: &str, extra: &[&str]) -> (Child, u32) {
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

fn signal(pid: u32, sig: &str) {
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

/// A ZeRO configuration's run of `length` steps, recording into `NAME.jsonl` and saving a
/// checkpoint every `every` steps into `NAME/`: its step events, memory events and P.
fn zero_run(
    dir: &Path,
    name: &str,
    lengths: (u32, u32),
    sets: &[&str],
) -> (Vec<Value>, Vec<Value>, u64) {
    zero_run_in_env(dir, name, lengths, sets, &[])
}

/// `zero_run` with `env` set for every rank.
fn zero_run_in_env(
    dir: &Path,
    name: &str,
    (length, every): (u32, u32),
    sets: &[&str],
    env: &[(&str, &str)],
) -> (Vec<Value>, Vec<Value>, u64) {
    let (record, every) = (format!("{name}.jsonl"), every.to_string());
    let mut extra = vec![
        "--record",
        &record,
        "--checkpoint-every",
        &every,
        "--checkpoint-dir",
        name,
        "--set",
        "train.accum_steps=2",
        "--set",
        "train.micro_batch=2",
        "--set",
        "train.noise=false",
        "--set",
        "train.eval_every=4",
    ];
    for s in sets {
        extra.extend(["--set", s]);
    }
    let (code, text) = mpirun_in_env(dir, 2, &run_args(length, &extra), env);
    assert_eq!(code, 0, "{name}: {text}");
    let all = events(&dir.join(&record));
    let params = all[0]["params"].as_u64().unwrap();
    let memory = all
        .iter()
        .filter(|e| e["type"] == "memory")
        .cloned()
        .collect();
    (steps(&dir.join(&record)), memory, params)
}

/// The largest per-tensor relative L2 distance between the last checkpoints in `a` and `b`
/// over the tensors named `prefix…` (the key bias left out, see `comparable`), and where: both
/// must hold the same tensors, of the same sizes.
fn largest_difference(a: &Path, b: &Path, prefix: &str) -> (f64, String) {
    let (ours, theirs) = (saved(a, prefix), saved(b, prefix));
    assert!(!ours.is_empty(), "no {prefix} tensors in {}", a.display());
    let names = |t: &[(String, Vec<f32>)]| -> Vec<(String, usize)> {
        t.iter().map(|(n, v)| (n.clone(), v.len())).collect()
    };
    assert_eq!(names(&ours), names(&theirs), "{prefix}");
    let mut worst = (0.0, String::new());
    for ((param, x), (_, y)) in ours.iter().zip(&theirs) {
        for (part, x, y) in comparable(param, x, y) {
            let e = relative_l2(x, y);
            if e >= worst.0 {
                worst = (e, format!("{param}{part}"));
            }
        }
    }
    worst
}

/// ZeRO-1 and ZeRO-2 (both accumulation modes) take the steps ZeRO-0 takes: every step's loss
/// and gradient norm within 1e-6, and the checkpoint at the end (the ranks gather the sharded
/// moments whole for it) holds the weights and AdamW moments of ZeRO-0's, each tensor within
/// 1e-6 relative L2; each rank's ledger holds 8P/W bytes of moments, and under ZeRO-2 4P/W of
/// gradient at the update; the bytes follow the payload rule of each stage.
#[test]
fn zero_stages_take_the_steps_zero_0_takes_with_a_w_th_of_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let val = |name: &str| -> f64 {
        events(&dir.path().join(format!("{name}.jsonl")))
            .iter()
            .rev()
            .find(|e| e["type"] == "eval")
            .and_then(|e| e["val_loss"].as_f64())
            .expect("an evaluation after the last step")
    };
    let (base, base_memory, p) = zero_run(dir.path(), "zero0", (4, 4), &["train.zero=0"]);
    let base_val = val("zero0");
    let opt_state = |memory: &[Value]| -> Vec<u64> {
        memory
            .iter()
            .filter(|m| m["phase"] == "optimizer")
            .map(|m| m["categories"]["optimizer_state"].as_u64().unwrap())
            .collect()
    };
    assert!(opt_state(&base_memory).iter().all(|&b| b == 8 * p));
    // (name, sets, gradient and weight bytes each rank sends per step, W = 2): a ring
    // all-reduce of 4P bytes sends 4P, a reduce-scatter or an all-gather 2P.
    let cases: [(&str, &[&str], u64); 3] = [
        ("zero1", &["train.zero=1"], 4 * p + 2 * p),
        ("zero2", &["train.zero=2"], 2 * p + 2 * p),
        (
            "zero2-rs",
            &["train.zero=2", "train.zero2_accumulate=reduce-scatter"],
            2 * (2 * p) + 2 * p,
        ),
    ];
    for (name, sets, bytes) in cases {
        let (run, memory, _) = zero_run(dir.path(), name, (4, 4), sets);
        for (a, b) in base.iter().zip(&run) {
            for key in ["loss", "grad_norm"] {
                let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
                assert!(
                    close(x, y, 1e-6),
                    "{name}: step {} {key}: {x} vs {y}",
                    a["step"]
                );
            }
            // 8-byte scalars: the tokens and the loss; under ZeRO-2 also the squared norm of the
            // pieces, again after clipping when it clipped (clip 1).
            let clipped = b["grad_norm"].as_f64().unwrap() > 1.0;
            let norms = if name.starts_with("zero2") {
                1 + u64::from(clipped)
            } else {
                0
            };
            // At the checkpoint's step the ranks gather both moments whole: two all-gathers.
            let gathered = if b["step"] == 4 { 2 * (2 * p) } else { 0 };
            let sent = b["comm"]["per_rank"][0]["sent_bytes"].as_u64();
            let expected = bytes + gathered + 8 * (2 + norms);
            assert_eq!(sent, Some(expected), "{name}: step {}", b["step"]);
        }
        let v = val(name);
        assert!(close(base_val, v, 1e-6), "{name}: val {base_val} vs {v}");
        for prefix in ["param/", "adam_m/", "adam_v/"] {
            let (e, at) =
                largest_difference(&dir.path().join("zero0"), &dir.path().join(name), prefix);
            eprintln!("{name} against zero0: largest relative L2 of {prefix} {e:e} ({at})");
            assert!(e <= 1e-6, "{name}: {at} differs by {e:e}");
        }
        assert!(opt_state(&memory).iter().all(|&b| b == 8 * p / 2), "{name}");
        if name.starts_with("zero2") {
            let grads: Vec<u64> = memory
                .iter()
                .filter(|m| m["phase"] == "optimizer")
                .map(|m| m["categories"]["gradients"].as_u64().unwrap())
                .collect();
            assert!(grads.iter().all(|&g| g == 4 * p / 2), "{name}: {grads:?}");
        }
    }
}

/// On the lean ops (a GPU's code path, here on the CPU) each rank updates its ZeRO pieces
/// by the Candle ops the unsharded step uses, not the fused CPU kernel. ZeRO-1 then takes
/// ZeRO-0's steps on those ops bit for bit (the same sums, each element's update the same ops),
/// and ZeRO-2 reduce-scattering every micro-batch within 1e-6 (its sums run in another order);
/// their checkpoints hold ZeRO-0's weights and moments, each tensor within those bounds.
#[test]
fn zero_on_the_lean_ops_takes_zero_0s_steps() {
    let dir = tempfile::tempdir().unwrap();
    let lean = [("GACCWB_KERNELS", "lean")];
    let (fused, _, _) = zero_run(dir.path(), "fused", (3, 3), &["train.zero=0"]);
    let run = |name, sets| zero_run_in_env(dir.path(), name, (3, 3), sets, &lean).0;
    let base = run("zero0", &["train.zero=0"]);
    let bits = |r: &[Value], key: &str| -> Vec<u64> {
        r.iter()
            .map(|s| s[key].as_f64().unwrap().to_bits())
            .collect()
    };
    // The ranks ran the lean ops: their summation order is not the fused kernels'.
    assert_ne!(
        bits(&base, "loss"),
        bits(&fused, "loss"),
        "GACCWB_KERNELS did not reach the ranks"
    );
    let cases: [(&str, &[&str], f64); 2] = [
        ("zero1", &["train.zero=1"], 0.0),
        (
            "zero2-rs",
            &["train.zero=2", "train.zero2_accumulate=reduce-scatter"],
            1e-6,
        ),
    ];
    for (name, sets, bound) in cases {
        let sharded = run(name, sets);
        assert_eq!(sharded.len(), base.len(), "{name}");
        for (a, b) in base.iter().zip(&sharded) {
            for key in ["loss", "grad_norm"] {
                let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
                assert!(
                    close(x, y, bound),
                    "{name}: step {} {key}: {x} vs {y}",
                    a["step"]
                );
            }
        }
        for prefix in ["param/", "adam_m/", "adam_v/"] {
            let (e, at) =
                largest_difference(&dir.path().join("zero0"), &dir.path().join(name), prefix);
            eprintln!("lean {name} against zero0: largest relative L2 of {prefix} {e:e} ({at})");
            assert!(e <= bound, "{name}: {at} differs by {e:e}");
        }
    }
}

/// A ZeRO run resumed from its checkpoint continues it: the checkpoint holds the whole moments,
/// each rank cuts its pieces from them, and the steps after it are the steps of the run that
/// never stopped, bit for bit, to its last checkpoint.
#[test]
fn a_zero_run_resumed_from_its_checkpoint_takes_the_same_steps() {
    let dir = tempfile::tempdir().unwrap();
    // The LR schedule's horizon is the whole run's, so the first two steps are its first two.
    let sets = [
        "train.zero=2",
        "train.zero2_accumulate=reduce-scatter",
        "train.decay_steps=4",
    ];
    let (whole, _, _) = zero_run(dir.path(), "whole", (4, 2), &sets);
    zero_run(dir.path(), "part", (2, 2), &sets);
    let resume: Vec<String> = [
        "run",
        "--headless",
        "--device",
        "cpu",
        "--resume",
        "part",
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        "part",
        "--record",
        "resumed.jsonl",
    ]
    .map(String::from)
    .to_vec();
    let (code, text) = mpirun(dir.path(), 2, &resume);
    assert_eq!(code, 0, "{text}");
    let resumed = steps(&dir.path().join("resumed.jsonl"));
    let numbers: Vec<&Value> = resumed.iter().map(|s| &s["step"]).collect();
    assert_eq!(numbers, [3, 4]);
    // The same sums in the same order: bit for bit, the key bias included.
    for (a, b) in whole[2..].iter().zip(&resumed) {
        assert_eq!(a["loss"], b["loss"], "step {}", a["step"]);
    }
    for prefix in ["param/", "adam_m/", "adam_v/"] {
        let (ours, theirs) = (
            saved(&dir.path().join("whole"), prefix),
            saved(&dir.path().join("part"), prefix),
        );
        assert!(!ours.is_empty() && ours == theirs, "{prefix} differs");
    }
}

/// The LR rule counts every rank's samples: with the LR tuned at 4 samples (B = 2), two ranks
/// at K = 2 take, step by step, the LR one process takes at K = 4, twice the LR at K = 2.
#[test]
fn the_lr_rule_follows_w_k_b() {
    let dir = tempfile::tempdir().unwrap();
    let lrs = |name: &str, ranks: usize, k: u32| -> Vec<f64> {
        let (record, accum) = (format!("{name}.jsonl"), format!("train.accum_steps={k}"));
        let extra = [
            "--record",
            &record,
            "--set",
            &accum,
            "--set",
            "train.micro_batch=2",
            "--set",
            "train.lr_rule=linear",
            "--set",
            "train.base_batch=4",
        ];
        let args = run_args(3, &extra);
        let (code, text) = match ranks {
            1 => alone(dir.path(), &args),
            _ => mpirun(dir.path(), ranks, &args),
        };
        assert_eq!(code, 0, "{name}: {text}");
        let lrs: Vec<f64> = steps(&dir.path().join(&record))
            .iter()
            .map(|s| s["lr"].as_f64().unwrap())
            .collect();
        assert_eq!(lrs.len(), 3, "{name}");
        lrs
    };
    let two = lrs("w2k2", 2, 2);
    let (k4, k2) = (lrs("w1k4", 1, 4), lrs("w1k2", 1, 2));
    eprintln!("lr per step: W=2 K=2 {two:?}, W=1 K=4 {k4:?}, W=1 K=2 {k2:?}");
    for ((a, b), c) in two.iter().zip(&k4).zip(&k2) {
        assert!(close(*a, *b, 1e-12), "{two:?} vs {k4:?}");
        assert!(close(*a, 2.0 * c, 1e-12), "{two:?} vs 2 × {k2:?}");
    }
}

/// Knobs turned mid-run at a boundary (as the `ddp-no-sync` and `ddp-zero` presets and the keys
/// do) change bytes and memory, never the steps: the loss of every step matches a run that never
/// turned them, within 1e-6. ZeRO 0 → 1 → 2 → 0 moves the moments into pieces and back whole.
#[test]
fn sync_and_zero_turned_mid_run_change_bytes_not_steps() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str]| -> Vec<Value> {
        let record = format!("{name}.jsonl");
        let mut all = vec![
            "--record",
            &record,
            "--set",
            "train.accum_steps=3",
            "--set",
            "train.micro_batch=2",
            "--set",
            "train.noise=false",
        ];
        all.extend_from_slice(extra);
        let (code, text) = mpirun(dir.path(), 2, &run_args(9, &all));
        assert_eq!(code, 0, "{name}: {text}");
        steps(&dir.path().join(&record))
    };
    let plain = run("plain", &[]);
    let turned = run(
        "turned",
        &[
            "--set",
            "train.sync=micro-batch",
            "--control",
            "2:set_sync=window",
            "--control",
            "3:set_zero=1",
            "--control",
            "5:set_zero=2",
            "--control",
            "7:set_zero=0",
        ],
    );
    for (a, b) in plain.iter().zip(&turned) {
        let (x, y) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert!(close(x, y, 1e-6), "step {}: {x} vs {y}", a["step"]);
    }
    let reduces: Vec<u64> = turned
        .iter()
        .map(|s| {
            s["comm"]["per_rank"][0]["gradient_reduces"]
                .as_u64()
                .unwrap()
        })
        .collect();
    // K = 3 reduces per step while summing every micro-batch, then one.
    assert_eq!(reduces[..2], [3, 3]);
    assert!(reduces[2..].iter().all(|&r| r == 1), "{reduces:?}");
}

/// LoRA over two ranks reduces the adapters' gradients only: each rank sends and receives 4
/// bytes per adapter weight a step (plus the two 8-byte scalars), where a full fine-tune of
/// the same model sends 4 per weight; and the two ranks at K = 2 train what one process trains
/// at K = 4, dropout included (a sample's mask follows the sample, not its rank): every step's
/// loss and the adapters at the end within 1e-6.
#[test]
fn lora_over_ranks_reduces_only_the_adapters_and_trains_what_one_process_trains() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, k: &str, lora: bool| {
        let accum = format!("train.accum_steps={k}");
        let (record, ckpt) = (format!("{name}.jsonl"), name.to_string());
        let mut extra = vec!["--set", "train.micro_batch=2", "--set", &accum];
        if lora {
            extra.extend([
                "--set",
                "train.lora_rank=4",
                "--set",
                "train.lora_dropout=0.1",
            ]);
        }
        extra.extend(["--record", &record, "--checkpoint-every", "3"]);
        extra.extend(["--checkpoint-dir", &ckpt]);
        run_args(3, &extra)
    };
    let (code, text) = alone(dir.path(), &run("one", "4", true));
    assert_eq!(code, 0, "{text}");
    for (name, lora) in [("lora", true), ("full", false)] {
        let (code, text) = mpirun(dir.path(), 2, &run(name, "2", lora));
        assert_eq!(code, 0, "{name}: {text}");
    }
    let params = |name: &str| {
        events(&dir.path().join(format!("{name}.jsonl")))[0]["params"]
            .as_u64()
            .unwrap()
    };
    // TINY's blocks: qkv [32, 96], proj [32, 32], fc [32, 128], proj [128, 32]; r = 4.
    let adapters = 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32));
    assert_eq!(
        params("lora"),
        adapters,
        "the adapters are the trained weights"
    );
    for name in ["lora", "full"] {
        let expected = 4 * params(name) + 8 + 8;
        let per_step: Vec<u64> = steps(&dir.path().join(format!("{name}.jsonl")))
            .iter()
            .flat_map(|s| s["comm"]["per_rank"].as_array().unwrap().clone())
            .map(|rank| rank["sent_bytes"].as_u64().unwrap())
            .collect();
        eprintln!(
            "{name}: {} trained weights, bytes sent per rank a step {per_step:?}",
            params(name)
        );
        assert!(
            per_step.len() == 6 && per_step.iter().all(|b| *b == expected),
            "{name}: {per_step:?}"
        );
    }
    assert!(
        params("full") > 4 * adapters,
        "r = 4 adapts a seventh of this tiny model"
    );
    let (one, two) = (
        steps(&dir.path().join("one.jsonl")),
        steps(&dir.path().join("lora.jsonl")),
    );
    assert_eq!(one.len(), 3);
    for (a, b) in one.iter().zip(&two) {
        let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
        assert!(close(la, lb, 1e-6), "step {}: {la} vs {lb}", a["step"]);
    }
    let (e, at) = largest_difference(&dir.path().join("one"), &dir.path().join("lora"), "param/");
    eprintln!("LoRA over two ranks against one process: largest relative L2 {e:e} ({at})");
    assert!(e <= 1e-6, "{at} differs by {e:e}");
}
