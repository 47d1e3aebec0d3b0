//! The gaccwb engine: a small GPT (`model`, `ops`) trained on a seeded corpus (`data`) by a
//! trainer thread (`train`) that speaks only the vocabulary in `telemetry`: `Control`s in,
//! `Event`s out. Memory is measured (`memory`) beside its analytic estimate, and planned for the models of
//! the Hugging Face hub (`hf`) on the usual mixed-precision stack (`planner`); runs are scripted
//! (`scenario`, `presets`), recorded (`record`) and checkpointed (`checkpoint`).
//!
//! This crate knows nothing of the terminal: no ratatui, crossterm or clap. The `gaccwb` crate
//! (the faces: TUI, headless, export, CLI) depends on it, never the other way round.

// Outside tests a panic is a bug report, not error handling: each remaining invariant is allowed
// where it stands, with why it holds.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
// Every public item says what it is for; CI's `-D warnings` makes a missing one an error.
#![warn(missing_docs)]
#![warn(unreachable_pub)]

pub mod budget;
pub mod checkpoint;
pub mod control;
pub mod data;
pub mod device;
pub mod dist;
pub mod end;
pub mod hf;
pub mod limits;
pub mod memory;
pub mod model;
pub mod ops;
pub mod planner;
pub mod presets;
pub mod record;
pub mod safe_write;
pub mod scenario;
pub mod telemetry;
pub mod tensors;
pub mod tokenizer;
pub mod train;
