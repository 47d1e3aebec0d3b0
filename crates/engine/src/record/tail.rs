//! A recording that may still be growing (a headless run's, a rank's), read as it is written.
//!
//! Reads are bounded ([`GrowingFile`]: a regular file only, a chunk per poll, a line cap, the
//! recording cap in all), and the follower checks that the writer is still there: the header
//! names the writing process and its host ([`crate::telemetry::Writer`]); on the same host, a
//! writer that exited or closed the file without an `end` event ends the follow
//! ([`Liveness::Gone`]). A writer that cannot be checked (another host, an older recording)
//! counts as gone after [`SILENCE`] without a new byte.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{check_header, parse_line, LineError, RecordError};
use crate::limits::growing::GrowingFile;
use crate::telemetry::{Event, Writer};

/// The longest line a follower reads (a header with a long timeline is a few hundred KiB).
const MAX_LINE: usize = 64 << 20;

/// How long a writer that cannot be checked may write nothing before the follow ends.
pub(super) const SILENCE: Duration = Duration::from_secs(60);

/// Whether the process writing a followed recording is still there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// It is writing, or may be.
    Writing,
    /// It is gone, and why.
    Gone(String),
}

/// A recording read as it grows: each [`Tail::poll`] returns the events of the complete lines
/// written since the last one.
pub struct Tail {
    path: String,
    file: GrowingFile,
    /// The file actually read: the target, or a replacement still being written beside it.
    reading: PathBuf,
    /// Lines read so far (for messages) and events among them.
    unknown: usize,
    events: usize,
    /// The header's writer, once read.
    writer: Option<Writer>,
    /// When the last new byte arrived.
    last_news: Instant,
    /// Bytes seen so far, to tell news from nothing.
    size: u64,
}

impl Tail {
    /// Follow `path` from its first line. When `--force` is replacing it, the replacement being
    /// written beside it (`.NAME.PID.tmp`) is followed: the new run, not the old file.
    pub fn open(path: &Path) -> Result<Tail, RecordError> {
        let p = path.display().to_string();
        let reading =
            crate::safe_write::replacement_in_progress(path).unwrap_or_else(|| path.to_path_buf());
        let limit = crate::limits::MAX_RECORDING_BYTES;
        let file = GrowingFile::open(&reading, "recording", MAX_LINE, limit).map_err(|err| {
            RecordError::Follow {
                path: p.clone(),
                err,
            }
        })?;
        Ok(Tail {
            path: p,
            file,
            reading,
            unknown: 0,
            events: 0,
            writer: None,
            last_news: Instant::now(),
            size: 0,
        })
    }

    /// The file being read (the replacement in progress, when there is one).
    pub fn reading(&self) -> &Path {
        &self.reading
    }

    /// The events of the lines completed since the last call (none if nothing new). A bad
    /// complete line is an error naming it, as in [`super::read_recording`].
    pub fn poll(&mut self) -> Result<Vec<Event>, RecordError> {
        let mut events = Vec::new();
        loop {
            let found = self.file.poll().map_err(|err| RecordError::Follow {
                path: self.path.clone(),
                err,
            })?;
            if let Some(&line) = found.too_long.first() {
                return Err(RecordError::LineTooLong {
                    path: self.path.clone(),
                    line,
                    limit: MAX_LINE,
                });
            }
            for (number, raw) in found.lines {
                if let Some(event) = self.event(number, &raw)? {
                    events.push(event);
                }
            }
            if !found.more {
                break;
            }
        }
        let size = self.file.file().metadata().map(|m| m.len()).unwrap_or(0);
        if size != self.size || !events.is_empty() {
            self.size = size;
            self.last_news = Instant::now();
        }
        Ok(events)
    }

    fn event(&mut self, number: usize, raw: &[u8]) -> Result<Option<Event>, RecordError> {
        let first = self.events == 0;
        let parsed = std::str::from_utf8(raw)
            .map_err(LineError::NotUtf8)
            .and_then(|text| parse_line(text, first, &mut self.unknown))
            .and_then(|e| match (&e, first) {
                (Some(event), true) => check_header(event).map(|()| e),
                _ => Ok(e),
            });
        match parsed {
            Ok(Some(event)) => {
                if let Event::Header(h) = &event {
                    self.writer = h.writer.clone();
                }
                self.events += 1;
                Ok(Some(event))
            }
            Ok(None) => Ok(None),
            Err(problem) => Err(RecordError::Line {
                path: self.path.clone(),
                line: number,
                problem,
            }),
        }
    }

    /// Whether the writer is still there. Ask when a poll found nothing new, then poll once
    /// more before believing [`Liveness::Gone`]: a writer that ended wrote its last line first.
    pub fn liveness(&self) -> Liveness {
        let silent = self.last_news.elapsed();
        let here = crate::telemetry::host_name();
        match &self.writer {
            Some(w) if w.host == here => self.writer_here(w.pid),
            _ if silent > SILENCE => Liveness::Gone(format!(
                "nothing was written to it for {} s and its writer cannot be checked from this \
                 host{}",
                SILENCE.as_secs(),
                self.writer
                    .as_ref()
                    .map(|w| format!(" (pid {} on {})", w.pid, w.host))
                    .unwrap_or_default()
            )),
            _ => Liveness::Writing,
        }
    }

    /// A writer on this host: alive and holding the file open.
    fn writer_here(&self, pid: u32) -> Liveness {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return match std::path::Path::new(&format!("/proc/{pid}")).exists() {
                // Alive but not ours to look into: it may be writing.
                true => Liveness::Writing,
                false => Liveness::Gone(format!("its writer (pid {pid}) has exited")),
            };
        };
        let Ok(ours) = self.file.file().metadata() else {
            return Liveness::Writing;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::metadata(fd.path())
                .is_ok_and(|m| m.dev() == ours.dev() && m.ino() == ours.ino())
        });
        match holds {
            true => Liveness::Writing,
            false => Liveness::Gone(format!("its writer (pid {pid}) closed it")),
        }
    }
}
