//! Shared by the integration tests: the one place test models are defined, and how a finished
//! `gaccwb` process is read.
// Each test binary uses its own subset.
#![allow(dead_code)]

pub mod hf;
pub mod ledger;
pub mod tmux;

use gaccwb::scenario::{ModelConfig, Scenario};
use gaccwb::telemetry::{Event, StepEvent};
use gaccwb::train::Trainer;

/// A model shape for tests. A test that needs another shape derives it from [`TINY`]
/// (`TestModel { layers: 4, ..TINY }`) and says why.
#[derive(Clone, Copy, Debug)]
pub struct TestModel {
    pub vocab: usize,
    pub d_model: usize,
    pub layers: usize,
    pub heads: usize,
    pub seq_len: usize,
}

/// The smallest model that still exercises every layer type, and a block feeding another: a
/// 2-layer, 32-wide GPT with 2 heads over a 32-token vocabulary (the synthetic source's alphabet
/// fits) and 32-token samples.
pub const TINY: TestModel = TestModel {
    vocab: 32,
    d_model: 32,
    layers: 2,
    heads: 2,
    seq_len: 32,
};

impl TestModel {
    pub fn config(&self) -> ModelConfig {
        ModelConfig {
            vocab: self.vocab,
            d_model: self.d_model,
            layers: self.layers,
            heads: self.heads,
            seq_len: self.seq_len,
            path: None,
            adapter: None,
        }
    }

    /// `Scenario::default()` with this model and no evaluation pass (it costs time and adds events
    /// few tests look at; those that do turn it back on).
    pub fn scenario(&self) -> Scenario {
        self.onto(Scenario::default())
    }

    /// `s` (a preset's scenario, say) with this model in place of its own, and no evaluation;
    /// its other settings stay.
    pub fn onto(&self, mut s: Scenario) -> Scenario {
        s.model = self.config();
        s.train.eval_every = 0;
        s
    }

    /// The `key=value` assignments `onto` makes, as `--set` and a compare grid take them.
    pub fn sets(&self) -> Vec<String> {
        vec![
            format!("model.vocab={}", self.vocab),
            format!("model.d_model={}", self.d_model),
            format!("model.layers={}", self.layers),
            format!("model.heads={}", self.heads),
            format!("model.seq_len={}", self.seq_len),
            "train.eval_every=0".to_string(),
        ]
    }

    /// [`sets`](Self::sets) as `gaccwb run` arguments: the binary runs the model that `scenario`
    /// builds in process.
    pub fn args(&self) -> Vec<String> {
        self.sets()
            .into_iter()
            .flat_map(|set| ["--set".to_string(), set])
            .collect()
    }
}

/// [`TINY`] accumulating: B=4 over K=2 micro-batches, with a two-step warm-up so the learning
/// rate moves within the few steps a test compares.
pub fn accumulating() -> Scenario {
    let mut s = TINY.scenario();
    s.train.micro_batch = 4;
    s.train.accum_steps = 2;
    s.train.warmup = 2;
    s
}

/// One optimizer step of `t`, which must succeed.
pub fn step(t: &mut Trainer) -> StepEvent {
    match t.train_step(|| true) {
        Ok(s) => s,
        Err(_) => panic!("step failed"),
    }
}

/// The step events among `events`, in order.
pub fn steps(events: &[Event]) -> impl Iterator<Item = &StepEvent> {
    events.iter().filter_map(|e| match e {
        Event::Step(s) => Some(s),
        _ => None,
    })
}

/// `gaccwb ARGS` run in `dir`, ended after two minutes (a hung run fails the test).
pub fn gaccwb(args: &[&str], dir: &std::path::Path) -> (i32, String, String) {
    gaccwb_in(dir, args, 120)
}

/// `gaccwb ARGS` run in `dir`, ended after `timeout_s` seconds: (exit code, stdout, stderr).
pub fn gaccwb_in(dir: &std::path::Path, args: &[&str], timeout_s: u64) -> (i32, String, String) {
    let out = assert_cmd::Command::cargo_bin("gaccwb")
        .unwrap()
        .current_dir(dir)
        .args(args)
        .timeout(std::time::Duration::from_secs(timeout_s))
        .output()
        .unwrap();
    outcome(args, out)
}

/// `run --headless` of [`TINY`] on the CPU for `steps` steps in `dir`, with `extra` arguments.
pub fn headless_tiny(dir: &std::path::Path, steps: &str, extra: &[&str]) -> (i32, String, String) {
    let model = TINY.args();
    let mut args = vec!["run", "--headless", "--device", "cpu", "--steps", steps];
    args.extend(model.iter().map(String::as_str));
    args.extend_from_slice(extra);
    gaccwb_in(dir, &args, 120)
}

/// Change a saved `checkpoint.json` in place, as a user's editor (or a bad disk) might.
pub fn edit_checkpoint(path: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(path, json.to_string()).unwrap();
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
