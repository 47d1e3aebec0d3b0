//! `gaccwb presets`: the built-in presets, a line each.

use gaccwb::presets;

pub fn list() -> anyhow::Result<()> {
    for s in presets::all() {
        println!("{:<24} {}", s.name, s.description);
    }
    Ok(())
}
