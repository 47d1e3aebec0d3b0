//! Writing files without destroying what the user made: a file that exists is refused unless the
//! caller was told to replace it, and a replacement is written beside it and renamed into place,
//! so the old content stays whole until the new one is complete.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// Create `path`, refusing to open an existing file (no truncation, no race with the check).
pub fn create_new(path: &Path, what: &str) -> anyhow::Result<File> {
    match File::options().write(true).create_new(true).open(path) {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => bail!(refusal(path, what)),
        Err(e) => Err(e).with_context(|| format!("cannot create {what} {}", path.display())),
    }
}

/// The message for a file that is there already.
pub fn refusal(path: &Path, what: &str) -> String {
    format!(
        "{} already exists; gaccwb does not overwrite files: choose another name for the {what}, \
         or add --force to replace it",
        path.display()
    )
}

/// Refuse an existing `path` unless `force`.
pub fn check_free(path: &Path, what: &str, force: bool) -> anyhow::Result<()> {
    if !force && path.symlink_metadata().is_ok() {
        bail!(refusal(path, what));
    }
    Ok(())
}

/// A hidden temporary name in the same directory (so a rename is atomic).
pub fn temp_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

/// Write `bytes` to `path`: refused when it exists and `force` is false; otherwise through a
/// temporary file renamed over it.
pub fn write_file(path: &Path, bytes: &[u8], what: &str, force: bool) -> anyhow::Result<()> {
    check_free(path, what, force)?;
    let tmp = temp_beside(path);
    let written = create_new(&tmp, what).and_then(|mut f| {
        f.write_all(bytes)
            .and_then(|_| f.sync_all())
            .with_context(|| format!("writing {}", tmp.display()))
    });
    let renamed = written.and_then(|_| {
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    });
    if renamed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    renamed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_existing_file_is_kept_unless_forced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.svg");
        std::fs::write(&path, "mine").unwrap();
        let e = write_file(&path, b"new", "chart", false).unwrap_err();
        assert!(e.to_string().contains("--force"), "{e}");
        assert!(create_new(&path, "recording").is_err());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "mine");
        write_file(&path, b"new", "chart", true).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file left behind");
    }
}
