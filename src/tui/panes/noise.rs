//! The grad-norm pane's second mode (`g`): the smoothed critical batch B_simple over steps with
//! the effective batch beside it (B·K; W·K·B, every rank's samples, over several ranks), and a
//! verdict in words. Also the Controls pane's line.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph, Wrap};
use ratatui::Frame;

use super::{
    block, draw_chart, fmt_num, placeholder, steps_in_view, ChartSpec, Series, Theme, Units,
};
use crate::control::AccumPolicy;
use crate::tui::app::{App, PaneId};

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    let title = match critical_batch(app) {
        Some(b) => format!(" Noise · B_crit ≈ {} seq ", fmt_num(b)),
        None => " Noise scale ".into(),
    };
    let block = block(title, app, PaneId::GradNorm, theme);
    if app.run.steps.is_empty() {
        return placeholder(frame, area, block, "waiting for the first step…", theme);
    }
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let (text, style) = verdict(app, theme);
    let rows = (text.chars().count() as u16)
        .div_ceil(inner.width.max(1))
        .clamp(1, 4);
    let [chart, words] =
        Layout::vertical([Constraint::Min(0), Constraint::Length(rows)]).areas(inner);
    let critical: Vec<(f64, f64)> = steps_in_view(app)
        .filter_map(|s| {
            let b = s.noise.as_ref()?.b_simple_seqs?;
            Some((s.step as f64, b))
        })
        .collect();
    // Every rank's samples: the critical batch is a property of the update, not of a rank.
    let effective: Vec<(f64, f64)> = steps_in_view(app)
        .map(|s| (s.step as f64, s.global_batch() as f64))
        .collect();
    let ranks = app.run.steps.back().and_then(|s| s.comm.as_ref());
    let batch_name = if ranks.is_some_and(|c| c.ranks > 1) {
        "W·K·B"
    } else {
        "B·K"
    };
    let series = [
        Series {
            name: "critical B".into(),
            points: critical,
            style: theme.fg(Color::Magenta),
            scatter: false,
        },
        Series {
            name: batch_name.into(),
            points: effective,
            style: theme.fg(Color::Cyan),
            scatter: false,
        },
    ];
    let spec = ChartSpec {
        series: &series,
        from_zero: false,
        units: Units::Number,
        scalable: true,
    };
    draw_chart(frame, chart, Block::new(), app, spec, theme);
    frame.render_widget(
        Paragraph::new(Line::styled(text, style)).wrap(Wrap { trim: true }),
        words,
    );
}

/// The smoothed critical batch (B_simple in sequences) of the newest estimate.
fn critical_batch(app: &App) -> Option<f64> {
    app.latest_noise().and_then(|(_, n)| n.b_simple_seqs)
}

/// What the estimate says about the effective batch in force, in words.
pub fn verdict(app: &App, theme: Theme) -> (String, Style) {
    let Some(last) = app
        .run
        .steps
        .iter()
        .rev()
        .find(|s| s.step <= app.view_end())
    else {
        return ("waiting for the first step…".into(), theme.dim());
    };
    if last.accum_steps < 2 {
        return (
            "needs K ≥ 2: the noise scale compares micro-batch and window gradients".into(),
            theme.warn(),
        );
    }
    let Some((_, noise)) = app.latest_noise() else {
        return (
            "measuring… (windows with K ≥ 2 that did not overflow)".into(),
            theme.dim(),
        );
    };
    let Some(b) = noise.b_simple_seqs else {
        return (
            "no estimate yet: the smoothed |G|² is not positive (noise dominates)".into(),
            theme.dim(),
        );
    };
    let eff = last.global_batch();
    let b_text = fmt_num(b);
    if (eff as f64) < b / 2.0 {
        (
            format!(
                "effective batch {eff} is below the critical batch ≈ {b_text}: raising K would \
                 cut optimizer steps with little loss per sample"
            ),
            theme.fg(Color::Green),
        )
    } else if (eff as f64) > b * 2.0 {
        (
            format!(
                "effective batch {eff} is above the critical batch ≈ {b_text}: samples are \
                 being wasted"
            ),
            theme.warn(),
        )
    } else {
        (
            format!(
                "effective batch {eff} is near the critical batch ≈ {b_text}: a balanced trade \
                 of steps against samples"
            ),
            theme.fg(Color::Green),
        )
    }
}

/// The Controls pane's line: the estimate and who chooses K.
pub fn status_line(app: &App, theme: Theme) -> Line<'static> {
    let estimate = match (app.last().map(|s| s.accum_steps), critical_batch(app)) {
        (Some(k), _) if k < 2 => "needs K≥2".to_string(),
        (_, Some(b)) => format!("≈{} seq", fmt_num(b)),
        (_, None) => "–".to_string(),
    };
    // Short names so the line fits a 40-column pane at 80×24.
    let short = |p: AccumPolicy| match p {
        AccumPolicy::Fixed => "fixed",
        AccumPolicy::NoiseScale => "noise",
    };
    let now = app.run.knobs.accum_policy;
    let target = app.target_knobs().accum_policy;
    let mut spans = vec![
        Span::styled("B_crit ", theme.dim()),
        Span::styled(estimate, theme.bold()),
        Span::styled("  K policy ", theme.dim()),
        Span::styled(short(now), theme.bold()),
    ];
    if target != now {
        spans.push(Span::styled(format!("→{}", short(target)), theme.warn()));
    }
    Line::from(spans)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::{Event, NoiseEvent};

    fn noise(b: Option<f64>) -> NoiseEvent {
        NoiseEvent {
            g2: 1.0,
            trace: 100.0,
            b_simple_tokens: b.map(|b| b * 30.0),
            b_simple_seqs: b,
            raw_g2: 1.0,
            raw_trace: 100.0,
            windows: 1,
        }
    }

    fn app_at(k: usize, b: Option<f64>) -> App {
        let mut app = App::default();
        let mut s = crate::tui::testing::step(1, 2.0);
        s.accum_steps = k;
        s.noise = (k >= 2).then(|| noise(b));
        app.update(&Event::Step(s));
        app
    }

    #[test]
    fn the_verdict_compares_the_effective_batch_with_the_critical_batch() {
        let theme = Theme { color: false };
        // micro-batch 8 × K 4 = 32.
        let (below, _) = verdict(&app_at(4, Some(410.0)), theme);
        assert!(below.starts_with("effective batch 32 is below the critical batch ≈ 410"));
        let (above, _) = verdict(&app_at(4, Some(10.0)), theme);
        assert!(above.contains("above the critical batch ≈ 10.00: samples are being wasted"));
        let (near, _) = verdict(&app_at(4, Some(40.0)), theme);
        assert!(near.contains("near"), "{near}");
        let (k1, _) = verdict(&app_at(1, None), theme);
        assert!(k1.starts_with("needs K ≥ 2"), "{k1}");
        let (none, _) = verdict(&app_at(2, None), theme);
        assert!(none.starts_with("no estimate yet"), "{none}");
    }

    /// Over two ranks the update averages W·K·B samples: 2 × 8 × 4 = 64, near a critical batch
    /// of 100 that one rank's 32 is below.
    #[test]
    fn over_ranks_the_verdict_counts_every_ranks_samples() {
        let theme = Theme { color: false };
        let mut app = App::default();
        let mut s = crate::tui::testing::step(1, 2.0);
        s.accum_steps = 4;
        s.noise = Some(noise(Some(100.0)));
        s.comm = Some(crate::dist::CommEvent {
            ranks: 2,
            ..Default::default()
        });
        app.update(&Event::Step(s));
        let (text, _) = verdict(&app, theme);
        assert!(text.starts_with("effective batch 64 is near"), "{text}");
    }
}
