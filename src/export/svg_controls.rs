//! The recording chart's controls: each applied knob change as a mark (one label per step, saying
//! what changed), the labels placed in rows above the panels so that none overlaps another, and
//! the dashed stubs from each label down to its marker lines.

use std::ops::Range;

use plotters::prelude::*;

use super::chart::{text_width, Area, DrawResult, FONT};
use super::svg::{MARKER, PLOT_LEFT, PLOT_RIGHT, WIDTH};
use crate::control::Knobs;
use crate::record::Recording;
use crate::telemetry::Event;

/// One row of control labels; labels that would overlap go to the next row.
pub const CONTROL_ROW: u32 = 22;
pub const MAX_CONTROL_ROWS: usize = 4;
const LABEL_FONT: u32 = 15;

/// The controls applied at one step, in one label ("B 32→4, K 1→8").
#[derive(Debug, PartialEq)]
pub struct Mark {
    pub step: u64,
    pub label: String,
}

/// The applied knob changes (flow controls change no curve), those of one step in one label,
/// each saying the value before and after: knobs start from the recording's configuration.
pub fn control_marks(recording: &Recording) -> Vec<Mark> {
    let mut knobs = Knobs::from_scenario(&recording.header.config);
    let mut marks: Vec<Mark> = Vec::new();
    for event in &recording.events {
        let Event::Control(c) = event else { continue };
        if c.control.is_flow() {
            continue;
        }
        let change = c.control.describe_change(&knobs);
        knobs.apply(&c.control);
        match marks.last_mut() {
            Some(m) if m.step == c.step => {
                m.label.push_str(", ");
                m.label.push_str(&change);
            }
            _ => marks.push(Mark {
                step: c.step,
                label: change,
            }),
        }
    }
    marks
}

/// A control label's place in the strip above the panels.
#[derive(Debug)]
pub struct Placed {
    /// Index into the marks.
    pub mark: usize,
    pub text: String,
    pub row: usize,
    /// The label ends left of its marker (it would run past the right edge otherwise).
    pub leftward: bool,
}

/// Rows for the labels so that none overlaps another (the first row that has room); a label
/// that finds no room in `MAX_CONTROL_ROWS` rows is left out and counted.
pub fn place_labels(marks: &[Mark], x: &Range<u64>) -> (Vec<Placed>, usize) {
    const GAP: i32 = 14;
    let mut rows: Vec<Vec<Range<i32>>> = vec![Vec::new(); MAX_CONTROL_ROWS];
    let mut placed = Vec::new();
    let mut unlabelled = 0;
    for (i, m) in marks.iter().enumerate() {
        let text = format!("step {}: {}", m.step, m.label);
        let px = approx_pixel(m.step, x);
        let width = text_width(&text, LABEL_FONT);
        let leftward = px + 5 + width > WIDTH as i32 - 8;
        let span = if leftward {
            (px - 5 - width)..px
        } else {
            px..(px + 5 + width)
        };
        let free = |row: &Vec<Range<i32>>| {
            row.iter()
                .all(|r| span.end + GAP <= r.start || r.end + GAP <= span.start)
        };
        match rows.iter().position(free) {
            Some(row) => {
                rows[row].push(span);
                placed.push(Placed {
                    mark: i,
                    text,
                    row,
                    leftward,
                });
            }
            None => unlabelled += 1,
        }
    }
    (placed, unlabelled)
}

/// Where plotters will put `step` (its exact mapping is read back from the chart when drawing).
fn approx_pixel(step: u64, x: &Range<u64>) -> i32 {
    let fraction = (step.saturating_sub(x.start)) as f64 / (x.end - x.start).max(1) as f64;
    PLOT_LEFT + (fraction * (PLOT_RIGHT - PLOT_LEFT) as f64) as i32
}

/// The labels above the panels, each with a dashed stub down to where its marker line starts.
/// `pixels` are the markers' exact x in the panels. Stubs go first: a label's white box keeps a
/// stub that passes under it from striking through its text.
pub fn draw_control_strip(
    area: &Area,
    placed: &[Placed],
    pixels: &[i32],
    unlabelled: usize,
) -> DrawResult {
    let bottom = area.dim_in_pixel().1 as i32;
    let base_x = area.get_base_pixel().0;
    let row_top = |row: usize| 4 + (row as u32 * CONTROL_ROW) as i32;
    for p in placed {
        let px = pixels[p.mark] - base_x;
        let mut top = row_top(p.row);
        while top < bottom {
            let end = (top + 4).min(bottom);
            area.draw(&PathElement::new(vec![(px, top), (px, end)], MARKER))?;
            top += 8;
        }
    }
    for p in placed {
        let px = pixels[p.mark] - base_x;
        let width = text_width(&p.text, LABEL_FONT);
        let left = if p.leftward { px - 5 - width } else { px + 5 };
        boxed_label(area, &p.text, (left, row_top(p.row)), BLACK)?;
    }
    if unlabelled > 0 {
        let rows = placed.iter().map(|p| p.row + 1).max().unwrap_or(0);
        let note = format!("{unlabelled} more control(s): marked, not labelled");
        boxed_label(
            area,
            &note,
            (PLOT_LEFT, row_top(rows)),
            RGBColor(90, 90, 90),
        )?;
    }
    Ok(())
}

/// `text` from `(left, top)` on a white box.
fn boxed_label(area: &Area, text: &str, (left, top): (i32, i32), color: RGBColor) -> DrawResult {
    let width = text_width(text, LABEL_FONT);
    let corners = [
        (left - 2, top - 1),
        (left + width + 2, top + CONTROL_ROW as i32 - 5),
    ];
    area.draw(&Rectangle::new(corners, WHITE.filled()))?;
    let style = (FONT, LABEL_FONT).into_font().color(&color);
    area.draw(&Text::new(text.to_string(), (left, top), style))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{Control, Origin};
    use crate::telemetry::ControlEvent;
    use crate::tui::testing::{header, sample_run};

    fn recording(events: Vec<Event>) -> Recording {
        Recording {
            header: header(),
            events,
            warnings: Vec::new(),
        }
    }

    #[test]
    fn controls_of_one_step_share_a_label_that_says_what_changed() {
        let mut events = sample_run(30);
        let at = |step, control| {
            Event::Control(ControlEvent {
                step,
                origin: Origin::Scenario,
                control,
            })
        };
        events.push(at(25, Control::SetMicroBatch { value: 2 }));
        events.push(at(25, Control::SetAccumSteps { value: 16 }));
        events.push(at(26, Control::Pause));
        let marks = control_marks(&recording(events));
        let b = header().config.train.micro_batch;
        assert_eq!(
            marks,
            [
                Mark {
                    step: 20,
                    label: format!("K {}→4", header().config.train.accum_steps),
                },
                Mark {
                    step: 25,
                    label: format!("B {b}→2, K 4→16"),
                },
            ]
        );
    }

    #[test]
    fn labels_that_would_overlap_take_another_row() {
        let mark = |step| Mark {
            step,
            label: "B 32→4, K 1→8".into(),
        };
        let long = Mark {
            step: 99,
            label: "B 32→4, K 1→8, dtype f32→bf16, offload off→on".into(),
        };
        let (placed, unlabelled) = place_labels(&[mark(10), mark(11), long], &(0..100));
        let rows: Vec<usize> = placed.iter().map(|p| p.row).collect();
        assert_eq!((rows, unlabelled), (vec![0, 1, 0], 0));
        assert!(
            placed[2].leftward,
            "a label at the right edge ends left of its marker"
        );
    }
}
