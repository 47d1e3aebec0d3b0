//! This host's rates for the planner, when no flag gives them: the fused AdamW's bytes of
//! optimizer state per second and the f32 product's FLOP/s, timed once (about half a second:
//! 4,194,304 parameters, five AdamW steps and five 512³ products after one of each untimed) and
//! cached in `$XDG_CACHE_HOME/gaccwb/host-rates.json` (beside the tokenizer cache) for this CPU,
//! thread count, gaccwb version and build (a debug build's kernels are several times slower). Delete the file to time again; `gaccwb bench --adamw` times
//! longer and prints the flags that pass its figures on.

use std::path::{Path, PathBuf};

use gaccwb::planner::{HostFigures, HostSource};
use serde::{Deserialize, Serialize};

/// Parameters the timing updates (16 bytes each of optimizer state: 64 MiB).
const PARAMS: usize = 1 << 22;
/// The side of the timed product.
const MATMUL_N: usize = 512;
/// Timed repetitions of each.
const STEPS: usize = 5;

/// What the cache holds.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Cached {
    /// The gaccwb version that timed it (a new kernel may run at another rate).
    version: String,
    /// The CPU's model name.
    cpu: String,
    /// Threads the kernels ran on.
    threads: usize,
    /// Timed by an optimized build (a debug build runs the kernels several times slower).
    optimized: bool,
    /// GB/s of AdamW's optimizer state.
    adamw_gbps: f64,
    /// TFLOP/s of the f32 product.
    cpu_tflops: f64,
}

/// The cache file.
pub fn cache_path() -> PathBuf {
    let tokenizers = gaccwb::tokenizer::default_cache_dir();
    tokenizers
        .parent()
        .map_or_else(|| tokenizers.clone(), Path::to_path_buf)
        .join("host-rates.json")
}

/// This CPU's model name (`/proc/cpuinfo`), or `unknown`.
fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The cached rates of this host, else timed now and cached; the assumed figures when timing
/// fails.
pub fn figures() -> HostFigures {
    let key = Cached {
        version: env!("CARGO_PKG_VERSION").into(),
        cpu: cpu_name(),
        threads: gaccwb::bench::threads(),
        optimized: !cfg!(debug_assertions),
        adamw_gbps: 0.0,
        cpu_tflops: 0.0,
    };
    let path = cache_path();
    let same_host =
        |c: &Cached| (&c.version, &c.cpu, c.threads) == (&key.version, &key.cpu, key.threads);
    if let Some(c) = read(&path).filter(same_host) {
        return measured(c.adamw_gbps, c.cpu_tflops);
    }
    let Ok(r) = gaccwb::bench::measure_host_rates(PARAMS, MATMUL_N, STEPS) else {
        return HostFigures::default();
    };
    let timed = Cached {
        adamw_gbps: r.adamw_bytes_per_s / 1e9,
        cpu_tflops: r.matmul_flops_per_s / 1e12,
        ..key
    };
    // The cache saves the next estimate half a second; failing to write it costs nothing else.
    let _ = write(&path, &timed);
    measured(timed.adamw_gbps, timed.cpu_tflops)
}

fn measured(adamw_gbps: f64, cpu_tflops: f64) -> HostFigures {
    let ok = |v: f64| v.is_finite() && v > 0.0;
    if !(ok(adamw_gbps) && ok(cpu_tflops)) {
        return HostFigures::default();
    }
    HostFigures {
        adamw_gbps,
        cpu_tflops,
        source: HostSource::Measured,
    }
}

/// The cache, when it is a small regular file of the expected form.
fn read(path: &Path) -> Option<Cached> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() || meta.len() > 4096 {
        return None;
    }
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

fn write(path: &Path, c: &Cached) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string_pretty(c)?;
    gaccwb::safe_write::write_file(
        path,
        text.as_bytes(),
        "host rates cache",
        &gaccwb::safe_write::Overwrite::ours(),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_of_another_form_is_ignored_and_a_good_one_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host-rates.json");
        std::fs::write(&path, "{not json").unwrap();
        assert!(read(&path).is_none());
        let c = Cached {
            version: "0".into(),
            cpu: "x".into(),
            threads: 2,
            optimized: true,
            adamw_gbps: 1.5,
            cpu_tflops: 0.02,
        };
        write(&path, &c).unwrap();
        assert_eq!(read(&path), Some(c));
        assert!(read(dir.path()).is_none(), "a directory is not a cache");
        assert_eq!(measured(f64::NAN, 1.0), HostFigures::default());
    }
}
