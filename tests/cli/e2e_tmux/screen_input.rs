//! The screen always quits: escape sequences it does not know, or that never end, never hold
//! the keys typed after them; a terminal that cannot draw is refused. Driven in a real (tmux)
//! terminal, as a user's keys arrive.

use std::time::Duration;

use crate::common::{
    self,
    tmux::{require_tmux, Tmux},
};

/// A recording of a few steps in `dir`, to replay.
fn recording(dir: &std::path::Path) -> std::path::PathBuf {
    let (code, _, stderr) = common::headless_tiny(dir, "3", &["--record", "r.jsonl"]);
    assert_eq!(code, 0, "{stderr}");
    dir.join("r.jsonl")
}

/// The exit status the shell printed after the command (`EXIT=N`, after the prompt when the
/// screen left the cursor there; the command line's own `EXIT=$?` is not a number).
fn exit_status(s: &str) -> Option<String> {
    s.lines()
        .filter_map(|l| l.split("EXIT=").nth(1))
        .map(str::trim)
        .find(|c| !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit()))
        .map(str::to_string)
}

/// The bytes `ESC[?25h` (or `ESC[?1l`, `ESC[?u`, an unterminated `ESC[200~`) stopped every
/// key: `q`, ctrl-c and space were ignored and only a signal ended the screen.
#[test]
fn q_quits_after_any_escape_sequence() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let rec = recording(dir.path());
    // Each sequence as hex bytes for `send-keys -H`, then the key that must still work.
    let cases: [(&str, &[&str]); 4] = [
        ("show-cursor", &["1b", "5b", "3f", "32", "35", "68"]),
        ("cursor-keys", &["1b", "5b", "3f", "31", "6c"]),
        ("kitty-query", &["1b", "5b", "3f", "75"]),
        (
            "paste-start",
            &["1b", "5b", "32", "30", "30", "7e", "61", "62"],
        ),
    ];
    for (name, bytes) in cases {
        let tmux = Tmux::start(name);
        let command = format!(
            "{} replay --speed 0.0625 {}; echo EXIT=$?",
            env!("CARGO_BIN_EXE_gaccwb"),
            rec.display()
        );
        tmux.send(&[&command, "Enter"]);
        tmux.wait_for("the replay screen", Duration::from_secs(30), |s| {
            s.contains("? help")
        });
        let mut hex = vec!["-H"];
        hex.extend_from_slice(bytes);
        tmux.send(&hex);
        tmux.send(&["q"]);
        let s = tmux.wait_for("the exit status", Duration::from_secs(15), |s| {
            exit_status(s).is_some()
        });
        assert_eq!(exit_status(&s).as_deref(), Some("0"), "{name}: {s}");
        tmux.assert_shell_usable();
    }
}

/// `TERM=dumb` was drawn anyway, escape sequences shown as text.
#[test]
fn a_terminal_that_cannot_draw_is_refused_with_the_fix() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let rec = recording(dir.path());
    let tmux = Tmux::start("dumb");
    let command = format!(
        "TERM=dumb {} replay {}; echo EXIT=$?",
        env!("CARGO_BIN_EXE_gaccwb"),
        rec.display()
    );
    tmux.send(&[&command, "Enter"]);
    let s = tmux.wait_for("the exit status", Duration::from_secs(30), |s| {
        exit_status(s).is_some()
    });
    assert_eq!(exit_status(&s).as_deref(), Some("2"), "{s}");
    assert!(s.contains("TERM=dumb") && s.contains("--headless"), "{s}");
}
