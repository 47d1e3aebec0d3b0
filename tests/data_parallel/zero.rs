//! ZeRO stages, the learning-rate rule over ranks, knobs turned mid-run, and LoRA over ranks.

use super::*;

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
pub(crate) fn largest_difference(a: &Path, b: &Path, prefix: &str) -> (f64, String) {
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
