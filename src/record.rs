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
