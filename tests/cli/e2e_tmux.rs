//! The real binary in a real (tmux) terminal: start, see steps, press K-up, see it applied on
//! screen and in the recording, quit, and find the shell usable again.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common;
mod screen_input;

use common::tmux::{require_tmux, Tmux};
use common::TINY;

fn steps_on_screen(s: &str) -> u64 {
    s.lines()
        .next()
        .and_then(|l| l.split("step ").nth(1))
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[test]
fn k_up_in_a_real_terminal_applies_records_and_quits_cleanly() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("session.jsonl");
    let tmux = Tmux::start("session");
    let command = format!(
        "RAYON_NUM_THREADS=1 {} run {} --device cpu --record {}; echo EXIT=$?",
        env!("CARGO_BIN_EXE_gaccwb"),
        TINY.args().join(" "),
        rec.display()
    );
    tmux.send(&[&command, "Enter"]);

    let s = tmux.wait_for("the first steps", Duration::from_secs(60), |s| {
        steps_on_screen(s) >= 3
    });
    assert!(s.contains("K 1  B 8  eff 8"), "{s}");
    tmux.send(&["+"]);
    tmux.wait_for("K=2 applied", Duration::from_secs(30), |s| {
        s.contains("K 2  B 8  eff 16") && s.contains("K=2 applied (key)")
    });
    // Live resize: the compact layout at 80×24, the warning below it.
    tmux.cmd(&["resize-window", "-t", "e2e", "-x", "80", "-y", "24"]);
    tmux.wait_for("the compact layout", Duration::from_secs(10), |s| {
        s.contains("K 2  B 8  eff 16") && s.lines().count() <= 24 && s.contains("? help")
    });
    tmux.cmd(&["resize-window", "-t", "e2e", "-x", "70", "-y", "20"]);
    tmux.wait_for("the too-small notice", Duration::from_secs(10), |s| {
        s.contains("terminal too small")
    });
    tmux.send(&["q"]);
    let s = tmux.wait_for("the exit status", Duration::from_secs(30), |s| {
        // The echoed command line holds `EXIT=$?` too; the status is a line of its own.
        s.lines().any(|l| l.starts_with("EXIT="))
    });
    assert!(s.lines().any(|l| l.trim() == "EXIT=0"), "{s}");

    tmux.assert_shell_usable();

    assert_recorded_k2(&rec);
}

#[test]
fn sigterm_and_sigint_stop_the_run_and_restore_the_terminal() {
    require_tmux();
    for (signal, code) in [("TERM", 143), ("INT", 130)] {
        stop_with(signal, code);
    }
}

/// Start the screen in tmux, send `signal` from outside, expect exit `code`, a usable shell and
/// a recording that ends saying which signal stopped it.
fn stop_with(signal: &str, code: i32) {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let rec = dir.path().join("session.jsonl");
    let tmux = Tmux::start(&signal.to_lowercase());
    // `exec` keeps the pid the shell wrote: the signal goes to gaccwb itself.
    let command = format!(
        "sh -c 'echo $$ > {}; RAYON_NUM_THREADS=1 exec {} run {} --device cpu --record {}'; \
         echo EXIT=$?",
        pidfile.display(),
        env!("CARGO_BIN_EXE_gaccwb"),
        TINY.args().join(" "),
        rec.display()
    );
    tmux.send(&[&command, "Enter"]);
    tmux.wait_for("the first steps", Duration::from_secs(60), |s| {
        steps_on_screen(s) >= 2
    });
    let pid = std::fs::read_to_string(&pidfile).unwrap();
    let killed = Command::new("kill")
        .args([&format!("-{signal}"), pid.trim()])
        .status()
        .unwrap();
    assert!(killed.success());
    let s = tmux.wait_for("the exit status", Duration::from_secs(30), |s| {
        // The echoed command line holds `EXIT=$?` too; the status is a line of its own.
        s.lines().any(|l| l.starts_with("EXIT="))
    });
    assert!(s.lines().any(|l| l.trim() == format!("EXIT={code}")), "{s}");
    tmux.assert_shell_usable();
    let rec = gaccwb::record::read_recording(&rec).unwrap();
    let reason = format!("stopped by SIG{signal}");
    assert!(matches!(
        rec.events.last(),
        Some(gaccwb::telemetry::Event::End(e)) if e.reason.to_string() == reason
    ));
}

fn assert_recorded_k2(path: &Path) {
    let rec = gaccwb::record::read_recording(path).unwrap();
    let applied = rec.events.iter().any(|e| {
        matches!(e, gaccwb::telemetry::Event::Control(c)
            if c.origin == gaccwb::control::Origin::Key
            && c.control == gaccwb::control::Control::SetAccumSteps { value: 2 })
    });
    assert!(
        applied,
        "no key control set_accum_steps=2 in {}",
        path.display()
    );
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains(r#""kind":"set_accum_steps","value":2"#));
    assert!(matches!(
        rec.events.last(),
        Some(gaccwb::telemetry::Event::End(e)) if e.reason == gaccwb::end::EndReason::Stopped
    ));
}
