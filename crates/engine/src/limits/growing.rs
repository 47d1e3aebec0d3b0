//! A user-given file read as it grows, one complete line at a time, with bounds: the file a
//! run reads its controls from (`--controls-from`) and a recording being followed
//! (`replay --follow`). It must be a regular file (a FIFO or a device is refused when opened,
//! never waited on), each call reads at most a chunk, a line longer than its limit is reported
//! and skipped, and the whole is capped.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::ReadError;

/// Bytes one [`GrowingFile::poll`] reads at most: a fast writer never holds the reader.
const CHUNK: usize = 1 << 20;

/// What one poll found.
#[derive(Debug, Default)]
pub struct Lines {
    /// The complete lines, without their newline, each with its 1-based number.
    pub lines: Vec<(usize, Vec<u8>)>,
    /// Lines longer than the limit, skipped: their numbers.
    pub too_long: Vec<usize>,
    /// Whether the file may hold more than was read (a full chunk came back).
    pub more: bool,
}

/// A regular file read line by line as it grows.
#[derive(Debug)]
pub struct GrowingFile {
    file: File,
    what: String,
    /// Bytes after the last newline: a line still being written.
    partial: Vec<u8>,
    /// The partial line passed the limit: its bytes are dropped up to its newline.
    skipping: bool,
    /// Complete lines read so far.
    lines: usize,
    /// Bytes read so far.
    read: u64,
    line_limit: usize,
    total_limit: u64,
}

impl GrowingFile {
    /// Open `path` (the `what`, for messages) to follow: a regular file, opened without
    /// blocking; lines of at most `line_limit` bytes, `total_limit` bytes in all.
    pub fn open(
        path: &Path,
        what: &str,
        line_limit: usize,
        total_limit: u64,
    ) -> Result<GrowingFile, ReadError> {
        let file = super::open_input(path, what)?;
        Ok(GrowingFile {
            file,
            what: what.to_string(),
            partial: Vec::new(),
            skipping: false,
            lines: 0,
            read: 0,
            line_limit,
            total_limit,
        })
    }

    /// The file being read.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The complete lines written since the last call (at most a chunk's worth).
    pub fn poll(&mut self) -> Result<Lines, ReadError> {
        let mut chunk = vec![0u8; CHUNK];
        let n = loop {
            match self.file.read(&mut chunk) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(err) => {
                    return Err(ReadError::Io {
                        what: self.what.clone(),
                        err,
                    })
                }
            }
        };
        self.read += n as u64;
        if self.read > self.total_limit {
            return Err(ReadError::TooLarge {
                what: self.what.clone(),
                size: self.read,
                limit: self.total_limit,
            });
        }
        let mut found = Lines {
            more: n == CHUNK,
            ..Lines::default()
        };
        for piece in chunk[..n].split_inclusive(|&b| b == b'\n') {
            let complete = piece.last() == Some(&b'\n');
            let body = piece.strip_suffix(b"\n").unwrap_or(piece);
            if !self.skipping {
                self.partial.extend_from_slice(body);
                if self.partial.len() > self.line_limit {
                    self.partial = Vec::new();
                    self.skipping = true;
                }
            }
            if complete {
                self.lines += 1;
                match std::mem::take(&mut self.skipping) {
                    true => found.too_long.push(self.lines),
                    false => found
                        .lines
                        .push((self.lines, std::mem::take(&mut self.partial))),
                }
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn lines_arrive_whole_and_an_endless_line_is_skipped_with_its_number() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("grows.txt");
        let mut w = File::create(&path).unwrap();
        let mut r = GrowingFile::open(&path, "test file", 8, 1 << 20).unwrap();
        w.write_all(b"one\ntw").unwrap();
        let got = r.poll().unwrap();
        assert_eq!(got.lines, [(1, b"one".to_vec())]);
        w.write_all(b"o\n").unwrap();
        w.write_all(&[b'x'; 100]).unwrap();
        let got = r.poll().unwrap();
        assert_eq!(got.lines, [(2, b"two".to_vec())]);
        // The long line is held no more than its limit, and reported once it ends.
        assert!(r.partial.is_empty());
        w.write_all(b"xx\nthree\n").unwrap();
        let got = r.poll().unwrap();
        assert_eq!(got.too_long, [3]);
        assert_eq!(got.lines, [(4, b"three".to_vec())]);
    }

    #[test]
    fn a_fifo_a_device_and_a_directory_are_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for path in [fifo.as_path(), Path::new("/dev/zero"), dir.path()] {
            let e = GrowingFile::open(path, "controls file", 8, 8).unwrap_err();
            assert!(matches!(e, ReadError::NotRegular { .. }), "{path:?}: {e}");
        }
    }

    #[test]
    fn the_whole_is_capped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.txt");
        std::fs::write(&path, [b'\n'; 100]).unwrap();
        let mut r = GrowingFile::open(&path, "test file", 8, 50).unwrap();
        assert!(matches!(r.poll(), Err(ReadError::TooLarge { .. })));
    }
}
