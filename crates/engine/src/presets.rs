//! The preset library: `presets/*.toml`, compiled into the binary so `gaccwb` runs anywhere with
//! no files, and resolvable by name or by path.

use std::path::Path;

use crate::scenario::{Scenario, ScenarioError};

/// Name and TOML text of every built-in preset, in the order `gaccwb presets` lists them.
pub const BUILTIN: &[(&str, &str)] = &[
    ("baseline", include_str!("../../../presets/baseline.toml")),
    (
        "accumulate-to-fit",
        include_str!("../../../presets/accumulate-to-fit.toml"),
    ),
    ("k-ramp", include_str!("../../../presets/k-ramp.toml")),
    (
        "adaptive-k",
        include_str!("../../../presets/adaptive-k.toml"),
    ),
    (
        "clip-high-lr",
        include_str!("../../../presets/clip-high-lr.toml"),
    ),
    (
        "fp16-overflow",
        include_str!("../../../presets/fp16-overflow.toml"),
    ),
    ("offload", include_str!("../../../presets/offload.toml")),
    (
        "pitfall-zero-grad",
        include_str!("../../../presets/pitfall-zero-grad.toml"),
    ),
    (
        "pitfall-mean-of-means",
        include_str!("../../../presets/pitfall-mean-of-means.toml"),
    ),
    ("lr-rules", include_str!("../../../presets/lr-rules.toml")),
    ("text-bpe", include_str!("../../../presets/text-bpe.toml")),
    (
        "three-ways-to-fit",
        include_str!("../../../presets/three-ways-to-fit.toml"),
    ),
    (
        "notes-table",
        include_str!("../../../presets/notes-table.toml"),
    ),
    ("oom-guard", include_str!("../../../presets/oom-guard.toml")),
    (
        "ddp-no-sync",
        include_str!("../../../presets/ddp-no-sync.toml"),
    ),
    ("ddp-zero", include_str!("../../../presets/ddp-zero.toml")),
    ("finetune", include_str!("../../../presets/finetune.toml")),
    (
        "lora-vs-full",
        include_str!("../../../presets/lora-vs-full.toml"),
    ),
];

/// The preset `gaccwb` runs with no arguments.
pub const DEFAULT: &str = "baseline";

/// A built-in preset by name, or a TOML file by path.
pub fn resolve(name_or_path: &str) -> Result<Scenario, ScenarioError> {
    if let Some((name, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
        let mut s = Scenario::from_toml(text, &format!("presets/{name}.toml"))?;
        if s.name.is_empty() {
            s.name = name.to_string();
        }
        return Ok(s);
    }
    let path = Path::new(name_or_path);
    if path.exists() || name_or_path.ends_with(".toml") {
        return Scenario::from_file(path);
    }
    let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
    Err(ScenarioError::Invalid(format!(
        "no preset or file named `{name_or_path}`; built-in presets: {}",
        names.join(", ")
    )))
}

/// Every built-in preset, parsed.
#[allow(clippy::expect_used)] // the built-in presets parse (tests/engine/presets.rs runs each)
pub fn all() -> Vec<Scenario> {
    BUILTIN
        .iter()
        .map(|(n, _)| resolve(n).expect("built-in presets are valid (tested)"))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_builtin_preset_parses() {
        for (name, _) in super::BUILTIN {
            super::resolve(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}
