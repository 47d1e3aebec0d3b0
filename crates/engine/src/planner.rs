//! The reference stack beside this engine: what the usual 16-bit mixed-precision training of an
//! [`Arch`](crate::hf::Arch) needs on each device and on the host, and how long a step takes.
//!
//! - `activations`: per micro-batch, after Korthikanti et al. 2022, term by term;
//! - `model_states`: weights, gradients and optimizer state placed by a ZeRO stage over ranks,
//!   with offload (DeepSpeed's accounting; the engine's own ZeRO is `train::zero`);
//! - `lora`: adapters on a frozen base (16-bit, 8-bit or 4-bit), what they count and cost;
//! - `step_time`: time per step from the device's, the links' and the host's rates, and its bound;
//! - `plan`: the verdict against a device budget and the levers taken one on top of another;
//! - `options`: `gaccwb estimate`'s flags checked and turned into what `plan` reads.
//!
//! Everything here is arithmetic on the shape: nothing is measured or allocated. The text people
//! read is the command line's (`src/cli/estimate/`); the JSON is these types serialised.

pub(crate) mod activations;
pub(crate) mod lora;
pub(crate) mod model_states;
pub(crate) mod options;
pub(crate) mod plan;
pub(crate) mod step_time;

pub use activations::Recompute;
pub use lora::{BaseDtype, Lora};
pub use model_states::Offload;
pub use options::{
    check_size, resolve_arch, resolve_lora, resolve_rates, resolve_setup, HostFigures, Options,
    OptionsError,
};
pub use plan::{engine_lora, engine_model, LeverRow, Outcome, ReferencePlan, Setup, LEVER_RANK};
pub use step_time::{flops_per_token, HostSource, Rates, StepTime};
