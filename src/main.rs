//! The `gaccwb` binary: process set-up, then the command line.
//!
//! Where things are, from here:
//! - the commands: `cli/` (one file each; `run` is the default);
//! - a run: `cli/run.rs` builds a `train::Trainer` (the training loop, `crates/engine/src/train/`)
//!   and follows it with `headless::run_session` or the screen's `tui::run_live`;
//! - keys: `tui/keymap.rs` maps a key to an `Action`, `tui/feed.rs` turns it into a `Control`;
//! - the gradient noise scale: `crates/engine/src/train/noise.rs`;
//! - data parallel: `crates/engine/src/dist.rs` (ranks, collectives, their counters) and
//!   `cli/ranks.rs` (`run --ranks N` through mpirun);
//! - knobs: one table, `crates/engine/src/control/knob.rs`;
//! - recordings: `session.rs` starts the `record::Recorder` that headless and the screen both
//!   write every event to; replay reads them back with `record::read_recording`.

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    tune_allocator();
    gaccwb::ops::configure_process();
    cli::main()
}

/// Keep freed buffers in the process instead of returning them to the OS after every step:
/// with glibc's defaults, a CPU training step spends a large share of its time in mmap/munmap and
/// page faults (measured: kernel CPU time per 8 steps 0.40–0.49 s by default, 0.06–0.12 s tuned).
/// 32 MiB is the largest mmap threshold glibc accepts.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator parameters; called before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}
