//! Keys from the terminal, read and parsed here rather than by crossterm's event reader: that
//! reader waits for more bytes after an escape sequence it does not know (`ESC[?25h`,
//! `ESC[?1l`, an unterminated bracketed paste `ESC[200~`), and every key typed after one, `q`
//! and ctrl-c included, joins the wait. Here a sequence ends at its final byte whether known or
//! not (unknown ones are dropped), a byte that cannot continue it ends it too, and a sequence
//! still open after [`ESCAPE_WAIT`] or longer than [`MAX_SEQUENCE`] bytes is dropped: the next
//! key always arrives. Resizes are seen by polling the size.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossterm::event::{Event, KeyCode, KeyEvent, KeyModifiers};
use futures_util::Stream;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// How long a lone ESC waits for the rest of a sequence before it is the Esc key (terminals
/// send a sequence's bytes together).
pub const ESCAPE_WAIT: Duration = Duration::from_millis(30);
/// Longest escape sequence kept; a longer one is dropped.
pub const MAX_SEQUENCE: usize = 256;
/// How often the reader wakes to look at the size and whether it should stop.
const TICK: Duration = Duration::from_millis(100);

/// Bytes to keys. Feed it what the terminal sent; it keeps an unfinished sequence until its
/// last byte arrives or [`Parser::expire`] drops it.
#[derive(Default)]
pub struct Parser {
    pending: Vec<u8>,
    since: Option<Instant>,
}

/// What the bytes so far make.
enum Parsed {
    /// A key, having used this many bytes.
    Key(KeyEvent, usize),
    /// Bytes that make no key (an unknown or broken sequence), dropped.
    Skip(usize),
    /// A sequence not finished yet.
    More,
}

impl Parser {
    /// The keys `bytes` complete (with what was pending before).
    pub fn feed(&mut self, bytes: &[u8], now: Instant) -> Vec<KeyEvent> {
        self.pending.extend_from_slice(bytes);
        let mut keys = Vec::new();
        loop {
            match parse(&self.pending) {
                Parsed::Key(key, used) => {
                    keys.push(key);
                    self.pending.drain(..used);
                }
                Parsed::Skip(used) => {
                    self.pending.drain(..used);
                }
                Parsed::More if self.pending.len() > MAX_SEQUENCE => self.pending.clear(),
                Parsed::More => break,
            }
        }
        self.since = (!self.pending.is_empty()).then_some(self.since.unwrap_or(now));
        keys
    }

    /// An unfinished sequence that waited [`ESCAPE_WAIT`]: a lone ESC is the Esc key, anything
    /// longer is dropped.
    pub fn expire(&mut self, now: Instant) -> Option<KeyEvent> {
        let since = self.since?;
        if now.duration_since(since) < ESCAPE_WAIT {
            return None;
        }
        self.since = None;
        let lone_escape = self.pending == [0x1b];
        self.pending.clear();
        lone_escape.then(|| KeyEvent::new(KeyCode::Esc, KeyModifiers::NONE))
    }

    /// Whether a sequence is waiting for more bytes.
    pub fn waiting(&self) -> bool {
        !self.pending.is_empty()
    }
}

fn key(code: KeyCode, modifiers: KeyModifiers, used: usize) -> Parsed {
    Parsed::Key(KeyEvent::new(code, modifiers), used)
}

/// The first key of `b`, or what to do with its first bytes.
fn parse(b: &[u8]) -> Parsed {
    let none = KeyModifiers::NONE;
    let Some(&first) = b.first() else {
        return Parsed::More;
    };
    match first {
        0x1b => escape(b),
        b'\r' | b'\n' => key(KeyCode::Enter, none, 1),
        b'\t' => key(KeyCode::Tab, none, 1),
        0x7f | 0x08 => key(KeyCode::Backspace, none, 1),
        0x00 => key(KeyCode::Char(' '), KeyModifiers::CONTROL, 1),
        c @ 0x01..=0x1a => key(
            KeyCode::Char((c - 1 + b'a') as char),
            KeyModifiers::CONTROL,
            1,
        ),
        c @ 0x1c..=0x1f => key(
            KeyCode::Char((c - 0x1c + b'4') as char),
            KeyModifiers::CONTROL,
            1,
        ),
        _ => utf8(b),
    }
}

/// One UTF-8 character (uppercase letters carry SHIFT, as crossterm reports them).
fn utf8(b: &[u8]) -> Parsed {
    let len = match b[0] {
        0x00..=0x7f => 1,
        0xc2..=0xdf => 2,
        0xe0..=0xef => 3,
        0xf0..=0xf4 => 4,
        _ => return Parsed::Skip(1),
    };
    if b.len() < len {
        // Continuation bytes only can follow; anything else ends a broken character.
        return match b[1..].iter().all(|&c| c & 0xc0 == 0x80) {
            true => Parsed::More,
            false => Parsed::Skip(1),
        };
    }
    match std::str::from_utf8(&b[..len])
        .ok()
        .and_then(|s| s.chars().next())
    {
        Some(c) => {
            let shift = match c.is_uppercase() {
                true => KeyModifiers::SHIFT,
                false => KeyModifiers::NONE,
            };
            key(KeyCode::Char(c), shift, len)
        }
        None => Parsed::Skip(1),
    }
}

/// A sequence that starts with ESC.
fn escape(b: &[u8]) -> Parsed {
    let Some(&second) = b.get(1) else {
        return Parsed::More;
    };
    match second {
        b'[' => csi(b),
        b'O' => ss3(b),
        // Strings (OSC, DCS, APC, PM, SOS) run to BEL or ESC \.
        b']' | b'P' | b'_' | b'^' | b'X' => string(b),
        0x1b => key(KeyCode::Esc, KeyModifiers::NONE, 1),
        _ => match parse(&b[1..]) {
            Parsed::Key(mut k, used) => {
                k.modifiers |= KeyModifiers::ALT;
                Parsed::Key(k, used + 1)
            }
            Parsed::Skip(_) => Parsed::Skip(1),
            Parsed::More => Parsed::More,
        },
    }
}

/// `ESC O x`: arrows, Home, End and F1–F4 in application mode.
fn ss3(b: &[u8]) -> Parsed {
    let Some(&x) = b.get(2) else {
        return Parsed::More;
    };
    let none = KeyModifiers::NONE;
    match x {
        b'A' => key(KeyCode::Up, none, 3),
        b'B' => key(KeyCode::Down, none, 3),
        b'C' => key(KeyCode::Right, none, 3),
        b'D' => key(KeyCode::Left, none, 3),
        b'H' => key(KeyCode::Home, none, 3),
        b'F' => key(KeyCode::End, none, 3),
        b'P'..=b'S' => key(KeyCode::F(1 + x - b'P'), none, 3),
        // Not a key: drop the introducer, read `x` afresh.
        _ => Parsed::Skip(2),
    }
}

/// `ESC [` parameters (0x30–0x3f), intermediates (0x20–0x2f), a final byte (0x40–0x7e). Any
/// other byte ends the sequence before it, unread.
fn csi(b: &[u8]) -> Parsed {
    for (i, &c) in b.iter().enumerate().skip(2) {
        match c {
            0x20..=0x3f => continue,
            0x40..=0x7e => {
                return match csi_key(&b[2..i], c) {
                    Some(k) => Parsed::Key(k, i + 1),
                    None => Parsed::Skip(i + 1),
                }
            }
            _ => return Parsed::Skip(i),
        }
    }
    Parsed::More
}

/// The key a complete CSI sequence stands for (`params` between `ESC [` and `last`), if any.
fn csi_key(params: &[u8], last: u8) -> Option<KeyEvent> {
    let text = std::str::from_utf8(params).ok()?;
    if text.starts_with(['?', '<', '>', '=']) {
        return None;
    }
    let mut fields = text.split(';');
    let number: Option<u16> = fields
        .next()
        .filter(|f| !f.is_empty())
        .map(str::parse::<u16>)
        .transpose()
        .ok()?;
    let modifiers = match fields.next() {
        Some(m) => modifiers(m.parse().ok()?),
        None => KeyModifiers::NONE,
    };
    let code = match (last, number) {
        (b'A', _) => KeyCode::Up,
        (b'B', _) => KeyCode::Down,
        (b'C', _) => KeyCode::Right,
        (b'D', _) => KeyCode::Left,
        (b'H', _) => KeyCode::Home,
        (b'F', _) => KeyCode::End,
        (b'Z', _) => return Some(KeyEvent::new(KeyCode::BackTab, KeyModifiers::SHIFT)),
        (b'P'..=b'S', _) => KeyCode::F(1 + last - b'P'),
        (b'~', Some(n)) => tilde_key(n)?,
        _ => return None,
    };
    Some(KeyEvent::new(code, modifiers))
}

/// `ESC [ n ~` keys.
fn tilde_key(n: u16) -> Option<KeyCode> {
    Some(match n {
        1 | 7 => KeyCode::Home,
        2 => KeyCode::Insert,
        3 => KeyCode::Delete,
        4 | 8 => KeyCode::End,
        5 => KeyCode::PageUp,
        6 => KeyCode::PageDown,
        11..=15 => KeyCode::F((n - 10) as u8),
        17..=21 => KeyCode::F((n - 11) as u8),
        23 | 24 => KeyCode::F((n - 12) as u8),
        _ => return None,
    })
}

/// xterm's modifier parameter: 1 + shift 1 + alt 2 + ctrl 4.
fn modifiers(m: u8) -> KeyModifiers {
    let bits = m.saturating_sub(1);
    let mut out = KeyModifiers::NONE;
    if bits & 1 != 0 {
        out |= KeyModifiers::SHIFT;
    }
    if bits & 2 != 0 {
        out |= KeyModifiers::ALT;
    }
    if bits & 4 != 0 {
        out |= KeyModifiers::CONTROL;
    }
    out
}

/// A string sequence: dropped up to and including its BEL or `ESC \`.
fn string(b: &[u8]) -> Parsed {
    let mut i = 2;
    while i < b.len() {
        match b[i] {
            0x07 => return Parsed::Skip(i + 1),
            0x1b if b.get(i + 1) == Some(&b'\\') => return Parsed::Skip(i + 2),
            0x1b if i + 1 == b.len() => return Parsed::More,
            _ => i += 1,
        }
    }
    Parsed::More
}

/// The terminal's keys and resizes, as crossterm's events, from a reader thread that stops
/// when the stream is dropped.
pub struct Input {
    events: UnboundedReceiver<io::Result<Event>>,
    stop: Arc<AtomicBool>,
}

impl Stream for Input {
    type Item = io::Result<Event>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.events.poll_recv(cx)
    }
}

impl Drop for Input {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Starts reading the terminal: standard input when it is one, else `/dev/tty` (as crossterm
/// reads it).
pub fn start() -> io::Result<Input> {
    let tty = match std::io::IsTerminal::is_terminal(&io::stdin()) {
        true => None,
        false => Some(std::fs::File::open("/dev/tty")?),
    };
    let (tx, events) = unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = Arc::clone(&stop);
    std::thread::Builder::new()
        .name("gaccwb-keys".into())
        .spawn(move || {
            let fd = tty.as_ref().map_or(0, |f| f.as_raw_fd());
            read_keys(fd, &tx, &stopped);
        })?;
    Ok(Input { events, stop })
}

/// The reader thread: bytes to keys until `stop` or the channel closes.
fn read_keys(fd: RawFd, tx: &UnboundedSender<io::Result<Event>>, stop: &AtomicBool) {
    let mut parser = Parser::default();
    let mut size = crossterm::terminal::size().ok();
    let mut buf = [0u8; 1024];
    while !stop.load(Ordering::SeqCst) && !tx.is_closed() {
        let wait = match parser.waiting() {
            true => ESCAPE_WAIT,
            false => TICK,
        };
        let mut out = match wait_readable(fd, wait) {
            Ok(true) => match read(fd, &mut buf) {
                Ok(0) => return,
                Ok(n) => parser.feed(&buf[..n], Instant::now()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => Vec::new(),
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            },
            Ok(false) => Vec::new(),
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        out.extend(parser.expire(Instant::now()));
        for k in out {
            let _ = tx.send(Ok(Event::Key(k)));
        }
        let now = crossterm::terminal::size().ok();
        if let (Some((w, h)), true) = (now, now != size) {
            size = now;
            let _ = tx.send(Ok(Event::Resize(w, h)));
        }
    }
}

/// Whether `fd` has bytes within `timeout`.
fn wait_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as libc::c_int) };
    match rc {
        -1 => match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::Interrupted => Ok(false),
            e => Err(e),
        },
        0 => Ok(false),
        _ => Ok(true),
    }
}

fn read(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for `buf.len()` bytes of writes for the duration of the call.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    match n {
        -1 => Err(io::Error::last_os_error()),
        n => Ok(n as usize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(bytes: &[u8]) -> Vec<KeyEvent> {
        let mut p = Parser::default();
        let now = Instant::now();
        let mut out = p.feed(bytes, now);
        out.extend(p.expire(now + ESCAPE_WAIT));
        out
    }

    fn plain(c: char) -> KeyEvent {
        KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE)
    }

    /// Every sequence that stopped crossterm's reader, followed by `q`: the `q` arrives.
    #[test]
    fn unknown_and_unfinished_sequences_never_hold_the_next_key() {
        for seq in [
            &b"\x1b[?25h"[..],
            b"\x1b[?1l",
            b"\x1b[?u",
            b"\x1b[200~",
            b"\x1b[?1049h",
            b"\x1b]0;title\x07",
            b"\x1b[12;34;56;78;90;12;34;56x",
        ] {
            let got = keys(&[seq, b"q"].concat());
            assert_eq!(got, [plain('q')], "{seq:?}");
        }
        // A sequence cut by a byte that cannot continue it: that byte is read afresh.
        assert_eq!(
            keys(b"\x1b[12\x03"),
            [KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)]
        );
        // Endless parameters are dropped at the cap, then keys flow again.
        let mut p = Parser::default();
        let now = Instant::now();
        let endless = [&b"\x1b["[..], &[b'1'; 1000][..]].concat();
        assert!(p.feed(&endless, now).is_empty());
        assert!(!p.waiting());
        assert_eq!(p.feed(b"q", now), [plain('q')]);
    }

    #[test]
    fn keys_the_keymap_uses_are_read_as_crossterm_reads_them() {
        assert_eq!(keys(b"q"), [plain('q')]);
        assert_eq!(
            keys(b"B"),
            [KeyEvent::new(KeyCode::Char('B'), KeyModifiers::SHIFT)]
        );
        assert_eq!(
            keys(b"\x03"),
            [KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)]
        );
        assert_eq!(keys(b" ")[0].code, KeyCode::Char(' '));
        assert_eq!(keys(b"\x1b[A")[0].code, KeyCode::Up);
        assert_eq!(keys(b"\x1bOB")[0].code, KeyCode::Down);
        assert_eq!(keys(b"\x1b[5~")[0].code, KeyCode::PageUp);
        assert_eq!(
            keys(b"\x1b[1;5C"),
            [KeyEvent::new(KeyCode::Right, KeyModifiers::CONTROL)]
        );
        assert_eq!(keys(b"\x1b[Z")[0].code, KeyCode::BackTab);
        assert_eq!(
            keys(b"\x1b"),
            [KeyEvent::new(KeyCode::Esc, KeyModifiers::NONE)]
        );
        assert_eq!(keys("é".as_bytes()), [plain('é')]);
    }

    #[test]
    fn a_sequence_split_across_reads_waits_for_its_end() {
        let mut p = Parser::default();
        let now = Instant::now();
        assert!(p.feed(b"\x1b[", now).is_empty());
        assert_eq!(p.expire(now), None);
        assert_eq!(p.feed(b"B", now)[0].code, KeyCode::Down);
        assert!(!p.waiting());
    }
}
