//! gaccwb: a terminal workbench for gradient accumulation.
//!
//! This crate holds the faces: the TUI (`tui`), the headless runner (`headless`), exports
//! (`export`) and the benchmark (`bench`). Everything below the terminal lives in the
//! `gaccwb-engine` crate (re-exported here under the same module names), which cannot depend on
//! this one: the layering is checked by the compiler.

pub use gaccwb_engine::{
    budget, checkpoint, control, data, device, dist, end, hf, limits, memory, model, ops, planner,
    presets, record, safe_write, scenario, telemetry, tokenizer, train,
};

pub mod bench;
pub mod children;
pub mod compare;
pub mod export;
pub mod headless;
pub mod out;
pub mod session;
pub mod signals;
pub mod steer;
pub mod tui;
