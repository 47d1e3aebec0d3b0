//! What is wrong with a scenario, a control or a command-line override, written for the user.

use crate::control::OutOfBounds;

/// A problem with a scenario, written for the user.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// A preset file that cannot be read.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// Why it cannot be read.
        message: String,
    },
    /// A preset that is not valid TOML or fails a check.
    #[error("{location}: {message}")]
    Parse {
        /// `file:line:col` of the offending value (the file alone when it is not found).
        location: String,
        /// What is wrong and the fix.
        message: String,
    },
    /// A preset name that is neither built in nor a file; the message lists the built-in ones.
    #[error("{0}")]
    Invalid(String),
    /// A `--set` override that cannot be applied.
    #[error("--set {key}: {message}")]
    Set {
        /// The `section.key` given.
        key: String,
        /// What is wrong and the fix.
        message: String,
    },
}

/// A check serde cannot express, failed: the key it concerns (`train.clip`,
/// `timeline[2].control`, so a file error can point at its line) and the message, which names
/// the key and the fix.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct Invalid {
    /// The dotted key concerned, so a file error can point at its line.
    pub key: String,
    /// What is wrong, naming the key and the fix.
    pub message: String,
}

impl Invalid {
    pub(super) fn new(key: &str, message: String) -> Invalid {
        Invalid {
            key: key.to_string(),
            message,
        }
    }
}

/// A control that may not be applied: a knob value out of its bounds, a loss scale that is not
/// positive, a window too large, or a policy that needs a measurement the run has off.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ControlError {
    /// A knob value outside its bounds.
    #[error("{what} {bound}")]
    Bounds {
        /// The knob, in words (`accumulation steps`).
        what: &'static str,
        /// The bound it breaks.
        bound: OutOfBounds,
    },
    /// A loss scale that is 0, negative or not finite.
    #[error("loss scale must be positive")]
    LossScale,
    /// A window (B, K, B × K × seq_len) beyond `crate::limits`; the message says which.
    #[error("{0}")]
    Window(String),
    /// The noise-scale K policy while `train.noise` is off.
    #[error(
        "set_accum_policy=noise-scale needs train.noise = true (the policy reads the gradient \
         noise scale); drop it or --set train.noise=true"
    )]
    NeedsNoise,
}

/// A `--control STEP:KIND[=VALUE]` argument that cannot be used, and why.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("--control {arg}: {message}")]
pub struct ControlArgError {
    /// The argument as given.
    pub arg: String,
    /// What is wrong with it and the fix.
    pub message: String,
}

/// A `--set` or `--control` value TOML cannot hold.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BadValue {
    /// A number too large for an f64.
    #[error("bad value `{0}`: beyond the largest number (about 1.8e308)")]
    BeyondFloat(String),
    /// An integer beyond `limits::MAX_INTEGER`.
    #[error("bad value `{0}`: beyond the largest integer ({max})", max = crate::limits::MAX_INTEGER)]
    BeyondInteger(String),
}
