//! `gaccwb presets`: the built-in presets, a line each.

use gaccwb::presets;

pub fn list() -> anyhow::Result<()> {
    let lines: String = presets::all()
        .iter()
        .map(|s| format!("{:<24} {}\n", s.name, s.description))
        .collect();
    gaccwb::out::print(&lines)?;
    Ok(())
}
