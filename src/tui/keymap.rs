//! Keys → `Action`s. One vocabulary: bindings in a TOML file name the same actions the defaults
//! use, and `App::apply` turns actions into `Control`s.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use serde::Deserialize;

use crate::control::{Knob, KnobAction, KNOBS};

/// Everything a key can ask for: turning a knob (the actions of the knob table,
/// `control::KNOBS`), or one of the workbench's own actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::EnumIter, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum Action {
    /// A knob's key action, by its name in the knob table (`accum_up`).
    Knob(&'static str),
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
    NoiseView,
    ScaleCycle,
}

impl Action {
    /// Every action: the knobs' in table order, then the rest (the help overlay's order).
    pub fn all() -> impl Iterator<Item = Action> {
        let knobs = KNOBS
            .iter()
            .flat_map(|k| k.actions)
            .map(|a| Action::Knob(a.name));
        let rest =
            <Action as strum::IntoEnumIterator>::iter().filter(|a| !matches!(a, Action::Knob(_)));
        knobs.chain(rest)
    }

    /// The name used in keymap files (snake_case).
    pub fn name(self) -> &'static str {
        match self {
            Action::Knob(name) => name,
            other => other.into(),
        }
    }

    /// The knob action this is, from the knob table.
    pub fn knob(self) -> Option<&'static KnobAction> {
        match self {
            Action::Knob(name) => Knob::action(name).map(|(_, a)| a),
            _ => None,
        }
    }

    /// One line for the help overlay.
    pub fn describe(self) -> &'static str {
        match self {
            Action::Knob(_) => self.knob().map_or("", |a| a.help),
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
            Action::NoiseView => "grad pane ↔ noise scale",
            Action::ScaleCycle => "y scale linear→robust→log",
        }
    }

    /// Actions that change the run, which a replay cannot do.
    pub fn live_only(self) -> bool {
        matches!(
            self,
            Action::Knob(_) | Action::FitNow | Action::RecordToggle
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

/// The workbench's own actions' default keys; the knobs' come from the knob table.
const DEFAULTS: &[(&str, Action)] = &[
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
    ("g", Action::NoiseView),
    ("s", Action::ScaleCycle),
];

/// Every default binding: the knob table's keys, then `DEFAULTS`.
pub fn default_bindings() -> impl Iterator<Item = (&'static str, Action)> {
    let knobs = KNOBS
        .iter()
        .flat_map(|k| k.actions)
        .flat_map(|a| a.keys.iter().map(move |key| (*key, Action::Knob(a.name))));
    knobs.chain(DEFAULTS.iter().copied())
}

impl Default for KeyMap {
    fn default() -> Self {
        let bindings = default_bindings()
            .map(|(k, a)| (Key::parse(k).expect("default keys parse"), a))
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
        // Every action the file names, with its keys and where they stand.
        let mut named: Vec<(Action, Vec<Key>, usize)> = Vec::new();
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
                named.push((action, parsed, keys.span().start));
            }
        }
        // A key does one thing: one the file lists for two actions is refused rather than left
        // to whichever comes last. (A key taken from an action the file does not name moves.)
        let mut listed: HashMap<Key, Action> = HashMap::new();
        for (action, keys, offset) in &named {
            for key in keys {
                if let Some(other) = listed.insert(*key, *action).filter(|o| o != action) {
                    return Err(KeyMapError {
                        location: at(*offset),
                        message: format!(
                            "`{}` is listed for `{}` too; a key does one thing: give `{}` or \
                             `{}` another key",
                            key.label(),
                            other.name(),
                            action.name(),
                            other.name()
                        ),
                    });
                }
                map.bindings.insert(*key, *action);
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
    if let Some(action) = Action::all().find(|a| a.name() == name) {
        return Ok(action);
    }
    let names: Vec<&str> = Action::all().map(Action::name).collect();
    let hint = crate::scenario::nearest(name, &names)
        .map(|n| format!(", did you mean `{n}`?"))
        .unwrap_or_default();
    Err(format!(
        "unknown action `{name}`{hint}; expected one of: {}",
        names.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn press(code: KeyCode, modifiers: KeyModifiers) -> KeyEvent {
        KeyEvent::new(code, modifiers)
    }

    /// README's "Default keys" table, read as action name → its keys, and the names in the
    /// table's order.
    fn readme_keys() -> (BTreeMap<String, Vec<String>>, Vec<String>) {
        let readme = include_str!("../../README.md");
        let table = readme
            .split("### Default keys")
            .nth(1)
            .expect("README has a Default keys section");
        let (mut keys, mut order) = (BTreeMap::new(), Vec::new());
        let rows = table.lines().skip_while(|l| !l.starts_with('|'));
        // The header and its rule, then the rows.
        for row in rows.skip(2).take_while(|l| l.starts_with('|')) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let groups: Vec<&str> = cells[1].split(" / ").collect();
            let names: Vec<&str> = cells[3].split(" / ").collect();
            assert_eq!(groups.len(), names.len(), "README row {row}");
            for (group, name) in groups.iter().zip(names) {
                let mut listed: Vec<String> = group
                    .split(", ")
                    .map(|k| k.trim_matches('`').to_string())
                    .collect();
                listed.sort();
                order.push(name.trim_matches('`').to_string());
                keys.insert(name.trim_matches('`').to_string(), listed);
            }
        }
        (keys, order)
    }

    /// The key table in README is the defaults: every action with exactly its default keys
    /// (the knobs' from the knob table), in the help overlay's order, so a knob whose keys are
    /// not documented fails here.
    #[test]
    fn the_readme_key_table_is_the_defaults() {
        let mut defaults: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (key, action) in default_bindings() {
            let label = Key::parse(key).unwrap().label();
            defaults
                .entry(action.name().into())
                .or_default()
                .push(label);
        }
        defaults.values_mut().for_each(|keys| keys.sort());
        let (documented, order) = readme_keys();
        assert_eq!(documented, defaults);
        let help_order: Vec<&str> = Action::all().map(Action::name).collect();
        assert_eq!(
            order, help_order,
            "README lists the keys in the help overlay's order"
        );
        let unbound: Vec<&str> = Action::all()
            .map(Action::name)
            .filter(|n| !defaults.contains_key(*n))
            .collect();
        assert!(
            unbound.is_empty(),
            "actions with no default key: {unbound:?}"
        );
    }

    #[test]
    fn default_keys_reach_their_actions() {
        let m = KeyMap::default();
        for (key, action) in default_bindings() {
            let key = Key::parse(key).unwrap();
            // Terminals report upper-case letters with SHIFT set; it must not matter.
            let mods = match key.code {
                KeyCode::Char(c) if c.is_ascii_uppercase() => KeyModifiers::SHIFT,
                _ if key.ctrl => KeyModifiers::CONTROL,
                _ => KeyModifiers::NONE,
            };
            assert_eq!(
                m.action_for(&press(key.code, mods)),
                Some(action),
                "{key:?}"
            );
        }
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
            Some(Action::Knob("accum_up"))
        );
        assert_eq!(
            m.action_for(&press(KeyCode::Up, KeyModifiers::NONE)),
            Some(Action::Knob("accum_up"))
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
    fn a_key_listed_for_two_actions_is_refused_with_both_named() {
        let e = KeyMap::from_toml(
            "[keys]\nquit = \"q\"\nfreeze = [\"x\", \"q\"]\n",
            "keys.toml",
        )
        .unwrap_err();
        assert!(e.message.contains("`q` is listed for `freeze` too"), "{e}");
        assert!(e.location.starts_with("keys.toml:"), "{e}");
    }

    #[test]
    fn action_names_are_snake_case() {
        assert_eq!(Action::FocusNext.name(), "focus_next");
        assert_eq!(Action::Knob("micro_batch_down").name(), "micro_batch_down");
        assert_eq!(
            parse_action("lr_rule_cycle"),
            Ok(Action::Knob("lr_rule_cycle"))
        );
        assert_eq!(parse_action("noise_view"), Ok(Action::NoiseView));
        assert!(parse_action("knob").is_err());
    }
}
