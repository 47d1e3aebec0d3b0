//! Steering a run from another process: controls as JSON lines appended to a file
//! (`run --controls-from FILE`), one per line in the timeline's form, e.g.
//! `{"kind": "set_accum_steps", "value": 8}`. The screen of `run --ranks N` writes its keys'
//! controls there for rank 0, which shares them with every rank at the next boundary; a script
//! can steer a headless run the same way.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;

use crate::limits::{GrowingFile, ReadError};

use crate::control::{Control, ControlMsg, Origin};

/// How often the file is read for new lines.
const POLL: Duration = Duration::from_millis(100);

/// Appends controls to the file a run reads them from.
pub struct ControlWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl ControlWriter {
    /// Creates `path`, which must not exist yet (it is the writer's own file).
    pub fn create(path: &Path) -> std::io::Result<ControlWriter> {
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(path)?;
        Ok(ControlWriter {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A second writer to the same file (its name may be gone: the file stays open).
    pub fn try_clone(&self) -> std::io::Result<ControlWriter> {
        Ok(ControlWriter {
            path: self.path.clone(),
            file: self.file.try_clone()?,
        })
    }

    /// One control, as one whole line.
    pub fn send(&mut self, control: &Control) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(control)?;
        line.push(b'\n');
        self.file.write_all(&line)
    }
}

/// The longest control line read (a control is a few dozen bytes).
const MAX_LINE: usize = 64 << 10;

/// A file of controls, opened and checked before the run starts: a regular file (a FIFO, a
/// device or a directory is refused at once, never waited on).
pub struct ControlReader {
    file: GrowingFile,
    name: String,
}

impl ControlReader {
    pub fn open(path: &Path) -> Result<ControlReader, ReadError> {
        let file = GrowingFile::open(path, "controls file", MAX_LINE, u64::MAX)?;
        Ok(ControlReader {
            file,
            name: path.display().to_string(),
        })
    }

    /// Reads the controls appended to the file from a thread of its own and sends each to the
    /// trainer as a key's. A line that is not a control (not JSON, not UTF-8, longer than 64
    /// KiB) and a control no headless run can take (`pause`, `single_step`: nothing could
    /// resume it) are reported on stderr with the line's number and skipped. Ends when the
    /// trainer is gone.
    pub fn follow(self, trainer: UnboundedSender<ControlMsg>) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name("gaccwb-controls".into())
            .spawn(move || self.read_lines(&trainer))?;
        Ok(())
    }

    fn read_lines(mut self, trainer: &UnboundedSender<ControlMsg>) {
        while !trainer.is_closed() {
            let found = match self.file.poll() {
                Ok(found) => found,
                Err(e) => {
                    crate::out::note(&format!(
                        "gaccwb: {}: {e}; no more controls are read from it",
                        self.name
                    ));
                    return;
                }
            };
            for number in &found.too_long {
                self.skip(*number, "a line longer than 64 KiB");
            }
            for (number, line) in found.lines {
                let Some(control) = self.control(number, &line) else {
                    continue;
                };
                let msg = ControlMsg {
                    control,
                    origin: Origin::Key,
                };
                if trainer.send(msg).is_err() {
                    return;
                }
            }
            if !found.more {
                std::thread::sleep(POLL);
            }
        }
    }

    /// The control on line `number`, or `None` (reported) when it holds none a run can take.
    fn control(&self, number: usize, line: &[u8]) -> Option<Control> {
        let Ok(text) = std::str::from_utf8(line) else {
            self.skip(number, "not UTF-8 text");
            return None;
        };
        if text.trim().is_empty() {
            return None;
        }
        match serde_json::from_str::<Control>(text.trim()) {
            Ok(Control::Pause | Control::SingleStep) => {
                self.skip(
                    number,
                    "a headless run has no screen to resume a pause from; steer it with \
                     stop or the knobs",
                );
                None
            }
            Ok(control) => Some(control),
            Err(e) => {
                self.skip(
                    number,
                    &format!(
                        "not a control ({e}); write one JSON object per line, e.g. \
                         {{\"kind\": \"set_accum_steps\", \"value\": 8}}"
                    ),
                );
                None
            }
        }
    }

    fn skip(&self, number: usize, why: &str) {
        crate::out::note(&format!("gaccwb: {}:{number}: skipped: {why}", self.name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_controls_arrive_in_order_and_bad_lines_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("controls.jsonl");
        let mut w = ControlWriter::create(&path).unwrap();
        assert!(
            ControlWriter::create(&path).is_err(),
            "an existing file is not ours"
        );
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        ControlReader::open(&path).unwrap().follow(tx).unwrap();
        w.send(&Control::SetAccumSteps { value: 4 }).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"not json\n")
            .unwrap();
        w.send(&Control::SetClip { value: None }).unwrap();
        let first = rx.blocking_recv().unwrap();
        let second = rx.blocking_recv().unwrap();
        assert_eq!(first.control, Control::SetAccumSteps { value: 4 });
        assert_eq!(second.control, Control::SetClip { value: None });
        assert_eq!(second.origin, Origin::Key);
    }
}
