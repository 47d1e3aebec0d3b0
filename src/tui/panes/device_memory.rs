//! Memory over time: NVML used/total on CUDA; the counting allocator's live and peak bytes on
//! the CPU (labelled as such). Applied controls are marked.

use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::text::Line;
use ratatui::Frame;

use super::{block, draw_chart, fmt_bytes, placeholder, ChartSpec, Series, Theme};
use crate::telemetry::MemorySource;
use crate::tui::app::{App, PaneId};

fn fmt_axis_bytes(v: f64) -> String {
    fmt_bytes(v.max(0.0) as u64)
}

pub fn render(frame: &mut Frame, area: Rect, app: &App, theme: Theme) {
    let end = app.view_end() as f64;
    let nvml = !app.device.is_empty();
    let (title, series) = if nvml {
        let total = app.device.back().and_then(|d| d.total);
        let used = app.device.back().map(|d| d.used).unwrap_or(0);
        let title = match total {
            Some(t) => format!(
                " Device memory · NVML {} / {} ",
                fmt_bytes(used),
                fmt_bytes(t)
            ),
            None => format!(" Device memory · NVML {} ", fmt_bytes(used)),
        };
        let used: Vec<(f64, f64)> = app
            .device
            .iter()
            .filter(|d| d.x <= end)
            .map(|d| (d.x, d.used as f64))
            .collect();
        let series = vec![Series {
            name: "NVML used".into(),
            points: used,
            style: theme.fg(Color::Green),
            scatter: false,
        }];
        (title, series)
    } else {
        let label = match app.memory_source {
            Some(MemorySource::Allocator) if app.is_cpu() => "allocator (CPU)",
            Some(MemorySource::Allocator) => "allocator (host)",
            Some(MemorySource::CudaPool) => "CUDA pool",
            Some(MemorySource::Nvml) => "NVML",
            _ => "",
        };
        let title = format!(" Memory · {label} ");
        let last = app.memory.back();
        let live_name = last.map_or("live".into(), |p| format!("live {}", fmt_bytes(p.live)));
        let peak_name = last.map_or("peak".into(), |p| format!("peak {}", fmt_bytes(p.peak)));
        let pick = |f: fn(&crate::tui::app::MemPoint) -> u64| -> Vec<(f64, f64)> {
            app.memory
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
        (title, series)
    };
    let mut block = block(title, app, PaneId::DeviceMemory, theme);
    let has_data = series.iter().any(|s| !s.points.is_empty());
    if let Some(reason) = &app.device_unavailable {
        if !has_data {
            return placeholder(frame, area, block, reason, theme);
        }
        block = block.title_bottom(Line::styled(format!(" {reason} "), theme.warn()));
    }
    if !has_data {
        return placeholder(frame, area, block, "no memory data yet", theme);
    }
    let (lo, hi) =
        super::y_range(series.iter().flat_map(|s| s.points.iter())).unwrap_or((0.0, 1.0));
    let y = super::nice_bounds(lo.min(0.0), hi);
    let spec = ChartSpec {
        series: &series,
        y_fixed: Some(y),
        y_fmt: fmt_axis_bytes,
    };
    draw_chart(frame, area, block, app, spec, theme);
}
