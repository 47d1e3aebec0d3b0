//! The memory budget on the screen: key `F` (fit now) and the Controls pane's budget line.
//!
//! The budget is the one the trainer resolved to bytes at its start (the header's
//! `memory_budget_bytes`), so the screen and the guard never disagree. "Fit now" asks the estimator for the largest
//! micro-batch dividing the effective batch whose predicted peak fits, and sends it with the K
//! that keeps B·K.

use crate::control::Control;
use crate::memory::estimate::{largest_micro_batch, Config};
use crate::memory::human_bytes;

use super::app::App;

/// The budget in bytes, when the run has one and it can be resolved here.
pub fn budget_bytes(app: &App) -> Option<u64> {
    app.run.header.as_ref()?.memory_budget_bytes
}

/// The controls that fit the budget now, or why there are none.
pub fn fit_controls(app: &App) -> Result<Vec<Control>, String> {
    let header = app
        .run
        .header
        .as_ref()
        .ok_or("fit: the run has not started yet")?;
    let budget = budget_bytes(app)
        .ok_or("fit: no memory budget (set train.memory_budget or run with --budget)")?;
    let k = app.target_knobs();
    let unified = app.unified_memory();
    let cfg =
        Config::from_knobs(&header.config.model, &k, unified).map_err(|e| format!("fit: {e}"))?;
    let effective = k.effective_batch();
    let row = largest_micro_batch(&cfg, effective, budget).ok_or_else(|| {
        format!(
            "fit: no micro-batch of effective batch {effective} fits {} by the estimate",
            human_bytes(budget)
        )
    })?;
    if row.micro_batch == k.micro_batch {
        return Err(format!(
            "fit: B={} is already the largest micro-batch of effective batch {effective} that \
             fits {} by the estimate (predicted {})",
            row.micro_batch,
            human_bytes(budget),
            human_bytes(row.peak)
        ));
    }
    Ok(vec![
        Control::SetMicroBatch {
            value: row.micro_batch,
        },
        Control::SetAccumSteps {
            value: row.accum_steps,
        },
    ])
}

/// "budget 6.00 GiB  headroom 1.20 GiB  guard 2×" for the Controls pane.
pub fn budget_line(app: &App) -> Option<String> {
    let budget = budget_bytes(app)?;
    let headroom = match app.run.measured.as_ref() {
        Some(m) if m.peak <= budget => human_bytes(budget - m.peak),
        Some(m) => format!("-{}", human_bytes(m.peak - budget)),
        None => "?".into(),
    };
    Some(format!(
        "budget {}  headroom {headroom}  guard actions {}",
        human_bytes(budget),
        app.run.guard_actions
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::MemoryBudget;
    use crate::control::Knobs;
    use crate::memory::estimate::estimate;
    use crate::telemetry::Event;
    use crate::tui::keymap::Action;

    #[test]
    fn fit_now_sends_the_largest_fitting_split_and_keeps_the_effective_batch() {
        let mut header = crate::tui::testing::header();
        header.config.train.micro_batch = 16;
        header.config.train.accum_steps = 1;
        let cfg = Config::from_knobs(
            &header.config.model,
            &Knobs::from_scenario(&header.config),
            true,
        )
        .unwrap();
        let budget = estimate(&Config {
            micro_batch: 4,
            accum_steps: 4,
            ..cfg
        })
        .peak();
        let mut app = App::default();
        app.update(&Event::Header(header.clone()));
        assert!(app.apply(Action::FitNow).is_empty(), "no budget, no change");
        assert!(app
            .run
            .log
            .back()
            .unwrap()
            .text
            .contains("no memory budget"));

        header.config.train.memory_budget = MemoryBudget::Bytes(budget);
        header.memory_budget_bytes = Some(budget);
        let mut app = App::default();
        app.update(&Event::Header(header));
        assert_eq!(
            app.apply(Action::FitNow),
            [
                Control::SetMicroBatch { value: 4 },
                Control::SetAccumSteps { value: 4 }
            ]
        );
        assert_eq!(app.target_knobs().effective_batch(), 16);
        assert!(budget_line(&app).unwrap().starts_with("budget "));
        // Pressed again once B=4 is in force: nothing to change, and it says so.
        app.update(&Event::Control(crate::telemetry::ControlEvent {
            step: 0,
            origin: crate::control::Origin::Key,
            control: Control::SetMicroBatch { value: 4 },
        }));
        app.update(&Event::Control(crate::telemetry::ControlEvent {
            step: 0,
            origin: crate::control::Origin::Key,
            control: Control::SetAccumSteps { value: 4 },
        }));
        assert!(app.apply(Action::FitNow).is_empty());
        let said = &app.run.log.back().unwrap().text;
        assert!(said.contains("B=4 is already the largest"), "{said}");
    }
}
