//! The `gaccwb` binary from the outside and its faces: the command line, `estimate`, `compare`,
//! recordings and exports, the break-it cases, the screen (rendered on a `TestBackend`, and in a
//! real tmux terminal). One test binary (one link of Candle); each module was a test file of its
//! own.

#[path = "../common/mod.rs"]
mod common;

mod bench_cli;
mod cli;
mod compare_cli;
mod e2e_tmux;
mod memory_estimate_cli;
mod planner_cli;
mod recording;
mod robustness;
mod robustness_files;
mod robustness_run;
mod svg_chart;
mod tui_cli;
mod tui_live;
mod tui_render;
mod tui_replay;
