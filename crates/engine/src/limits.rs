//! Bounds on what gaccwb accepts: input file sizes, and training sizes whose products would
//! overflow or index past a buffer. Everything the user can type, script or edit (a preset, a
//! `--set`, a `--control`, a timeline entry, an edited `checkpoint.json`) passes these checks
//! before it reaches the trainer.

use std::io::Read;
use std::path::Path;

pub(crate) mod growing;
pub use growing::GrowingFile;

/// Largest preset or keymap file read (they are a few hundred bytes in practice).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Largest recording read (it is held in memory whole).
pub const MAX_RECORDING_BYTES: u64 = 1 << 30;
/// Largest `--data` corpus read (it is held in memory whole).
pub const MAX_DATA_BYTES: u64 = 1 << 30;
/// Largest `data.tokenizer_file` or cached tokenizer read (GPT-2's `tokenizer.json` is 1.4 MB;
/// the largest published ones are tens of MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// Largest `checkpoint.json` read (the scenario and the knobs; the tensors are a file of their own).
pub const MAX_CHECKPOINT_STATE_BYTES: u64 = 64 << 20;

/// Largest micro-batch, accumulation steps, sequence length and width accepted.
pub const MAX_MICRO_BATCH: usize = 1 << 16;
/// Largest accumulation steps K accepted.
pub const MAX_ACCUM_STEPS: usize = 1 << 16;
/// Largest sequence length accepted.
pub const MAX_SEQ_LEN: usize = 1 << 16;
/// Largest model width accepted.
pub const MAX_D_MODEL: usize = 1 << 17;
/// Largest number of transformer blocks accepted.
pub const MAX_LAYERS: usize = 1 << 12;
/// Data-parallel ranks `train.ranks` may ask `gaccwb run` to start on one host.
pub const MAX_RANKS: usize = 1 << 10;
/// Largest effective batch `gaccwb estimate` tabulates (it tries every divisor).
pub const MAX_EFFECTIVE_BATCH: usize = 1 << 20;
/// Largest number of tokens one window (B·K·seq_len) may hold.
pub const MAX_WINDOW_TOKENS: u64 = 1 << 32;
/// Largest integer TOML can write back: a preset field above it cannot be re-serialised.
pub const MAX_INTEGER: u64 = i64::MAX as u64;

/// Why a bounded file could not be read; `what` names the file's role ("preset", "recording").
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// A device, pipe or directory: reading it might never end.
    #[error(
        "the {what} is {kind}, not a regular file (a device, pipe or directory could block or \
         never end); copy it to a file first"
    )]
    NotRegular {
        /// The file's role.
        what: String,
        /// What is there instead ("a FIFO (named pipe)", "a directory").
        kind: &'static str,
    },
    /// The operating system refused to open or read it.
    #[error("cannot read the {what}: {err}")]
    Io {
        /// The file's role.
        what: String,
        /// What the operating system said.
        err: std::io::Error,
    },
    /// Longer than gaccwb reads for this role.
    #[error(
        "the {what} is larger than gaccwb reads ({size} bytes or more; the limit is {limit} bytes)"
    )]
    TooLarge {
        /// The file's role.
        what: String,
        /// Bytes found (at least).
        size: u64,
        /// Bytes allowed.
        limit: u64,
    },
    /// A text file that is not UTF-8.
    #[error("the {what} is not UTF-8 text: {err}")]
    NotUtf8 {
        /// The file's role.
        what: String,
        /// Where the bytes stopped being UTF-8.
        err: std::string::FromUtf8Error,
    },
}

/// A size over its bound: a value, or a window whose token count overflows.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BoundError {
    /// `key` is above its maximum.
    #[error("{key} ({value}) must be at most {max}")]
    AboveMax {
        /// The field or option, as the user wrote it.
        key: String,
        /// The value given.
        value: u64,
        /// The largest accepted.
        max: u64,
    },
    /// B·K·seq_len is more than a window may hold.
    #[error(
        "a window of micro-batch {micro_batch} × accumulation steps {accum_steps} × seq_len \
         {seq_len} tokens is more than {MAX_WINDOW_TOKENS} tokens"
    )]
    WindowTooLarge {
        /// B.
        micro_batch: usize,
        /// K.
        accum_steps: usize,
        /// Tokens per sample.
        seq_len: usize,
    },
}

/// Open a file the user named as an input: it must be a regular file. It is opened without
/// blocking (a FIFO with no writer would wait forever; a FIFO with one is refused all the same)
/// and checked once open, as the path may have changed meanwhile; reads then block as usual.
pub fn open_input(path: &Path, what: &str) -> Result<std::fs::File, ReadError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |err| ReadError::Io {
        what: what.to_string(),
        err,
    };
    let not_regular = |meta: &std::fs::Metadata| ReadError::NotRegular {
        what: what.to_string(),
        kind: kind_of(meta),
    };
    // Refused without opening it where the path says so already: opening a device can act.
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let file = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open and owned by `file`; F_GETFL/F_SETFL change only its status flags.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok(file)
}

/// The kind of a file that is not a regular file, for messages.
pub fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "a special file"
    }
}

/// Read a whole file of at most `limit` bytes. A device, pipe or directory is refused (it may
/// never end), and so is a file that turns out longer than `limit` while it is read.
pub fn read_bounded(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>, ReadError> {
    let file = open_input(path, what)?;
    let io = |err| ReadError::Io {
        what: what.to_string(),
        err,
    };
    let too_large = |size| ReadError::TooLarge {
        what: what.to_string(),
        size,
        limit,
    };
    let len = file.metadata().map_err(io)?.len();
    if len > limit {
        return Err(too_large(len));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// `read_bounded` for text files.
pub fn read_bounded_text(path: &Path, limit: u64, what: &str) -> Result<String, ReadError> {
    let bytes = read_bounded(path, limit, what)?;
    String::from_utf8(bytes).map_err(|err| ReadError::NotUtf8 {
        what: what.to_string(),
        err,
    })
}

/// Until every check is typed, a bound's message travels as text.
impl From<BoundError> for String {
    fn from(e: BoundError) -> String {
        e.to_string()
    }
}

/// `value` (named `key`) is at most `max`.
pub fn at_most(key: &str, value: u64, max: u64) -> Result<(), BoundError> {
    if value > max {
        return Err(BoundError::AboveMax {
            key: key.to_string(),
            value,
            max,
        });
    }
    Ok(())
}

/// One window's shape: B and K within bounds, and B·K·seq_len tokens without overflow.
pub fn check_window(
    micro_batch: usize,
    accum_steps: usize,
    seq_len: usize,
) -> Result<(), BoundError> {
    at_most("micro-batch", micro_batch as u64, MAX_MICRO_BATCH as u64)?;
    at_most(
        "accumulation steps",
        accum_steps as u64,
        MAX_ACCUM_STEPS as u64,
    )?;
    let tokens = (micro_batch as u64)
        .checked_mul(accum_steps as u64)
        .and_then(|n| n.checked_mul(seq_len as u64));
    match tokens {
        Some(n) if n <= MAX_WINDOW_TOKENS => Ok(()),
        _ => Err(BoundError::WindowTooLarge {
            micro_batch,
            accum_steps,
            seq_len,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_that_overflow_are_refused() {
        assert!(check_window(8, 4, 128).is_ok());
        assert!(check_window(8, 2305843009213693952, 128).is_err());
        assert!(check_window(MAX_MICRO_BATCH, MAX_ACCUM_STEPS, MAX_SEQ_LEN).is_err());
        assert!(check_window(MAX_MICRO_BATCH + 1, 1, 1).is_err());
    }

    #[test]
    fn non_regular_and_oversized_files_are_refused() {
        let e = read_bounded(Path::new("/dev/zero"), 10, "preset").unwrap_err();
        assert!(matches!(e, ReadError::NotRegular { .. }), "{e}");
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.toml");
        std::fs::write(&path, vec![b'#'; 11]).unwrap();
        let e = read_bounded(&path, 10, "preset").unwrap_err();
        assert!(matches!(e, ReadError::TooLarge { size: 11, .. }), "{e}");
        assert!(e.to_string().contains("larger than gaccwb reads"), "{e}");
        assert_eq!(read_bounded(&path, 11, "preset").unwrap().len(), 11);
    }
}
