//! Data parallel over MPI: ranks started by `mpirun`, checked against one process.
//!
//! Built only with `--features mpi` (CI's `mpi` stage: `cargo test --features mpi --test
//! data_parallel`). It needs Open MPI's `mpirun` on PATH and fails, not skips, without it.

#![cfg(feature = "mpi")]

#[path = "../common/mod.rs"]
mod common;
mod faults;
mod process_tree;
mod zero;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::TINY;
use serde_json::Value;
use zero::largest_difference;

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
