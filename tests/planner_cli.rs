//! `gaccwb estimate` for the models people train: Hugging Face configs of each family, the
//! reference stack beside this engine, ZeRO and offload levers, time per step, and one-line
//! refusals of bad values.

use std::path::Path;

use assert_cmd::Command;
use gaccwb::hf::config as hf_config;

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/hf/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn estimate_json(args: &[&str]) -> serde_json::Value {
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .arg("estimate")
        .args(args)
        .arg("--json")
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    serde_json::from_slice(&out).unwrap()
}

/// The stderr of a refused command, which must exit 2 with one line.
fn refused(args: &[&str]) -> String {
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .arg("estimate")
        .args(args)
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(text.trim_end().lines().count(), 1, "{text}");
    text
}

#[test]
fn each_family_config_counts_its_published_parameters() {
    // Published counts of the checkpoints whose config.json the fixtures copy.
    let published = [
        ("gpt2.json", "gpt2", 124_439_808u64),
        ("llama3-8b.json", "llama", 8_030_261_248),
        ("mistral-7b.json", "mistral", 7_241_732_096),
        ("qwen2-0.5b.json", "qwen2", 494_032_768),
        ("pythia-160m.json", "gpt_neox", 162_322_944),
    ];
    for (file, family, count) in published {
        let arch = hf_config::load(Path::new(&fixture(file))).unwrap();
        assert_eq!(
            (arch.family.as_str(), arch.param_count()),
            (family, count),
            "{file}"
        );
    }
    let qwen = hf_config::load(Path::new(&fixture("qwen2-0.5b.json"))).unwrap();
    assert!(qwen.tied && qwen.qkv_bias && !qwen.out_bias);
    assert_eq!((qwen.heads, qwen.kv_heads), (14, 2));
}

#[test]
fn a_llama_config_gets_the_reference_stack_only() {
    let report = estimate_json(&["--config", &fixture("llama3-8b.json"), "--seq-len", "4096"]);
    assert!(report["engine_unavailable"]
        .as_str()
        .unwrap()
        .contains("grouped-query attention"));
    assert!(report.get("table").is_none(), "no engine table: {report}");
    let r = &report["reference"];
    assert_eq!(r["params"], 8_030_261_248u64);
    assert_eq!(r["arch"]["seq_len"], 4096);
    let c = &r["configured"];
    for key in ["device", "host", "fits"] {
        assert!(c.get(key).is_some(), "{key}: {c}");
    }
    let t = &c["time"];
    for key in [
        "flops",
        "compute_s",
        "pcie_s",
        "network_s",
        "cpu_adam_s",
        "step_s",
        "tokens_per_s",
    ] {
        assert!(t[key].as_f64().is_some(), "{key}: {t}");
    }
    assert_eq!(t["bound"], "compute");
    assert!(r["levers"].as_array().unwrap().len() >= 3);
}

#[test]
fn a_gpt2_shape_answers_for_both_stacks() {
    let report = estimate_json(&["--shape", "gpt2", "--tied", "--gpu", "--budget-gib", "24"]);
    // This engine's fields stay at the top level; its head is untied.
    assert_eq!(report["params"], 124_439_808u64 + 768 * 50257);
    assert_eq!(report["reference"]["params"], 124_439_808u64);
    assert!(report.get("engine_unavailable").is_none());
    let engine_only = estimate_json(&["--shape", "gpt2", "--stack", "engine"]);
    assert!(engine_only.get("reference").is_none());
    assert!(refused(&["--shape", "llama3-70b", "--stack", "engine"]).contains("--stack reference"));
}

/// The notes' case: GPT-3 175B on a 40 GB card, K=4, ZeRO-3 with the optimizer and the
/// parameters offloaded. The weights leave the device; the activations of one sample decide.
#[test]
fn gpt3_on_forty_gigabytes_with_zero3_offload() {
    let case = |recompute: &str| {
        estimate_json(&[
            "--shape",
            "gpt3-175b",
            "--stack",
            "reference",
            "--gpu-model",
            "a100",
            "--budget-gib",
            "40",
            "--set",
            "train.micro_batch=1",
            "--set",
            "train.accum_steps=4",
            "--zero",
            "3",
            "--offload",
            "optimizer,parameters",
            "--recompute",
            recompute,
        ])["reference"]["configured"]
            .clone()
    };
    let params = 174_604_259_328u64;
    let flash = case("none");
    assert_eq!(flash["fits"], false);
    let full = case("full");
    assert_eq!(full["fits"], true);
    assert!(full["device"].as_u64().unwrap() < 40 << 30);
    // 16-bit weights, fp32 gradients, master weights and moments on the host: 18 bytes each.
    assert_eq!(full["host"], 18 * params);
    // Each of the 4 micro-batches fetches the 16-bit weights three times (forward, backward,
    // recompute) and sends its gradients down once.
    assert_eq!(full["time"]["h2d_bytes"], 4 * 3 * 2 * params);
    assert_eq!(full["time"]["d2h_bytes"], 4 * 2 * params);
}

#[test]
fn bad_values_are_one_line_errors_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let t5 = dir.path().join("t5.json");
    std::fs::write(&t5, r#"{"model_type": "t5", "vocab_size": 32128}"#).unwrap();
    let partial = dir.path().join("partial.json");
    std::fs::write(
        &partial,
        r#"{"model_type": "mistral", "vocab_size": 32000}"#,
    )
    .unwrap();
    let t5 = t5.to_str().unwrap();
    let partial = partial.to_str().unwrap();
    let cases: [(&[&str], &str); 9] = [
        (&["--ranks", "0"], "--ranks 0"),
        (&["--mfu", "0"], "--mfu 0"),
        (&["--mfu", "1.5"], "--mfu 1.5"),
        (
            &["--gpu-model", "v100"],
            "--gpu-model v100: unknown GPU; models: h100, h200",
        ),
        (&["--offload", "nvme"], "--offload nvme: unknown target"),
        (
            &["--offload", "parameters"],
            "--offload parameters needs --zero 3",
        ),
        (&["--zero", "4"], "--zero 4"),
        (
            &["--config", t5],
            "model_type `t5` is not supported; supported: gpt2, llama",
        ),
        (
            &["--config", partial],
            "field `hidden_size` is missing (model_type mistral",
        ),
    ];
    for (args, expected) in cases {
        let err = refused(args);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
    assert!(refused(&["--config", t5]).contains("t5.json"));
}
