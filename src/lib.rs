//! gaccwb: a terminal workbench for gradient accumulation.
//!
//! The trainer (`train`) runs a small GPT (`model`) on a seeded corpus (`data`) in its own thread
//! and speaks only the vocabulary in `telemetry`: `Control`s in, `Event`s out. Everything that
//! watches a run — the TUI, the headless progress bar, the recorder, replay, export — consumes
//! those same events.

pub mod bench;
pub mod checkpoint;
pub mod data;
pub mod device;
pub mod export;
pub mod headless;
pub mod memory;
pub mod model;
pub mod ops;
pub mod presets;
pub mod record;
pub mod scenario;
pub mod telemetry;
pub mod train;
pub mod tui;
