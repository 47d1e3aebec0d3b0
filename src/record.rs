//! Session recordings: the event stream as JSON Lines, header first.
//!
//! The writer flushes at least once a second, so a crash or `kill -9` loses at most the last
//! second and leaves a file whose only possible defect is a truncated last line.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::telemetry::Event;

const FLUSH_EVERY: Duration = Duration::from_secs(1);

pub struct Recorder {
    path: PathBuf,
    out: BufWriter<File>,
    last_flush: Instant,
}

impl Recorder {
    /// Create (or truncate) `path`.
    pub fn create(path: &Path) -> anyhow::Result<Recorder> {
        let file = File::create(path)
            .with_context(|| format!("cannot create recording {}", path.display()))?;
        Ok(Recorder {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
            last_flush: Instant::now(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(&mut self, event: &Event) -> anyhow::Result<()> {
        serde_json::to_writer(&mut self.out, event)?;
        self.out.write_all(b"\n")?;
        if self.last_flush.elapsed() >= FLUSH_EVERY {
            self.flush()?;
        }
        Ok(())
    }

    /// Push buffered lines to the OS (they survive a crash of this process from here on).
    pub fn flush(&mut self) -> anyhow::Result<()> {
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))?;
        self.last_flush = Instant::now();
        Ok(())
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// A recording read back: the header, then every event in order (the header included).
pub struct Recording {
    pub header: crate::telemetry::Header,
    pub events: Vec<Event>,
    /// Problems that did not stop reading (e.g. a truncated last line).
    pub warnings: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    #[error("{path}:{line}: {message}")]
    Line {
        path: String,
        line: usize,
        message: String,
    },
}

/// Read a recording. A truncated last line is tolerated with a warning; a bad line elsewhere is
/// an error naming its line; a newer major version is refused.
pub fn read_recording(path: &Path) -> Result<Recording, RecordError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| RecordError::Io {
        path: p.clone(),
        message: e.to_string(),
    })?;
    let lines: Vec<&str> = text.lines().collect();
    let ends_with_newline = text.ends_with('\n');
    let mut events = Vec::with_capacity(lines.len());
    let mut warnings = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Event>(line) {
            Ok(e) => events.push(e),
            Err(e) if i + 1 == lines.len() && !ends_with_newline => {
                warnings.push(format!(
                    "{p}:{}: last line is truncated and was skipped ({e})",
                    i + 1
                ));
            }
            Err(e) => {
                return Err(RecordError::Line {
                    path: p,
                    line: i + 1,
                    message: e.to_string(),
                })
            }
        }
    }
    let header = match events.first() {
        Some(Event::Header(h)) => h.clone(),
        _ => {
            return Err(RecordError::Line {
                path: p,
                line: 1,
                message: "the first line must be the header event".into(),
            })
        }
    };
    if header.version > crate::telemetry::FORMAT_VERSION {
        return Err(RecordError::Line {
            path: p,
            line: 1,
            message: format!(
                "recording format version {} is newer than this gaccwb reads ({}); upgrade gaccwb",
                header.version,
                crate::telemetry::FORMAT_VERSION
            ),
        });
    }
    Ok(Recording {
        header,
        events,
        warnings,
    })
}
