//! Steering a run from another process: controls as JSON lines appended to a file
//! (`run --controls-from FILE`), one per line in the timeline's form, e.g.
//! `{"kind": "set_accum_steps", "value": 8}`. The screen of `run --ranks N` writes its keys'
//! controls there for rank 0, which shares them with every rank at the next boundary; a script
//! can steer a headless run the same way.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;

use crate::telemetry::{Control, ControlMsg, Origin};

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

    /// One control, as one whole line.
    pub fn send(&mut self, control: &Control) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(control)?;
        line.push(b'\n');
        self.file.write_all(&line)
    }
}

/// Reads the controls appended to `path` from a thread of its own and sends each to the trainer
/// as a key's. A line that is not a control is reported on stderr with its number and skipped.
/// Ends when the trainer is gone.
pub fn follow(path: &Path, trainer: UnboundedSender<ControlMsg>) -> std::io::Result<()> {
    let file = std::fs::File::open(path)?;
    let name = path.display().to_string();
    std::thread::Builder::new()
        .name("gaccwb-controls".into())
        .spawn(move || read_lines(std::io::BufReader::new(file), &name, &trainer))?;
    Ok(())
}

fn read_lines(mut reader: impl BufRead, name: &str, trainer: &UnboundedSender<ControlMsg>) {
    let (mut pending, mut number) = (String::new(), 0usize);
    loop {
        match reader.read_line(&mut pending) {
            Ok(0) | Err(_) if trainer.is_closed() => return,
            Ok(_) if pending.ends_with('\n') => {
                number += 1;
                let line = std::mem::take(&mut pending);
                match serde_json::from_str::<Control>(line.trim()) {
                    Ok(control) => {
                        let msg = ControlMsg {
                            control,
                            origin: Origin::Key,
                        };
                        if trainer.send(msg).is_err() {
                            return;
                        }
                    }
                    Err(e) if line.trim().is_empty() => drop(e),
                    Err(e) => crate::out::note(&format!(
                        "gaccwb: {name}:{number}: not a control, skipped ({e}); write one JSON \
                         object per line, e.g. {{\"kind\": \"set_accum_steps\", \"value\": 8}}"
                    )),
                }
            }
            // Nothing new, or half a line: wait for the rest.
            _ => std::thread::sleep(POLL),
        }
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
        follow(&path, tx).unwrap();
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
