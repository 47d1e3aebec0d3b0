//! The reference stack beside this engine: what the usual 16-bit mixed-precision training of an
//! [`Arch`](crate::hf::Arch) needs on each device and on the host, and how long a step takes.
//!
//! - `activations`: per micro-batch, after Korthikanti et al. 2022, term by term;
//! - `model_states`: weights, gradients and optimizer state placed by a ZeRO stage over ranks,
//!   with offload (DeepSpeed's accounting; the engine's own ZeRO is `train::zero`);
//! - `step_time`: time per step from the device's, the links' and the host's rates, and its bound;
//! - `plan`: the verdict against a device budget and the levers taken one on top of another;
//! - `options`: `gaccwb estimate`'s flags checked and turned into what `plan` reads.
//!
//! Everything here is arithmetic on the shape: nothing is measured or allocated. The text people
//! read is the command line's (`src/cli/estimate/`); the JSON is these types serialised.

pub mod activations;
pub mod model_states;
pub mod options;
pub mod plan;
pub mod step_time;
