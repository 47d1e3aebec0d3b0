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

/// The files `scenario` reads: the corpus, the tokenizer file, and every file of the model
/// directory and the adapter directory it names.
pub fn add_scenario(scenario: &Scenario, inputs: &mut Inputs) {
    if let Some(path) = &scenario.data.path {
        inputs.add("the corpus", path);
    }
    if let Some(path) = &scenario.data.tokenizer_file {
        inputs.add("the tokenizer file", path);
    }
    if let Some(model) = &scenario.model.path {
        // `ORG/NAME` stands for a directory of the local cache.
        let dir = model
            .to_str()
            .and_then(|name| gaccwb::model::hf::resolve(name).ok())
            .unwrap_or_else(|| model.clone());
        add_files(&dir, "the model's", inputs);
    }
    if let Some(adapter) = &scenario.model.adapter {
        add_files(adapter, "the adapter's", inputs);
    }
}

/// `path` when it is a file, else every file directly in it (links followed: the cache's
/// snapshots link to their blobs).
fn add_files(path: &Path, label: &str, inputs: &mut Inputs) {
    let Ok(entries) = std::fs::read_dir(path) else {
        inputs.add(&format!("{label} file"), path);
        return;
    };
    for entry in entries.flatten() {
        inputs.add(&format!("{label} file"), &entry.path());
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
