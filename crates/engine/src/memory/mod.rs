//! Memory truth: where the bytes of a training step go, measured, with their source named, and
//! an analytic prediction to set beside them.
//!
//! - `alloc`: the counting global allocator (CPU measured total, per-phase peaks);
//! - `ledger`: the per-category ledger the trainer fills each optimizer step;
//! - `gpu`: device sources (NVML, the CUDA memory pool, the allocator) and the sampler thread;
//! - `estimate`: the analytic estimator behind `gaccwb estimate`'s column for this engine;
//! - `figure`: the one rule that turns a step's measurements into its figure;
//! - `verdict`: what each memory lever reaches against a budget, the named GPT shapes, human
//!   units; the memory guard (`train::oom_guard`) refuses a run with the same verdict;
//! - `fit`: whether a configuration fits the memory this machine has free.
//!
//! The planner for other stacks (the reference stack) is the `planner` module.

pub mod alloc;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_pool;
pub mod estimate;
pub(crate) mod figure;
pub(crate) mod fit;
pub mod gpu;
pub(crate) mod ledger;
pub(crate) mod verdict;

pub use figure::{highest_figure, step_figures, StepFigure};
pub use fit::check_fits;
pub use ledger::{Ledger, Persistent, TotalMeter};
pub use verdict::{check_shape, human_bytes, named_shape, ShapeError, Verdict};
