//! Recordings: the reader's tolerance and refusals, record → read → export round trips, and a
//! real `kill -9` of the binary mid-recording.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::Device;
use gaccwb::export::{csv, svg};
use gaccwb::headless::{self, HeadlessOptions};
use gaccwb::presets;
use gaccwb::record::{parse_recording, read_recording, Recorder, Recording};
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::{Categories, Event, MemoryEvent, Phase, StepEvent};

use crate::common;

use common::TINY;

/// A small, quick scenario with a timeline (so controls are recorded) and evaluations.
fn tiny(steps: u64) -> Scenario {
    let mut s = TINY.onto(presets::resolve("accumulate-to-fit").unwrap());
    s.train.micro_batch = 4;
    s.train.eval_every = 2;
    s.train.steps = steps;
    s.timeline[0].step = 2;
    s.timeline[0].control = gaccwb::control::Control::SetMicroBatch { value: 2 };
    s.timeline[1].step = 2;
    s
}

fn step_events(events: &[Event]) -> Vec<StepEvent> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) => Some(s.clone()),
            _ => None,
        })
        .collect()
}

fn memory_events(events: &[Event]) -> Vec<MemoryEvent> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Memory(m) => Some(m.clone()),
            _ => None,
        })
        .collect()
}

/// Record a real run: the trainer's own memory measurements of every phase go into the file.
fn recorded_run(dir: &Path) -> (std::path::PathBuf, headless::Summary) {
    let path = dir.join("run.jsonl");
    let summary = headless::run(
        tiny(4),
        Device::Cpu,
        HeadlessOptions {
            record: Some(path.clone()),
            quiet: true,
        },
    )
    .unwrap();
    (path, summary)
}

/// Parse a CSV made by `export::csv` (numbers and bare words only) into rows of cells.
fn rows(text: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let mut lines = text.lines();
    let header = lines
        .next()
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect();
    let body = lines
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    (header, body)
}

fn cell<T: std::str::FromStr>(header: &[String], row: &[String], name: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    let i = header.iter().position(|h| h == name).unwrap();
    row[i].parse().unwrap()
}

#[test]
fn record_read_export_round_trip_reproduces_step_and_memory_series() {
    let dir = tempfile::tempdir().unwrap();
    let (path, summary) = recorded_run(dir.path());
    let recording = read_recording(&path).unwrap();
    assert!(recording.warnings.is_empty(), "{:?}", recording.warnings);
    let steps = step_events(&recording.events);
    assert_eq!(
        steps, summary.steps,
        "the file holds exactly what the run saw"
    );
    assert_eq!(recording.header.config, tiny(4));
    let controls = recording
        .events
        .iter()
        .filter(|e| matches!(e, Event::Control(_)))
        .count();
    assert_eq!(controls, 2, "applied controls are recorded");

    let out = dir.path().join("csv");
    let files = csv::write_csv(&recording, &out, &Default::default()).unwrap();
    assert_eq!(files.len(), 5);

    let (header, body) = rows(&std::fs::read_to_string(out.join("steps.csv")).unwrap());
    assert_eq!(header, csv::STEP_COLUMNS);
    assert_eq!(body.len(), steps.len());
    for (row, s) in body.iter().zip(&steps) {
        assert_eq!(cell::<u64>(&header, row, "step"), s.step);
        assert_eq!(cell::<f64>(&header, row, "loss"), s.loss);
        assert_eq!(cell::<f64>(&header, row, "grad_norm"), s.grad_norm);
        assert_eq!(
            cell::<f64>(&header, row, "grad_norm_clipped"),
            s.grad_norm_clipped
        );
        assert_eq!(cell::<f64>(&header, row, "lr"), s.lr);
        assert_eq!(cell::<f64>(&header, row, "loss_scale"), s.loss_scale);
        assert_eq!(cell::<usize>(&header, row, "accum_steps"), s.accum_steps);
        assert_eq!(cell::<usize>(&header, row, "micro_batch"), s.micro_batch);
        assert_eq!(cell::<u64>(&header, row, "tokens"), s.tokens);
        assert_eq!(cell::<bool>(&header, row, "skipped"), s.skipped);
        let raw_trace: String = cell(&header, row, "noise_raw_trace");
        match &s.noise {
            Some(n) => assert_eq!(raw_trace.parse::<f64>().unwrap(), n.raw_trace),
            None => assert!(raw_trace.is_empty()),
        }
    }
    assert!(
        steps.iter().any(|s| s.noise.is_some()),
        "windows with K ≥ 2 carry the noise scale"
    );

    let memory = memory_events(&recording.events);
    // Every step is measured in each of its four phases (forward, backward, optimizer, step).
    for s in &steps {
        let phases: Vec<Phase> = memory
            .iter()
            .filter(|m| m.step == s.step)
            .map(|m| m.phase)
            .collect();
        for phase in [
            Phase::Forward,
            Phase::Backward,
            Phase::Optimizer,
            Phase::Step,
        ] {
            assert!(phases.contains(&phase), "step {} lacks {phase:?}", s.step);
        }
    }
    let (header, body) = rows(&std::fs::read_to_string(out.join("memory.csv")).unwrap());
    assert_eq!(header, csv::memory_columns());
    assert_eq!(body.len(), memory.len());
    for (row, m) in body.iter().zip(&memory) {
        assert_eq!(cell::<u64>(&header, row, "step"), m.step);
        assert_eq!(cell::<u64>(&header, row, "total"), m.total);
        assert_eq!(cell::<u64>(&header, row, "peak"), m.peak);
        assert_eq!(cell::<bool>(&header, row, "unified"), m.unified);
        let phase: String = cell(&header, row, "phase");
        assert_eq!(serde_json::to_value(m.phase).unwrap(), phase.as_str());
        let source: String = cell(&header, row, "source");
        assert_eq!(serde_json::to_value(m.source).unwrap(), source.as_str());
        for (name, value) in Categories::NAMES.iter().zip(m.categories.values()) {
            assert_eq!(cell::<u64>(&header, row, name), value, "{name}");
        }
    }

    let chart = svg::render_svg(&recording, gaccwb::tui::app::YScale::Linear).unwrap();
    assert!(chart.starts_with("<svg"), "{}", &chart[..80]);
    for label in [
        "loss (nats/token)",
        "before clip",
        "after clip",
        "loss scale",
        "activations",
        "validation",
    ] {
        assert!(chart.contains(label), "chart lacks {label}");
    }
}

#[test]
fn export_cli_writes_csv_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = recorded_run(dir.path());
    let bin = env!("CARGO_BIN_EXE_gaccwb");
    let out = dir.path().join("out");
    let status = Command::new(bin)
        .args(["export", path.to_str().unwrap(), "--to", "csv", "-o"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    for f in [
        "steps.csv",
        "memory.csv",
        "estimates.csv",
        "controls.csv",
        "evals.csv",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    let controls = std::fs::read_to_string(out.join("controls.csv")).unwrap();
    assert!(
        controls.contains("2,scenario,set_micro_batch,micro-batch=2"),
        "{controls}"
    );
    let chart = dir.path().join("charts.svg");
    let status = Command::new(bin)
        .args(["export", path.to_str().unwrap(), "--to", "svg", "-o"])
        .arg(&chart)
        .status()
        .unwrap();
    assert!(status.success());
    assert!(std::fs::read_to_string(&chart).unwrap().contains("<svg"));
}

fn valid_recording_bytes() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = recorded_run(dir.path());
    std::fs::read(path).unwrap()
}

fn parse(bytes: &[u8]) -> Result<Recording, String> {
    parse_recording(bytes, "r.jsonl").map_err(|e| e.to_string())
}

#[test]
fn truncated_last_line_is_tolerated_with_a_warning() {
    let bytes = valid_recording_bytes();
    let whole = parse(&bytes).unwrap();
    let cut = &bytes[..bytes.len() - 20];
    let r = parse(cut).unwrap();
    assert_eq!(r.events.len(), whole.events.len() - 1);
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    let lines = bytes.iter().filter(|b| **b == b'\n').count();
    assert!(
        r.warnings[0].starts_with(&format!("r.jsonl:{lines}: the last line is incomplete")),
        "{}",
        r.warnings[0]
    );
    // Cut inside a multi-byte character: still only a warning.
    let mut odd = bytes[..bytes.len() - 1].to_vec();
    odd.extend_from_slice(&[b'{', 0xE2, 0x82]);
    let r = parse(&odd).unwrap();
    assert_eq!(r.warnings.len(), 1);
}

#[test]
fn a_corrupt_line_elsewhere_is_an_error_naming_its_line() {
    let text = String::from_utf8(valid_recording_bytes()).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[3] = "{\"type\":\"step\",\"step\":";
    let err = parse((lines.join("\n") + "\n").as_bytes()).unwrap_err();
    assert!(err.starts_with("r.jsonl:4: "), "{err}");
    lines[3] = "{\"type\":\"step\",\"step\":\"four\"}";
    let err = parse((lines.join("\n") + "\n").as_bytes()).unwrap_err();
    assert!(err.starts_with("r.jsonl:4: bad step event"), "{err}");
}

#[test]
fn newer_major_versions_are_refused_and_unknown_event_types_skipped() {
    let text = String::from_utf8(valid_recording_bytes()).unwrap();
    let mut header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    header["version"] = 99.into();
    // A future header may not even have today's fields.
    header.as_object_mut().unwrap().remove("config");
    let rest: Vec<&str> = text.lines().skip(1).collect();
    let newer = format!("{header}\n{}\n", rest.join("\n"));
    let err = parse(newer.as_bytes()).unwrap_err();
    assert!(
        err.starts_with("r.jsonl:1: recording format version 99 is newer"),
        "{err}"
    );

    let with_unknown = format!(
        "{}\n{{\"type\":\"hologram\",\"step\":1}}\n{}\n",
        text.lines().next().unwrap(),
        rest.join("\n")
    );
    let r = parse(with_unknown.as_bytes()).unwrap();
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    assert!(r.warnings[0].contains("skipped 1 event"));

    let err = parse(b"").unwrap_err();
    assert!(err.contains("no header"), "{err}");
    let err = parse(rest.join("\n").as_bytes()).unwrap_err();
    assert!(
        err.starts_with("r.jsonl:1: the first line must be the header"),
        "{err}"
    );
}

/// Count complete step lines written so far.
fn steps_on_disk(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|t| {
            t.lines()
                .filter(|l| l.starts_with("{\"type\":\"step\""))
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn kill_dash_nine_mid_recording_leaves_a_file_that_replays() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("killed.jsonl");
    let mut child = Command::new(env!("CARGO_BIN_EXE_gaccwb"))
        .args([
            "run",
            "baseline",
            "--headless",
            "--device",
            "cpu",
            "--steps",
            "0",
        ])
        .args(TINY.args())
        .arg("--record")
        .arg(&path)
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while steps_on_disk(&path) < 3 {
        assert!(Instant::now() < deadline, "no steps reached the file");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    child.kill().unwrap(); // SIGKILL on Unix: no destructor, no final flush
    child.wait().unwrap();
    let seen = steps_on_disk(&path);
    let r = read_recording(&path).unwrap_or_else(|e| panic!("{e}"));
    let steps = step_events(&r.events);
    assert!(
        steps.len() >= 3 && steps.len() >= seen,
        "{} steps",
        steps.len()
    );
    assert!(
        steps.windows(2).all(|w| w[1].step == w[0].step + 1),
        "steps are contiguous"
    );
    assert!(
        !matches!(r.events.last(), Some(Event::End(_))),
        "the run was killed"
    );
}

#[test]
fn events_before_the_header_are_written_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let text = String::from_utf8(valid_recording_bytes()).unwrap();
    let header: Event = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let sample = Event::Device(gaccwb::telemetry::DeviceEvent {
        t_ms: 1,
        unavailable: Some("NVML unavailable: test".into()),
        ..Default::default()
    });
    let path = dir.path().join("early.jsonl");
    let mut rec = Recorder::create(&path).unwrap();
    rec.write(&sample).unwrap();
    rec.write(&header).unwrap();
    drop(rec);
    let r = read_recording(&path).unwrap();
    assert_eq!(r.events, vec![header, sample]);
}

#[test]
fn non_finite_step_values_survive_the_round_trip() {
    let text = String::from_utf8(valid_recording_bytes()).unwrap();
    let header: Event = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let recording = parse(text.as_bytes()).unwrap();
    let mut overflow = step_events(&recording.events)[0].clone();
    overflow.grad_norm = f64::INFINITY;
    overflow.grad_norm_clipped = f64::NEG_INFINITY;
    overflow.loss = f64::NAN;
    overflow.skipped = true;
    let mut bytes = Vec::new();
    for e in [header, Event::Step(overflow)] {
        serde_json::to_writer(&mut bytes, &e).unwrap();
        bytes.push(b'\n');
    }
    let back = step_events(&parse(&bytes).unwrap().events).remove(0);
    assert_eq!(back.grad_norm, f64::INFINITY);
    assert_eq!(back.grad_norm_clipped, f64::NEG_INFINITY);
    assert!(back.loss.is_nan());
    // Files written before non-finite values were spelt out hold `null`: read as NaN.
    let old = String::from_utf8(bytes).unwrap().replace("\"inf\"", "null");
    let back = step_events(&parse(old.as_bytes()).unwrap().events).remove(0);
    assert!(back.grad_norm.is_nan());
}

#[test]
fn an_estimate_recorded_as_a_memory_event_reads_back_as_an_estimate() {
    let mut bytes = valid_recording_bytes();
    let legacy = r#"{"type": "memory", "step": 1, "phase": "step", "source": "estimate", "categories": {"parameters": 4, "compute_weights": 0, "gradients": 0, "gradients_transient": 0, "optimizer_state": 8, "offloaded": 0, "activations": 0, "other": 0}, "total": 12, "peak": 12, "unified": true}"#;
    bytes.extend_from_slice(legacy.as_bytes());
    bytes.push(b'\n');
    let r = parse(&bytes).unwrap();
    let last = r.events.last().unwrap();
    match last {
        Event::Estimate(e) => {
            assert_eq!((e.step, e.total, e.categories.optimizer_state), (1, 12, 8))
        }
        other => panic!("expected an estimate, got {other:?}"),
    }
    assert!(
        !memory_events(&r.events).is_empty(),
        "the run's own measurements stay memory events"
    );
}

/// `host_device_bytes` arrived after recordings existed: one made before it reads back with 0.
/// (The fixture is the start and the end of the asset as an earlier version recorded it.)
#[test]
fn a_recording_from_before_host_device_bytes_reads_back_with_zero() {
    let asset =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/before-host-device-bytes.jsonl");
    let bytes = std::fs::read(&asset).unwrap();
    assert!(!String::from_utf8_lossy(&bytes).contains("host_device_bytes"));
    let r = parse(&bytes).unwrap();
    let steps = step_events(&r.events);
    assert!(!steps.is_empty());
    assert!(steps.iter().all(|s| s.host_device_bytes == 0));
}

/// A recording read while it grows, in pieces cut mid-line, gives the events a whole read gives;
/// a line still being written waits for its newline.
#[test]
fn a_tail_reads_a_growing_recording_line_by_complete_line() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let (whole, _) = recorded_run(dir.path());
    let bytes = std::fs::read(&whole).unwrap();
    let growing = dir.path().join("growing.jsonl");
    let mut out = std::fs::File::create(&growing).unwrap();
    let mut tail = gaccwb::record::Tail::open(&growing).unwrap();
    let mut seen = Vec::new();
    for piece in bytes.chunks(777) {
        out.write_all(piece).unwrap();
        out.flush().unwrap();
        let new = tail.poll().unwrap();
        let written = std::fs::read(&growing).unwrap();
        let complete_lines = written.iter().filter(|&&b| b == b'\n').count();
        seen.extend(new);
        assert_eq!(seen.len(), complete_lines);
    }
    assert_eq!(seen, read_recording(&whole).unwrap().events);
    out.write_all(b"{\"type\": 7}\n").unwrap();
    let e = tail.poll().unwrap_err().to_string();
    assert!(e.contains("growing.jsonl:"), "{e}");
}

/// `replay --follow --headless` started while a run is still writing its recording waits for
/// the run's end and prints the summary the run prints.
#[test]
fn replay_follow_headless_waits_for_a_running_recording_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("growing.jsonl");
    let run = Command::new(env!("CARGO_BIN_EXE_gaccwb"))
        .current_dir(dir.path())
        .env("RAYON_NUM_THREADS", "1")
        .args(["run", "--headless", "--device", "cpu", "--steps", "200"])
        .args(TINY.args())
        .args(["--record", "growing.jsonl"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !std::fs::read_to_string(&record).is_ok_and(|t| t.contains("\"type\":\"step\"")) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no step recorded"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = std::fs::read_to_string(&record).unwrap();
    assert!(
        !before.contains("\"type\":\"end\""),
        "the run ended before the follower started"
    );
    let follow = Command::new(env!("CARGO_BIN_EXE_gaccwb"))
        .args(["replay", "--follow", "--headless"])
        .arg(&record)
        .output()
        .unwrap();
    let run_out = run.wait_with_output().unwrap();
    assert!(run_out.status.success());
    let followed = String::from_utf8_lossy(&follow.stdout);
    assert!(follow.status.success(), "{followed}");
    assert!(followed.starts_with("200 steps (completed)"), "{followed}");
    assert_eq!(followed, String::from_utf8_lossy(&run_out.stdout));
}

/// The figures README quotes from `assets/accumulate-to-fit.jsonl`, read by the rule every
/// consumer uses (`memory::figure`): the step before the switch and the first after it.
struct Quoted {
    activations: (u64, u64),
    gradients: (u64, u64),
    peak: (u64, u64),
}

fn quoted(recording: &Recording, switch: u64) -> Quoted {
    let figures = gaccwb::memory::step_figures(memory_events(&recording.events).iter());
    let at = |step: u64| {
        let f = figures.iter().find(|f| f.step == step).expect("the step");
        assert_eq!(
            f.fullest.phase,
            Phase::Backward,
            "step {step} peaks in backward"
        );
        f.clone()
    };
    let (before, after) = (at(switch), at(switch + 1));
    let pair =
        |c: fn(&Categories) -> u64| (c(&before.measured_ledger()), c(&after.measured_ledger()));
    Quoted {
        activations: pair(|c| c.activations),
        gradients: pair(|c| c.gradients),
        peak: (before.peak, after.peak),
    }
}

/// README's opening figures are the asset's, and the asset is what the preset records today: a
/// fresh run of `accumulate-to-fit` measures the same activations and gradients to the byte
/// (the peak holds the process's own heap, which its arguments move, so only the asset's is
/// quoted). The asset's SVG and cast are its exports by today's code. When this fails, record
/// the asset again and export it with the commands in README's Assets section.
#[test]
fn readme_figures_are_the_assets_and_the_asset_is_what_the_preset_records_today() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let asset = read_recording(&root.join("assets/accumulate-to-fit.jsonl")).unwrap();
    let q = quoted(&asset, 60);
    let mib = |b: u64| format!("{:.2} MiB", b as f64 / (1 << 20) as f64);
    // README's lines are wrapped: compare its words.
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let readme = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    let ratio = (q.activations.0 as f64 / q.activations.1 as f64).round();
    let params = asset.header.params * 4;
    assert_eq!(
        q.gradients,
        (0, params),
        "K=1 keeps no buffer; K=8 one of the parameters' size"
    );
    for fragment in [
        format!(
            "`activations` fall {ratio}× ({} → {} at the backward peak",
            mib(q.activations.0),
            mib(q.activations.1)
        ),
        format!(
            "the step's peak from {} to {}",
            mib(q.peak.0),
            mib(q.peak.1)
        ),
        format!("of exactly the parameters' size ({} KiB)", params / 1024),
    ] {
        assert!(
            readme.contains(&fragment),
            "README should say `{fragment}` (the asset's figures)"
        );
    }

    // The preset again, its switch moved to step 1: what a step holds depends on its shape,
    // not on the step it comes at, and two steps keep the test short.
    let dir = tempfile::tempdir().unwrap();
    let fresh = dir.path().join("fresh.jsonl");
    let status = Command::new(env!("CARGO_BIN_EXE_gaccwb"))
        .args(["run", "accumulate-to-fit", "--headless", "--device", "cpu"])
        .args(["--steps", "2", "--control", "1:set_micro_batch=4"])
        .args(["--control", "1:set_accum_steps=8", "--record"])
        .arg(&fresh)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let now = quoted(&read_recording(&fresh).unwrap(), 1);
    assert_eq!(
        now.activations, q.activations,
        "activations: a fresh run against the asset"
    );
    assert_eq!(
        now.gradients, q.gradients,
        "gradients: a fresh run against the asset"
    );

    let svg = std::fs::read_to_string(root.join("assets/accumulate-to-fit.svg")).unwrap();
    let drawn = svg::render_svg(&asset, gaccwb::tui::app::YScale::Linear).unwrap();
    assert!(
        svg == drawn,
        "assets/accumulate-to-fit.svg is not the asset's export today"
    );
    let cast = std::fs::read(root.join("assets/accumulate-to-fit.cast")).unwrap();
    let mut drawn = Vec::new();
    let opts = gaccwb::export::cast::CastOptions {
        speed: 0.1,
        ..Default::default()
    };
    gaccwb::export::cast::write_cast(&asset.events, &mut drawn, &opts).unwrap();
    assert!(
        cast == drawn,
        "assets/accumulate-to-fit.cast is not the asset's export today"
    );
}
