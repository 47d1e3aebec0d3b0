//! `gaccwb estimate` for the models people train: Hugging Face configs of each family, the
//! reference stack beside this engine, ZeRO and offload levers, time per step, and one-line
//! refusals of bad values.

use std::path::Path;

use assert_cmd::Command;
use gaccwb::hf::read_config;
use gaccwb::planner::{BaseDtype, Lora};

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/hf/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `estimate … --json` with the host's AdamW rate given, so nothing is timed.
fn estimate_json(args: &[&str]) -> serde_json::Value {
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .arg("estimate")
        .args(args)
        .args(["--cpu-adam-gbps", "2", "--json"])
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

/// The parameters of each fixture as `transformers` 5.25 builds the model on PyTorch's meta
/// device (benches/hf_param_counts.py): (file, model_type, parameters, active parameters).
const COUNTS: [(&str, &str, u64, u64); 12] = [
    ("gpt2.json", "gpt2", 124_439_808, 124_439_808),
    ("pythia-160m.json", "gpt_neox", 162_322_944, 162_322_944),
    ("llama3-8b.json", "llama", 8_030_261_248, 8_030_261_248),
    ("mistral-7b.json", "mistral", 7_241_732_096, 7_241_732_096),
    ("qwen2-0.5b.json", "qwen2", 494_032_768, 494_032_768),
    ("qwen3-0.6b.json", "qwen3", 596_049_920, 596_049_920),
    ("gemma-2b.json", "gemma", 2_506_172_416, 2_506_172_416),
    ("gemma2-2b.json", "gemma2", 2_614_341_888, 2_614_341_888),
    ("phi3.5-mini.json", "phi3", 3_821_079_552, 3_821_079_552),
    (
        "mixtral-8x7b.json",
        "mixtral",
        46_702_792_704,
        12_879_925_248,
    ),
    (
        "qwen1.5-moe-a2.7b.json",
        "qwen2_moe",
        14_315_784_192,
        2_689_173_504,
    ),
    (
        "qwen3-30b-a3b.json",
        "qwen3_moe",
        30_532_122_624,
        3_353_032_704,
    ),
];

#[test]
fn each_family_config_counts_the_parameters_transformers_builds() {
    for (file, family, count, active) in COUNTS {
        let arch = read_config(Path::new(&fixture(file))).unwrap();
        assert_eq!(
            (
                arch.family.as_str(),
                arch.param_count(),
                arch.active_params()
            ),
            (family, count, active),
            "{file}"
        );
    }
    let qwen = read_config(Path::new(&fixture("qwen2-0.5b.json"))).unwrap();
    assert!(qwen.tied && qwen.qkv_bias && !qwen.out_bias);
    assert_eq!((qwen.heads, qwen.kv_heads), (14, 2));
    let gemma2 = read_config(Path::new(&fixture("gemma2-2b.json"))).unwrap();
    assert!(gemma2.attention_softcap && gemma2.logit_softcap && gemma2.post_norms);
    assert_eq!(
        gemma2.sliding.map(|w| (w.window, w.layers)),
        Some((4096, 13))
    );
}

/// Rank-16 adapters on every projection, as PEFT 0.21 counts them on each dense fixture
/// (benches/hf_param_counts.py --lora): the planner's count from the config and the targets.
#[test]
fn lora_adapters_count_what_peft_counts() {
    let peft = [
        ("gpt2.json", 2_359_296u64),
        ("pythia-160m.json", 2_359_296),
        ("llama3-8b.json", 41_943_040),
        ("mistral-7b.json", 41_943_040),
        ("qwen2-0.5b.json", 8_798_208),
        ("qwen3-0.6b.json", 10_092_544),
        ("gemma-2b.json", 19_611_648),
        ("gemma2-2b.json", 20_766_720),
        ("phi3.5-mini.json", 25_165_824),
    ];
    for (file, count) in peft {
        let arch = read_config(Path::new(&fixture(file))).unwrap();
        let lora = Lora::new(&arch, 16, None, 0.0, BaseDtype::Bf16).unwrap();
        assert_eq!(lora.adapter_params(&arch), count, "{file}");
    }
}

#[test]
fn a_llama_config_gets_this_engines_estimate_and_the_reference_stack() {
    let report = estimate_json(&["--config", &fixture("llama3-8b.json"), "--seq-len", "4096"]);
    // The engine trains llama: its estimate books the family's own blocks and tied-or-not head.
    assert!(report["engine_unavailable"].is_null(), "{report}");
    assert_eq!(report["engine"]["params"], 8_030_261_248u64);
    assert_eq!(report["model"]["params"], 8_030_261_248u64);
    assert_eq!(report["model"]["arch"]["seq_len"], 4096);
    let r = &report["reference"];
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
    // A family the engine does not train (GeGLU, post-norms, soft-capping): the reference only.
    let gemma2 = estimate_json(&["--config", &fixture("gemma2-2b.json"), "--seq-len", "1024"]);
    assert!(gemma2["engine"].is_null(), "{gemma2}");
    assert!(gemma2["engine_unavailable"]
        .as_str()
        .unwrap()
        .contains("gemma2"));
}

/// The question people ask, with no flags: a fine-tune's sequence length (not the 8192-token
/// context), one sample per micro-batch at the preset's effective batch, judged against the
/// memory of the GPU whose time is given, the host's AdamW timed here.
#[test]
fn a_llama_config_with_no_flags_answers_the_question_people_ask() {
    let cache = tempfile::tempdir().unwrap();
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .env("XDG_CACHE_HOME", cache.path())
        .args(["estimate", "--config", &fixture("llama3-8b.json"), "--json"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(report["model"]["arch"]["seq_len"], 4096);
    assert_eq!(report["model"]["arch"]["max_context"], 8192);
    assert_eq!(report["budget"]["bytes"], 80_000_000_000u64);
    let r = &report["reference"];
    let setup = &r["configured"]["setup"];
    assert_eq!(
        (setup["micro_batch"].as_u64(), setup["accum_steps"].as_u64()),
        (Some(1), Some(8))
    );
    assert_eq!(r["rates"]["gpu"]["name"], "h100");
    assert_eq!(r["rates"]["host_source"], "measured");
    assert!(cache.path().join("gaccwb/host-rates.json").is_file());
    // A full fine-tune of 8B parameters needs 16 bytes each of state: more than 80 GB until the
    // optimizer leaves the device; LoRA fits, QLoRA in less.
    assert_eq!(r["configured"]["fits"], false);
    let fitting: Vec<&str> = r["levers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["outcome"]["fits"] == true)
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(fitting.first(), Some(&"+ offload optimizer"), "{fitting:?}");
    let adapters = r["adapters"].as_array().unwrap();
    assert_eq!(adapters.len(), 2);
    assert!(adapters.iter().all(|l| l["outcome"]["fits"] == true));
    assert_eq!(adapters[0]["outcome"]["trained_params"], 41_943_040u64);
}

#[test]
fn lora_on_the_reference_stack_and_a_seam_for_this_engine() {
    let report = estimate_json(&[
        "--config",
        &fixture("llama3-8b.json"),
        "--lora-rank",
        "16",
        "--base-dtype",
        "nf4",
    ]);
    let c = &report["reference"]["configured"];
    assert_eq!(c["trained_params"], 41_943_040u64);
    assert_eq!(c["setup"]["lora"]["base"], "nf4");
    // Gradients and optimizer state for the adapters only: 20 bytes each in all.
    let m = &c["model_states"];
    let states: u64 = ["weights16", "gradients16", "gradients32", "optimizer"]
        .iter()
        .map(|k| m[*k]["device"].as_u64().unwrap())
        .sum();
    assert_eq!(states, 20 * 41_943_040);
    assert!(report["reference"]["adapters"]
        .as_array()
        .unwrap()
        .is_empty());
    // The engine books LoRA on GPT-2's shape: the adapters of every linear layer of its 12
    // blocks trained (8·(768 + 2304) + 8·(768 + 768) + 2·8·(768 + 3072) each), the base frozen.
    let gpt2 = estimate_json(&["--shape", "gpt2", "--lora-rank", "8"]);
    let engine = &gpt2["engine"];
    let adapters = 12 * 8 * (768 + 2304 + 768 + 768 + 2 * (768 + 3072));
    assert_eq!(engine["params"], adapters);
    assert_eq!(engine["estimate"]["step"]["optimizer_state"], 8 * adapters);
    assert!(engine["estimate"]["step"]["frozen"].as_u64().unwrap() > 100_000_000);
    // A 4-bit base is the reference stack's alone.
    assert!(refused(&[
        "--shape",
        "gpt2",
        "--lora-rank",
        "8",
        "--base-dtype",
        "nf4",
        "--stack",
        "engine"
    ])
    .contains("--stack reference"));
}

#[test]
fn a_mixture_of_experts_keeps_every_expert_and_computes_the_routed_ones() {
    let report = estimate_json(&["--config", &fixture("mixtral-8x7b.json")]);
    let (params, active) = (46_702_792_704u64, 12_879_925_248u64);
    assert_eq!(report["model"]["params"], params);
    assert_eq!(report["model"]["active_params"], active);
    let c = &report["reference"]["configured"];
    // Every expert's 16-bit weights and gradients, fp32 gradients and AdamW state.
    let m = &c["model_states"];
    assert_eq!(m["weights16"]["device"], 2 * params);
    assert_eq!(m["optimizer"]["device"], 12 * params);
    // FLOPs follow the two routed experts: 6 per active matrix parameter, far below 6 per
    // parameter.
    let tokens = c["time"]["tokens"].as_f64().unwrap();
    let per_token = c["time"]["flops"].as_f64().unwrap() / tokens;
    assert!(per_token < 6.0 * active as f64 + 12.0 * 32.0 * 4096.0 * 4096.0 + 1.0);
    assert!(per_token > 6.0 * (active as f64 - 2.0 * 32000.0 * 4096.0));
}

#[test]
fn a_gpt2_shape_answers_for_both_stacks() {
    let report = estimate_json(&["--shape", "gpt2", "--tied", "--gpu", "--budget-gib", "24"]);
    // The model's count once, the published one; this engine's head is untied.
    assert_eq!(report["model"]["params"], 124_439_808u64);
    assert_eq!(report["engine"]["params"], 124_439_808u64 + 768 * 50257);
    assert!(report["engine_unavailable"].is_null());
    // A shorter context is the same published model, and this engine's at that length.
    let short = estimate_json(&["--shape", "gpt2", "--seq-len", "512"]);
    assert_eq!(short["model"]["params"], 124_439_808u64);
    assert_eq!(short["engine"]["config"]["model"]["seq_len"], 512);
    assert_eq!(short["model"]["arch"]["seq_len"], 512);
    let engine_only = estimate_json(&["--shape", "gpt2", "--stack", "engine"]);
    assert!(engine_only["reference"].is_null());
    // The same keys whatever the family.
    let llama = estimate_json(&["--shape", "llama3-8b"]);
    let keys = |v: &serde_json::Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(keys(&report), keys(&llama));
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
    let llama = fixture("llama3-8b.json");
    let cases: [(&[&str], &str); 17] = [
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
            "model_type `t5` is not supported; supported: gpt2, gpt_neox, llama",
        ),
        (
            &["--config", partial],
            "field `hidden_size` is missing (model_type mistral",
        ),
        (&["--config", "/dev/zero"], "/dev/zero: not a regular file"),
        (
            &["--seq-len", "100", "--set", "model.seq_len=200"],
            "--seq-len 100 and --set model.seq_len=200 name one setting",
        ),
        (
            &[
                "--config",
                &llama,
                "--lora-rank",
                "8",
                "--lora-targets",
                "w9",
            ],
            "--lora-targets w9: llama has no linear layer of that name; its layers: q_proj",
        ),
        (&["--base-dtype", "nf4"], "--base-dtype needs --lora-rank"),
        (&["--offload", "optimizer,optimizer"], "named twice"),
        (&["--ranks", "100000"], "--ranks 100000: at most 65536"),
        (
            &["--mfu", "1e-300"],
            "--mfu 1e-300: expected a fraction from 0.001 to 1",
        ),
        (
            &["--gpu-model", "cpu", "--offload", "optimizer"],
            "offload moves nothing",
        ),
    ];
    for (args, expected) in cases {
        let err = refused(args);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
    assert!(refused(&["--config", t5]).contains("t5.json"));
}
