//! The engine in process: training semantics, precision, checkpoints, the ops, Hugging Face
//! models, presets, recordings' readers and the memory sources. One test binary (one link of
//! Candle); each module was a test file of its own, and its tests run in parallel with the
//! others'. Tests that read the counting allocator's peaks belong in `tests/memory`, not here:
//! every other test's allocations would land in their figures.

#[path = "../common/mod.rs"]
mod common;

mod boundary_inplace;
mod checkpoint;
mod checkpointing;
mod composite;
mod engine;
mod evaluation;
mod fuzz_presets;
mod fuzz_recording;
mod hf_models;
mod lean_ops;
mod memory_sources;
mod model_layers;
mod noise;
mod offload;
mod precision;
mod presets;
mod text_bpe;
