//! What ties a checkpoint together: the SHA-256 of its tensor file and the ranks that saved
//! it, checked on resume; and the temporary files a killed save left, recognised for removal.

use std::path::Path;

use sha2::Digest;

use super::{CheckpointError, State, STATE_FILE};

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
fn file_sha256(path: &Path) -> Result<String, CheckpointError> {
    use std::io::Read;
    let mut file = crate::limits::open_input(path, "checkpoint tensor file").map_err(|err| {
        CheckpointError::TensorFile {
            path: path.to_path_buf(),
            err: Box::new(err),
        }
    })?;
    let mut hasher = sha2::Sha256::new();
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut chunk)
            .map_err(|err| CheckpointError::ReadTensors {
                path: path.to_path_buf(),
                err,
            })?;
        if n == 0 {
            return Ok(hex(&hasher.finalize()));
        }
        hasher.update(&chunk[..n]);
    }
}

/// A checkpoint saved by a run of another number of ranks: a window would take another W·K·B
/// samples and the data order would change, so the run would not continue but fork.
pub fn check_ranks(dir: &Path, state: &State, ranks: usize) -> Result<(), CheckpointError> {
    let window = state.knobs.micro_batch * state.knobs.accum_steps;
    match state.ranks {
        Some(saved) if saved != ranks => Err(CheckpointError::Ranks {
            path: dir.join(STATE_FILE),
            saved,
            ranks,
            taken: ranks * window,
            expected: saved * window,
        }),
        _ => Ok(()),
    }
}

/// The tensor file `state` names in `dir` is the one it was saved with (version 1 states
/// carry no hash: nothing to compare).
pub(super) fn verify_tensors(dir: &Path, state: &State) -> Result<(), CheckpointError> {
    let path = dir.join(&state.tensors);
    let found = file_sha256(&path)?;
    if let Some(saved) = state.tensors_sha256.as_deref().filter(|s| *s != found) {
        return Err(CheckpointError::Tampered {
            path,
            state: dir.join(STATE_FILE),
            found,
            saved: saved.to_string(),
        });
    }
    Ok(())
}
