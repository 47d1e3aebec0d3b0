//! `gaccwb estimate`: tables for people, JSON for scripts, usage errors for bad input.

use assert_cmd::Command;

#[test]
fn estimate_prints_json_with_the_table_and_the_largest_fitting_micro_batch() {
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .args([
            "estimate",
            "--stack",
            "engine",
            "--set",
            "train.micro_batch=4",
            "--set",
            "train.accum_steps=8",
        ])
        .args(["--budget-gib", "0.25", "--json"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let answer: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let report = &answer["engine"];
    assert_eq!(report["effective_batch"], 32);
    let table = report["table"].as_array().unwrap();
    assert_eq!(table.len(), 6, "B = 1, 2, 4, 8, 16, 32");
    let peaks: Vec<u64> = table.iter().map(|r| r["peak"].as_u64().unwrap()).collect();
    assert!(peaks.windows(2).all(|w| w[0] < w[1]), "{peaks:?}");
    let fit = &report["largest_fitting"];
    assert!(fit["peak"].as_u64().unwrap() <= 1 << 28);
    let next = table
        .iter()
        .find(|r| r["micro_batch"].as_u64() > fit["micro_batch"].as_u64());
    assert!(next.is_none_or(|r| r["peak"].as_u64().unwrap() > 1 << 28));
    assert_eq!(
        report["estimate"]["step"]["parameters"].as_u64().unwrap(),
        report["params"].as_u64().unwrap() * 4
    );
}

#[test]
fn estimate_prints_tables_and_rejects_bad_input() {
    let text = Command::cargo_bin("gaccwb")
        .unwrap()
        .args([
            "estimate",
            "baseline",
            "--effective",
            "16",
            "--stack",
            "engine",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(text).unwrap();
    assert!(text.contains("activations"), "{text}");
    assert!(text.contains("At effective batch 16"), "{text}");
    Command::cargo_bin("gaccwb")
        .unwrap()
        .args(["estimate", "--set", "train.micro_batch=zero"])
        .assert()
        .code(2);
    Command::cargo_bin("gaccwb")
        .unwrap()
        .args(["estimate", "--budget-gib", "-1"])
        .assert()
        .code(2);
}

#[test]
fn estimate_plans_named_shapes_it_cannot_train_and_gives_a_verdict() {
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .args([
            "estimate",
            "--shape",
            "gpt3-175b",
            "--gpu",
            "--budget-gib",
            "40",
            "--stack",
            "engine",
        ])
        .args([
            "--set",
            "train.dtype=bf16",
            "--set",
            "train.offload=true",
            "--json",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let answer: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let report = &answer["engine"];
    assert!(report["not_trainable_here"]
        .as_str()
        .unwrap()
        .contains("model.vocab"));
    // Offload in bf16 leaves no f32 weights on the device; the f32 gradient buffer (on the
    // device by default) is what cannot fit.
    let blocker = &report["verdict"]["blocker"];
    assert_eq!(blocker["category"], "gradients");
    assert_eq!(blocker["alone_exceeds"], true);
    assert_eq!(
        blocker["bytes"].as_u64().unwrap(),
        report["params"].as_u64().unwrap() * 4,
        "exact bytes in JSON"
    );
    Command::cargo_bin("gaccwb")
        .unwrap()
        .args(["estimate", "--shape", "gpt5"])
        .assert()
        .code(2);
    Command::cargo_bin("gaccwb")
        .unwrap()
        .args(["run", "--headless", "--budget", "6 GiBs"])
        .assert()
        .code(2);
}
