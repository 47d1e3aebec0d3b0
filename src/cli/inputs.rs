//! The files a command reads. Nothing it writes (`--log`, `--record`, `--csv`, an export) may be
//! one of them; `safe_write` compares them by device and inode.

use std::path::Path;

use gaccwb::presets;
use gaccwb::safe_write::Inputs;
use gaccwb::scenario::Scenario;

/// The preset file `name` (when it is a file) and the data files its scenario names. A preset
/// that does not resolve adds only its own path: the command reports the error itself.
pub fn preset(name: &str) -> Inputs {
    let mut inputs = Inputs::default().with("the preset", Path::new(name));
    if let Ok(s) = presets::resolve(name) {
        add_scenario(&s, &mut inputs);
    }
    inputs
}

/// The data files `scenario` names: the corpus and the tokenizer file.
pub fn add_scenario(scenario: &Scenario, inputs: &mut Inputs) {
    if let Some(path) = &scenario.data.path {
        inputs.add("the corpus", path);
    }
    if let Some(path) = &scenario.data.tokenizer_file {
        inputs.add("the tokenizer file", path);
    }
}

/// A recording being replayed or exported, and the keymap (`--keys`) when one is named.
pub fn recording(file: &Path, keys: Option<&Path>) -> Inputs {
    let mut inputs = Inputs::default().with("the recording", file);
    if let Some(keys) = keys {
        inputs.add("the keymap", keys);
    }
    inputs
}
