//! `gaccwb run --ranks N`: data parallel on this host through the MPI launcher.
//!
//! The ranks are this same program, started by `mpirun -n N … run --headless`, rank 0 recording
//! the run. Headless, the launcher's output is the run's. On the screen, the workbench follows
//! rank 0's recording as it grows (`replay --follow`); the launcher's own output goes to a log,
//! shown if the job fails. Knob keys go to a controls file rank 0 reads and shares with every
//! rank at the next boundary; `q` sends `stop` the same way, so the ranks stop together.
//!
//! One process tree: `mpirun` is started with a parent-death signal and each rank asks for one
//! towards its own parent (`children`), so nothing trains on after the launcher is gone, however
//! it ends. `mpirun` leads a process group of its own: a terminal's ctrl-c reaches the launcher
//! alone, which sends the signal as it came to each rank (they stop at the next boundary and
//! record which signal stopped them) and exits 128 + its number; a second signal ends them at
//! once. The scratch files (the recording the screen follows when none was asked for, the
//! controls file, the launcher's log) are unlinked as soon as both sides hold them open.

use std::ffi::OsString;
use std::io::{Read, Seek};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use gaccwb::children::{self, Scratch};
use gaccwb::control::Control;
use gaccwb::signals::{Signalled, Stoppers};
use gaccwb::tui::{self, keymap::KeyMap};

use super::{usage, UsageError};

/// The launcher `--ranks` runs.
const LAUNCHER: &str = "mpirun";

/// How long the screen waits for rank 0 to start its recording.
const START_LIMIT: Duration = Duration::from_secs(300);

/// How often the launcher looks at its child and at the signals.
const POLL: Duration = Duration::from_millis(50);

/// What `run --ranks N` needs from the command line that was given.
pub struct Launch<'a> {
    pub ranks: usize,
    /// What asked for the ranks, for messages: `--ranks` or `train.ranks`.
    pub flag: &'static str,
    pub headless: bool,
    pub record: Option<&'a Path>,
    pub keys: Option<&'a Path>,
}

/// Start `ranks` ranks of this command line and follow them to the end. `precheck` refuses
/// what rank 0 would refuse (its recording, checkpoint directory, controls file) before any
/// rank starts.
pub fn launch(l: Launch, precheck: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
    if !cfg!(feature = "mpi") {
        return Err(usage(format!(
            "{} {} needs a gaccwb built with MPI: `cargo build --release --features mpi` (needs \
             Open MPI, e.g. Debian's openmpi-bin and libopenmpi-dev, and libclang)",
            l.flag, l.ranks
        ))
        .into());
    }
    if gaccwb::dist::launched(|n| std::env::var(n).ok())?.is_some() {
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
    precheck()?;
    // From here on a signal is the launcher's to pass on, never the early exit.
    let mut stoppers = Stoppers::register()?;
    let Some(keys) = keys else {
        let mut command = launcher(l.ranks, None)?;
        let mut child = spawn(&mut command)?;
        let (status, signalled) = supervise(&mut child, &mut stoppers, None)?;
        return outcome(status, signalled);
    };
    let scratch = Scratch::create("ranks")?;
    // The recording the screen follows, when the user asked for none: a scratch file.
    let scratch_record = scratch.path().join("ranks.jsonl");
    let record = l.record.unwrap_or(scratch_record.as_path());
    let existed = record.symlink_metadata().is_ok();
    let mut command = launcher(l.ranks, l.record.is_none().then_some(record))?;
    // The screen's knob keys, for rank 0 to share with every rank at the next boundary.
    let steer = gaccwb::steer::ControlWriter::create(&scratch.path().join("controls.jsonl"))?;
    command.arg("--controls-from").arg(steer.path());
    let log_path = scratch.path().join("mpirun.log");
    let log_file = std::fs::File::create(&log_path)?;
    let log = std::fs::File::open(&log_path)?;
    command
        .stdout(Stdio::from(log_file.try_clone()?))
        .stderr(Stdio::from(log_file));
    let child = spawn(&mut command)?;
    let _ = std::fs::remove_file(&log_path);
    let job = Job {
        child,
        log,
        stoppers,
        scratch,
    };
    job.on_screen(record, existed, &keys, steer)
}

/// `mpirun -n N THIS-PROGRAM ARGS…`: this command line without `--ranks`, headless, with
/// rank 0 recording to `record` when given (the user gave no `--record`).
fn launcher(ranks: usize, record: Option<&Path>) -> anyhow::Result<Command> {
    let exe = std::env::current_exe()?;
    let mut args = without_ranks(std::env::args_os().skip(1));
    if !args.iter().any(|a| a == "--headless") {
        args.push("--headless".into());
    }
    if let Some(record) = record {
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

/// Starts the launcher tied to this process, in a process group of its own.
fn spawn(command: &mut Command) -> anyhow::Result<Child> {
    children::spawn_tied(command, true).map_err(not_found)
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

/// How the job ended, as this process's result: the signal the launcher passed on, else the
/// launcher's exit status.
fn outcome(status: ExitStatus, signalled: Option<i32>) -> anyhow::Result<()> {
    if let Some(signo) = signalled {
        return Err(Signalled(signo).into());
    }
    if status.success() {
        return Ok(());
    }
    Err(RanksFailed(status.code().unwrap_or(1)).into())
}

/// The ranks' job failed; this process exits with the launcher's code.
#[derive(Debug, thiserror::Error)]
#[error("the ranks' job ended with exit code {0}")]
pub struct RanksFailed(pub i32);

/// Waits for the launcher, passing signals on: the first to every rank as it came (they stop
/// at the next boundary), a second ends the ranks and the launcher at once. `signalled`: a
/// signal already caught, to pass on first. Returns the exit status and the first signal.
fn supervise(
    child: &mut Child,
    stoppers: &mut Stoppers,
    mut signalled: Option<i32>,
) -> anyhow::Result<(ExitStatus, Option<i32>)> {
    let exe = std::env::current_exe()?;
    let mut passed_on = false;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok((status, signalled));
        }
        if let Some(signo) = stoppers.poll() {
            match signalled {
                None => {
                    signalled = Some(signo);
                    gaccwb::out::note(&format!(
                        "gaccwb: {}: stopping the ranks at the next boundary (again to end them \
                         at once)",
                        gaccwb::signals::name(signo)
                    ));
                }
                Some(_) => {
                    for pid in children::descendants(child.id()) {
                        children::send(pid, libc::SIGKILL);
                    }
                    let _ = child.kill();
                }
            }
        }
        if let (Some(signo), false) = (signalled, passed_on) {
            // Ranks not started yet are looked for again at the next poll.
            let ranks = children::ranks_below(child.id(), &exe);
            for &pid in &ranks {
                children::send(pid, signo);
            }
            passed_on = !ranks.is_empty();
        }
        std::thread::sleep(POLL);
    }
}

/// A job followed on the screen.
struct Job {
    child: Child,
    /// The launcher's output (its name already unlinked).
    log: std::fs::File,
    stoppers: Stoppers,
    scratch: Scratch,
}

impl Job {
    /// Follow rank 0's recording on the screen; on quit, stop the ranks through the controls
    /// file (a signal is passed on as it came). A job that fails shows the launcher's log.
    fn on_screen(
        mut self,
        record: &Path,
        existed: bool,
        keys: &KeyMap,
        steer: gaccwb::steer::ControlWriter,
    ) -> anyhow::Result<()> {
        // An existing --record (with --force) is replaced when the run ends; until then the
        // run writes beside it, and that is the file to follow.
        let started = Instant::now();
        let ready = || match existed {
            true => gaccwb::safe_write::replacement_in_progress(record).is_some(),
            false => record.exists(),
        };
        while !ready() {
            if let Some(status) = self.child.try_wait()? {
                self.print_log();
                return outcome(status, None);
            }
            if let Some(signo) = self.stoppers.poll() {
                let (status, signalled) =
                    supervise(&mut self.child, &mut self.stoppers, Some(signo))?;
                return outcome(status, signalled);
            }
            if started.elapsed() > START_LIMIT {
                self.end_now();
                self.print_log();
                anyhow::bail!("rank 0 wrote no recording in {} s", START_LIMIT.as_secs());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let tail = gaccwb::record::Tail::open(record)?;
        // Rank 0 opened the controls file before it created the recording: both sides hold
        // every scratch file now, and their names can go.
        self.scratch.remove();
        let mut stop = steer.try_clone()?;
        let shown = tui::follow_tail(tail, keys, Some(steer));
        // The screen handled the signals so far.
        self.stoppers.skip_past();
        let running = self.child.try_wait()?.is_none();
        let signalled = gaccwb::signals::caught().map(|s| s.0);
        if running && signalled.is_none() {
            // The user quit: every rank stops at the next boundary, together.
            stop.send(&Control::Stop)?;
            gaccwb::out::note("gaccwb: stopping the ranks at the next boundary…");
        }
        let (status, signalled) = supervise(&mut self.child, &mut self.stoppers, signalled)?;
        shown?;
        let result = outcome(status, signalled);
        if result.is_err() && signalled.is_none() {
            self.print_log();
        }
        result
    }

    /// SIGKILL to the ranks and the launcher.
    fn end_now(&mut self) {
        for pid in children::descendants(self.child.id()) {
            children::send(pid, libc::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The last lines of the launcher's output.
    fn print_log(&mut self) {
        let mut text = Vec::new();
        let _ = self.log.rewind();
        let _ = (&self.log).take(1 << 20).read_to_end(&mut text);
        let text = String::from_utf8_lossy(&text);
        let lines: Vec<&str> = text.lines().collect();
        for line in &lines[lines.len().saturating_sub(30)..] {
            gaccwb::out::note(&gaccwb::headless::strip(line));
        }
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
