//! `gaccwb compare … --svg FILE`: the compare table as two panels of grouped bars, one group per
//! configuration. Memory: the measured peak stacked by ledger category (the same colours as the
//! recording's chart) beside the predicted peak (outlined). Throughput: tokens/s, with optimizer
//! steps/s under each value.

use std::ops::Range;
use std::path::Path;

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::chart::{
    axis_number, category_color, category_label, draw_legend, legend_top, text, well_formed,
    wrap_at_commas, Area, DrawResult, LegendEntry, Swatch, FONT, LEGEND_WIDTH, MIB, PALETTE,
    STACK_ORDER,
};
use crate::compare::Row;

const WIDTH: u32 = 1100;
const TITLE_HEIGHT: u32 = 50;
const MEMORY_HEIGHT: u32 = 380;
const SPEED_HEIGHT: u32 = 280;
const MARGIN: u32 = 12;
const Y_LABELS: u32 = 70;
const LABEL_FONT: u32 = 15;
const LINE: u32 = 18;
/// The colour of the predicted peak (the recording's chart draws the estimate in it too).
const PREDICTED: RGBColor = RGBColor(230, 0, 126);

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Draw the chart into `out`; an existing file is refused unless `rules` allow it.
pub fn write_compare_svg(
    rows: &[Row],
    title: &str,
    out: &Path,
    rules: &crate::safe_write::Overwrite,
) -> anyhow::Result<()> {
    let svg = render_compare_svg(rows, title)
        .map_err(|e| anyhow::anyhow!("drawing the compare chart: {e}"))?;
    Ok(crate::safe_write::write_file(
        out,
        svg.as_bytes(),
        "chart",
        rules,
    )?)
}

/// The chart as SVG text.
pub fn render_compare_svg(rows: &[Row], title: &str) -> Result<String, Box<dyn std::error::Error>> {
    let plot_width = (WIDTH - LEGEND_WIDTH - 2 * MARGIN - Y_LABELS) as i32;
    let slot = plot_width / rows.len().max(1) as i32;
    let labels: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut lines = wrap_at_commas(&text(&r.config), slot - 10, LABEL_FONT);
            lines.push(format!("B·K = {}", r.effective_batch));
            lines
        })
        .collect();
    let label_height = labels.iter().map(Vec::len).max().unwrap_or(1) as u32 * LINE + 14;
    let height = TITLE_HEIGHT + MEMORY_HEIGHT + SPEED_HEIGHT + 2 * label_height;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (head, rest) = root.split_vertically(TITLE_HEIGHT);
        head.draw(&Text::new(
            text(title),
            ((MARGIN + Y_LABELS) as i32, 12),
            (FONT, 24),
        ))?;
        let (memory, speed) = rest.split_vertically(MEMORY_HEIGHT + label_height);
        draw_memory(&memory, rows, &labels, label_height)?;
        draw_speed(&speed, rows, &labels, label_height)?;
        root.present()?;
    }
    Ok(well_formed(svg))
}

/// A panel's chart (configuration i centred at x = i) and its legend column.
fn build_chart<'a, 'b>(
    plot: &'a Area<'b>,
    caption: &str,
    configs: usize,
    y: Range<f64>,
    label_height: u32,
) -> Result<Chart<'a, 'b>, Box<dyn std::error::Error>> {
    let mut chart = ChartBuilder::on(plot)
        .caption(caption, (FONT, 18))
        .margin(MARGIN)
        .x_label_area_size(label_height)
        .y_label_area_size(Y_LABELS)
        .build_cartesian_2d(-0.5..configs as f64 - 0.5, y.clone())?;
    let y_label = move |v: &f64| axis_number(*v, &y);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_labels(6)
        .y_label_formatter(&y_label)
        .light_line_style(WHITE)
        .label_style((FONT, 14))
        .draw()?;
    Ok(chart)
}

/// Each configuration's label lines, centred under its group.
fn draw_config_labels(area: &Area, chart: &Chart, labels: &[Vec<String>]) -> DrawResult {
    let bottom = chart.plotting_area().get_pixel_range().1.end;
    let (base_x, base_y) = area.get_base_pixel();
    let centred = Pos::new(HPos::Center, VPos::Top);
    for (i, lines) in labels.iter().enumerate() {
        let x = chart.backend_coord(&(i as f64, 0.0)).0 - base_x;
        for (j, line) in lines.iter().enumerate() {
            let grey = j + 1 == lines.len();
            let color = if grey { RGBColor(90, 90, 90) } else { BLACK };
            let style = TextStyle::from((FONT, LABEL_FONT).into_font())
                .color(&color)
                .pos(centred);
            let y = bottom - base_y + 8 + (j as u32 * LINE) as i32;
            area.draw(&Text::new(line.clone(), (x, y), style))?;
        }
    }
    Ok(())
}

/// `text` centred `lift` pixels above (x, y) in chart coordinates.
fn value_label(chart: &mut Chart, (x, y): (f64, f64), lift: i32, text: String) -> DrawResult {
    let style = TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    chart.draw_series([EmptyElement::at((x, y)) + Text::new(text, (0, -lift), style)])?;
    Ok(())
}

fn draw_memory(area: &Area, rows: &[Row], labels: &[Vec<String>], label_height: u32) -> DrawResult {
    let mib = |b: u64| b as f64 / MIB;
    let top = rows
        .iter()
        .map(|r| mib(r.measured_peak.max(r.predicted_peak)))
        .fold(0.0, f64::max);
    let (plot, legend) = area.split_horizontally(WIDTH - LEGEND_WIDTH);
    let caption = "peak memory (MiB): measured, by ledger category, beside predicted";
    let y = 0.0..(top * 1.15).max(1.0);
    let mut chart = build_chart(&plot, caption, rows.len(), y, label_height)?;
    let present: Vec<usize> = STACK_ORDER
        .iter()
        .copied()
        .filter(|&c| rows.iter().any(|r| r.measured_ledger.values()[c] > 0))
        .collect();
    for (i, r) in rows.iter().enumerate() {
        let x = i as f64;
        let values = r.measured_ledger.values();
        let mut below = 0.0;
        for &c in &present {
            let height = mib(values[c]);
            let bar = [(x - 0.36, below), (x - 0.02, below + height)];
            chart.draw_series([Rectangle::new(bar, category_color(c).filled())])?;
            below += height;
        }
        let measured = mib(r.measured_peak);
        chart.draw_series([PathElement::new(
            [(x - 0.36, measured), (x - 0.02, measured)],
            BLACK.stroke_width(2),
        )])?;
        value_label(
            &mut chart,
            (x - 0.19, measured),
            4,
            format!("{measured:.1}"),
        )?;
        let predicted = mib(r.predicted_peak);
        let bar = [(x + 0.02, 0.0), (x + 0.36, predicted)];
        chart.draw_series([Rectangle::new(bar, PREDICTED.mix(0.12).filled())])?;
        chart.draw_series([Rectangle::new(bar, PREDICTED.stroke_width(2))])?;
        value_label(
            &mut chart,
            (x + 0.19, predicted),
            4,
            format!("{predicted:.1}"),
        )?;
    }
    draw_config_labels(area, &chart, labels)?;
    let mut entries = vec![
        LegendEntry::new("measured peak", Swatch::Line(BLACK)),
        LegendEntry::new("predicted peak", Swatch::Outline(PREDICTED)),
    ];
    for &c in present.iter().rev() {
        entries.push(LegendEntry::new(
            category_label(c),
            Swatch::Fill(category_color(c)),
        ));
    }
    let top = chart.plotting_area().get_pixel_range().1.start;
    draw_legend(&legend, legend_top(&legend, top), &entries)
}

fn draw_speed(area: &Area, rows: &[Row], labels: &[Vec<String>], label_height: u32) -> DrawResult {
    let top = rows.iter().map(|r| r.tokens_per_s).fold(0.0, f64::max);
    let (plot, legend) = area.split_horizontally(WIDTH - LEGEND_WIDTH);
    // Room above the bars for two lines of value label.
    let y = 0.0..(top * 1.25).max(1.0);
    let mut chart = build_chart(&plot, "throughput (tokens/s)", rows.len(), y, label_height)?;
    let color = PALETTE[0];
    for (i, r) in rows.iter().enumerate() {
        let x = i as f64;
        let bar = [(x - 0.3, 0.0), (x + 0.3, r.tokens_per_s)];
        chart.draw_series([Rectangle::new(bar, color.mix(0.85).filled())])?;
        let steps = format!("{:.2} steps/s", r.steps_per_s);
        value_label(&mut chart, (x, r.tokens_per_s), 4, steps)?;
        let tokens = format!("{:.0} tok/s", r.tokens_per_s);
        value_label(&mut chart, (x, r.tokens_per_s), 22, tokens)?;
    }
    draw_config_labels(area, &chart, labels)?;
    let entries = [LegendEntry::new("tokens/s", Swatch::Fill(color))];
    let top = chart.plotting_area().get_pixel_range().1.start;
    draw_legend(&legend, legend_top(&legend, top), &entries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::Categories;

    fn row(config: &str, peak_mib: u64, tokens_per_s: f64) -> Row {
        Row {
            config: config.into(),
            micro_batch: 4,
            accum_steps: 8,
            effective_batch: 32,
            measured_peak: peak_mib << 20,
            largest_category: "activations".into(),
            measured_ledger: Categories {
                activations: (peak_mib - 1) << 20,
                parameters: 1 << 20,
                ..Categories::default()
            },
            predicted_peak: (peak_mib - 1) << 20,
            tokens_per_s,
            steps_per_s: 1.5,
            train_loss: 2.0,
            command: Vec::new(),
            recording: None,
            val_loss: None,
        }
    }

    #[test]
    fn every_configuration_gets_its_label_and_values() {
        let rows = [
            row("B=32,K=1", 17, 21000.0),
            row("B=4,K=8,offload,bf16", 7, 9000.0),
        ];
        let svg = render_compare_svg(&rows, "compare").unwrap();
        // plotters writes each text's content on a line of its own.
        let has = |text: &str| svg.lines().any(|l| l.trim() == text);
        for text in [
            "B=32,K=1",
            "17.0",
            "16.0",
            "7.0",
            "21000 tok/s",
            "9000 tok/s",
            "B·K = 32",
        ] {
            assert!(has(text), "{text} missing");
        }
    }
}
