//! The one way gaccwb writes files: recordings, exports, logs, compare's outputs, checkpoints and
//! the tokenizer cache all go through here, so one set of rules holds for all of them.
//!
//! - Only regular files are written. A path naming a directory, a device, a FIFO or a socket is
//!   refused with its kind named, `--force` or not: writing or renaming there could replace
//!   `/dev/null`, hang on a pipe or lose a directory.
//! - A file that exists is refused unless the caller was told to replace it (`--force`), and even
//!   then one of the run's own inputs ([`Inputs`], compared by device and inode, so a symbolic or
//!   hard link to the preset counts as the preset) is refused.
//! - A replacement is written to a hidden temporary file beside the target and renamed into place
//!   when complete ([`Pending`]), so the old content stays whole until then; the target is checked
//!   again just before the rename. Without `--force` the rename itself refuses an existing target.
//! - A directory a run writes into for its whole life (checkpoints) is held with an `flock`
//!   ([`lock_dir`]); a second run is refused with the holder's pid.

use std::fs::{File, Metadata};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::limits::kind_of;

/// Why a file was not written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The file exists and `--force` was not given.
    #[error(
        "{} already exists; gaccwb does not overwrite files: choose another name for the {what}, \
         or add --force to replace it", path.display()
    )]
    Exists {
        /// The file.
        path: PathBuf,
        /// Its role ("recording", "checkpoint").
        what: String,
    },
    /// A device, pipe or directory where a file would go.
    #[error(
        "{} is {kind}, not a regular file; gaccwb writes the {what} only to a regular file \
         (never through a device, pipe or directory): choose a file name", path.display()
    )]
    NotRegular {
        /// The path.
        path: PathBuf,
        /// The output's role.
        what: String,
        /// What is there instead ("a directory", "a FIFO").
        kind: &'static str,
    },
    /// The output would replace one of the run's inputs.
    #[error(
        "{} is an input of this run ({input}); write the {what} to another file \
         (--force never replaces a run's inputs)", path.display()
    )]
    IsInput {
        /// The path.
        path: PathBuf,
        /// The output's role.
        what: String,
        /// Which input it is ("the preset", "--data").
        input: String,
    },
    /// The operating system refused.
    #[error("cannot {action} {}: {err}", path.display())]
    Io {
        /// What was being done ("create", "rename").
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        err: std::io::Error,
    },
    /// Another running gaccwb saves into the directory.
    #[error(
        "{} is in use by another gaccwb run (pid {holder}); wait for it to end or choose \
         another directory", dir.display()
    )]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// The pid holding its lock.
        holder: String,
    },
}

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> WriteError + 'a {
    move |err| WriteError::Io {
        action,
        path: path.to_path_buf(),
        err,
    }
}

/// A file's identity: the same file under any name, link or hard link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    fn of(meta: &Metadata) -> FileId {
        FileId {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

/// The files a command reads (its preset, `--data`, `--keys`, the tokenizer file, the recording
/// it exports, the checkpoint it resumes): no write may replace or append to one of them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Inputs {
    files: Vec<(FileId, String)>,
}

impl Inputs {
    /// Add `path`, described as `label` ("the preset") in messages; a path that is not there
    /// is nothing to protect and is skipped.
    pub fn add(&mut self, label: &str, path: &Path) {
        if let Ok(meta) = std::fs::metadata(path) {
            let described = format!("{label} {}", path.display());
            self.files.push((FileId::of(&meta), described));
        }
    }

    /// `add`, chained.
    pub fn with(mut self, label: &str, path: &Path) -> Inputs {
        self.add(label, path);
        self
    }

    /// The input that `meta` (a followed stat) is, if any.
    fn find(&self, meta: &Metadata) -> Option<&str> {
        let id = FileId::of(meta);
        self.files
            .iter()
            .find(|(f, _)| *f == id)
            .map(|(_, label)| label.as_str())
    }
}

/// What a write may replace: nothing, or (`force`) a regular file that is none of `inputs`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overwrite {
    /// Replace an existing regular file (`--force`).
    pub force: bool,
    /// Files never replaced, force or not: the run's inputs.
    pub inputs: Inputs,
}

impl Overwrite {
    /// Rules with `force` over every file but `inputs`.
    pub fn new(force: bool, inputs: Inputs) -> Overwrite {
        Overwrite { force, inputs }
    }

    /// Replace any regular file: for files only gaccwb writes (its cache, a locked checkpoint
    /// directory).
    pub fn ours() -> Overwrite {
        Overwrite::new(true, Inputs::default())
    }
}

/// What is at `path`, followed through links: `None` when nothing is there.
fn existing(path: &Path, what: &str) -> Result<Option<Metadata>, WriteError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("inspect", path)(e)),
        Ok(m) if !m.file_type().is_symlink() => return Ok(Some(m)),
        Ok(_) => {}
    }
    match std::fs::metadata(path) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(WriteError::NotRegular {
            path: path.to_path_buf(),
            what: what.to_string(),
            kind: "a symbolic link to nothing",
        }),
        Err(e) => Err(io("inspect", path)(e)),
    }
}

/// Whether `path` may be written as the `what` under `rules`: free, or (with `force`) a regular
/// file that is none of the inputs. Called before work starts, and again before a rename.
pub fn check(path: &Path, what: &str, rules: &Overwrite) -> Result<(), WriteError> {
    let Some(meta) = existing(path, what)? else {
        return Ok(());
    };
    if !meta.is_file() {
        return Err(WriteError::NotRegular {
            path: path.to_path_buf(),
            what: what.to_string(),
            kind: kind_of(&meta),
        });
    }
    if let Some(input) = rules.inputs.find(&meta) {
        return Err(WriteError::IsInput {
            path: path.to_path_buf(),
            what: what.to_string(),
            input: input.to_string(),
        });
    }
    if !rules.force {
        return Err(WriteError::Exists {
            path: path.to_path_buf(),
            what: what.to_string(),
        });
    }
    Ok(())
}

/// Create `path` as a new regular file, refusing anything there already (no truncation, no race
/// with the check, no link followed).
pub fn create_new(path: &Path, what: &str) -> Result<File, WriteError> {
    match File::options()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            check(path, what, &Overwrite::default())?;
            Err(WriteError::Exists {
                path: path.to_path_buf(),
                what: what.to_string(),
            })
        }
        Err(e) => Err(io("create", path)(e)),
    }
}

/// A file being written under a hidden temporary name beside its target; [`Pending::commit`]
/// renames it into place, dropping it uncommitted removes it.
pub struct Pending {
    path: PathBuf,
    tmp: PathBuf,
    file: File,
    what: String,
    rules: Overwrite,
    finished: bool,
}

impl Pending {
    /// Start writing the `what` to `path`, refused now if `rules` would refuse it at the end.
    pub fn begin(path: &Path, what: &str, rules: &Overwrite) -> Result<Pending, WriteError> {
        check(path, what, rules)?;
        let (tmp, file) = create_temp_beside(path, what)?;
        Ok(Pending {
            path: path.to_path_buf(),
            tmp,
            file,
            what: what.to_string(),
            rules: rules.clone(),
            finished: false,
        })
    }

    /// The file to write into.
    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    /// The target the file takes the name of.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sync the file and rename it over the target, checked again first (it may have become a
    /// device, a directory or an input since `begin`). On failure the temporary file is removed.
    pub fn commit(mut self) -> Result<(), WriteError> {
        self.finished = true;
        let done = self.try_commit();
        if done.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
        }
        done
    }

    fn try_commit(&self) -> Result<(), WriteError> {
        self.file.sync_all().map_err(io("write", &self.tmp))?;
        check(&self.path, &self.what, &self.rules)?;
        if self.rules.force {
            std::fs::rename(&self.tmp, &self.path).map_err(io("rename into", &self.path))?;
        } else {
            rename_noreplace(&self.tmp, &self.path, &self.what)?;
        }
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Makes the rename durable; not every filesystem lets a directory be synced.
            let _ = File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A fresh hidden file `.NAME.PID.tmp` beside `path` (so a rename is atomic); another number is
/// tried when a file of that name is left from an earlier process.
fn create_temp_beside(path: &Path, what: &str) -> Result<(PathBuf, File), WriteError> {
    const TRIES: u32 = 100;
    let mut n = 0;
    loop {
        let tmp = temp_name(path, n);
        match create_new(&tmp, what) {
            Ok(f) => return Ok((tmp, f)),
            Err(WriteError::Exists { .. } | WriteError::NotRegular { .. }) if n + 1 < TRIES => {
                n += 1
            }
            Err(e) => return Err(e),
        }
    }
}

fn temp_name(path: &Path, n: u32) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let pid = std::process::id();
    match n {
        0 => path.with_file_name(format!(".{name}.{pid}.tmp")),
        _ => path.with_file_name(format!(".{name}.{pid}-{n}.tmp")),
    }
}

/// The replacement of `path` another process is writing now (`--force`: `.NAME.PID.tmp`
/// beside it, its PID alive), the newest when there are several: a follower of `path` reads the
/// new run rather than the old file.
pub fn replacement_in_progress(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_str()?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let prefix = format!(".{name}.");
    let writer = |file: &str| -> Option<u32> {
        let rest = file.strip_prefix(&prefix)?.strip_suffix(".tmp")?;
        rest.split('-').next()?.parse().ok()
    };
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let pid = writer(e.file_name().to_str()?)?;
            let alive = Path::new(&format!("/proc/{pid}")).exists();
            let meta = e.metadata().ok().filter(|m| m.is_file() && alive)?;
            Some((meta.modified().ok()?, e.path()))
        })
        .max()
        .map(|(_, p)| p)
}

/// Rename `tmp` to `path` only if nothing is at `path` (a file made meanwhile is never replaced).
fn rename_noreplace(tmp: &Path, path: &Path, what: &str) -> Result<(), WriteError> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).ok();
    let (Some(from), Some(to)) = (c(tmp), c(path)) else {
        return Err(io("rename into", path)(
            std::io::ErrorKind::InvalidInput.into(),
        ));
    };
    // SAFETY: both pointers are NUL-terminated strings that live across the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EEXIST) => {
            check(path, what, &Overwrite::default())?;
            Err(WriteError::Exists {
                path: path.to_path_buf(),
                what: what.to_string(),
            })
        }
        // A filesystem without the flag: the check just made is the best left.
        Some(libc::EINVAL | libc::ENOSYS) => {
            std::fs::rename(tmp, path).map_err(io("rename into", path))
        }
        _ => Err(io("rename into", path)(err)),
    }
}

/// Write `bytes` to `path` as the `what`, through a temporary file renamed into place.
pub fn write_file(
    path: &Path,
    bytes: &[u8],
    what: &str,
    rules: &Overwrite,
) -> Result<(), WriteError> {
    let mut pending = Pending::begin(path, what, rules)?;
    let tmp = pending.tmp.clone();
    pending.file().write_all(bytes).map_err(io("write", &tmp))?;
    pending.commit()
}

/// Open `path` to append to (a log): a regular file (created if missing) or a terminal, none of
/// `inputs`. Opened non-blocking, so a FIFO with no reader is refused instead of waiting forever.
pub fn open_append(path: &Path, what: &str, inputs: &Inputs) -> Result<File, WriteError> {
    let not_regular = |kind| WriteError::NotRegular {
        path: path.to_path_buf(),
        what: what.to_string(),
        kind,
    };
    // Refused without opening it: opening a FIFO or a device can block or act.
    if let Some(meta) = existing(path, what)? {
        if !meta.is_file() && !meta.file_type().is_char_device() {
            return Err(not_regular(kind_of(&meta)));
        }
    }
    let file = File::options()
        .append(true)
        .create(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENXIO) => not_regular("a FIFO (named pipe)"),
            _ => io("open", path)(e),
        })?;
    // What was opened, not what the path named a moment before.
    let meta = file.metadata().map_err(io("inspect", path))?;
    if let Some(input) = inputs.find(&meta) {
        return Err(WriteError::IsInput {
            path: path.to_path_buf(),
            what: what.to_string(),
            input: input.to_string(),
        });
    }
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    if !meta.is_file() {
        // SAFETY: `fd` is an open descriptor owned by `file` for the whole call.
        if unsafe { libc::isatty(fd) } != 1 {
            return Err(not_regular("a device that is not a terminal"));
        }
    }
    // Blocking again for the writes: a terminal's buffer may fill, and waiting is right then.
    // SAFETY: `fd` is open and owned by `file`; F_GETFL/F_SETFL change only its status flags.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok(file)
}

/// The name of the lock file in a locked directory (left there: removing it would race with the
/// next run taking it).
pub const LOCK_FILE: &str = ".gaccwb.lock";

/// An exclusive `flock` on a directory, held while this value lives (the kernel drops it when the
/// process ends, however it ends).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// Create `dir` if missing and lock it, or say which process holds it.
pub fn lock_dir(dir: &Path) -> Result<DirLock, WriteError> {
    std::fs::create_dir_all(dir).map_err(io("create the directory", dir))?;
    let path = dir.join(LOCK_FILE);
    if let Some(meta) = existing(&path, "lock file")? {
        if !meta.is_file() {
            return Err(WriteError::NotRegular {
                path,
                what: "lock file".into(),
                kind: kind_of(&meta),
            });
        }
    }
    let mut file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
        .map_err(io("open", &path))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = (&file).take(32).read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "unknown".to_string(),
                pid => pid.to_string(),
            };
            return Err(WriteError::Locked {
                dir: dir.to_path_buf(),
                holder,
            });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io("lock", &path)(e)),
    }
    let pid = format!("{}\n", std::process::id());
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(pid.as_bytes()))
        .map_err(io("write", &path))?;
    Ok(DirLock { _file: file })
}

#[cfg(test)]
mod tests;
