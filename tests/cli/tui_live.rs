//! The live path without a terminal: a real (tiny) trainer, the real event loop on a
//! TestBackend, scripted keys. K-up reaches the trainer as a control and comes back applied;
//! `r` starts a recording mid-run that opens with a header carrying the knobs in force, and stops
//! it with a last line saying so.

use std::time::Duration;

use crossterm::event::{Event as T, KeyCode, KeyEvent, KeyModifiers};
use futures_util::stream;
use gaccwb::control::{Control, Origin};
use gaccwb::record::read_recording;
use gaccwb::telemetry::Event;
use gaccwb::tui::app::App;
use gaccwb::tui::event_loop;
use gaccwb::tui::feed::{Feed, Live};
use gaccwb::tui::keymap::KeyMap;
use ratatui::backend::TestBackend;
use ratatui::Terminal;

use crate::common;

use common::TINY;

fn key(c: char) -> std::io::Result<T> {
    Ok(T::Key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE)))
}

#[tokio::test(flavor = "current_thread")]
async fn keys_drive_the_trainer_and_recording_starts_mid_run() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("rec.jsonl");
    let baseline = TINY.onto(gaccwb::presets::resolve("baseline").unwrap());
    let (handle, sink) = gaccwb::train::spawn(baseline, candle_core::Device::Cpu).unwrap();
    drop(sink);
    // `--record` not given: the key's recording goes to a fresh file named after `base`.
    let mut live = Live::new(handle, None).unwrap();
    live.set_record_base(base.clone());
    let mut feed = Feed::Live(live);
    let mut app = App::default();
    let script = vec![
        (1500, key('+')),
        (1000, key('r')),
        (1000, key('r')),
        (200, key('q')),
    ];
    let input = Box::pin(stream::unfold(script.into_iter(), |mut it| async move {
        let (wait, item) = it.next()?;
        tokio::time::sleep(Duration::from_millis(wait)).await;
        Some((item, it))
    }));
    let mut t = Terminal::new(TestBackend::new(120, 40)).unwrap();
    event_loop::run(
        &mut t,
        &mut app,
        &KeyMap::default(),
        &mut feed,
        input,
        std::future::pending(),
    )
    .await
    .unwrap();

    assert_eq!(app.run.knobs.accum_steps, 2, "K=2 came back applied");
    assert!(app.run.pending.is_empty());
    assert_eq!(app.run.ended, Some(gaccwb::end::EndReason::Stopped));
    assert!(app.run.log.iter().any(|l| l.text == "K=2 applied (key)"));

    let rec = read_recording(&base).unwrap();
    assert_eq!(
        rec.header.config.train.accum_steps, 2,
        "header knobs are the live ones"
    );
    let steps: Vec<u64> = rec
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) => Some(s.step),
            _ => None,
        })
        .collect();
    assert!(
        !steps.is_empty() && steps[0] > 1,
        "starts mid-run: {steps:?}"
    );
    assert!(!rec.events.iter().any(|e| matches!(e,
        Event::Control(c) if c.origin == Origin::Key && c.control == Control::SetAccumSteps { value: 2 })));
    // Stopped with `r` while the run went on: the file says so, and its replay does not read
    // like a crash.
    assert!(
        matches!(rec.events.last(), Some(Event::Log(l)) if l.message == gaccwb::headless::RECORDING_STOPPED),
        "{:?}",
        rec.events.last()
    );
    let summary = gaccwb::tui::summarize(&rec.events).render();
    assert!(
        summary.contains("(recording stopped with `r`; the run went on)"),
        "{summary}"
    );
}
