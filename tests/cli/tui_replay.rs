//! Events replayed into the App (directly, through the replay feed and through the real event
//! loop on a TestBackend) show what they should; record → replay and export round trips.

use std::time::Duration;

use futures_util::stream;
use gaccwb::export::cast::{write_cast, CastOptions};
use gaccwb::telemetry::Event;
use gaccwb::tui::app::App;
use gaccwb::tui::feed::{Feed, Replay};
use gaccwb::tui::keymap::KeyMap;
use gaccwb::tui::testing::sample_run_ended;
use gaccwb::tui::{event_loop, ui};
use ratatui::backend::TestBackend;
use ratatui::Terminal;

use crate::common;

use common::TINY;

fn text(t: &Terminal<TestBackend>) -> String {
    let buf = t.backend().buffer();
    let area = buf.area;
    (0..area.height)
        .map(|y| {
            (0..area.width)
                .map(|x| buf[(x, y)].symbol().to_string())
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn render(app: &App) -> String {
    let mut t = Terminal::new(TestBackend::new(160, 48)).unwrap();
    t.draw(|f| ui::render(f, app, &KeyMap::default())).unwrap();
    text(&t)
}

#[test]
fn seeking_rebuilds_the_state_at_that_step() {
    let mut app = App::default();
    let mut replay = Replay::new(sample_run_ended(40), 1.0, &mut app);
    replay.seek(&mut app, 10);
    assert_eq!(app.last_step(), 10);
    assert_eq!(app.run.knobs.accum_steps, 1);
    assert!(app.run.markers.is_empty());
    let s = render(&app);
    assert!(s.contains("K 1  B 8  eff 8") && s.contains("REPLAY"), "{s}");

    replay.seek(&mut app, 30);
    assert_eq!(app.last_step(), 30);
    assert_eq!(app.run.knobs.accum_steps, 4);
    assert_eq!(app.run.markers.len(), 1);
    let s = render(&app);
    assert!(s.contains("K 4  B 8  eff 32"), "{s}");
    assert!(s.contains("K=4 applied (key)"), "{s}");

    // Back again: nothing of the later steps survives.
    replay.seek(&mut app, 5);
    assert_eq!((app.last_step(), app.run.steps.len()), (5, 5));
    assert!(!render(&app).contains("K=4 applied"));
}

#[test]
fn single_steps_feed_one_step_each() {
    let mut app = App::default();
    let mut replay = Replay::new(sample_run_ended(40), 1.0, &mut app);
    for _ in 0..3 {
        replay.feed_one_step(&mut app);
    }
    assert_eq!(app.last_step(), 3);
}

/// Keys for the loop: speed up a lot, let it play to the end, quit.
fn keys_then_quit(
) -> impl futures_util::Stream<Item = std::io::Result<crossterm::event::Event>> + Unpin {
    use crossterm::event::{Event as T, KeyCode, KeyEvent, KeyModifiers};
    let key = |c| Ok(T::Key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE)));
    let script: Vec<(u64, std::io::Result<T>)> = vec![
        (0, key('>')),
        (0, key('>')),
        (0, key('>')),
        (0, key('>')),
        (0, key('>')),
        (0, key('>')),
        // 40 steps of 50 ms at ×64 take 31 ms; the margin is for a loaded machine.
        (2000, key('q')),
    ];
    Box::pin(stream::unfold(script.into_iter(), |mut it| async move {
        let (wait, item) = it.next()?;
        tokio::time::sleep(Duration::from_millis(wait)).await;
        Some((item, it))
    }))
}

#[tokio::test(flavor = "current_thread")]
async fn the_event_loop_plays_a_recording_to_the_end_and_quits() {
    let mut t = Terminal::new(TestBackend::new(120, 40)).unwrap();
    let mut app = App::default();
    let replay = Replay::new(sample_run_ended(40), 1.0, &mut app);
    let mut feed = Feed::Replay(replay);
    event_loop::run(
        &mut t,
        &mut app,
        &KeyMap::default(),
        &mut feed,
        keys_then_quit(),
        std::future::pending(),
    )
    .await
    .unwrap();
    assert!(app.view.quit);
    assert_eq!(app.run.ended, Some(gaccwb::end::EndReason::Completed));
    let s = text(&t);
    assert!(s.contains("step 40/100"), "{s}");
    // Played to its end: said so, with how the run ended, not "playing".
    assert!(
        s.contains("ended: completed") && s.contains("REPLAY at its end (40 steps)"),
        "{s}"
    );
}

#[test]
fn the_cast_has_frames_and_a_marker_per_applied_control() {
    let events = sample_run_ended(40);
    let mut out = Vec::new();
    let stats = write_cast(&events, &mut out, &CastOptions::default()).unwrap();
    let text = String::from_utf8(out).unwrap();
    let mut lines = text.lines();
    let header: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(header["version"], 2);
    assert_eq!(
        (header["width"].as_u64(), header["height"].as_u64()),
        (Some(120), Some(40))
    );
    let records: Vec<serde_json::Value> = lines.map(|l| serde_json::from_str(l).unwrap()).collect();
    let markers: Vec<&serde_json::Value> = records.iter().filter(|r| r[1] == "m").collect();
    assert_eq!(markers.len(), 1);
    assert_eq!(markers[0][2], "step 20: K=4");
    assert_eq!(stats.markers, 1);
    // 40 steps of 50 ms: 2 s of cast at ≤ 10 frames/s.
    assert!((stats.duration_s - 2.0).abs() < 1e-9);
    assert!(stats.frames >= 10 && stats.frames <= 22, "{stats:?}");
    let times: Vec<f64> = records.iter().map(|r| r[0].as_f64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "time goes forward");
    let output: String = records
        .iter()
        .filter(|r| r[1] == "o")
        .map(|r| r[2].as_str().unwrap().to_string())
        .collect();
    assert!(output.contains("step"), "frames hold the screen");
    assert!(output.contains("K=4") && output.contains("applied"));
}

#[test]
fn a_recorded_run_replays_to_the_same_summary() {
    use gaccwb::headless::{self, HeadlessOptions};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.jsonl");
    let mut s = TINY.onto(gaccwb::presets::resolve("baseline").unwrap());
    s.train.steps = 4;
    s.train.eval_every = 2;
    let live = headless::run(
        s,
        candle_core::Device::Cpu,
        HeadlessOptions {
            record: Some(path.clone()),
            quiet: true,
        },
    )
    .unwrap();
    let rec = gaccwb::record::read_recording(&path).unwrap();
    let replayed = gaccwb::tui::summarize(&rec.events);
    assert_eq!(replayed.render(), live.render());

    // And through the App: the same steps, the same last loss.
    let mut app = App::default();
    for e in &rec.events {
        app.update(e);
    }
    let steps: Vec<u64> = app.run.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, vec![1, 2, 3, 4]);
    assert_eq!(app.last().unwrap().loss, live.steps[3].loss);
    assert!(matches!(rec.events.last(), Some(Event::End(_))));
}
