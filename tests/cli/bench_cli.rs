//! `gaccwb bench --model`: the step's rate beside the host's product rate in the step's dtype.

use std::path::Path;

use assert_cmd::Command;
use serde_json::Value;

use crate::common;

/// With f32 and bf16 asked for, the products are timed in both at the same shapes, and each
/// dtype's step is a fraction of its own dtype's best product (bf16 products run on AMX tiles or
/// AVX-512 BF16 dot products where the CPU has them, faster than f32, so f32's best would flatter
/// bf16). Each step's forward and backward carry the fused head's share.
#[test]
fn bench_model_rates_each_dtype_against_its_own_products() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/models/llama-tied");
    let args = [
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--seq-len",
        "16",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--dtype",
        "f32,bf16",
        "--json",
    ];
    let out = Command::cargo_bin("gaccwb")
        .unwrap()
        .env("RAYON_NUM_THREADS", "1")
        .args(args)
        .output()
        .unwrap();
    let (code, stdout, stderr) = common::outcome(&args, out);
    assert_eq!(code, 0, "{stderr}");
    let rows: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let products = rows
        .iter()
        .find(|r| r["impl"] == "candle-product")
        .expect("a product row")["products"]
        .as_array()
        .unwrap()
        .clone();
    // The peak is of the widest f32 FMA the CPU has, on the one thread asked for.
    let peak = &rows.iter().find(|r| r["impl"] == "candle-product").unwrap()["fma_peak"];
    match widest_fma() {
        Some(isa) => {
            assert!(peak["flops_per_s"].as_f64().unwrap() > 0.0, "{peak}");
            assert_eq!((&peak["threads"], &peak["isa"]), (&1.into(), &isa.into()));
        }
        None => assert!(peak.is_null(), "{peak}"),
    }
    let shapes = |dtype: &str| -> Vec<(u64, u64, u64)> {
        let of = |p: &Value, k: &str| p[k].as_u64().unwrap();
        products
            .iter()
            .filter(|p| p["dtype"] == dtype)
            .map(|p| (of(p, "m"), of(p, "k"), of(p, "n")))
            .collect()
    };
    assert_eq!(shapes("f32").len(), 3, "{products:?}");
    assert_eq!(shapes("f32"), shapes("bf16"), "{products:?}");
    for dtype in ["f32", "bf16"] {
        let best = products
            .iter()
            .filter(|p| p["dtype"] == dtype)
            .map(|p| p["flops_per_s"].as_f64().unwrap())
            .fold(0.0, f64::max);
        let step = rows.iter().find(|r| r["dtype"] == dtype).expect(dtype);
        let rate = step["flops_per_s"].as_f64().unwrap();
        assert_eq!(
            step["of_best_product"].as_f64().unwrap(),
            rate / best,
            "{dtype}"
        );
        // The FMA peak bounds the dtypes whose products run on f32 FMAs (`gemm`).
        let on_fmas = products
            .iter()
            .filter(|p| p["dtype"] == dtype)
            .all(|p| p["kernel"] == "gemm");
        let expected = peak["flops_per_s"]
            .as_f64()
            .filter(|_| on_fmas)
            .map(|p| rate / p);
        assert_eq!(step["of_fma_peak"].as_f64(), expected, "{dtype}");
        // The fused head's share lies inside the forward and the backward.
        for phase in ["forward", "backward"] {
            let head = step[format!("head_{phase}_ms")]
                .as_f64()
                .expect("head timed");
            let whole = step[format!("{phase}_ms")].as_f64().unwrap();
            assert!(
                head > 0.0 && head < whole,
                "{dtype} {phase}: {head} of {whole}"
            );
        }
    }
}

/// The widest f32 FMA this CPU has, as `ops::peak` names it.
fn widest_fma() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some("avx512f");
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Some("avx2 fma");
        }
    }
    None
}

/// `--device` chooses where `--model`'s step runs: without `--model` it is a usage error, and a
/// GPU this build cannot open fails before anything is timed, saying how to get one.
#[test]
fn bench_device_needs_a_model_and_a_device_that_opens() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let run = |args: &[&str]| common::gaccwb(args, root);
    let (code, _, stderr) = run(&["bench", "--device", "cpu"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--model"), "{stderr}");
    #[cfg(not(feature = "cuda"))]
    {
        let model = root.join("tests/fixtures/hf/models/llama-tied");
        let (code, stdout, stderr) = run(&[
            "bench",
            "--model",
            model.to_str().unwrap(),
            "--device",
            "cuda",
        ]);
        assert_eq!(code, 1, "{stderr}");
        assert!(stdout.is_empty(), "{stdout}");
        assert!(stderr.contains("--features cuda"), "{stderr}");
    }
}
