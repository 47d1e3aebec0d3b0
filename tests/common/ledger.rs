//! Measuring one training step's ledger for the estimator's sweeps.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Mutex, OnceLock};

use candle_core::Device;
use gaccwb::memory::estimate::Config;
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::{MemoryEvent, Phase};
use gaccwb::train::Trainer;

/// Runs `job` on the one thread every measurement of this process runs on, and returns its
/// result (or its panic). `gemm`'s workspace slab belongs to a thread and is freed when it ends,
/// and `ops::workspace::bytes` counts a slab for every thread that reserved one: sweeps run by
/// separate tests, each on its own harness thread, would be charged for slabs already gone.
pub fn on_measuring_thread<R: Send + 'static>(job: impl FnOnce() -> R + Send + 'static) -> R {
    type Job = Box<dyn FnOnce() + Send>;
    static JOBS: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    let jobs = JOBS.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::spawn(move || rx.into_iter().for_each(|job| job()));
        Mutex::new(tx)
    });
    let (done, result) = mpsc::channel();
    let run: Job = Box::new(move || {
        let _ = done.send(catch_unwind(AssertUnwindSafe(job)));
    });
    jobs.lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(run)
        .unwrap();
    match result.recv().unwrap() {
        Ok(r) => r,
        Err(panic) => resume_unwind(panic),
    }
}

/// Runs `job` with `RAYON_NUM_THREADS` at 1, and puts the variable back after it, panic or not.
/// Candle's matmul (the lean ops' products) reads the variable at every call: at 1 every product
/// runs on the calling thread, whose `gemm` workspace the estimate counts, instead of on rayon's
/// pool, each of whose threads would hold a workspace the estimate does not count on that path.
pub fn with_one_rayon_thread<R>(job: impl FnOnce() -> R) -> R {
    struct Restore(Option<std::ffi::OsString>);
    impl Drop for Restore {
        fn drop(&mut self) {
            match self.0.take() {
                Some(v) => std::env::set_var("RAYON_NUM_THREADS", v),
                None => std::env::remove_var("RAYON_NUM_THREADS"),
            }
        }
    }
    let _restore = Restore(std::env::var_os("RAYON_NUM_THREADS"));
    std::env::set_var("RAYON_NUM_THREADS", "1");
    job()
}

/// A trainer of `s` to measure: its fused ops run on its own thread
/// (`Trainer::force_serial_ops`). On the pool a worker packs its copy of a product's operand
/// only when the scheduler runs it in time, so a phase's peak would hold one copy or two as
/// the machine's load has it; here every allocation comes in one order. Estimate it with
/// [`serial_config`].
pub fn serial_trainer(s: Scenario) -> Trainer {
    let mut t = Trainer::new(s, Device::Cpu).unwrap();
    t.force_serial_ops(true);
    t
}

/// The estimate's configuration of `s` run as [`serial_trainer`] runs it: one thread packs.
pub fn serial_config(s: &Scenario) -> Config {
    Config {
        threads: 1,
        ..Config::from_scenario(s, true).unwrap()
    }
}

/// The memory events of the third step of `s` (the first two take the one-time allocations), on
/// the lean ops when `lean`, and the bytes the process holds that are not the run's step: its
/// own allocations from before the trainer was built (the test harness, a sweep's records of
/// earlier points; not `gemm`'s workspace, which the estimate counts: call
/// `gaccwb::ops::workspace::reserve` first so that it is held from the start), and the trainer's
/// bookkeeping at rest (`bookkeeping`). The fused ops run on the pool when `pool`, else on the
/// trainer's thread ([`serial_trainer`]).
pub fn third_step(s: Scenario, lean: bool, pool: bool) -> (Vec<MemoryEvent>, u64) {
    let before = gaccwb::memory::alloc::live();
    let mut t = Trainer::new(s, Device::Cpu).unwrap();
    let built = gaccwb::memory::alloc::live() - before;
    t.force_lean_ops(lean);
    t.force_serial_ops(!pool);
    for _ in 0..2 {
        t.train_step(|| true).ok().unwrap();
        t.take_memory_events();
    }
    t.train_step(|| true).ok().unwrap();
    let events = t.take_memory_events();
    let fixed = before - gaccwb::ops::workspace::bytes() + bookkeeping(built, &events);
    (events, fixed)
}

/// What a phase's `event` held, less the process's `fixed` bytes (`third_step`): its peak, or
/// for the step's end, the bytes held then.
pub fn held(event: &MemoryEvent, fixed: u64) -> u64 {
    let held = match event.phase {
        Phase::Step => event.total,
        _ => event.peak,
    };
    held - fixed
}

/// What a trainer holds at rest beyond its model states, from the bytes it held when built and
/// the states the step's end reports (weights, moments, offloaded copies): Candle's host header
/// of every tensor (about 250 bytes each), the parameters' names, the data stream. It is fixed
/// from the start, the same in every phase, and on a GPU it lives in host memory.
pub fn bookkeeping(built: u64, events: &[MemoryEvent]) -> u64 {
    let rest = events.iter().find(|e| e.phase == Phase::Step).unwrap();
    let states = rest.categories.sum() - rest.categories.other;
    built.saturating_sub(states)
}

/// The Hugging Face fixtures' model directories (tiny random checkpoints, d = 32, two layers):
/// GPT-2 tied and untied, Llama with grouped-query attention and Llama 3 rotary scaling, Llama
/// tied, Qwen2 with q/k/v biases and a tied head, Mistral.
pub const FIXTURES: [&str; 6] = [
    "gpt2-tied",
    "gpt2-untied",
    "llama-gqa-llama3",
    "llama-tied",
    "qwen2-bias",
    "mistral-window",
];

/// Categories the estimate matches to the byte (the others hold transients).
const EXACT: [&str; 6] = [
    "frozen",
    "parameters",
    "compute_weights",
    "gradients",
    "optimizer_state",
    "activations",
];

/// The largest gap a sweep allows, as a share of the phase's measured figure.
pub const TOLERANCE: f64 = 0.05;

/// One point of a family sweep.
#[derive(Clone, Debug)]
pub struct FamilyPoint {
    /// A fixture's directory, or this engine's GPT.
    pub family: Option<&'static str>,
    pub dtype: &'static str,
    pub checkpointing: &'static str,
    /// The lean ops (the GPU's path, on the CPU) instead of the fused CPU ops.
    pub lean: bool,
    pub micro_batch: usize,
    pub accum_steps: usize,
    /// LoRA of rank 4 on these targets (`train.lora_targets`; empty: every linear layer of
    /// the blocks), or every weight trained.
    pub lora: Option<&'static [&'static str]>,
    /// LoRA's dropout (`train.lora_dropout`).
    pub dropout: f64,
}

impl FamilyPoint {
    fn name(&self) -> String {
        let family = self.family.unwrap_or("gaccwb");
        match self.lora {
            None => family.to_string(),
            Some(_) => format!("{family} lora"),
        }
    }

    pub fn label(&self) -> String {
        format!(
            "{} {} ckpt-{} {} B{} K{}{}",
            self.name(),
            self.dtype,
            self.checkpointing,
            if self.lean { "lean" } else { "fused" },
            self.micro_batch,
            self.accum_steps,
            match self.lora {
                None => String::new(),
                Some([]) => " lora-r4 all-linear".to_string(),
                Some(targets) => format!(" lora-r4 {}", targets.join(",")),
            },
        ) + &match self.dropout {
            0.0 => String::new(),
            p => format!(" dropout {p}"),
        }
    }

    /// The scenario: a fixture loaded from its directory as a run loads it (`model.path`), or
    /// this engine's GPT of the sweep's size; T = 32.
    pub fn scenario(&self) -> gaccwb::scenario::Scenario {
        let mut s = super::TestModel {
            vocab: 64,
            ..super::TINY
        }
        .scenario();
        if let Some(dir) = self.family {
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
            s.model.path = Some(root.join("tests/fixtures/hf/models").join(dir));
        }
        for set in [
            format!("train.micro_batch={}", self.micro_batch),
            format!("train.accum_steps={}", self.accum_steps),
            format!("train.dtype={}", self.dtype),
            format!("train.checkpointing=\"{}\"", self.checkpointing),
        ] {
            s.set(&set).unwrap();
        }
        if let Some(targets) = self.lora {
            s.train.lora_rank = 4;
            s.train.lora_targets = targets.iter().map(|t| t.to_string()).collect();
            s.train.lora_dropout = self.dropout;
        }
        s
    }
}

/// Every family × f32 and bf16 × checkpointing off and `blocks` × (B, K) ∈ {(4, 1), (2, 3)},
/// on the lean ops or the fused ones; then LoRA runs (`lora_grid`).
pub fn family_grid(lean: bool) -> Vec<FamilyPoint> {
    let mut points = full_grid(lean);
    points.extend(lora_grid(lean));
    points
}

/// LoRA of rank 4 on a Llama with grouped-query attention and a tied GPT-2 × every linear
/// layer (B = 4, K = 1) or a target list (B = 2, K = 3: attention's q and v for the Llama,
/// GPT-2's fused qkv and MLP output, so one step adapts only its first layer and the other
/// only its second) × f32 and bf16 × checkpointing off and `blocks`.
pub fn lora_grid(lean: bool) -> Vec<FamilyPoint> {
    let targets: [(&str, &[&str]); 2] = [
        ("llama-gqa-llama3", &["q_proj", "v_proj"]),
        ("gpt2-tied", &["c_attn", "mlp.c_proj"]),
    ];
    let mut points = Vec::new();
    for (family, some) in targets {
        for (lora, (micro_batch, accum_steps)) in [(&[][..], (4, 1)), (some, (2, 3))] {
            points.extend(lora_points(
                family,
                lora,
                (micro_batch, accum_steps),
                lean,
                0.0,
            ));
        }
    }
    points
}

/// One LoRA run of `family` × f32 and bf16 × checkpointing off and `blocks`.
fn lora_points(
    family: &'static str,
    lora: &'static [&'static str],
    (micro_batch, accum_steps): (usize, usize),
    lean: bool,
    dropout: f64,
) -> Vec<FamilyPoint> {
    let mut points = Vec::new();
    for dtype in ["f32", "bf16"] {
        for checkpointing in ["none", "blocks"] {
            points.push(FamilyPoint {
                family: Some(family),
                dtype,
                checkpointing,
                lean,
                micro_batch,
                accum_steps,
                lora: Some(lora),
                dropout,
            });
        }
    }
    points
}

/// LoRA of rank 4 on every linear layer with dropout 0.1 (its masks drawn in each pass, none
/// kept), B = 4, K = 1 and B = 2, K = 3, × f32 and bf16 × checkpointing off and `blocks`, on a
/// Llama with grouped-query attention (lean ops only) and a tied GPT-2.
pub fn lora_dropout_grid(lean: bool) -> Vec<FamilyPoint> {
    let mut points = Vec::new();
    for family in ["llama-gqa-llama3", "gpt2-tied"] {
        if family == "llama-gqa-llama3" && !lean {
            continue;
        }
        for case in [(4, 1), (2, 3)] {
            points.extend(lora_points(family, &[], case, lean, 0.1));
        }
    }
    points
}

/// The families with every weight trained.
fn full_grid(lean: bool) -> Vec<FamilyPoint> {
    let families = std::iter::once(None).chain(FIXTURES.into_iter().map(Some));
    let mut points = Vec::new();
    for family in families {
        for dtype in ["f32", "bf16"] {
            for checkpointing in ["none", "blocks"] {
                for (micro_batch, accum_steps) in [(4, 1), (2, 3)] {
                    points.push(FamilyPoint {
                        family,
                        dtype,
                        checkpointing,
                        lean,
                        micro_batch,
                        accum_steps,
                        lora: None,
                        dropout: 0.0,
                    });
                }
            }
        }
    }
    points
}

/// Measures every point against the estimate of its scenario (`Config::from_scenario`, which
/// reads a model directory's `config.json`) and prints, per family and phase, the largest gap
/// and each point's activations and phase peaks. Returns the gaps over `TOLERANCE` and the
/// exact categories that differ.
pub fn family_sweep(points: &[FamilyPoint]) -> Vec<String> {
    use gaccwb::memory::estimate::estimate;
    use gaccwb::telemetry::Categories;
    gaccwb::ops::workspace::reserve();
    let mut worst = std::collections::BTreeMap::<(String, usize), (f64, String)>::new();
    let mut failures = Vec::new();
    for point in points {
        let s = point.scenario();
        let mut cfg = serial_config(&s);
        cfg.fused = !point.lean;
        let predicted = estimate(&cfg);
        let (measured, fixed) = third_step(s, point.lean, false);
        let mut peaks = Vec::new();
        for (slot, (phase, estimated)) in predicted.phases().into_iter().enumerate() {
            let event = measured.iter().find(|e| e.phase == phase).unwrap();
            let total = held(event, fixed);
            peaks.push(total);
            let mut got = event.categories;
            got.other -= fixed;
            let pairs = got.values().into_iter().zip(estimated.values());
            for (category, (m, e)) in Categories::NAMES.iter().zip(pairs) {
                let share = (m as f64 - e as f64).abs() / total as f64;
                let what = format!(
                    "{} {phase:?} {category}: measured {m} estimate {e} of {total} ({:+.2}%)",
                    point.label(),
                    100.0 * (e as f64 - m as f64) / total as f64
                );
                let w = worst.entry((point.name(), slot)).or_default();
                if share > w.0 {
                    *w = (share, what.clone());
                }
                if share > TOLERANCE || (EXACT.contains(category) && m != e) {
                    failures.push(what);
                }
            }
        }
        let activations = predicted.backward.activations;
        println!(
            "{}: activations {activations} B; peaks forward {} backward {} optimizer {} step {}",
            point.label(),
            peaks[0],
            peaks[1],
            peaks[2],
            peaks[3]
        );
    }
    for ((_, slot), (_, what)) in &worst {
        let phase = [
            Phase::Forward,
            Phase::Backward,
            Phase::Optimizer,
            Phase::Step,
        ][*slot];
        println!("worst {phase:?}: {what}");
    }
    for f in &failures {
        println!("off: {f}");
    }
    failures
}
