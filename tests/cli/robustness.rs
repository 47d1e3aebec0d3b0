//! Nothing lost, nothing hung: the break-it cases, each a regression test. Every
//! case checks the exit code and what is on disk before and after.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use gaccwb::record::read_recording;
use gaccwb::telemetry::{Event, Level};

use crate::common;
mod inputs;

use common::{gaccwb, TINY};

fn headless(extra: &[&str], dir: &Path) -> (i32, String, String) {
    common::headless_tiny(dir, "2", extra)
}

/// `run --headless` resuming the checkpoint in `ck` for 3 steps.
fn resume_ck(extra: &[&str], dir: &Path) -> (i32, String, String) {
    let mut args = vec![
        "run",
        "--headless",
        "--device",
        "cpu",
        "--resume",
        "ck",
        "--steps",
        "3",
    ];
    args.extend_from_slice(extra);
    gaccwb(&args, dir)
}

fn end_reason(path: &Path) -> String {
    let rec = read_recording(path).unwrap();
    match rec.events.last() {
        Some(Event::End(e)) => e.reason.to_string(),
        other => panic!("the recording does not end with `end`: {other:?}"),
    }
}

/// A window observer that panics as the first window starts.
struct PanicsAtTheFirstWindow;

impl gaccwb::train::WindowObserver for PanicsAtTheFirstWindow {
    fn window_start(&mut self, _step: u64) -> candle_core::Result<()> {
        panic!("a test's window observer panics")
    }
}

/// A trainer whose thread panics in its first window.
fn crashing_trainer(s: gaccwb::scenario::Scenario) -> gaccwb::train::Trainer {
    let mut trainer = gaccwb::train::Trainer::new(s, candle_core::Device::Cpu).unwrap();
    trainer.observe_windows(Box::new(PanicsAtTheFirstWindow));
    trainer
}

// A crash in the trainer thread ends the run instead of hanging it.
#[test]
fn a_panicking_trainer_sends_end_with_the_reason() {
    let mut s = TINY.scenario();
    s.train.steps = 3;
    let trainer = crashing_trainer(s);
    let (mut handle, sink) = gaccwb::train::spawn_trainer(trainer).unwrap();
    let _keeps_the_channel_open = sink; // as the device sampler does
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut errors = Vec::new();
    let reason = loop {
        assert!(
            Instant::now() < deadline,
            "no `end` after the trainer crashed"
        );
        match handle.events.try_recv() {
            Ok(Event::End(e)) => break e.reason.to_string(),
            Ok(Event::Log(l)) if l.level == Level::Error => errors.push(l.message),
            Ok(_) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    assert!(reason.starts_with("error: the trainer crashed"), "{reason}");
    assert!(gaccwb::end::EndReason::parse(&reason).is_failure());
    assert_eq!(errors, vec![reason]);
}

#[test]
fn controls_that_overflow_are_usage_errors_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let huge = "1:set_accum_steps=2305843009213693952";
    let (code, _, stderr) = headless(&["--control", huge, "--record", "r.jsonl"], dir.path());
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("accumulation steps"), "{stderr}");
    assert!(
        !dir.path().join("r.jsonl").exists(),
        "nothing recorded for a refused run"
    );
    let window = "1:set_micro_batch=60000";
    let (code, _, stderr) = headless(
        &["--control", "1:set_accum_steps=60000", "--control", window],
        dir.path(),
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("more than"), "{stderr}");
}

#[test]
fn an_edited_checkpoint_with_huge_knobs_is_refused_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = headless(
        &["--checkpoint-every", "1", "--checkpoint-dir", "ck"],
        dir.path(),
    );
    assert_eq!(code, 0, "{stderr}");
    common::edit_checkpoint(&dir.path().join("ck/checkpoint.json"), |json| {
        json["knobs"]["accum_steps"] = serde_json::json!(2305843009213693952u64);
    });
    let (code, _, stderr) = resume_ck(&[], dir.path());
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("checkpoint.json") && stderr.contains("accumulation steps"),
        "{stderr}"
    );
}

// Never overwrite what the user made.
#[test]
fn record_refuses_an_existing_file_and_force_replaces_it_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mine = dir.path().join("mine.jsonl");
    std::fs::write(&mine, "my notes\n").unwrap();
    let (code, _, stderr) = headless(&["--record", "mine.jsonl"], dir.path());
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("already exists") && stderr.contains("--force"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "my notes\n");
    let (code, _, stderr) = headless(&["--record", "mine.jsonl", "--force"], dir.path());
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(end_reason(&mine), "completed");
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
}

#[test]
fn record_never_writes_over_the_runs_own_input() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(
        &corpus,
        "the quick brown fox jumps over the lazy dog\n".repeat(20),
    )
    .unwrap();
    let (code, _, stderr) = headless(
        &["--data", "corpus.txt", "--record", "corpus.txt", "--force"],
        dir.path(),
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("is an input of this run"), "{stderr}");
    assert!(std::fs::read_to_string(&corpus)
        .unwrap()
        .starts_with("the quick"));
}

#[test]
fn export_refuses_existing_outputs_and_its_own_input() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = headless(&["--record", "run.jsonl"], dir.path());
    assert_eq!(code, 0, "{stderr}");
    let before = std::fs::read(dir.path().join("run.jsonl")).unwrap();
    for format in ["svg", "cast"] {
        let (code, _, stderr) = gaccwb(
            &[
                "export",
                "run.jsonl",
                "--to",
                format,
                "-o",
                "run.jsonl",
                "--force",
            ],
            dir.path(),
        );
        assert_eq!(code, 2, "{format}: {stderr}");
    }
    assert_eq!(std::fs::read(dir.path().join("run.jsonl")).unwrap(), before);
    std::fs::write(dir.path().join("chart.svg"), "mine").unwrap();
    let (code, _, stderr) = gaccwb(
        &["export", "run.jsonl", "--to", "svg", "-o", "chart.svg"],
        dir.path(),
    );
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("already exists"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("chart.svg")).unwrap(),
        "mine"
    );
    let (code, _, stderr) = gaccwb(
        &[
            "export",
            "run.jsonl",
            "--to",
            "svg",
            "-o",
            "chart.svg",
            "--force",
        ],
        dir.path(),
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(std::fs::read_to_string(dir.path().join("chart.svg"))
        .unwrap()
        .contains("<svg"));
    std::fs::create_dir(dir.path().join("csv")).unwrap();
    std::fs::write(dir.path().join("csv/evals.csv"), "mine").unwrap();
    let (code, _, stderr) = gaccwb(
        &["export", "run.jsonl", "--to", "csv", "-o", "csv"],
        dir.path(),
    );
    assert_eq!(code, 1, "{stderr}");
    assert!(
        !dir.path().join("csv/steps.csv").exists(),
        "refused before writing anything"
    );
}

#[test]
fn compare_refuses_existing_outputs_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let grid = format!("B=2,{}", TINY.sets().join(","));
    let compare = |extra: &[&str]| {
        let mut args = vec!["compare", "baseline", "--grid", &grid, "--steps", "1"];
        args.extend_from_slice(extra);
        gaccwb(&args, dir.path())
    };
    for flag in ["--csv", "--svg"] {
        std::fs::write(dir.path().join("mine"), "my notes").unwrap();
        let (code, _, stderr) = compare(&[flag, "mine"]);
        assert_eq!(code, 1, "{flag}: {stderr}");
        assert!(stderr.contains("--force"), "{stderr}");
        assert!(
            !stderr.contains("[1/1]"),
            "refused before training: {stderr}"
        );
        let mine = std::fs::read_to_string(dir.path().join("mine")).unwrap();
        assert_eq!(mine, "my notes");
    }
    let (code, _, stderr) = compare(&["--csv", "mine", "--svg", "chart.svg", "--force"]);
    assert_eq!(code, 0, "{stderr}");
    let csv = std::fs::read_to_string(dir.path().join("mine")).unwrap();
    assert!(csv.starts_with("config,"), "{csv}");
    let svg = std::fs::read_to_string(dir.path().join("chart.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains(&grid), "{svg}");
}

#[test]
fn a_checkpoint_dir_of_another_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let save = ["--checkpoint-every", "1", "--checkpoint-dir", "ck"];
    let (code, _, stderr) = headless(&save, dir.path());
    assert_eq!(code, 0, "{stderr}");
    let tensors = dir.path().join("ck/step-00000002.safetensors");
    let before = std::fs::read(&tensors).unwrap();
    let (code, _, stderr) = headless(&[&save[..], &["--seed", "7"]].concat(), dir.path());
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("already holds another run's checkpoint (step 2)"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&tensors).unwrap(), before);
    // Resuming it saves into it, as before.
    let (code, _, stderr) = resume_ck(&save, dir.path());
    assert_eq!(code, 0, "{stderr}");
    assert!(dir.path().join("ck/step-00000003.safetensors").exists());
}

// Memory before allocation.
#[test]
fn a_model_the_machine_cannot_hold_is_refused_with_figures() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = headless(
        &["--set", "model.d_model=65536", "--set", "model.layers=64"],
        dir.path(),
    );
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("does not fit") && stderr.contains("GiB"),
        "{stderr}"
    );
}

// No hang without a screen; signals stop cleanly.
#[test]
fn headless_refuses_pause_and_single_step() {
    let dir = tempfile::tempdir().unwrap();
    for control in ["1:pause", "0:single_step"] {
        let (code, _, stderr) = headless(&["--control", control], dir.path());
        assert_eq!(code, 2, "{control}: {stderr}");
        assert!(stderr.contains("no screen"), "{stderr}");
    }
}

#[test]
fn sigterm_sigint_and_sighup_end_the_run_with_the_conventional_code() {
    for (signo, code) in [
        (libc::SIGTERM, 143),
        (libc::SIGINT, 130),
        (libc::SIGHUP, 129),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let args = [
            "run",
            "--headless",
            "--device",
            "cpu",
            "--steps",
            "0",
            "--record",
            "r.jsonl",
        ];
        let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("gaccwb"))
            .current_dir(dir.path())
            .args(args)
            .args(TINY.args())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let rec = dir.path().join("r.jsonl");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_to_string(&rec)
            .unwrap_or_default()
            .contains("\"type\":\"step\"")
        {
            assert!(Instant::now() < deadline, "no step recorded");
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: kill only sends a signal to the child this test started.
        unsafe { libc::kill(child.id() as i32, signo) };
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(code), "{stdout}");
        let name = gaccwb::signals::name(signo);
        assert!(stdout.contains(&format!("(stopped by {name})")), "{stdout}");
        assert_eq!(end_reason(&rec), format!("stopped by {name}"));
    }
}

// Divergence ends the run.
#[test]
fn a_run_that_stays_non_finite_ends_as_diverged() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--set",
        "train.dtype=\"f16\"",
        "--set",
        "train.loss_scale=1e30",
        "--set",
        "train.max_nonfinite_windows=2",
        "--record",
        "r.jsonl",
    ];
    let (code, stdout, stderr) = headless(&args, dir.path());
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert!(stderr.contains("diverged"), "{stderr}");
    let reason = end_reason(&dir.path().join("r.jsonl"));
    assert!(
        reason.starts_with("diverged") && reason.contains("steps 1–2"),
        "{reason}"
    );
}

// Bounded inputs.
#[test]
fn endless_and_oversized_inputs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = headless(&["--data", "/dev/zero"], dir.path());
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("not a regular file"), "{stderr}");
    let (code, _, stderr) = gaccwb(&["replay", "--headless", "/dev/zero"], dir.path());
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("not a regular file"), "{stderr}");
    let big = dir.path().join("big.toml");
    std::fs::write(
        &big,
        vec![b'#'; (gaccwb::limits::MAX_CONFIG_BYTES + 1) as usize],
    )
    .unwrap();
    let (code, _, stderr) = gaccwb(&["run", "--headless", "big.toml"], dir.path());
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("larger than gaccwb reads"), "{stderr}");
}

#[test]
fn a_keymap_without_quit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, "[keys]\nquit = []\n").unwrap();
    let e = gaccwb::tui::keymap::KeyMap::from_file(&keys).unwrap_err();
    assert!(e.to_string().contains("no key is left for `quit`"), "{e}");
}

#[test]
fn extreme_numbers_in_a_recording_do_not_hang_replay_or_export() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = headless(&["--record", "run.jsonl"], dir.path());
    assert_eq!(code, 0, "{stderr}");
    let text = std::fs::read_to_string(dir.path().join("run.jsonl")).unwrap();
    let extreme: String = text
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            if v["type"] == "step" {
                for key in ["loss", "grad_norm", "step_ms", "tokens_per_s", "lr"] {
                    v[key] = serde_json::json!(f64::MAX);
                }
            }
            if v["type"] == "end" {
                v["reason"] = serde_json::json!("done\u{1b}[2J\u{1b}]0;title\u{7}");
            }
            v.to_string() + "\n"
        })
        .collect();
    std::fs::write(dir.path().join("x.jsonl"), extreme).unwrap();
    let (code, stdout, stderr) = gaccwb(&["replay", "--headless", "x.jsonl"], dir.path());
    assert_eq!(code, 0, "{stderr}");
    assert!(
        !stdout.contains('\u{1b}') && stdout.contains("done"),
        "{stdout:?}"
    );
    for (format, out) in [("csv", "csv"), ("svg", "x.svg"), ("cast", "x.cast")] {
        let (code, _, stderr) = gaccwb(
            &["export", "x.jsonl", "--to", format, "-o", out],
            dir.path(),
        );
        assert_eq!(code, 0, "{format}: {stderr}");
    }
}

#[test]
fn estimate_refuses_an_effective_batch_it_would_search_forever() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = gaccwb(
        &["estimate", "--effective", "1000000000000000000"],
        dir.path(),
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--effective"), "{stderr}");
}

// Errors point at the cause.
#[test]
fn a_too_large_number_in_a_preset_names_its_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("big.toml"),
        "name = \"big\"\n\n[train]\nsteps = 18446744073709551615\n",
    )
    .unwrap();
    let (code, _, stderr) = gaccwb(
        &["run", "--headless", "big.toml", "--set", "train.lr=0.1"],
        dir.path(),
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("big.toml:4") && stderr.contains("train.steps"),
        "{stderr}"
    );
    assert!(!stderr.contains("--set"), "{stderr}");
}

#[test]
fn a_cut_off_header_line_is_reported_as_such() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("cut.jsonl"),
        "{\"type\":\"header\",\"version\":1,\"con",
    )
    .unwrap();
    let (code, _, stderr) = gaccwb(&["replay", "--headless", "cut.jsonl"], dir.path());
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("header line is incomplete"), "{stderr}");
    assert!(!stderr.contains("empty"), "{stderr}");
}

/// The live event loop on a TestBackend with scripted keys (ms to wait, key).
async fn screen(
    feed: &mut gaccwb::tui::feed::Feed,
    app: &mut gaccwb::tui::app::App,
    script: Vec<(u64, char)>,
) -> anyhow::Result<()> {
    use crossterm::event::{Event as T, KeyCode, KeyEvent, KeyModifiers};
    let input = Box::pin(futures_util::stream::unfold(
        script.into_iter(),
        |mut it| async move {
            let (wait, c) = it.next()?;
            tokio::time::sleep(Duration::from_millis(wait)).await;
            let key = T::Key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
            Some((Ok(key), it))
        },
    ));
    let mut t = ratatui::Terminal::new(ratatui::backend::TestBackend::new(120, 40)).unwrap();
    let keys = gaccwb::tui::keymap::KeyMap::default();
    gaccwb::tui::event_loop::run(&mut t, app, &keys, feed, input, std::future::pending()).await
}

// On the screen: the UI stops drawing a dead run and returns the failure.
#[tokio::test(flavor = "current_thread")]
async fn the_screen_closes_with_an_error_when_the_trainer_crashes() {
    use gaccwb::tui::feed::{Feed, Live};
    let trainer = crashing_trainer(TINY.scenario());
    let (handle, _sink) = gaccwb::train::spawn_trainer(trainer).unwrap();
    let mut feed = Feed::Live(Live::new(handle, None).unwrap());
    let mut app = gaccwb::tui::app::App::default();
    // No key is ever pressed: only the failure can end the loop.
    let run = screen(&mut feed, &mut app, vec![(600_000, 'q')]);
    let result = tokio::time::timeout(Duration::from_secs(60), run).await;
    let e = result
        .expect("the screen kept running after the crash")
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("training failed: error: the trainer crashed"),
        "{e}"
    );
}

// On the screen: `r` skips names that exist instead of truncating them.
#[tokio::test(flavor = "current_thread")]
async fn the_record_key_never_truncates_an_existing_file() {
    use gaccwb::tui::feed::{Feed, Live};
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("rec.jsonl");
    std::fs::write(&base, "mine\n").unwrap();
    let (handle, _sink) = gaccwb::train::spawn(TINY.scenario(), candle_core::Device::Cpu).unwrap();
    let mut live = Live::new(handle, None).unwrap();
    live.set_record_base(base.clone());
    let mut feed = Feed::Live(live);
    let mut app = gaccwb::tui::app::App::default();
    screen(&mut feed, &mut app, vec![(1500, 'r'), (500, 'q')])
        .await
        .unwrap();
    assert_eq!(std::fs::read_to_string(&base).unwrap(), "mine\n");
    let second = dir.path().join("rec-2.jsonl");
    assert!(
        read_recording(&second).is_ok(),
        "the recording went to rec-2.jsonl"
    );
}

// Items 1 and 3 at run time: a knob change that breaks the bounds is refused at the boundary,
// and the knobs stay as they were.
#[test]
fn a_knob_change_that_overflows_is_refused_at_the_boundary() {
    use gaccwb::control::Control;
    // B·K_max·seq_len = 2^12·2^16·2^5 tokens, over the window's 2^32.
    let mut s = TINY.scenario();
    s.train.micro_batch = 1 << 12;
    let mut trainer = gaccwb::train::Trainer::new(s, candle_core::Device::Cpu).unwrap();
    let too_many = Control::SetAccumSteps {
        value: gaccwb::limits::MAX_ACCUM_STEPS,
    };
    let e = trainer.apply_control(&too_many).unwrap_err();
    assert!(e.to_string().contains("more than"), "{e}");
    assert_eq!(trainer.knobs().accum_steps, 1);
    assert!(trainer
        .apply_control(&Control::SetAccumSteps { value: 2 })
        .is_ok());
}
