//! One process tree: every process gaccwb starts (a `compare` row, `mpirun` and its ranks) dies
//! with the process that started it, on every signal, `SIGKILL` included.
//!
//! Linux's parent-death signal does it: a child started by [`spawn_tied`] is sent `SIGTERM`
//! when its parent exits for any reason, and a rank started by an MPI launcher asks for the
//! same towards the launcher's daemon ([`die_with_parent`]). `SIGTERM` is the signal every
//! gaccwb process already handles: a run stops at its next boundary and records its `end`.

use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

/// Starts `command` so that it is sent `SIGTERM` when this process dies, however it dies.
/// With `own_group`, the child leads a process group of its own: a terminal's ctrl-c reaches
/// this process alone, which decides what to pass on.
pub fn spawn_tied(command: &mut Command, own_group: bool) -> io::Result<Child> {
    let parent = std::process::id();
    if own_group {
        command.process_group(0);
    }
    // SAFETY: the closure runs in the forked child before exec and calls only prctl and
    // getppid, which are async-signal-safe; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before the prctl: then nothing would ever signal us.
            if libc::getppid() as u32 != parent {
                return Err(io::Error::other(
                    "the process that started this one has exited",
                ));
            }
            Ok(())
        });
    }
    command.spawn()
}

/// For a rank an MPI launcher started: `SIGTERM` when the launcher's process (its parent)
/// dies, so no rank trains on after `mpirun` was killed. Returns false when the parent is
/// already gone (adopted by init): the caller stops at once.
pub fn die_with_parent() -> bool {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number and touches no memory.
    let set = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) } == 0;
    // SAFETY: getppid cannot fail and touches no memory.
    let parent = unsafe { libc::getppid() };
    !set || parent != 1
}

/// Every process below `root` (children, their children, …), read from `/proc`: the ranks
/// under `mpirun` and its daemon. Empty where `/proc` cannot be read.
pub fn descendants(root: u32) -> Vec<u32> {
    let parents = parent_table();
    let mut found = vec![root];
    let mut at = 0;
    while at < found.len() {
        let parent = found[at];
        found.extend(
            parents
                .iter()
                .filter(|&&(_, ppid)| ppid == parent)
                .map(|&(pid, _)| pid),
        );
        at += 1;
    }
    found.remove(0);
    found
}

/// Every process's (pid, parent pid).
fn parent_table() -> Vec<(u32, u32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // "pid (comm) state ppid …": comm may hold spaces and parentheses.
            let after = &stat[stat.rfind(')')? + 1..];
            let ppid = after.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect()
}

/// The processes below `root` running `exe` (this program): the ranks, not the launcher's
/// daemons.
pub fn ranks_below(root: u32, exe: &Path) -> Vec<u32> {
    let exe = exe.canonicalize().unwrap_or_else(|_| exe.to_path_buf());
    descendants(root)
        .into_iter()
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e == exe))
        .collect()
}

/// Sends `signo` to `pid`.
pub fn send(pid: u32, signo: i32) {
    // SAFETY: kill only sends a signal; a pid that exited meanwhile gets nothing (ESRCH).
    unsafe {
        libc::kill(pid as libc::pid_t, signo);
    }
}

/// Whether process `pid` exists (a zombie counts until reaped).
pub fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 checks for existence and permission only.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A scratch directory of this process, `gaccwb-KIND-PID` in the temporary directory, removed
/// when dropped. A process killed before it could remove its own (SIGKILL) leaves it behind;
/// the next process of the same kind removes every one whose PID no longer runs.
pub struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    pub fn create(kind: &str) -> io::Result<Scratch> {
        let tmp = std::env::temp_dir();
        let prefix = format!("gaccwb-{kind}-");
        if let Ok(entries) = std::fs::read_dir(&tmp) {
            for e in entries.flatten() {
                let name = e.file_name();
                let pid = name
                    .to_str()
                    .and_then(|n| n.strip_prefix(&prefix))
                    .and_then(|p| p.parse::<u32>().ok());
                if pid.is_some_and(|p| !alive(p)) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = tmp.join(format!("{prefix}{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir)?;
        Ok(Scratch { dir })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Removes the directory now (its files stay readable to whoever holds them open).
    pub fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_directory_of_a_process_gone_is_removed_by_the_next() {
        // Left by a process that no longer runs (2^22 + 1 is above Linux's pid range).
        let left = std::env::temp_dir().join("gaccwb-test-4194305");
        std::fs::create_dir_all(&left).unwrap();
        let scratch = Scratch::create("test").unwrap();
        assert!(!left.exists());
        let path = scratch.path().to_path_buf();
        assert!(path.exists());
        drop(scratch);
        assert!(!path.exists());
    }

    #[test]
    fn a_tied_child_is_found_below_its_parent_and_ends_with_a_signal() {
        let mut child = spawn_tied(Command::new("sleep").arg("30"), true).unwrap();
        let below = descendants(std::process::id());
        assert!(below.contains(&child.id()), "{below:?}");
        assert!(alive(child.id()));
        send(child.id(), libc::SIGTERM);
        let status = child.wait().unwrap();
        assert!(!status.success());
        assert!(!alive(child.id()));
    }
}
