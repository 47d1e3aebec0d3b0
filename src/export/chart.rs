//! What the recording's charts (`svg`) and the compare chart (`compare_svg`) share: the colour of
//! each ledger category and the order they stack in, the legend column, and text widths for
//! placing labels without overlaps.

use std::ops::Range;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::telemetry::Categories;

pub type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
pub type DrawResult = Result<(), Box<dyn std::error::Error>>;

pub const FONT: &str = "sans-serif";
/// The column right of each chart that holds its legend, so no legend covers data.
pub const LEGEND_WIDTH: u32 = 210;
pub const MIB: f64 = 1048576.0;

/// Line colours of a chart's series, in order.
pub const PALETTE: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
];

/// Ledger categories bottom to top, as indices into `Categories::NAMES`: what persists across a
/// step (parameters, optimizer state, the accumulated gradients) under what comes and goes
/// inside it (transient gradients, activations), `other` on top; frozen weights (LoRA's base)
/// beside the parameters.
pub const STACK_ORDER: [usize; 9] = [0, 7, 1, 4, 2, 5, 3, 6, 8];

/// One colour per category, indexed like `Categories::NAMES`.
const CATEGORY_COLORS: [RGBColor; 9] = [
    RGBColor(31, 119, 180),  // parameters
    RGBColor(158, 202, 225), // compute weights
    RGBColor(255, 127, 14),  // gradients
    RGBColor(255, 187, 120), // gradients, transient
    RGBColor(44, 160, 44),   // optimizer state
    RGBColor(148, 103, 189), // offloaded
    RGBColor(214, 39, 40),   // activations
    RGBColor(23, 190, 207),  // frozen
    RGBColor(190, 190, 190), // other
];

pub fn category_color(index: usize) -> RGBColor {
    CATEGORY_COLORS[index]
}

pub fn category_label(index: usize) -> String {
    Categories::NAMES[index].replace('_', " ")
}

/// How a legend entry is drawn.
#[derive(Clone, Copy)]
pub enum Swatch {
    Line(RGBColor),
    Dashed(RGBColor),
    Fill(RGBColor),
    /// An outlined box (a predicted bar).
    Outline(RGBColor),
    /// A cross (a marked step).
    Cross(RGBColor),
    /// No swatch: a note in the legend.
    None,
}

pub struct LegendEntry {
    pub label: String,
    pub swatch: Swatch,
}

impl LegendEntry {
    pub fn new(label: impl Into<String>, swatch: Swatch) -> LegendEntry {
        LegendEntry {
            label: label.into(),
            swatch,
        }
    }
}

const LEGEND_ROW: i32 = 20;

/// The entries one under another in `area` (a legend column), starting `top` pixels down.
pub fn draw_legend(area: &Area, top: i32, entries: &[LegendEntry]) -> DrawResult {
    for (i, entry) in entries.iter().enumerate() {
        let (x, y) = (10, top + i as i32 * LEGEND_ROW);
        let mid = y + 7;
        match entry.swatch {
            Swatch::Line(c) => {
                area.draw(&PathElement::new(
                    vec![(x, mid), (x + 24, mid)],
                    c.stroke_width(2),
                ))?;
            }
            Swatch::Dashed(c) => {
                for dash in [x, x + 10, x + 20] {
                    area.draw(&PathElement::new(
                        vec![(dash, mid), (dash + 5, mid)],
                        c.stroke_width(2),
                    ))?;
                }
            }
            Swatch::Fill(c) => {
                area.draw(&Rectangle::new([(x, y + 1), (x + 24, y + 13)], c.filled()))?;
            }
            Swatch::Outline(c) => {
                area.draw(&Rectangle::new(
                    [(x, y + 1), (x + 24, y + 13)],
                    c.stroke_width(2),
                ))?;
            }
            Swatch::Cross(c) => {
                area.draw(&Cross::new((x + 12, mid), 5, c.stroke_width(2)))?;
            }
            Swatch::None => {}
        }
        area.draw(&Text::new(entry.label.clone(), (x + 32, y), (FONT, 15)))?;
    }
    Ok(())
}

/// Where a legend beside `chart_top` (the absolute pixel row its plot starts at) begins in `area`.
pub fn legend_top(area: &Area, chart_top: i32) -> i32 {
    chart_top - area.get_base_pixel().1 + 4
}

/// A y-axis label for `value` on an axis spanning `range`: as many decimals as the span needs
/// (no "40.0" on an axis of tens), powers of ten for huge values.
pub fn axis_number(value: f64, range: &Range<f64>) -> String {
    let span = (range.end - range.start).abs();
    let decimals = match span {
        s if s >= 20.0 => 0,
        s if s >= 2.0 => 1,
        s if s >= 0.2 => 2,
        _ => 3,
    };
    if value.abs() >= 1e7 {
        format!("{value:.2e}")
    } else {
        format!("{value:.decimals$}")
    }
}

/// A text's width in pixels, estimated: the SVG is rendered with whatever sans-serif font the
/// viewer has, so an estimate with some slack is all a layout can use.
pub fn text_width(text: &str, font_size: u32) -> i32 {
    // plotters writes font-size = size / 1.24; an average sans-serif glyph is ~0.6 em wide.
    (text.chars().count() as f64 * font_size as f64 / 1.24 * 0.6).ceil() as i32
}

/// Split `text` at commas into lines of at most `width` pixels (a long configuration label).
pub fn wrap_at_commas(text: &str, width: i32, font_size: u32) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for part in text.split(',').map(str::trim) {
        match lines.last_mut() {
            Some(line) if text_width(&format!("{line},{part}"), font_size) <= width => {
                line.push(',');
                line.push_str(part);
            }
            _ => lines.push(part.to_string()),
        }
    }
    lines
}

/// Text from a recording or the command line as it may appear in a chart: without escape
/// sequences or other control characters (`headless::strip`), newlines and tabs as spaces.
pub fn text(raw: &str) -> String {
    crate::headless::strip(raw).replace(['\n', '\t'], " ")
}

/// The SVG without any character XML 1.0 forbids (C0 controls other than tab, newline and
/// return, U+FFFE, U+FFFF), whatever text reached it: the file is always well-formed.
pub fn well_formed(svg: String) -> String {
    let allowed = |c: &char| match *c {
        '\t' | '\n' | '\r' => true,
        '\u{fffe}' | '\u{ffff}' => false,
        c => !c.is_control() || c as u32 >= 0x7f,
    };
    if svg.chars().all(|c| allowed(&c)) {
        return svg;
    }
    svg.chars().filter(allowed).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_labels_wrap_at_commas_only_when_too_wide() {
        assert_eq!(wrap_at_commas("B=4,K=8", 500, 15), ["B=4,K=8"]);
        let lines = wrap_at_commas("B=4,K=8,offload,bf16", text_width("B=4,K=8", 15), 15);
        assert_eq!(lines, ["B=4,K=8", "offload", "bf16"]);
    }

    #[test]
    fn axis_numbers_carry_the_decimals_their_span_needs() {
        assert_eq!(axis_number(40.0, &(0.0..47.0)), "40");
        assert_eq!(axis_number(2.5, &(1.4..3.6)), "2.5");
        assert_eq!(axis_number(0.25, &(0.2..0.3)), "0.250");
        assert_eq!(axis_number(1e300, &(0.0..1e300)), "1.00e300");
    }
}
