//! The models of the Hugging Face hub as shapes: [`Arch`] describes a decoder-only transformer
//! (norms, MLP or experts, attention, positions, biases, head) and counts its parameters as
//! `transformers` does; [`read_config`] reads one from a model's `config.json`; [`named`] gives the
//! published shapes `--shape` accepts; [`Arch::linears`] lists a block's linear layers by the
//! names LoRA targets. The planner (`planner`) plans for an `Arch`; a model loader can read the
//! same description.

mod arch;
pub(crate) mod config;
mod linears;
mod named;

pub use arch::{Arch, Experts, Mlp, Norm, Positions, Sliding};
pub use config::{read_config, HfConfigError};
pub use linears::{Linear, Place, Role};
pub use named::{named, shape_names};
