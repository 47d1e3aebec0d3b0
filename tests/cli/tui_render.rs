//! The whole screen rendered into a `TestBackend` at the sizes that matter, from a fixed event
//! list, and checked for what a user must be able to read.

use gaccwb::control::{Control, Dtype, Origin};
use gaccwb::telemetry::{ControlEvent, DeviceEvent, Event, MemorySource};
use gaccwb::tui::app::{App, PaneId};
use gaccwb::tui::keymap::{Action, KeyMap};
use gaccwb::tui::testing::{header, sample_run, step};
use gaccwb::tui::ui;
use ratatui::backend::TestBackend;
use ratatui::Terminal;

fn screen(app: &App, w: u16, h: u16) -> String {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| ui::render(f, app, &KeyMap::default())).unwrap();
    let buf = t.backend().buffer();
    (0..h)
        .map(|y| {
            (0..w)
                .map(|x| buf[(x, y)].symbol().to_string())
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn app() -> App {
    let mut app = App::default();
    app.view.color = false;
    for e in sample_run(40) {
        app.update(&e);
    }
    app
}

#[test]
fn full_layout_at_160x48_shows_every_pane() {
    let s = screen(&app(), 160, 48);
    for needle in [
        "gaccwb · baseline · cpu · step 40/100",
        "Memory · allocator (CPU)",
        "live 19.0 MiB",
        "peak 33.0 MiB",
        "Memory ledger · allocator at backward of step 40",
        "activation",
        "12.0 MiB",
        "11.0 MiB",
        "opt state",
        "Loss 1.3250 · val 1.3750 · floor 1.2500",
        "Grad norm",
        "clip 1.00",
        "Loss scale: off (f32)",
        "K 4  B 8  eff 32",
        "20000 tok/s",
        "fwd/bwd/opt 20/25/5 ms",
        "pending: none",
        "CPU: offload moves nothing physically",
        "K=4 applied (key)",
        "something to see in the log",
        "? help",
    ] {
        assert!(s.contains(needle), "missing `{needle}` in\n{s}");
    }
}

#[test]
fn compact_layout_at_80x24_keeps_the_essentials() {
    let s = screen(&app(), 80, 24);
    for needle in [
        "step 40/100",
        "Loss 1.3250",
        "K 4  B 8  eff 32",
        "Ledger · backward, step 40",
        "Grad norm",
        "something to see in the log",
        "q/ctrl-c quit",
        "other",
    ] {
        assert!(s.contains(needle), "missing `{needle}` in\n{s}");
    }
    insta::assert_snapshot!("compact_80x24", s);
}

#[test]
fn compact_layout_reaches_hidden_panes_by_focus() {
    let mut app = app();
    app.view.focus = PaneId::LossScale;
    assert!(screen(&app, 80, 24).contains("Loss scale: off (f32)"));
    app.view.focus = PaneId::DeviceMemory;
    assert!(screen(&app, 80, 24).contains("allocator (CPU)"));
    app.view.expanded = true;
    let s = screen(&app, 80, 24);
    assert!(
        s.contains("allocator (CPU)") && !s.contains("Memory ledger"),
        "{s}"
    );
}

#[test]
fn help_overlay_lists_every_live_key_and_the_story() {
    let mut app = app();
    app.apply(Action::Help);
    let s = screen(&app, 80, 24);
    let keys = KeyMap::default();
    for a in Action::all().filter(|a| !a.replay_only()) {
        let label = keys.label_for(a);
        assert!(s.contains(&label), "no key `{label}` for {a:?} in\n{s}");
    }
    for needle in [
        "accumulation steps K ×2",
        "micro-batch ÷2",
        "quit",
        "seeded Markov",
    ] {
        assert!(s.contains(needle), "missing `{needle}` in\n{s}");
    }
    insta::assert_snapshot!("help_80x24", s);
}

#[test]
fn too_small_says_so() {
    let s = screen(&app(), 60, 20);
    assert!(s.contains("terminal too small"), "{s}");
    assert!(s.contains("need 80×24, have 60×20"), "{s}");
}

#[test]
fn pending_changes_show_until_applied() {
    let mut app = app();
    let sent = app.apply(Action::Knob("accum_up"));
    assert_eq!(sent, vec![Control::SetAccumSteps { value: 8 }]);
    let s = screen(&app, 160, 48);
    assert!(s.contains("K 4→8"), "{s}");
    assert!(s.contains("pending (next boundary): K=8"), "{s}");
    app.update(&Event::Control(ControlEvent {
        step: 41,
        origin: Origin::Key,
        control: Control::SetAccumSteps { value: 8 },
    }));
    let s = screen(&app, 160, 48);
    assert!(
        s.contains("K 8  B 8  eff 64") && s.contains("pending: none"),
        "{s}"
    );
}

#[test]
fn memory_panes_wait_for_data_and_report_nvml_trouble() {
    let mut app = App::default();
    app.update(&Event::Header(header()));
    app.update(&Event::Step(step(1, 3.0)));
    let s = screen(&app, 160, 48);
    assert_eq!(s.matches("no memory data yet").count(), 2, "{s}");
    app.update(&Event::Device(DeviceEvent {
        source: MemorySource::Nvml,
        unavailable: Some("NVML unavailable: libnvidia-ml.so not found".into()),
        ..DeviceEvent::default()
    }));
    let s = screen(&app, 160, 48);
    assert!(
        s.contains("NVML unavailable: libnvidia-ml.so not found"),
        "{s}"
    );
}

#[test]
fn nvml_samples_draw_used_over_total() {
    let mut app = App::default();
    let mut h = header();
    h.device = "cuda:0".into();
    app.update(&Event::Header(h));
    for i in 1..=5 {
        app.update(&Event::Step(step(i, 2.0)));
        app.update(&Event::Device(DeviceEvent {
            t_ms: i * 100,
            source: MemorySource::Nvml,
            used: Some((1 + i) << 30),
            total: Some(80 << 30),
            ..DeviceEvent::default()
        }));
    }
    let s = screen(&app, 160, 48);
    assert!(s.contains("NVML 6.0 GiB / 80.0 GiB"), "{s}");
}

#[test]
fn fp16_overflows_show_in_the_loss_scale_pane_and_the_log() {
    let mut app = App::default();
    app.update(&Event::Header(header()));
    for i in 1..=10 {
        let mut s = step(i, 2.0);
        s.dtype = Dtype::F16;
        s.loss_scale = 65536.0;
        s.skipped = i == 7;
        s.overflow_count = u64::from(i >= 7);
        app.update(&Event::Step(s));
    }
    let s = screen(&app, 160, 48);
    assert!(s.contains("Loss scale 2^16 · 1 skipped"), "{s}");
    assert!(s.contains("overflow: step skipped"), "{s}");
}

#[test]
fn no_color_renders_without_colours() {
    use ratatui::style::Color;
    let app = app();
    let mut t = Terminal::new(TestBackend::new(160, 48)).unwrap();
    t.draw(|f| ui::render(f, &app, &KeyMap::default())).unwrap();
    let buf = t.backend().buffer();
    assert!(buf
        .content()
        .iter()
        .all(|c| c.fg == Color::Reset && c.bg == Color::Reset));
}

#[test]
fn help_in_a_replay_lists_seek_and_speed_not_knobs() {
    let mut app = app();
    app.view.replay = Some(gaccwb::tui::app::ReplayStatus {
        speed: 2.0,
        paused: true,
        last_step: 40,
        following: false,
        steerable: false,
        finished: false,
    });
    app.apply(Action::Help);
    let s = screen(&app, 120, 40);
    assert!(
        s.contains("replay: 10 steps back") && s.contains("replay: double speed"),
        "{s}"
    );
    assert!(!s.contains("accumulation steps K ×2"), "{s}");
    assert!(s.contains("REPLAY paused ×2 (40 steps)"), "{s}");
}

#[test]
fn sampled_allocator_memory_is_never_called_nvml() {
    let mut app = app();
    app.update(&Event::Device(DeviceEvent {
        t_ms: 100,
        source: MemorySource::Allocator,
        used: Some(10 << 20),
        total: Some(24 << 30),
        ..DeviceEvent::default()
    }));
    let s = screen(&app, 160, 48);
    assert!(!s.contains("NVML"), "{s}");
    assert!(s.contains("Memory · allocator (CPU)"), "{s}");
}

#[test]
fn the_noise_view_at_80x24_shows_the_critical_batch_beside_b_k_and_a_verdict() {
    let mut app = app();
    let keys = KeyMap::default();
    let g = crossterm::event::KeyEvent::new(
        crossterm::event::KeyCode::Char('g'),
        crossterm::event::KeyModifiers::NONE,
    );
    let action = keys.action_for(&g).expect("g is bound");
    assert_eq!(action, Action::NoiseView);
    app.apply(action);
    let mut s = step(41, 1.3);
    s.accum_steps = 4;
    s.noise = Some(gaccwb::telemetry::NoiseEvent {
        g2: 0.02,
        trace: 250.0,
        b_simple_tokens: Some(12_500.0),
        b_simple_seqs: Some(410.0),
        raw_g2: 0.03,
        raw_trace: 240.0,
        windows: 12,
    });
    app.update(&Event::Step(s));
    let screen_text = screen(&app, 80, 24);
    for needle in [
        "Noise · B_crit ≈ 410 seq",
        "effective batch 32 is below the",
        "little loss",
        "B_crit ≈410 seq  K policy fixed",
    ] {
        assert!(
            screen_text.contains(needle),
            "missing `{needle}` in\n{screen_text}"
        );
    }
    // `a` toggles the policy; the Controls pane shows it pending until applied.
    let a = crossterm::event::KeyEvent::new(
        crossterm::event::KeyCode::Char('a'),
        crossterm::event::KeyModifiers::NONE,
    );
    let controls = app.apply(keys.action_for(&a).expect("a is bound"));
    assert_eq!(
        controls,
        vec![Control::SetAccumPolicy {
            value: gaccwb::control::AccumPolicy::NoiseScale
        }]
    );
    assert!(screen(&app, 80, 24).contains("K policy fixed→noise"));
    // With K = 1 there is no number, only what it needs.
    let mut one = step(42, 1.3);
    one.accum_steps = 1;
    app.update(&Event::Step(one));
    let s = screen(&app, 80, 24);
    assert!(
        s.contains("needs K ≥ 2") && s.contains("B_crit needs K≥2"),
        "{s}"
    );
}

#[test]
fn the_status_pane_says_how_many_threads_the_cpu_ops_ran_on() {
    let mut app = app();
    assert!(
        !screen(&app, 160, 48).contains(" thread"),
        "no count recorded yet"
    );
    for (n, threads, expected) in [(41, 2, "2 threads"), (42, 1, "1 thread")] {
        let mut s = step(n, 1.3);
        s.cpu_threads = Some(threads);
        app.update(&Event::Step(s));
        let text = screen(&app, 160, 48);
        assert!(text.contains(&format!("ms  {expected}")), "{text}");
    }
}

/// `app()` with `n` knob changes applied across the run, as after many key presses.
fn app_with_controls(n: u64) -> App {
    let mut app = app();
    for i in 0..n {
        app.update(&Event::Control(ControlEvent {
            step: 1 + i * 39 / n.max(1),
            origin: Origin::Key,
            control: Control::SetClip {
                value: Some(0.5 + i as f64 / 10.0),
            },
        }));
    }
    app
}

#[test]
fn controls_are_ticks_on_the_step_axis_and_legends_stay_whole() {
    let app = app_with_controls(25);
    let s = screen(&app, 120, 36);
    assert!(
        s.matches('┴').count() >= 6,
        "a tick per applied control:\n{s}"
    );
    for legend in ["─ before", "─ after", "• clip", "─ train", "• val"] {
        assert!(
            s.contains(legend),
            "legend `{legend}` drawn over or missing:\n{s}"
        );
    }
    // Markers never cross the plot: the only dots are the scatter series' own.
    let columns_of_dots =
        (0..120).filter(|&x| s.lines().filter(|l| l.chars().nth(x) == Some('•')).count() > 6);
    assert_eq!(columns_of_dots.count(), 0, "{s}");
}

#[test]
fn chart_labels_are_round_values_in_one_format() {
    let s = screen(&app(), 120, 36);
    // The grad-norm chart (0.5 … 1.5): every label on its axis with one decimal.
    let labels: Vec<&str> = s
        .lines()
        .filter_map(|l| {
            let pane = l.split('│').nth(3)?;
            let label = pane.trim();
            label.parse::<f64>().ok().map(|_| label)
        })
        .collect();
    assert!(labels.len() >= 2, "{labels:?}\n{s}");
    let decimals = |l: &str| l.split('.').nth(1).map_or(0, str::len);
    assert!(
        labels.iter().all(|l| decimals(l) == decimals(labels[0])),
        "{labels:?}"
    );
}

#[test]
fn the_scale_key_turns_a_spike_into_an_edge_and_back() {
    let mut app = app();
    let mut spike = step(41, 1.3);
    spike.grad_norm = 32.0;
    app.update(&Event::Step(spike));
    let linear = screen(&app, 120, 36);
    assert!(linear.contains("32"), "{linear}");
    app.apply(Action::ScaleCycle);
    let robust = screen(&app, 120, 36);
    assert!(
        robust.contains("[robust 1↑] ─ before ─ after • clip"),
        "{robust}"
    );
    app.apply(Action::ScaleCycle);
    assert!(screen(&app, 120, 36).contains("[log]"));
    app.apply(Action::ScaleCycle);
    assert!(!screen(&app, 120, 36).contains("[log]"));
}

#[test]
fn a_loss_scale_that_is_off_draws_nothing() {
    let mut app = app();
    app.view.focus = PaneId::LossScale;
    let s = screen(&app, 80, 24);
    assert!(
        s.contains("Loss scale: off (f32)") && s.contains("not used: only f16 scales the loss"),
        "{s}"
    );
    assert!(!s.contains("2^0"), "no axis for a scale that is off:\n{s}");
}

#[test]
fn help_is_whole_at_80x24() {
    let mut app = app();
    let mut h = header();
    h.config.explanation = "A story long enough to wrap over many lines. ".repeat(12);
    app.update(&Event::Header(h));
    app.apply(Action::Help);
    let s = screen(&app, 80, 24);
    let keys = KeyMap::default();
    for a in Action::all().filter(|a| !a.replay_only()) {
        assert!(s.contains(a.describe()), "no `{}` in\n{s}", a.describe());
        assert!(s.contains(&keys.label_for(a)), "{a:?}");
    }
    assert!(s.contains("Any key closes this help."), "{s}");
    assert!(s.contains('…'), "the story is cut, not the keys:\n{s}");
}

#[test]
fn the_ledger_at_80x24_keeps_every_category_and_its_total() {
    let s = screen(&app(), 80, 24);
    for label in ["params", "grads tmp", "activation", "other"] {
        assert!(s.contains(label), "{label}:\n{s}");
    }
    assert!(s.contains("total 31.0 MiB · est 30.0 MiB"), "{s}");
}

#[test]
fn applied_checkpointing_stays_in_the_controls_pane() {
    let mut app = app();
    app.update(&Event::Control(ControlEvent {
        step: 40,
        origin: Origin::Key,
        control: Control::SetCheckpointing {
            value: gaccwb::control::Checkpointing::Blocks,
        },
    }));
    for (w, h) in [(80, 24), (120, 36)] {
        let s = screen(&app, w, h);
        assert!(s.contains("ckpt blocks"), "{w}×{h}:\n{s}");
    }
}

#[test]
fn a_followed_run_that_ended_is_not_followed_any_more() {
    let mut app = App::default();
    app.view.color = false;
    for e in gaccwb::tui::testing::sample_run_ended(40) {
        app.update(&e);
    }
    app.view.replay = Some(gaccwb::tui::app::ReplayStatus {
        speed: 1.0,
        paused: false,
        last_step: 40,
        following: true,
        steerable: false,
        finished: true,
    });
    let s = screen(&app, 120, 36);
    assert!(!s.contains("FOLLOWING"), "{s}");
    assert!(
        s.contains("FOLLOWED to its end (40 steps)") && s.contains("ended: completed"),
        "{s}"
    );
}
