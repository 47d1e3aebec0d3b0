use super::*;
use crate::control::{Checkpointing, Dtype, LrRule};

fn app_with_config() -> App {
    let mut app = App::default();
    let mut header = crate::tui::testing::header();
    header.config.train.accum_steps = 2;
    header.config.train.micro_batch = 8;
    app.update(&Event::Header(header));
    app
}

#[test]
fn knob_keys_become_controls_from_the_target_state() {
    let mut app = app_with_config();
    assert_eq!(
        app.apply(Action::Knob("accum_up")),
        vec![Control::SetAccumSteps { value: 4 }]
    );
    // A second press before the trainer answers builds on the pending value.
    assert_eq!(
        app.apply(Action::Knob("accum_up")),
        vec![Control::SetAccumSteps { value: 8 }]
    );
    assert_eq!(app.run.pending, vec![Control::SetAccumSteps { value: 8 }]);
    assert_eq!(
        app.apply(Action::Knob("micro_batch_down")),
        vec![Control::SetMicroBatch { value: 4 }]
    );
    assert_eq!(
        app.apply(Action::Knob("micro_batch_up")),
        vec![Control::SetMicroBatch { value: 8 }]
    );
    assert_eq!(
        app.apply(Action::Knob("clip_down")),
        vec![Control::SetClip { value: Some(0.5) }]
    );
    assert_eq!(
        app.apply(Action::Knob("clip_toggle")),
        vec![Control::SetClip { value: None }]
    );
    assert_eq!(
        app.apply(Action::Knob("clip_toggle")),
        vec![Control::SetClip { value: Some(1.0) }]
    );
    assert_eq!(
        app.apply(Action::Knob("offload_toggle")),
        vec![Control::SetOffload { value: true }]
    );
    assert_eq!(
        app.apply(Action::Knob("precision_cycle")),
        vec![Control::SetDtype { value: Dtype::Bf16 }]
    );
    assert_eq!(
        app.apply(Action::Knob("lr_rule_cycle")),
        vec![Control::SetLrRule {
            value: LrRule::Linear
        }]
    );
    assert_eq!(app.apply(Action::PauseResume), vec![Control::Pause]);
    // Before the trainer answers, space again undoes the pending pause.
    assert_eq!(app.apply(Action::PauseResume), vec![Control::Resume]);
    assert_eq!(app.apply(Action::SingleStep), vec![Control::SingleStep]);
    assert_eq!(app.apply(Action::PauseResume), vec![Control::Resume]);
}

#[test]
fn a_newer_pending_value_survives_an_older_one_being_applied() {
    let mut app = app_with_config();
    app.apply(Action::Knob("accum_up"));
    app.apply(Action::Knob("accum_up"));
    let applied = |value| {
        Event::Control(ControlEvent {
            step: 1,
            origin: Origin::Key,
            control: Control::SetAccumSteps { value },
        })
    };
    app.update(&applied(4));
    assert_eq!(app.run.pending, vec![Control::SetAccumSteps { value: 8 }]);
    app.update(&applied(8));
    assert!(app.run.pending.is_empty());
}

#[test]
fn key_presses_become_controls() {
    use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    let keys = crate::tui::keymap::KeyMap::default();
    let mut app = app_with_config();
    let mut press = |c: char| {
        let e = KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE);
        keys.action_for(&e)
            .map(|a| app.apply(a))
            .unwrap_or_default()
    };
    assert_eq!(press('+'), vec![Control::SetAccumSteps { value: 4 }]);
    assert_eq!(press('-'), vec![Control::SetAccumSteps { value: 2 }]);
    assert_eq!(press('B'), vec![Control::SetMicroBatch { value: 16 }]);
    assert_eq!(press('C'), vec![Control::SetClip { value: Some(2.0) }]);
    assert_eq!(press('x'), vec![Control::SetClip { value: None }]);
    assert_eq!(press('o'), vec![Control::SetOffload { value: true }]);
    assert_eq!(
        press('k'),
        vec![Control::SetCheckpointing {
            value: Checkpointing::Blocks
        }]
    );
    assert_eq!(press('p'), vec![Control::SetDtype { value: Dtype::Bf16 }]);
    assert_eq!(
        press('l'),
        vec![Control::SetLrRule {
            value: LrRule::Linear
        }]
    );
    assert_eq!(press(' '), vec![Control::Pause]);
    assert_eq!(press('n'), vec![Control::SingleStep]);
    assert!(press('f').is_empty() && press('z').is_empty() && press('j').is_empty());
}

/// The knobs of ranks turn in a run of several; in a run of one, they only say why not.
#[test]
fn data_parallel_keys_act_with_ranks_and_say_why_not_without() {
    let mut app = app_with_config();
    for action in [Action::Knob("sync_toggle"), Action::Knob("zero_cycle")] {
        assert!(app.apply(action).is_empty(), "{action:?}");
        let said = &app.run.log.back().unwrap().text;
        assert!(
            said.contains("one process") && said.contains("nothing changed"),
            "{said}"
        );
    }
    assert!(app.run.pending.is_empty());
    let mut header = crate::tui::testing::header();
    header.ranks = Some(2);
    app.update(&Event::Header(header));
    assert_eq!(
        app.apply(Action::Knob("sync_toggle")),
        vec![Control::SetSync {
            value: crate::control::SyncEvery::MicroBatch
        }]
    );
    assert_eq!(
        app.apply(Action::Knob("zero_cycle")),
        vec![Control::SetZero { value: 1 }]
    );
}

/// Seeking in a live run, and turning a knob or recording in a replay, leave a line in the
/// event log and change nothing.
#[test]
fn keys_that_cannot_act_here_say_so() {
    let mut app = app_with_config();
    let knobs = app.run.knobs.clone();
    for action in [
        Action::SeekBack,
        Action::SeekForward,
        Action::SpeedDown,
        Action::SpeedUp,
    ] {
        let lines = app.run.log.len();
        assert!(app.apply(action).is_empty());
        assert_eq!(app.run.log.len(), lines + 1, "{action:?} said nothing");
        assert!(app
            .run
            .log
            .back()
            .unwrap()
            .text
            .contains("only in a replay"));
    }
    app.view.replay = Some(ReplayStatus {
        speed: 1.0,
        paused: false,
        last_step: 0,
        following: false,
        steerable: false,
        finished: false,
    });
    for action in [
        Action::Knob("accum_up"),
        Action::FitNow,
        Action::RecordToggle,
    ] {
        let lines = app.run.log.len();
        assert!(app.apply(action).is_empty());
        assert_eq!(app.run.log.len(), lines + 1, "{action:?} said nothing");
        assert!(app.run.log.back().unwrap().text.contains("a replay shows"));
    }
    assert_eq!(app.run.knobs, knobs);
    assert!(app.run.pending.is_empty());
}

#[test]
fn k_and_micro_batch_never_go_below_one() {
    let mut app = App::default();
    app.run.knobs.accum_steps = 1;
    app.run.knobs.micro_batch = 1;
    assert_eq!(
        app.apply(Action::Knob("accum_down")),
        vec![Control::SetAccumSteps { value: 1 }]
    );
    assert_eq!(
        app.apply(Action::Knob("micro_batch_down")),
        vec![Control::SetMicroBatch { value: 1 }]
    );
}

#[test]
fn pending_clears_when_the_trainer_reports_the_control() {
    let mut app = app_with_config();
    app.apply(Action::Knob("accum_up"));
    assert_eq!(app.run.knobs.accum_steps, 2);
    app.update(&Event::Control(ControlEvent {
        step: 3,
        origin: Origin::Key,
        control: Control::SetAccumSteps { value: 4 },
    }));
    assert!(app.run.pending.is_empty());
    assert_eq!(app.run.knobs.accum_steps, 4);
    assert_eq!(app.run.markers.back(), Some(&(3, "K=4".to_string())));
}

#[test]
fn display_actions_send_nothing() {
    let mut app = app_with_config();
    for a in [
        Action::Freeze,
        Action::ZoomIn,
        Action::ZoomOut,
        Action::Expand,
        Action::FocusNext,
        Action::RecordToggle,
    ] {
        assert!(app.apply(a).is_empty(), "{a:?}");
    }
    assert!(app.view.frozen.is_some() && app.view.expanded);
    assert_eq!(app.view.focus, PaneId::GradNorm);
    app.apply(Action::Help);
    assert!(app.view.help);
    // With help open, a knob key only closes it.
    assert!(app.apply(Action::Knob("accum_up")).is_empty());
    assert!(!app.view.help);
}

#[test]
fn a_replay_is_read_only() {
    let mut app = app_with_config();
    app.view.replay = Some(ReplayStatus {
        speed: 1.0,
        paused: false,
        last_step: 0,
        following: false,
        steerable: false,
        finished: false,
    });
    assert!(app.apply(Action::Knob("accum_up")).is_empty());
    assert!(app.run.pending.is_empty());
}

#[test]
fn histories_are_bounded() {
    let mut app = App::new(5);
    for i in 1..=12 {
        app.update(&Event::Step(crate::tui::testing::step(i, 2.0)));
    }
    assert_eq!(app.run.steps.len(), 5);
    assert_eq!(app.run.steps.front().unwrap().step, 8);
}
