//! Writing to stdout and stderr without panicking. `println!` panics when the reader went away
//! (`gaccwb … | head`) or the disk is full (`> /dev/full`); these return an error instead, which
//! ends the program with exit code 1: quietly for a closed pipe, with one line otherwise.

use std::io::Write;

/// Standard output could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write to standard output: {0}")]
pub struct OutputError(pub std::io::Error);

impl From<std::io::Error> for OutputError {
    fn from(e: std::io::Error) -> OutputError {
        OutputError(e)
    }
}

impl OutputError {
    /// The reader went away: nothing to report, as `head` users expect.
    pub fn is_broken_pipe(&self) -> bool {
        self.0.kind() == std::io::ErrorKind::BrokenPipe
    }
}

/// `text` on stdout as it is, flushed.
pub fn print(text: &str) -> Result<(), OutputError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

/// `line` and a newline on stdout, flushed.
pub fn println(line: &str) -> Result<(), OutputError> {
    print(&format!("{line}\n"))
}

/// `line` and a newline on stderr. When stderr itself cannot be written there is nobody left
/// to tell, so the error is dropped.
pub fn note(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
