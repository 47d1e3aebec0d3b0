//! The models of the Hugging Face hub as shapes: [`Arch`] describes a decoder-only transformer
//! (norms, MLP, attention, positions, biases, head) and counts its parameters as `transformers`
//! does; [`config`] reads one from a model's `config.json`; [`named`] gives the published shapes
//! `--shape` accepts. The planner (`planner`) plans for an `Arch`; a model loader can read
//! the same description.

mod arch;
pub mod config;

pub use arch::{named, shape_names, Arch, Mlp, Norm, Positions};
