//! `gaccwb export`: a recording as CSV files, an SVG chart or an asciinema cast.

use std::path::PathBuf;

use clap::Args;

use gaccwb::export::cast::{write_cast, CastOptions};
use gaccwb::record::read_recording;
use gaccwb::safe_write::{Inputs, Overwrite};
use gaccwb::{export, headless};

#[derive(Args)]
pub struct ExportArgs {
    /// A recording made with --record.
    file: PathBuf,
    /// csv: a directory of steps.csv, memory.csv, controls.csv, evals.csv; svg: one chart file.
    #[arg(long = "to", value_enum)]
    format: ExportFormat,
    /// Output directory (csv) or file (svg, cast).
    #[arg(short = 'o', long = "out", value_name = "OUT")]
    out: PathBuf,
    /// cast: screen size, COLSxROWS.
    #[arg(long, default_value = "120x40", value_parser = parse_size)]
    size: (u16, u16),
    /// svg: the y scale of the loss and gradient-norm panels (robust: within Tukey's far-out
    /// fences, a spike drawn at the edge).
    #[arg(long, value_enum, default_value = "linear")]
    scale: Scale,
    /// cast: time runs this many times faster than the recorded step times.
    #[arg(long, default_value_t = 1.0, value_parser = super::speed)]
    speed: f64,
    /// Replace existing output files (by default they are refused).
    #[arg(long)]
    force: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ExportFormat {
    Csv,
    Svg,
    /// asciinema v2 recording of the replayed screen.
    Cast,
}

/// The largest cast screen, each side: every frame is drawn into a buffer of that many cells.
const MAX_CAST_SIDE: u16 = 1000;

#[derive(Clone, Copy, clap::ValueEnum)]
enum Scale {
    Linear,
    Robust,
    Log,
}

impl From<Scale> for gaccwb::tui::app::YScale {
    fn from(s: Scale) -> Self {
        match s {
            Scale::Linear => Self::Linear,
            Scale::Robust => Self::Robust,
            Scale::Log => Self::Log,
        }
    }
}

fn parse_size(s: &str) -> Result<(u16, u16), String> {
    let bad = || {
        format!(
            "bad size `{s}`: expected COLSxROWS, from 80x24 to {MAX_CAST_SIDE}x{MAX_CAST_SIDE}, \
             e.g. 120x40"
        )
    };
    let (w, h) = s.split_once('x').ok_or_else(bad)?;
    let (w, h): (u16, u16) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
    if w < 80 || h < 24 || w > MAX_CAST_SIDE || h > MAX_CAST_SIDE {
        return Err(bad());
    }
    Ok((w, h))
}

impl ExportArgs {
    /// The files export reads: the recording, which no output may replace.
    pub(super) fn inputs(&self) -> Inputs {
        super::inputs::recording(&self.file, None)
    }
}

pub fn export(args: ExportArgs) -> anyhow::Result<()> {
    let recording = read_recording(&args.file)?;
    for w in &recording.warnings {
        gaccwb::out::note(&format!("gaccwb: warning: {}", headless::strip(w)));
    }
    let rules = &Overwrite::new(args.force, args.inputs());
    match args.format {
        ExportFormat::Csv => {
            for path in export::csv::write_csv(&recording, &args.out, rules)? {
                gaccwb::out::println(&path.display().to_string())?;
            }
        }
        ExportFormat::Svg => {
            export::svg::write_svg(&recording, args.scale.into(), &args.out, rules)?;
            gaccwb::out::println(&args.out.display().to_string())?;
        }
        ExportFormat::Cast => {
            gaccwb::safe_write::check(&args.out, "cast", rules)?;
            let mut out = Vec::new();
            let opts = CastOptions {
                width: args.size.0,
                height: args.size.1,
                speed: args.speed,
                ..CastOptions::default()
            };
            let stats = write_cast(&recording.events, &mut out, &opts)?;
            gaccwb::safe_write::write_file(&args.out, &out, "cast", rules)?;
            gaccwb::out::note(&format!(
                "wrote {}: {} frames, {} control markers, {:.1} s",
                args.out.display(),
                stats.frames,
                stats.markers,
                stats.duration_s
            ));
        }
    }
    Ok(())
}
