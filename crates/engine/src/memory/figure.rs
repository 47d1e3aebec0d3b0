//! The figure of a step: the one rule every consumer of `memory` events uses (the screen, the
//! headless summary, the SVG export, the compare table) to turn a step's per-phase measurements
//! into one number and one ledger.
//!
//! - `peak`: the highest measured figure of any phase of the step (each phase event's `peak`);
//! - `live`: the latest measured total of the step (after its `step` phase: what persists);
//! - `fullest`: the phase event with the largest total (usually backward): the ledger to show.
//!
//! Estimates are `estimate` events, never `memory` events, so they cannot enter a figure.

use crate::telemetry::{Categories, MemoryEvent, Phase};

#[derive(Clone, Debug, PartialEq)]
/// One step's memory as the panes summarise it: its peak, what is live after it, and its fullest phase.
pub struct StepFigure {
    /// The optimizer step.
    pub step: u64,
    /// The highest peak over its phases.
    pub peak: u64,
    /// Bytes live at its `step` phase.
    pub live: u64,
    /// The phase with the highest peak.
    pub fullest: MemoryEvent,
    /// The step's `step` phase has arrived: nothing more of it will.
    pub complete: bool,
}

impl StepFigure {
    /// A figure started from the step's first memory event.
    pub fn new(m: &MemoryEvent) -> StepFigure {
        StepFigure {
            step: m.step,
            peak: m.peak.max(m.total),
            live: m.total,
            fullest: m.clone(),
            complete: m.phase == Phase::Step,
        }
    }

    /// By category, the bytes of the fullest phase that lie in the measured memory: offloaded
    /// bytes sit in host memory unless host and device memory are one (`unified`).
    pub fn measured_ledger(&self) -> Categories {
        let mut ledger = self.fullest.categories;
        if !self.fullest.unified {
            ledger.offloaded = 0;
        }
        ledger
    }

    /// Fold in another measurement of the same step.
    pub fn absorb(&mut self, m: &MemoryEvent) {
        debug_assert_eq!(m.step, self.step);
        self.peak = self.peak.max(m.peak).max(m.total);
        self.live = m.total;
        if m.total >= self.fullest.total {
            self.fullest = m.clone();
        }
        self.complete |= m.phase == Phase::Step;
    }
}

/// One figure per step, in order, from a stream of measurements (consecutive events of a step).
pub fn step_figures<'a>(events: impl IntoIterator<Item = &'a MemoryEvent>) -> Vec<StepFigure> {
    let mut figures: Vec<StepFigure> = Vec::new();
    for m in events {
        match figures.last_mut() {
            Some(f) if f.step == m.step => f.absorb(m),
            _ => figures.push(StepFigure::new(m)),
        }
    }
    figures
}

/// The figure with the highest peak; of equal peaks, the later (the run's steady state).
pub fn highest_figure(figures: impl IntoIterator<Item = StepFigure>) -> Option<StepFigure> {
    figures.into_iter().max_by_key(|f| f.peak)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::MemorySource;

    fn event(step: u64, phase: Phase, total: u64, peak: u64) -> MemoryEvent {
        MemoryEvent {
            step,
            phase,
            source: MemorySource::Allocator,
            categories: Categories {
                activations: total,
                ..Categories::default()
            },
            total,
            peak,
            unified: true,
        }
    }

    #[test]
    fn a_step_is_its_highest_peak_its_last_total_and_its_fullest_phase() {
        let events = [
            event(1, Phase::Forward, 50, 60),
            event(1, Phase::Backward, 80, 95),
            event(1, Phase::Optimizer, 40, 45),
            event(1, Phase::Step, 30, 95),
            event(2, Phase::Forward, 55, 70),
        ];
        let figures = step_figures(&events);
        assert_eq!(figures.len(), 2);
        let first = &figures[0];
        assert_eq!((first.step, first.peak, first.live), (1, 95, 30));
        assert_eq!(first.fullest.phase, Phase::Backward);
        assert!(first.complete);
        assert!(!figures[1].complete);
        assert_eq!(figures[1].peak, 70);
    }
}
