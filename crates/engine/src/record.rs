//! Session recordings: the event stream as JSON Lines, header first.
//!
//! Line 1 is `Event::Header` (format version, the scenario, device, build); every later line is
//! one `Event` exactly as the UI received it, applied controls included (`Event::Control` carries
//! its origin). `telemetry::FORMAT_VERSION` is the major version: additive changes (a new field
//! with a default, a new event type, control kind, origin or end reason) keep it, and a reader
//! skips, with one warning, the events holding names it does not know; it refuses a file with a
//! newer major version.
//!
//! The writer pushes every step-level event to the OS at once and samples at least once a second,
//! so `kill -9` loses at most the last second and leaves a file whose only possible defect is a
//! truncated last line, which the reader tolerates.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::telemetry::{Event, EventKind, Header, FORMAT_VERSION};

mod tail;

const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Whether this build knows an event type; a same-major file may hold others (skipped with a
/// warning). The names are serde's tags, the variants' snake_case names.
fn is_known_type(name: &str) -> bool {
    use strum::VariantArray;
    EventKind::VARIANTS
        .iter()
        .any(|k| <&'static str>::from(k) == name)
}

/// Writes the event stream to a JSON Lines file, header first, flushing steps at once and samples within a second.
pub struct Recorder {
    path: PathBuf,
    out: BufWriter<File>,
    last_flush: Instant,
    /// Events that arrived before the header (the device sampler can beat the trainer); they
    /// are written right after it so the header is always line 1.
    before_header: Option<Vec<Event>>,
    /// With `create_replacing`: the temporary file written, renamed over `path` when done.
    replacing: Option<Box<crate::safe_write::Pending>>,
    /// A write failed (a full disk): the recording is incomplete and never replaces a file.
    failed: bool,
}

impl Recorder {
    /// Create `path`; an existing file is never truncated (an error says so).
    pub fn create(path: &Path) -> Result<Recorder, RecordError> {
        let file = crate::safe_write::create_new(path, "recording")?;
        Ok(Recorder::writing(path, file, None))
    }

    /// Replace `path` (`--force`, as `rules` allow): the events go to a temporary file beside it
    /// that takes the name when the recording is finished, so the old file stays whole until then.
    pub fn create_replacing(
        path: &Path,
        rules: &crate::safe_write::Overwrite,
    ) -> Result<Recorder, RecordError> {
        let mut pending = crate::safe_write::Pending::begin(path, "recording", rules)?;
        let file = pending
            .file()
            .try_clone()
            .map_err(|err| RecordError::Write {
                path: path.to_path_buf(),
                err,
            })?;
        Ok(Recorder::writing(path, file, Some(Box::new(pending))))
    }

    fn writing(
        path: &Path,
        file: File,
        replacing: Option<Box<crate::safe_write::Pending>>,
    ) -> Recorder {
        Recorder {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
            last_flush: Instant::now(),
            before_header: Some(Vec::new()),
            replacing,
            failed: false,
        }
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one event. Steps, controls and the run's start and end reach the OS at once;
    /// high-rate samples (memory, device) are batched for at most a second.
    pub fn write(&mut self, event: &Event) -> Result<(), RecordError> {
        if let Some(waiting) = &mut self.before_header {
            if !matches!(event, Event::Header(_)) {
                waiting.push(event.clone());
                return Ok(());
            }
            let waiting = self.before_header.take().unwrap_or_default();
            self.write_line(event)?;
            for e in &waiting {
                self.write_line(e)?;
            }
            return self.flush();
        }
        self.write_line(event)?;
        let sample = matches!(event, Event::Memory(_) | Event::Device(_));
        if !sample || self.last_flush.elapsed() >= FLUSH_EVERY {
            self.flush()?;
        }
        Ok(())
    }

    fn write_line(&mut self, event: &Event) -> Result<(), RecordError> {
        let written = match event {
            // The header names the process writing it: a follower checks it is still there.
            Event::Header(h) if h.writer.is_none() => {
                let mut h = h.clone();
                h.writer = Some(crate::telemetry::Writer::this_process());
                serde_json::to_writer(&mut self.out, &Event::Header(h))
            }
            _ => serde_json::to_writer(&mut self.out, event),
        };
        let written = written
            .map_err(std::io::Error::from)
            .and_then(|()| self.out.write_all(b"\n"));
        self.failed |= written.is_err();
        written.map_err(|err| RecordError::Write {
            path: self.path.clone(),
            err,
        })
    }

    /// Push buffered lines to the OS (they survive a crash of this process from here on).
    pub fn flush(&mut self) -> Result<(), RecordError> {
        let flushed = self.out.flush();
        self.failed |= flushed.is_err();
        flushed.map_err(|err| RecordError::Write {
            path: self.path.clone(),
            err,
        })?;
        self.last_flush = Instant::now();
        Ok(())
    }

    /// The recording is complete: flushed, and (with `create_replacing`) renamed over its target,
    /// which is checked again first. A recording that could not be written whole (a full disk)
    /// never replaces the old file: its temporary file is removed, the old file stays.
    pub fn finish(mut self) -> Result<PathBuf, RecordError> {
        self.flush()?;
        if self.failed {
            return Err(RecordError::Incomplete {
                path: self.path.clone(),
            });
        }
        if let Some(pending) = self.replacing.take() {
            pending.commit()?;
        }
        Ok(self.path.clone())
    }
}

impl Drop for Recorder {
    /// A recorder dropped without `finish` (an error ended the run first) flushes what it has;
    /// a replacement is abandoned (its temporary file removed), so the old file stays whole.
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// A recording read back: the header, then every event in order (the header included).
#[derive(Debug)]
pub struct Recording {
    /// The run's first line: scenario, device, build.
    pub header: Header,
    /// Every event in file order, the header included.
    pub events: Vec<Event>,
    /// Problems that did not stop reading (e.g. a truncated last line).
    pub warnings: Vec<String>,
}

/// Why a recording cannot be written or read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The recording's file could not be created or take its name (it exists, it is not a
    /// regular file, it is an input of the run, the OS refused).
    #[error(transparent)]
    File(#[from] crate::safe_write::WriteError),
    /// Writing an event failed (a full disk).
    #[error("writing {}", path.display())]
    Write {
        /// The recording's path.
        path: PathBuf,
        /// Why.
        #[source]
        err: std::io::Error,
    },
    /// A write failed earlier, so the recording is not whole; it replaced no file.
    #[error("{}: the recording could not be written whole; the file is left as it was", path.display())]
    Incomplete {
        /// The recording's path.
        path: PathBuf,
    },
    /// The file itself could not be read.
    #[error("{path}: {err}")]
    Io {
        /// The recording's path.
        path: String,
        /// Why.
        err: crate::limits::ReadError,
    },
    /// A recording being followed could not be opened or read further.
    #[error("{path}: {err}")]
    Follow {
        /// The recording's path.
        path: String,
        /// Why: not a regular file, too large, an I/O error.
        err: crate::limits::ReadError,
    },
    /// A recording being followed has a line longer than any event gaccwb writes.
    #[error("{path}:{line}: a line longer than {limit} bytes: not a recording gaccwb wrote")]
    LineTooLong {
        /// The recording's path.
        path: String,
        /// 1-based line number.
        line: usize,
        /// The longest line read.
        limit: usize,
    },
    /// A line that is not a valid event where one is needed.
    #[error("{path}:{line}: {problem}")]
    Line {
        /// The recording's path.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        problem: LineError,
    },
}

/// What is wrong with one line of a recording.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// Bytes that are not UTF-8.
    #[error("not UTF-8 text ({0})")]
    NotUtf8(std::str::Utf8Error),
    /// Text that is not JSON.
    #[error("not a JSON object: {0}")]
    NotJson(serde_json::Error),
    /// JSON without the `type` every event has.
    #[error("not an event: no \"type\" field")]
    NoType,
    /// An event of a known type whose fields do not read.
    #[error("bad {kind} event: {err}")]
    BadEvent {
        /// The event's type.
        kind: String,
        /// What serde said.
        err: serde_json::Error,
    },
    /// The first event is not the header.
    #[error("the first line must be the header event (\"type\": \"header\")")]
    NotHeader,
    /// The header has no version to check.
    #[error("the header has no numeric \"version\"")]
    NoVersion,
    /// Written by a newer gaccwb in a format this one cannot read.
    #[error(
        "recording format version {version} is newer than this gaccwb reads \
         ({FORMAT_VERSION}); upgrade gaccwb to replay it"
    )]
    NewerVersion {
        /// The recording's format version.
        version: u64,
    },
    /// The file ends inside its only line.
    #[error(
        "the header line is incomplete (the file was cut off while it was written), so \
         nothing can be read"
    )]
    IncompleteHeader,
    /// No line at all.
    #[error("the file is empty: no header line")]
    Empty,
}

/// Read a recording. A truncated last line is tolerated with a warning; a bad line elsewhere is
/// an error naming its line; a newer major version is refused.
pub fn read_recording(path: &Path) -> Result<Recording, RecordError> {
    let p = path.display().to_string();
    let limit = crate::limits::MAX_RECORDING_BYTES;
    let bytes =
        crate::limits::read_bounded(path, limit, "recording").map_err(|err| RecordError::Io {
            path: p.clone(),
            err,
        })?;
    parse_recording(&bytes, &p)
}

/// `read_recording` on bytes already in memory; `origin` names the file in messages.
pub fn parse_recording(bytes: &[u8], origin: &str) -> Result<Recording, RecordError> {
    let line_err = |line: usize, problem: LineError| RecordError::Line {
        path: origin.to_string(),
        line,
        problem,
    };
    let lines: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
    // `split` yields an empty tail after a final newline; a non-empty tail was cut short.
    let last = lines.len() - 1;
    let truncated_tail = !lines[last].is_empty();
    let mut events = Vec::with_capacity(lines.len());
    let mut warnings = Vec::new();
    let mut unknown_types = 0usize;
    for (i, raw) in lines.iter().enumerate() {
        let number = i + 1;
        let parsed = std::str::from_utf8(raw)
            .map_err(LineError::NotUtf8)
            .and_then(|text| parse_line(text, events.is_empty(), &mut unknown_types));
        match parsed {
            Ok(Some(event)) => {
                if events.is_empty() {
                    check_header(&event).map_err(|m| line_err(number, m))?;
                }
                events.push(event);
            }
            Ok(None) => {}
            Err(message) if i == last && truncated_tail => {
                warnings.push(format!(
                    "{origin}:{number}: the last line is incomplete (the run was cut off while \
                     writing it) and was skipped: {message}"
                ));
            }
            Err(message) => return Err(line_err(number, message)),
        }
    }
    if unknown_types > 0 {
        warnings.push(format!(
            "{origin}: skipped {unknown_types} event(s) or timeline entries holding names this \
             gaccwb does not know (an event type, control kind, origin…; written by a newer \
             version)"
        ));
    }
    let header = match events.first() {
        Some(Event::Header(h)) => h.clone(),
        _ if truncated_tail && last == 0 => return Err(line_err(1, LineError::IncompleteHeader)),
        _ => return Err(line_err(1, LineError::Empty)),
    };
    Ok(Recording {
        header,
        events,
        warnings,
    })
}

pub use tail::{Liveness, Tail};

/// One line: an event, nothing (blank line, unknown event type) or why it is not valid.
fn parse_line(text: &str, first: bool, unknown: &mut usize) -> Result<Option<Event>, LineError> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let mut value: serde_json::Value = serde_json::from_str(text).map_err(LineError::NotJson)?;
    migrate_estimate(&mut value);
    if first {
        check_version(&value)?;
    }
    let kind = value
        .get("type")
        .and_then(|t| t.as_str())
        .map(str::to_string);
    match kind.as_deref() {
        None => return Err(LineError::NoType),
        Some(k) if !is_known_type(k) => {
            *unknown += 1;
            return Ok(None);
        }
        Some(_) => {}
    }
    if first {
        drop_unknown_timeline_entries(&mut value, unknown);
    }
    match serde_json::from_value(value) {
        Ok(event) => Ok(Some(event)),
        // A name from a newer minor version (a control kind, an origin, a level): skipped like
        // an unknown event type. The header cannot be skipped.
        Err(e) if !first && e.to_string().starts_with("unknown variant") => {
            *unknown += 1;
            Ok(None)
        }
        Err(err) => Err(LineError::BadEvent {
            kind: kind.unwrap_or_else(|| "?".into()),
            err,
        }),
    }
}

/// The header's timeline without the entries whose control kind this version does not know
/// (counted with the skipped events); the rest of the scenario must be readable.
fn drop_unknown_timeline_entries(header: &mut serde_json::Value, unknown: &mut usize) {
    let Some(timeline) = header
        .pointer_mut("/config/timeline")
        .and_then(|t| t.as_array_mut())
    else {
        return;
    };
    let before = timeline.len();
    timeline.retain(|entry| {
        let control = entry.get("control").cloned().unwrap_or_default();
        match serde_json::from_value::<crate::control::Control>(control) {
            Err(e) => !e.to_string().starts_with("unknown variant"),
            Ok(_) => true,
        }
    });
    *unknown += before - timeline.len();
}

/// Recordings made before estimates had their own event type carried them as `memory` events
/// with `"source": "estimate"`: read those as the `estimate` events they are.
fn migrate_estimate(value: &mut serde_json::Value) {
    let legacy = value.get("type").and_then(|t| t.as_str()) == Some("memory")
        && value.get("source").and_then(|s| s.as_str()) == Some("estimate");
    if let (true, Some(object)) = (legacy, value.as_object_mut()) {
        object.insert("type".into(), "estimate".into());
        object.remove("source");
        object.remove("peak");
    }
}

/// Refuse a newer major version before trying to read the header's fields, which may differ.
fn check_version(value: &serde_json::Value) -> Result<(), LineError> {
    if value.get("type").and_then(|t| t.as_str()) != Some("header") {
        return Err(LineError::NotHeader);
    }
    let version = value
        .get("version")
        .and_then(|v| v.as_u64())
        .ok_or(LineError::NoVersion)?;
    if version > u64::from(FORMAT_VERSION) {
        return Err(LineError::NewerVersion { version });
    }
    Ok(())
}

fn check_header(first: &Event) -> Result<(), LineError> {
    match first {
        Event::Header(_) => Ok(()),
        _ => Err(LineError::NotHeader),
    }
}
