//! Keys → `Action`s. One vocabulary: bindings in a TOML file name the same actions the defaults
//! use, and `App::apply` turns actions into `Control`s.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use serde::{Deserialize, Serialize};

/// Everything a key can ask for.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::EnumIter,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Action {
    AccumUp,
    AccumDown,
    MicroBatchDown,
    MicroBatchUp,
    ClipDown,
    ClipUp,
    ClipToggle,
    OffloadToggle,
    CheckpointToggle,
    PrecisionCycle,
    LrRuleCycle,
    PauseResume,
    SingleStep,
    Freeze,
    ZoomIn,
    ZoomOut,
    Expand,
    FocusNext,
    FocusPrev,
    RecordToggle,
    Help,
    Quit,
    SeekBack,
    SeekForward,
    SpeedDown,
    SpeedUp,
    FitNow,
    AccumPolicyToggle,
    NoiseView,
}

impl Action {
    /// Every action, in declaration order (the help overlay's order).
    pub fn all() -> impl Iterator<Item = Action> {
        <Action as strum::IntoEnumIterator>::iter()
    }

    /// The name used in keymap files (snake_case, as serde reads it).
    pub fn name(self) -> &'static str {
        self.into()
    }

    /// One line for the help overlay.
    pub fn describe(self) -> &'static str {
        match self {
            Action::AccumUp => "accumulation steps K ×2",
            Action::AccumDown => "accumulation steps K ÷2",
            Action::MicroBatchDown => "micro-batch ÷2",
            Action::MicroBatchUp => "micro-batch ×2",
            Action::ClipDown => "clip norm ÷2",
            Action::ClipUp => "clip norm ×2",
            Action::ClipToggle => "clipping off / on",
            Action::OffloadToggle => "optimizer offload on / off",
            Action::CheckpointToggle => "checkpointing on / off",
            Action::PrecisionCycle => "precision f32→bf16→f16",
            Action::LrRuleCycle => "LR rule none→linear→sqrt",
            Action::PauseResume => "pause / resume",
            Action::SingleStep => "one step, then pause",
            Action::Freeze => "freeze charts (runs on)",
            Action::ZoomIn => "zoom in (fewer steps)",
            Action::ZoomOut => "zoom out (more steps)",
            Action::Expand => "expand the focused pane",
            Action::FocusNext => "focus the next pane",
            Action::FocusPrev => "focus the previous pane",
            Action::RecordToggle => "start / stop recording",
            Action::Help => "this help",
            Action::Quit => "quit",
            Action::SeekBack => "replay: 10 steps back",
            Action::SeekForward => "replay: 10 steps forward",
            Action::SpeedDown => "replay: half speed",
            Action::SpeedUp => "replay: double speed",
            Action::FitNow => "fit B to the memory budget",
            Action::AccumPolicyToggle => "K policy fixed / noise",
            Action::NoiseView => "grad pane ↔ noise scale",
        }
    }

    /// Actions that change the run, which a replay cannot do.
    pub fn live_only(self) -> bool {
        matches!(
            self,
            Action::AccumUp
                | Action::AccumDown
                | Action::MicroBatchDown
                | Action::MicroBatchUp
                | Action::ClipDown
                | Action::ClipUp
                | Action::ClipToggle
                | Action::OffloadToggle
                | Action::CheckpointToggle
                | Action::PrecisionCycle
                | Action::LrRuleCycle
                | Action::FitNow
                | Action::RecordToggle
                | Action::AccumPolicyToggle
        )
    }

    /// Actions that only mean something while replaying.
    pub fn replay_only(self) -> bool {
        matches!(
            self,
            Action::SeekBack | Action::SeekForward | Action::SpeedDown | Action::SpeedUp
        )
    }
}

/// A key as written in keymap files: `+`, `B`, `space`, `tab`, `ctrl-c`, …
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub code: KeyCode,
    pub ctrl: bool,
}

impl Key {
    pub const fn char(c: char) -> Key {
        Key {
            code: KeyCode::Char(c),
            ctrl: false,
        }
    }

    /// Parse a key name; the error says what is accepted.
    pub fn parse(s: &str) -> Result<Key, String> {
        let (ctrl, rest) = match s.strip_prefix("ctrl-").or_else(|| s.strip_prefix("ctrl+")) {
            Some(rest) if !rest.is_empty() => (true, rest),
            _ => (false, s),
        };
        let mut chars = rest.chars();
        let code = match (chars.next(), chars.next()) {
            (Some(c), None) => KeyCode::Char(c),
            _ => match rest.to_ascii_lowercase().as_str() {
                "space" => KeyCode::Char(' '),
                "tab" => KeyCode::Tab,
                "backtab" | "shift-tab" => KeyCode::BackTab,
                "esc" | "escape" => KeyCode::Esc,
                "enter" | "return" => KeyCode::Enter,
                "left" => KeyCode::Left,
                "right" => KeyCode::Right,
                "up" => KeyCode::Up,
                "down" => KeyCode::Down,
                "home" => KeyCode::Home,
                "end" => KeyCode::End,
                "pageup" => KeyCode::PageUp,
                "pagedown" => KeyCode::PageDown,
                _ => {
                    return Err(format!(
                        "unknown key `{s}`: expected one character (e.g. `+`, `B`), a name \
                         (space, tab, backtab, esc, enter, left, right, up, down, home, end, \
                         pageup, pagedown) or ctrl-<key>"
                    ))
                }
            },
        };
        Ok(Key { code, ctrl })
    }

    pub fn from_event(e: &KeyEvent) -> Option<Key> {
        if e.kind == KeyEventKind::Release {
            return None;
        }
        Some(Key {
            code: e.code,
            ctrl: e.modifiers.contains(KeyModifiers::CONTROL),
        })
    }

    /// The name shown in the footer and the help overlay.
    pub fn label(&self) -> String {
        let base = match self.code {
            KeyCode::Char(' ') => "space".to_string(),
            KeyCode::Char(c) => c.to_string(),
            KeyCode::Tab => "tab".into(),
            KeyCode::BackTab => "backtab".into(),
            KeyCode::Esc => "esc".into(),
            KeyCode::Enter => "enter".into(),
            KeyCode::Left => "left".into(),
            KeyCode::Right => "right".into(),
            KeyCode::Up => "up".into(),
            KeyCode::Down => "down".into(),
            KeyCode::Home => "home".into(),
            KeyCode::End => "end".into(),
            KeyCode::PageUp => "pageup".into(),
            KeyCode::PageDown => "pagedown".into(),
            other => format!("{other:?}").to_lowercase(),
        };
        if self.ctrl {
            format!("ctrl-{base}")
        } else {
            base
        }
    }
}

/// The bindings in force.
#[derive(Clone, Debug)]
pub struct KeyMap {
    bindings: HashMap<Key, Action>,
}

const DEFAULTS: &[(&str, Action)] = &[
    ("+", Action::AccumUp),
    ("-", Action::AccumDown),
    ("b", Action::MicroBatchDown),
    ("B", Action::MicroBatchUp),
    ("c", Action::ClipDown),
    ("C", Action::ClipUp),
    ("x", Action::ClipToggle),
    ("o", Action::OffloadToggle),
    ("k", Action::CheckpointToggle),
    ("p", Action::PrecisionCycle),
    ("l", Action::LrRuleCycle),
    ("space", Action::PauseResume),
    ("n", Action::SingleStep),
    ("f", Action::Freeze),
    ("z", Action::ZoomIn),
    ("Z", Action::ZoomOut),
    ("e", Action::Expand),
    ("tab", Action::FocusNext),
    ("backtab", Action::FocusPrev),
    ("r", Action::RecordToggle),
    ("?", Action::Help),
    ("q", Action::Quit),
    ("ctrl-c", Action::Quit),
    ("[", Action::SeekBack),
    ("]", Action::SeekForward),
    ("<", Action::SpeedDown),
    (">", Action::SpeedUp),
    ("F", Action::FitNow),
    ("a", Action::AccumPolicyToggle),
    ("g", Action::NoiseView),
];

impl Default for KeyMap {
    fn default() -> Self {
        let bindings = DEFAULTS
            .iter()
            .map(|(k, a)| (Key::parse(k).expect("default keys parse"), *a))
            .collect();
        KeyMap { bindings }
    }
}

/// A keymap file that cannot be used, with where and why.
#[derive(Debug, thiserror::Error)]
#[error("{location}: {message}")]
pub struct KeyMapError {
    pub location: String,
    pub message: String,
}

/// `action = "key"` or `action = ["key", ...]`.
#[derive(Deserialize)]
#[serde(untagged)]
enum KeyList {
    One(String),
    Many(Vec<String>),
}

impl KeyMap {
    pub fn action_for(&self, e: &KeyEvent) -> Option<Action> {
        let key = Key::from_event(e)?;
        self.bindings.get(&key).copied()
    }

    /// Keys bound to `action`, in a stable order.
    pub fn keys_for(&self, action: Action) -> Vec<Key> {
        let mut keys: Vec<Key> = self
            .bindings
            .iter()
            .filter(|(_, a)| **a == action)
            .map(|(k, _)| *k)
            .collect();
        // Plain keys before ctrl- chords, then by name, so labels read the same every time.
        keys.sort_by_key(|k| (k.ctrl, k.label()));
        keys
    }

    /// "k1/k2" for the footer and help; "unbound" when no key is left.
    pub fn label_for(&self, action: Action) -> String {
        let keys = self.keys_for(action);
        if keys.is_empty() {
            return "unbound".into();
        }
        keys.iter().map(Key::label).collect::<Vec<_>>().join("/")
    }

    /// Defaults, then the `[keys]` table of a TOML text: each action named there gets exactly
    /// the keys listed (an empty list unbinds it).
    pub fn from_toml(text: &str, origin: &str) -> Result<KeyMap, KeyMapError> {
        type Table = BTreeMap<String, BTreeMap<toml::Spanned<String>, toml::Spanned<KeyList>>>;
        let at = |offset: usize| {
            let (line, col) = crate::scenario::line_col(text, offset);
            format!("{origin}:{line}:{col}")
        };
        let table: Table = toml::from_str(text).map_err(|e| KeyMapError {
            location: e
                .span()
                .map(|s| at(s.start))
                .unwrap_or_else(|| origin.to_string()),
            message: format!(
                "{}; expected a [keys] table like `accum_up = [\"+\", \"k\"]`",
                e.message()
            ),
        })?;
        let mut map = KeyMap::default();
        for (section, entries) in table {
            if section != "keys" {
                return Err(KeyMapError {
                    location: origin.to_string(),
                    message: format!("unknown table [{section}]; the only table is [keys]"),
                });
            }
            for (name, keys) in entries {
                let action = parse_action(name.get_ref()).map_err(|message| KeyMapError {
                    location: at(name.span().start),
                    message,
                })?;
                let names = match keys.get_ref() {
                    KeyList::One(k) => vec![k.clone()],
                    KeyList::Many(ks) => ks.clone(),
                };
                let parsed = names
                    .iter()
                    .map(|k| Key::parse(k))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|message| KeyMapError {
                        location: at(keys.span().start),
                        message,
                    })?;
                map.bindings.retain(|_, a| *a != action);
                for key in parsed {
                    map.bindings.insert(key, action);
                }
            }
        }
        if map.keys_for(Action::Quit).is_empty() {
            return Err(KeyMapError {
                location: origin.to_string(),
                message: "no key is left for `quit`, so the screen could not be closed; \
                          bind one, e.g. quit = \"q\""
                    .into(),
            });
        }
        Ok(map)
    }

    pub fn from_file(path: &Path) -> Result<KeyMap, KeyMapError> {
        let origin = path.display().to_string();
        let limit = crate::limits::MAX_CONFIG_BYTES;
        let text =
            crate::limits::read_bounded_text(path, limit, "keymap").map_err(|e| KeyMapError {
                location: origin.clone(),
                message: e.to_string(),
            })?;
        KeyMap::from_toml(&text, &origin)
    }

    /// `--keys FILE` when given; else `$XDG_CONFIG_HOME/gaccwb/keys.toml` (or
    /// `~/.config/gaccwb/keys.toml`) when it exists; else the defaults.
    pub fn load(explicit: Option<&Path>) -> Result<KeyMap, KeyMapError> {
        if let Some(path) = explicit {
            return KeyMap::from_file(path);
        }
        match default_path() {
            Some(path) if path.exists() => KeyMap::from_file(&path),
            _ => Ok(KeyMap::default()),
        }
    }
}

fn default_path() -> Option<std::path::PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".config")))?;
    Some(base.join("gaccwb").join("keys.toml"))
}

fn parse_action(name: &str) -> Result<Action, String> {
    serde_json::from_value(serde_json::Value::String(name.to_string())).map_err(|_| {
        let names: Vec<String> = Action::all().map(|a| a.name().to_string()).collect();
        let candidates: Vec<&str> = names.iter().map(String::as_str).collect();
        let hint = crate::scenario::nearest(name, &candidates)
            .map(|n| format!(", did you mean `{n}`?"))
            .unwrap_or_default();
        format!(
            "unknown action `{name}`{hint}; expected one of: {}",
            names.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn press(code: KeyCode, modifiers: KeyModifiers) -> KeyEvent {
        KeyEvent::new(code, modifiers)
    }

    #[test]
    fn default_keys_match_the_documented_table() {
        let m = KeyMap::default();
        let cases = [
            ('+', Action::AccumUp),
            ('-', Action::AccumDown),
            ('b', Action::MicroBatchDown),
            ('B', Action::MicroBatchUp),
            ('c', Action::ClipDown),
            ('C', Action::ClipUp),
            ('x', Action::ClipToggle),
            ('o', Action::OffloadToggle),
            ('k', Action::CheckpointToggle),
            ('p', Action::PrecisionCycle),
            ('l', Action::LrRuleCycle),
            (' ', Action::PauseResume),
            ('n', Action::SingleStep),
            ('f', Action::Freeze),
            ('z', Action::ZoomIn),
            ('Z', Action::ZoomOut),
            ('e', Action::Expand),
            ('r', Action::RecordToggle),
            ('?', Action::Help),
            ('q', Action::Quit),
            ('F', Action::FitNow),
        ];
        for (c, action) in cases {
            // Terminals report upper-case letters with SHIFT set; it must not matter.
            let mods = if c.is_ascii_uppercase() {
                KeyModifiers::SHIFT
            } else {
                KeyModifiers::NONE
            };
            assert_eq!(
                m.action_for(&press(KeyCode::Char(c), mods)),
                Some(action),
                "{c}"
            );
        }
        assert_eq!(
            m.action_for(&press(KeyCode::Char('c'), KeyModifiers::CONTROL)),
            Some(Action::Quit)
        );
    }

    #[test]
    fn a_keymap_file_rebinds_and_unbinds() {
        let m = KeyMap::from_toml(
            "[keys]\naccum_up = [\"k\", \"up\"]\nquit = \"Q\"\nfreeze = []\n",
            "keys.toml",
        )
        .unwrap();
        assert_eq!(
            m.action_for(&press(KeyCode::Char('k'), KeyModifiers::NONE)),
            Some(Action::AccumUp)
        );
        assert_eq!(
            m.action_for(&press(KeyCode::Up, KeyModifiers::NONE)),
            Some(Action::AccumUp)
        );
        assert_eq!(
            m.action_for(&press(KeyCode::Char('+'), KeyModifiers::NONE)),
            None
        );
        assert_eq!(m.label_for(Action::Quit), "Q");
        assert_eq!(m.label_for(Action::Freeze), "unbound");
    }

    #[test]
    fn a_bad_keymap_names_file_line_and_the_fix() {
        let e = KeyMap::from_toml("[keys]\nquit = \"q\"\naccum_upp = \"k\"\n", "keys.toml")
            .unwrap_err();
        assert_eq!(e.location, "keys.toml:3:1");
        assert!(e.message.contains("unknown action `accum_upp`"), "{e}");
        assert!(e.message.contains("did you mean `accum_up`?"), "{e}");

        let e = KeyMap::from_toml("[keys]\nquit = \"meta-q\"\n", "keys.toml").unwrap_err();
        assert_eq!(e.location, "keys.toml:2:8");
        assert!(e.message.contains("unknown key `meta-q`"), "{e}");

        let e = KeyMap::from_toml("[keys]\nquit = \n", "keys.toml").unwrap_err();
        assert!(e.location.starts_with("keys.toml:2"), "{e}");
    }

    #[test]
    fn action_names_are_snake_case() {
        assert_eq!(Action::MicroBatchDown.name(), "micro_batch_down");
        assert_eq!(parse_action("lr_rule_cycle"), Ok(Action::LrRuleCycle));
    }
}
