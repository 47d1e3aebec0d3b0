//! Memory over time: NVML used/total on CUDA; the counting allocator's live and peak bytes on
//! the CPU (labelled as such). Applied controls are marked.

use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::text::Line;
use ratatui::Frame;

use super::{block, draw_chart, fmt_bytes, placeholder, ChartSpec, Series, Theme, Units};
use crate::memory::StepFigure;
use crate::telemetry::MemorySource;
use crate::tui::app::{App, PaneId};

fn source_label(source: MemorySource, cpu: bool) -> &'static str {
    match source {
        MemorySource::Nvml => "NVML",
        MemorySource::CudaPool => "CUDA pool",
        MemorySource::Allocator if cpu => "allocator (CPU)",
        MemorySource::Allocator => "allocator (host)",
    }
}

/// Sampled device memory: one series per GPU source (NVML used, CUDA pool), titled by the first.
fn gpu_series(app: &App, theme: Theme) -> Option<(String, Vec<Series>)> {
    let end = app.view_end() as f64;
    let sources = [MemorySource::Nvml, MemorySource::CudaPool];
    let colors = [Color::Green, Color::Blue];
    let mut series = Vec::new();
    let mut title = None;
    for (source, color) in sources.into_iter().zip(colors) {
        let points: Vec<(f64, f64)> = app
            .run
            .device
            .iter()
            .filter(|d| d.source == source && d.x <= end)
            .map(|d| (d.x, d.used as f64))
            .collect();
        if points.is_empty() {
            continue;
        }
        let last = app.run.device.iter().rev().find(|d| d.source == source)?;
        let label = source_label(source, false);
        let figure = match last.total {
            Some(t) => format!("{} / {}", fmt_bytes(last.used), fmt_bytes(t)),
            None => fmt_bytes(last.used),
        };
        title.get_or_insert(format!(" Device memory · {label} {figure} "));
        series.push(Series {
            name: format!("{label} used"),
            points,
            style: theme.fg(color),
            scatter: false,
        });
    }
    title.map(|t| (t, series))
}

/// Per-step live and peak bytes from the trainer's measured ledger (the allocator on the CPU).
fn step_series(app: &App, theme: Theme) -> (String, Vec<Series>) {
    let end = app.view_end() as f64;
    let label = app
        .run
        .memory_source
        .map(|s| source_label(s, app.is_cpu()))
        .unwrap_or("");
    let last = app.run.memory.back();
    let live_name = last.map_or("live".into(), |p| format!("live {}", fmt_bytes(p.live)));
    let peak_name = last.map_or("peak".into(), |p| format!("peak {}", fmt_bytes(p.peak)));
    let pick = |f: fn(&StepFigure) -> u64| -> Vec<(f64, f64)> {
        app.run
            .memory
            .iter()
            .filter(|p| p.step as f64 <= end)
            .map(|p| (p.step as f64, f(p) as f64))
            .collect()
    };
    let series = vec![
        Series {
            name: live_name,
            points: pick(|p| p.live),
            style: theme.fg(Color::Green),
            scatter: false,
        },
        Series {
            name: peak_name,
            points: pick(|p| p.peak),
            style: theme.fg(Color::Red),
            scatter: false,
        },
    ];
    (format!(" Memory · {label} "), series)
}

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    let (title, series) = gpu_series(app, theme).unwrap_or_else(|| step_series(app, theme));
    let mut block = block(title, app, PaneId::DeviceMemory, theme);
    let has_data = series.iter().any(|s| !s.points.is_empty());
    if let Some(reason) = &app.run.device_unavailable {
        if !has_data {
            return placeholder(frame, area, block, reason, theme);
        }
        block = block.title_bottom(Line::styled(format!(" {reason} "), theme.warn()));
    }
    if !has_data {
        return placeholder(frame, area, block, "no memory data yet", theme);
    }
    let spec = ChartSpec {
        series: &series,
        from_zero: true,
        units: Units::Bytes,
        scalable: true,
    };
    draw_chart(frame, area, block, app, spec, theme);
}
