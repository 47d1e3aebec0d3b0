//! The command line: bad input gives a clear error and a non-zero exit, never a panic.

use assert_cmd::Command;
use gaccwb::telemetry::Event;
use std::path::Path;

use crate::common;

use common::{steps, TestModel, TINY};

/// [`TINY`] reading a file: its bytes are tokens, so it needs the whole byte vocabulary.
const BYTES: TestModel = TestModel { vocab: 256, ..TINY };

/// Wide and long enough that at B=12 (768 rows) the fused products are cut into row blocks.
const SPLIT: TestModel = TestModel {
    d_model: 64,
    heads: 4,
    seq_len: 64,
    ..TINY
};

fn gaccwb(args: &[&str]) -> (i32, String, String) {
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .args(args)
        .output()
        .unwrap();
    common::outcome(args, out)
}

fn run_headless(extra: &[&str]) -> (i32, String, String) {
    run_headless_with(TINY, extra)
}

/// Two steps of `model` on the CPU, then `extra` arguments.
fn run_headless_with(model: TestModel, extra: &[&str]) -> (i32, String, String) {
    let model = model.args();
    let mut args = vec!["run", "--headless", "--device", "cpu", "--steps", "2"];
    args.extend(model.iter().map(String::as_str));
    args.extend_from_slice(extra);
    gaccwb(&args)
}

#[test]
fn a_headless_run_completes_and_summarises() {
    let (code, stdout, stderr) = run_headless(&[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("2 steps (completed) on cpu"), "{stdout}");
}

#[test]
fn zero_accumulation_steps_is_a_usage_error() {
    let (code, _, stderr) = run_headless(&["--set", "train.accum_steps=0"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("train.accum_steps") && stderr.contains("at least 1"),
        "{stderr}"
    );
}

#[test]
fn an_unknown_set_key_suggests_the_nearest_one() {
    let (code, _, stderr) = run_headless(&["--set", "train.acum_steps=4"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("unknown key `acum_steps`, did you mean `accum_steps`?"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
}

#[test]
fn a_bad_set_value_names_the_value() {
    let (code, _, stderr) = run_headless(&["--set", "train.dtype=f8"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("f8"), "{stderr}");
}

#[test]
fn a_missing_data_file_is_named() {
    let (code, _, stderr) = run_headless_with(BYTES, &["--data", "/nonexistent/corpus.txt"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("/nonexistent/corpus.txt"), "{stderr}");
}

#[test]
fn an_empty_data_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.txt");
    std::fs::write(&path, b"").unwrap();
    let (code, _, stderr) = run_headless_with(BYTES, &["--data", path.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("empty.txt") && stderr.contains("empty"),
        "{stderr}"
    );
}

#[test]
fn a_data_file_shorter_than_seq_len_says_what_is_needed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.txt");
    std::fs::write(&path, b"just a few bytes").unwrap();
    let (code, _, stderr) = run_headless_with(BYTES, &["--data", path.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("short.txt") && stderr.contains("seq_len"),
        "{stderr}"
    );
}

#[test]
fn a_file_corpus_trains() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("corpus.txt");
    std::fs::write(
        &path,
        "the quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let (code, stdout, stderr) = run_headless_with(BYTES, &["--data", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("completed"), "{stdout}");
}

#[test]
fn an_unknown_device_is_rejected() {
    let (code, _, stderr) = gaccwb(&["run", "--headless", "--device", "tpu:0"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("tpu:0") && stderr.contains("expected cpu"),
        "{stderr}"
    );
}

// A CUDA build on a machine with a GPU runs on cuda:0, so this holds only without the feature.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_or_a_gpu_explains_itself() {
    let model = TINY.args();
    let mut args = vec!["run", "--headless", "--steps", "1", "--device", "cuda:0"];
    args.extend(model.iter().map(String::as_str));
    let (code, _, stderr) = gaccwb(&args);
    assert_ne!(code, 0);
    assert!(stderr.contains("cuda:0"), "{stderr}");
}

#[test]
fn the_recording_holds_the_documented_step_fields() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.jsonl");
    let (code, _, stderr) = run_headless(&["--record", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    let text = std::fs::read_to_string(&path).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(first["type"], "header");
    assert_eq!(first["version"], 1);
    assert_eq!(first["device"], "cpu");
    let step: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["type"] == "step")
        .unwrap();
    for field in [
        "step",
        "loss",
        "grad_norm",
        "grad_norm_clipped",
        "lr",
        "accum_steps",
        "micro_batch",
        "tokens",
        "tokens_per_s",
        "step_ms",
        "skipped",
    ] {
        assert!(
            step.get(field).is_some(),
            "step event lacks `{field}`: {step}"
        );
    }
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["type"], "end");
    assert_eq!(last["reason"], "completed");
}

#[test]
fn a_command_line_control_is_applied_and_reported_with_origin_cli() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.jsonl");
    let (code, _, stderr) = run_headless(&[
        "--control",
        "1:set_accum_steps=2",
        "--record",
        path.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let events: Vec<serde_json::Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let control = events
        .iter()
        .find(|e| e["type"] == "control")
        .expect("a control event");
    assert_eq!(control["origin"], "cli");
    assert_eq!(control["step"], 1);
    assert_eq!(
        control["control"],
        serde_json::json!({"kind": "set_accum_steps", "value": 2})
    );
    let ks: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["type"] == "step")
        .map(|e| &e["accum_steps"])
        .collect();
    assert_eq!(ks, [1, 2]);
}

#[test]
fn a_bad_command_line_control_is_a_usage_error() {
    let (code, _, stderr) = run_headless(&["--control", "1:set_accum_steps=0"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("--control 1:set_accum_steps=0") && stderr.contains("at least 1"),
        "{stderr}"
    );
}

/// Fused kernels split work by shape, never by thread count: one thread and two train to the
/// same bits (losses and gradient norms of every step).
#[test]
fn training_is_bitwise_identical_at_one_and_two_threads() {
    let dir = tempfile::tempdir().unwrap();
    for (name, model, micro_batch) in [
        // The shape: it once split its 768-row products differently at 1 and 2 threads.
        ("issue", SPLIT, "train.micro_batch=12"),
        // A tall head: vocabulary 256 over 432 rows.
        (
            "tall",
            TestModel {
                vocab: 256,
                d_model: 48,
                layers: 1,
                seq_len: 48,
                ..TINY
            },
            "train.micro_batch=9",
        ),
        // A product too small to split.
        ("small", TINY, "train.micro_batch=2"),
        // Wide products: vocabulary 256 over 32 rows (and the MLP's 128 columns), cut into
        // column blocks.
        (
            "wide",
            TestModel {
                vocab: 256,
                seq_len: 8,
                ..TINY
            },
            "train.micro_batch=4",
        ),
        // 8,256 rows at V = 256: the fused head and loss go through them in nine blocks of
        // rows (eight of 1,024, one of 64; slices of the vocabulary need V > 2,048, above a
        // byte vocabulary: `ops::tests` holds those to the same bits off and on the pool); one
        // layer keeps them quick.
        (
            "blocked",
            TestModel {
                vocab: 256,
                layers: 1,
                seq_len: 64,
                ..TINY
            },
            "train.micro_batch=129",
        ),
    ] {
        let steps = |threads: &str| {
            let path = dir.path().join(format!("{name}-threads-{threads}.jsonl"));
            let env = [("RAYON_NUM_THREADS", threads)];
            step_bits(&run_recorded(&path, model, &[micro_batch], 3, &env, None))
        };
        let (one, two) = (steps("1"), steps("2"));
        assert_eq!(one.len(), 3, "{name}");
        assert_eq!(one, two, "{name}: 1 vs 2 threads");
    }
}

/// A headless run of `model` on the CPU for `steps` steps with `--set`s, environment `env` and,
/// with `pin`, only the given CPUs allowed; its recording, written to `record`.
fn run_recorded(
    record: &Path,
    model: TestModel,
    sets: &[&str],
    steps: u32,
    env: &[(&str, &str)],
    pin: Option<&'static [usize]>,
) -> gaccwb::record::Recording {
    let (model, steps) = (model.args(), steps.to_string());
    let mut args = vec!["run", "--headless", "--device", "cpu", "--steps", &steps];
    args.extend(model.iter().map(String::as_str));
    for set in sets {
        args.extend_from_slice(&["--set", set]);
    }
    args.extend_from_slice(&["--record", record.to_str().unwrap()]);
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("gaccwb"));
    cmd.envs(env.iter().copied()).args(&args);
    if let Some(cpus) = pin {
        #[cfg(target_os = "linux")]
        pin_to(&mut cmd, cpus);
        #[cfg(not(target_os = "linux"))]
        panic!("pinning to CPUs {cpus:?} is written for Linux");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    gaccwb::record::read_recording(record).unwrap()
}

/// Loss and both gradient norms of every step, as bits.
fn step_bits(recording: &gaccwb::record::Recording) -> Vec<[u64; 3]> {
    steps(&recording.events)
        .map(|s| [s.loss, s.grad_norm, s.grad_norm_clipped].map(f64::to_bits))
        .collect()
}

/// Whether the fused ops run on the pool or on the trainer's thread alone changes time, not
/// bits: fixed either way, or chosen by the governor (its reading of the load, its probes), the
/// steps are the same; each step records the threads it ran on.
#[test]
fn the_cpu_pool_choice_changes_time_not_results() {
    let dir = tempfile::tempdir().unwrap();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let run = |choice: &str| {
        let path = dir.path().join(format!("{choice}.jsonl"));
        let env = [("RAYON_NUM_THREADS", "2"), ("GACCWB_CPU_POOL", choice)];
        run_recorded(&path, SPLIT, &["train.micro_batch=12"], 8, &env, None)
    };
    let threads = |r: &gaccwb::record::Recording| -> Vec<Option<usize>> {
        steps(&r.events).map(|s| s.cpu_threads).collect()
    };
    let (pool, serial) = (run("pool"), run("serial"));
    assert_eq!(step_bits(&pool).len(), 8);
    assert_eq!(step_bits(&pool), step_bits(&serial), "pool vs serial");
    assert_eq!(step_bits(&pool), step_bits(&run("auto")), "pool vs auto");
    let (on_pool, alone) = if cpus >= 2 {
        (Some(2), Some(1))
    } else {
        (None, None)
    };
    assert_eq!(threads(&pool), [on_pool; 8]);
    assert_eq!(threads(&serial), [alone; 8]);
    let model = TINY.args();
    let mut args = vec!["run", "--headless", "--steps", "1"];
    args.extend(model.iter().map(String::as_str));
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .env("GACCWB_CPU_POOL", "many")
        .args(&args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("GACCWB_CPU_POOL=\"many\""), "{stderr}");
}

/// Has `cmd` run on the given CPUs only (its affinity mask, as `taskset` or a container sets it).
#[cfg(target_os = "linux")]
fn pin_to(cmd: &mut std::process::Command, cpus: &'static [usize]) {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec the hook calls only `sched_setaffinity` on a set built on
    // its own stack: async-signal-safe, no allocation, no locks.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &cpu in cpus {
                libc::CPU_SET(cpu, &mut set);
            }
            match libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
}

/// A process allowed one CPU (its affinity mask, as `taskset -c 0` or a container sets it) runs
/// one thread, whatever `RAYON_NUM_THREADS` says: a second would only wait for the first.
#[cfg(target_os = "linux")]
#[test]
fn the_cpu_path_uses_no_more_threads_than_the_cpus_it_may_run_on() {
    let dir = tempfile::tempdir().unwrap();
    let threads = |pin: Option<&'static [usize]>| {
        let path = dir.path().join(format!("{}.jsonl", pin.is_some()));
        let env = [("RAYON_NUM_THREADS", "2")];
        run_recorded(&path, TINY, &[], 1, &env, pin)
            .header
            .build
            .threads
    };
    assert_eq!(threads(Some(&[0])), 1, "one CPU allowed");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(
        threads(None),
        cpus.min(2),
        "RAYON_NUM_THREADS=2 on {cpus} CPUs"
    );
}

/// Busy loops that end with the value.
#[cfg(target_os = "linux")]
struct BusyLoops(Vec<std::process::Child>);

#[cfg(target_os = "linux")]
impl Drop for BusyLoops {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Beside processes that keep its CPUs busy, a run starts with the fused ops on the trainer's
/// thread alone, from the governor's reading of `/proc` before any window is timed, says so, and
/// its steps say so; the bits are those of a run on the pool. The run and two busy loops share
/// CPUs 0 and 1; on a one-CPU machine there is no pool to choose, and no such line.
#[cfg(target_os = "linux")]
#[test]
fn a_run_beside_busy_processes_starts_on_one_thread_and_logs_why() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pinned: &'static [usize] = if cpus >= 2 { &[0, 1] } else { &[0] };
    let dir = tempfile::tempdir().unwrap();
    let sets = ["train.micro_batch=12"];
    let two = ("RAYON_NUM_THREADS", "2");
    let on_pool = run_recorded(
        &dir.path().join("pool.jsonl"),
        SPLIT,
        &sets,
        3,
        &[two, ("GACCWB_CPU_POOL", "pool")],
        Some(pinned),
    );
    let _loops = BusyLoops(
        (0..2)
            .map(|_| {
                let mut sh = std::process::Command::new("sh");
                sh.args(["-c", "while :; do :; done"]);
                pin_to(&mut sh, pinned);
                sh.spawn().unwrap()
            })
            .collect(),
    );
    // Windows of this size take long enough for a reading before the third.
    let busy = dir.path().join("busy.jsonl");
    let recording = run_recorded(&busy, SPLIT, &sets, 3, &[two], Some(pinned));
    let logs: Vec<&str> = recording
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Log(l) => Some(l.message.as_str()),
            _ => None,
        })
        .collect();
    let started_serial = logs
        .iter()
        .any(|l| l.starts_with("CPU ops start on the trainer's thread alone"));
    assert_eq!(started_serial, cpus >= 2, "{logs:?}");
    let threads: Vec<Option<usize>> = steps(&recording.events).map(|s| s.cpu_threads).collect();
    let pool_threads: Vec<Option<usize>> = steps(&on_pool.events).map(|s| s.cpu_threads).collect();
    if cpus >= 2 {
        assert_eq!(threads.last(), Some(&Some(1)), "{threads:?}");
        assert_eq!(pool_threads, [Some(2); 3]);
    } else {
        assert_eq!(threads, [None; 3], "one CPU: no choice to record");
    }
    assert_eq!(step_bits(&recording), step_bits(&on_pool));
}

#[test]
fn the_lean_kernels_switch_and_its_old_name_run_and_unknown_values_are_refused() {
    let run = |value: &str| {
        let model = TINY.args();
        let mut args = vec!["run", "--headless", "--device", "cpu", "--steps", "2"];
        args.extend(model.iter().map(String::as_str));
        let out = Command::cargo_bin("gaccwb")
            .unwrap()
            .env("GACCWB_KERNELS", value)
            .args(&args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for value in ["lean", "composite"] {
        let (code, stderr) = run(value);
        assert_eq!(code, Some(0), "{value}: {stderr}");
    }
    let (code, stderr) = run("tensor-cores");
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("GACCWB_KERNELS") && stderr.contains("lean"),
        "{stderr}"
    );
}

/// `--log FILE` gets the run's diagnostics (applied controls, the end) and appends to an earlier
/// log; the headless output carries none of them.
#[test]
fn diagnostics_go_to_the_log_file_only() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("gaccwb.log");
    std::fs::write(&log, "an earlier line\n").unwrap();
    let log_arg = log.to_str().unwrap();
    let (code, stdout, stderr) =
        run_headless(&["--control", "1:set_accum_steps=2", "--log", log_arg]);
    assert_eq!(code, 0, "{stderr}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.starts_with("an earlier line\n"), "{text}");
    assert!(text.contains("applied K=2"), "{text}");
    assert!(
        text.contains("run ended") && text.contains("completed"),
        "{text}"
    );
    assert!(!stdout.contains("applied K=2") && !stderr.contains("applied K=2"));
}

#[test]
fn help_shows_the_command_as_optional() {
    let (code, stdout, stderr) = gaccwb(&["--help"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("Usage: gaccwb [OPTIONS] [COMMAND]"),
        "{stdout}"
    );
    assert!(!stdout.contains("<COMMAND>"), "{stdout}");
}
