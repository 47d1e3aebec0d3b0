//! Shared by the integration tests: the smallest model that still exercises every layer type,
//! and how a finished `gaccwb` process is read.
// Each test binary uses its own subset.
#![allow(dead_code)]

use gaccwb::scenario::Scenario;

/// A 2-layer, 32-wide GPT over a 32-token vocabulary with 32-token samples; no evaluation.
pub fn tiny_scenario() -> Scenario {
    let mut s = Scenario::default();
    s.model.vocab = 32;
    s.model.d_model = 32;
    s.model.layers = 2;
    s.model.heads = 2;
    s.model.seq_len = 32;
    s.train.eval_every = 0;
    s
}

/// A finished `gaccwb` run as (exit code, stdout, stderr); a panic is a test failure whatever
/// the exit code.
pub fn outcome(args: &[&str], out: std::process::Output) -> (i32, String, String) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !stderr.contains("panicked"),
        "gaccwb {args:?} panicked:\n{stderr}"
    );
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
    )
}
