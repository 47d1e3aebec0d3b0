//! What ties a checkpoint together: the SHA-256 of its tensor file and the ranks that saved
//! it, checked on resume; and the temporary files a killed save left, recognised for removal.

use std::path::Path;

use anyhow::{bail, Context};
use sha2::Digest;

use super::{State, STATE_FILE};

/// `.step-N.safetensors.PID.tmp` or `.checkpoint.json.PID.tmp` of a process no longer running.
pub(super) fn is_abandoned_save(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix(".step-")
        .or_else(|| name.strip_prefix(".checkpoint.json."))
    else {
        return false;
    };
    let Some(rest) = rest.strip_suffix(".tmp") else {
        return false;
    };
    let pid = rest.rsplit('.').next().and_then(|p| p.split('-').next());
    match pid.and_then(|p| p.parse::<u32>().ok()) {
        Some(pid) => !Path::new(&format!("/proc/{pid}")).exists(),
        None => false,
    }
}

/// SHA-256 of `bytes` (a tensor file being saved), lowercase hex.
pub(super) fn sha256_hex(bytes: &[u8]) -> String {
    hex(&sha2::Sha256::digest(bytes))
}

/// Lowercase hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of the file at `path`, read in chunks (a regular file only).
fn file_sha256(path: &Path) -> anyhow::Result<String> {
    use std::io::Read;
    let mut file = crate::limits::open_input(path, "checkpoint tensor file")
        .with_context(|| path.display().to_string())?;
    let mut hasher = sha2::Sha256::new();
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut chunk)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            return Ok(hex(&hasher.finalize()));
        }
        hasher.update(&chunk[..n]);
    }
}

/// A checkpoint saved by a run of another number of ranks: a window would take another W·K·B
/// samples and the data order would change, so the run would not continue but fork.
pub fn check_ranks(dir: &Path, state: &State, ranks: usize) -> anyhow::Result<()> {
    match state.ranks {
        Some(saved) if saved != ranks => bail!(
            "{}: saved by a run of {saved} rank(s), resumed on {ranks}: each window would take \
             {} samples instead of {}; resume with --ranks {saved} (mpirun -n {saved})",
            dir.join(STATE_FILE).display(),
            ranks * state.knobs.micro_batch * state.knobs.accum_steps,
            saved * state.knobs.micro_batch * state.knobs.accum_steps
        ),
        _ => Ok(()),
    }
}

/// The tensor file `state` names in `dir` is the one it was saved with (version 1 states
/// carry no hash: nothing to compare).
pub(super) fn verify_tensors(dir: &Path, state: &State) -> anyhow::Result<()> {
    let path = dir.join(&state.tensors);
    let sha256 = file_sha256(&path)?;
    if let Some(saved) = state.tensors_sha256.as_deref().filter(|s| *s != sha256) {
        bail!(
            "{}: its contents are not the tensors {} was saved with (SHA-256 {sha256}, expected \
             {saved}): the file was changed or belongs to another save; restore the pair of \
             files one save wrote",
            path.display(),
            dir.join(STATE_FILE).display()
        );
    }
    Ok(())
}
