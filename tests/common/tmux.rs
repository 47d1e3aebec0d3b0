//! A private tmux server driving the real binary in a real terminal: send keys, read the screen.

use std::process::Command;
use std::time::{Duration, Instant};

pub struct Tmux {
    socket: String,
}

impl Tmux {
    /// A private tmux server (its own socket) with a 120×40 shell.
    pub fn start(tag: &str) -> Tmux {
        let tmux = Tmux {
            socket: format!("gaccwb-e2e-{}-{tag}", std::process::id()),
        };
        let started = tmux.cmd(&[
            "new-session",
            "-d",
            "-s",
            "e2e",
            "-x",
            "120",
            "-y",
            "40",
            "env",
            "PS1=e2e$ ",
            "sh",
        ]);
        assert!(started.status.success(), "{started:?}");
        tmux
    }

    /// After the program ended: main screen, and the shell takes a command.
    pub fn assert_shell_usable(&self) {
        let alt = self.cmd(&["display-message", "-p", "-t", "e2e", "#{alternate_on}"]);
        assert_eq!(String::from_utf8_lossy(&alt.stdout).trim(), "0");
        self.send(&["clear; echo shell-$((40+2))", "Enter"]);
        self.wait_for("the shell to answer", Duration::from_secs(10), |s| {
            s.lines().any(|l| l.trim() == "shell-42")
        });
    }

    pub fn cmd(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .args(["-L", &self.socket, "-f", "/dev/null"])
            .args(args)
            .output()
            .expect("tmux runs")
    }

    pub fn screen(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["capture-pane", "-p", "-t", "e2e"]).stdout).into()
    }

    pub fn send(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "e2e"];
        args.extend_from_slice(keys);
        assert!(self.cmd(&args).status.success());
    }

    /// Poll the screen until `pred` holds; panic with the screen after `timeout`.
    pub fn wait_for(&self, what: &str, timeout: Duration, pred: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let s = self.screen();
            if pred(&s) {
                return s;
            }
            if start.elapsed() > timeout {
                panic!("timed out waiting for {what}; screen:\n{s}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

/// tmux must run here: a test that cannot see the screen fails rather than passing unseen.
/// `.ci/run` installs it; on a workstation, install tmux (`apt-get install tmux`).
pub fn require_tmux() {
    let found = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "tmux is not installed: the end-to-end tests drive the real screen through it; install \
         tmux (.ci/run does)"
    );
}
