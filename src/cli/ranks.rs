//! `gaccwb run --ranks N`: data parallel on this host through the MPI launcher.
//!
//! The ranks are this same program, started by `mpirun -n N … run --headless`, rank 0 recording
//! the run. Headless, the launcher's output is the run's. On the screen, the workbench follows
//! rank 0's recording as it grows (`replay --follow`); the launcher's own output goes to a log
//! file, shown if the job fails. Knob keys go to a controls file rank 0 reads and shares with
//! every rank at the next boundary. Quitting the screen ends the ranks (SIGTERM to the launcher:
//! each rank stops at the next boundary, all together).

use std::ffi::OsString;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gaccwb::tui::{self, keymap::KeyMap};

use super::{usage, UsageError};

/// The launcher `--ranks` runs.
const LAUNCHER: &str = "mpirun";

/// How long the screen waits for rank 0 to start its recording.
const START_LIMIT: Duration = Duration::from_secs(300);

/// What `run --ranks N` needs from the command line that was given.
pub struct Launch<'a> {
    pub ranks: usize,
    pub headless: bool,
    pub record: Option<&'a Path>,
    pub keys: Option<&'a Path>,
}

/// Start `ranks` ranks of this command line and follow them to the end.
pub fn launch(l: Launch) -> anyhow::Result<()> {
    if !cfg!(feature = "mpi") {
        return Err(usage(
            "--ranks needs a gaccwb built with MPI: `cargo build --release --features mpi` (needs \
             Open MPI, e.g. Debian's openmpi-bin and libopenmpi-dev, and libclang)",
        )
        .into());
    }
    if gaccwb::dist::launch::read(|n| std::env::var(n).ok())?.is_some() {
        return Err(usage(
            "--ranks starts its own ranks; under mpirun, leave it out (mpirun -n N gaccwb run \
             --headless …)",
        )
        .into());
    }
    let keys = match l.headless {
        false => {
            let keys = KeyMap::load(l.keys).map_err(usage)?;
            tui::require_terminal().map_err(usage)?;
            Some(keys)
        }
        true => None,
    };
    // The recording the screen follows, when the user asked for none: a temporary file.
    let scratch = tempfile::tempdir()?;
    let record = l
        .record
        .map(Path::to_path_buf)
        .unwrap_or_else(|| scratch.path().join("ranks.jsonl"));
    let mut command = launcher(l.ranks, &record, l.record.is_none())?;
    let Some(keys) = keys else {
        return exit_as(command.status());
    };
    // The screen's knob keys, for rank 0 to share with every rank at the next boundary.
    let steer = gaccwb::steer::ControlWriter::create(&scratch.path().join("controls.jsonl"))?;
    command.arg("--controls-from").arg(steer.path());
    let log = scratch.path().join("mpirun.log");
    let log_file = std::fs::File::create(&log)?;
    command
        .stdout(Stdio::from(log_file.try_clone()?))
        .stderr(Stdio::from(log_file));
    let child = command.spawn().map_err(not_found)?;
    on_screen(child, &record, &log, &keys, steer)
}

/// `mpirun -n N THIS-PROGRAM ARGS…`: this command line without `--ranks`, headless, with
/// rank 0 recording to `record` (added when the user gave no `--record`).
fn launcher(ranks: usize, record: &Path, add_record: bool) -> anyhow::Result<Command> {
    let exe = std::env::current_exe()?;
    let mut args = without_ranks(std::env::args_os().skip(1));
    if !args.iter().any(|a| a == "--headless") {
        args.push("--headless".into());
    }
    if add_record {
        args.extend(["--record".into(), record.as_os_str().to_owned()]);
    }
    let mut c = Command::new(LAUNCHER);
    // mpirun forwards its standard input to rank 0; the keys belong to the screen.
    c.stdin(Stdio::null())
        .args(["-n", &ranks.to_string()])
        .arg(exe)
        .args(args);
    allow_root(&mut c, is_root());
    Ok(c)
}

/// What Open MPI's mpirun needs to start ranks as root: it refuses otherwise, and most GPU
/// containers run as root. MPICH ignores the variables.
const ROOT_ENV: [(&str, &str); 2] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
];

pub(super) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// As root, start `launcher` with the variables Open MPI asks for, and say so: asking for ranks
/// is asking mpirun to start them.
pub(super) fn allow_root(launcher: &mut Command, root: bool) {
    if !root {
        return;
    }
    let names: Vec<String> = ROOT_ENV.iter().map(|(n, v)| format!("{n}={v}")).collect();
    gaccwb::out::note(&format!(
        "gaccwb: running as root, so mpirun is started with {} (Open MPI refuses root otherwise)",
        names.join(" ")
    ));
    launcher.envs(ROOT_ENV);
}

/// The arguments without `--ranks N` or `--ranks=N`.
fn without_ranks(args: impl Iterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        match a.to_str() {
            Some("--ranks") => skip_value = true,
            Some(s) if s.starts_with("--ranks=") => {}
            _ => out.push(a),
        }
    }
    out
}

fn not_found(e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        return UsageError(format!(
            "--ranks: `{LAUNCHER}` is not on PATH; install Open MPI (Debian: openmpi-bin)"
        ))
        .into();
    }
    anyhow::Error::new(e).context(format!("starting {LAUNCHER}"))
}

/// The launcher's exit status as this process's result.
fn exit_as(status: std::io::Result<std::process::ExitStatus>) -> anyhow::Result<()> {
    let status = status.map_err(not_found)?;
    if status.success() {
        return Ok(());
    }
    Err(RanksFailed(status.code().unwrap_or(1)).into())
}

/// The ranks' job failed; this process exits with the launcher's code.
#[derive(Debug, thiserror::Error)]
#[error("the ranks' job ended with exit code {0}")]
pub struct RanksFailed(pub i32);

/// Follow rank 0's recording on the screen; on quit, end the ranks. A job that fails shows the
/// launcher's log.
fn on_screen(
    mut child: Child,
    record: &Path,
    log: &Path,
    keys: &KeyMap,
    steer: gaccwb::steer::ControlWriter,
) -> anyhow::Result<()> {
    let started = Instant::now();
    while !record.exists() {
        if let Some(status) = child.try_wait()? {
            print_log(log);
            return exit_as(Ok(status));
        }
        if started.elapsed() > START_LIMIT {
            let _ = child.kill();
            print_log(log);
            anyhow::bail!("rank 0 wrote no recording in {} s", START_LIMIT.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let shown = tui::run_follow(record, keys, Some(steer));
    let ended_by_us = child.try_wait()?.is_none();
    if ended_by_us {
        terminate(&child);
    }
    let status = child.wait();
    shown?;
    if ended_by_us {
        // The user quit: the ranks were asked to stop, and how they ended is that answer.
        status?;
        return Ok(());
    }
    let result = exit_as(status);
    if result.is_err() {
        print_log(log);
    }
    result
}

/// SIGTERM to the launcher, which passes it to the ranks: they stop together at the next
/// boundary.
fn terminate(child: &Child) {
    // SAFETY: kill(2) with a process id we started and have not yet waited for, so it cannot
    // have been reused; no memory is involved.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
}

fn print_log(log: &Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    for line in &lines[lines.len().saturating_sub(30)..] {
        gaccwb::out::note(&gaccwb::headless::strip(line));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn as_root_mpirun_gets_what_open_mpi_needs_and_otherwise_nothing() {
        let envs = |root| {
            let mut c = Command::new(LAUNCHER);
            allow_root(&mut c, root);
            c.get_envs()
                .map(|(k, v)| format!("{}={}", k.to_string_lossy(), v.unwrap().to_string_lossy()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            envs(true),
            [
                "OMPI_ALLOW_RUN_AS_ROOT=1",
                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
            ]
        );
        assert!(envs(false).is_empty());
    }

    #[test]
    fn ranks_are_taken_out_in_both_spellings() {
        let args = ["run", "--ranks", "2", "--steps", "5", "--ranks=3", "x"].map(OsString::from);
        let out = without_ranks(args.into_iter());
        assert_eq!(out, ["run", "--steps", "5", "x"].map(OsString::from));
    }
}
