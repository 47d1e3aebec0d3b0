//! Memory truth: where the bytes of a training step go, measured, with their source named, and
//! an analytic prediction to set beside them.
//!
//! - `alloc`: the counting global allocator (CPU measured total, per-phase peaks);
//! - `ledger`: the per-category ledger the trainer fills each optimizer step;
//! - `gpu`: device sources (NVML, the CUDA memory pool, the allocator) and the sampler thread;
//! - `estimate`: the analytic estimator behind `gaccwb estimate`;
//! - `figure`: the one rule that turns a step's measurements into its figure.
//! - `planner`: named shapes, human units and the verdict per budget;
//! - `planner`'s verdict is what the memory guard (`train::oom_guard`) refuses a run with;
//! - `arch` and `hf_config`: the architectures people train (GPT, Llama, Mistral, Qwen2,
//!   GPT-NeoX), named or read from a Hugging Face `config.json`;
//! - the reference stack beside this engine: `reference` (activations after Korthikanti et al.),
//!   `zero` (model states under ZeRO stages and offload), `step_time` (time per step and its
//!   bound) and `plan` (the verdict and levers that combine them).

pub mod alloc;
pub mod arch;
#[cfg(feature = "cuda")]
pub mod cuda_pool;
pub mod estimate;
pub mod figure;
pub mod fit;
pub mod gpu;
pub mod hf_config;
pub mod ledger;
pub mod plan;
pub mod plan_options;
pub mod planner;
pub mod reference;
pub mod step_time;
pub mod zero;

pub use figure::{highest_figure, step_figures, StepFigure};
pub use ledger::{Ledger, Persistent, TotalMeter};
