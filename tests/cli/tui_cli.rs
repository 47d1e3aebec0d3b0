//! The screen-related commands from the outside: no terminal, replay --headless, export cast,
//! a bad keymap file.

use assert_cmd::Command;

use crate::common;

use common::TINY;

fn gaccwb() -> Command {
    let mut c = Command::cargo_bin("gaccwb").unwrap();
    c.env("RAYON_NUM_THREADS", "1");
    c
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into()
}

#[test]
fn without_a_terminal_the_screen_points_to_headless() {
    let o = gaccwb().output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("add --headless"), "{}", stderr(&o));
}

#[test]
fn a_bad_keymap_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, "[keys]\nquit = \"q\"\nzoom = \"z\"\n").unwrap();
    let o = gaccwb()
        .args(["run", "--keys"])
        .arg(&keys)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.contains(&format!("{}:3:1", keys.display())), "{e}");
    assert!(
        e.contains("unknown action `zoom`, did you mean `zoom_in`?"),
        "{e}"
    );
}

#[test]
fn replay_headless_and_cast_export_read_a_recording() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("run.jsonl");
    let live = gaccwb()
        .args(["run", "--headless", "--steps", "3", "--device", "cpu"])
        .args(TINY.args())
        .arg("--record")
        .arg(&rec)
        .output()
        .unwrap();
    assert!(live.status.success(), "{}", stderr(&live));
    let replay = gaccwb()
        .arg("replay")
        .arg(&rec)
        .arg("--headless")
        .output()
        .unwrap();
    assert!(replay.status.success(), "{}", stderr(&replay));
    assert_eq!(
        String::from_utf8_lossy(&replay.stdout),
        String::from_utf8_lossy(&live.stdout),
        "replay prints the summary the run printed"
    );

    let cast = dir.path().join("run.cast");
    let o = gaccwb()
        .arg("export")
        .arg(&rec)
        .args(["--to", "cast", "-o"])
        .arg(&cast)
        .args(["--size", "80x24"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&cast).unwrap();
    let header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(
        (header["width"].as_u64(), header["height"].as_u64()),
        (Some(80), Some(24))
    );
    assert!(text.lines().count() > 2);

    let o = gaccwb()
        .arg("export")
        .arg(&rec)
        .args(["--to", "cast", "-o"])
        .arg(&cast)
        .args(["--size", "60x20"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("from 80x24"), "{}", stderr(&o));
}

#[test]
fn replay_of_a_missing_file_says_which() {
    let o = gaccwb()
        .args(["replay", "/nonexistent/run.jsonl", "--headless"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("/nonexistent/run.jsonl"),
        "{}",
        stderr(&o)
    );
}
