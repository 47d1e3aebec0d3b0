//! `--set section.key=value` and `--control STEP:KIND[=VALUE]`: overrides from the command line.

use super::*;

/// One `section.key = value` override, parsed: what `--set` and a compare grid item make. Its
/// `Display` is the `--set` argument that makes it again.
#[derive(Clone, Debug, PartialEq)]
pub struct Assignment {
    /// `section.key`, e.g. `train.accum_steps`.
    pub key: String,
    /// The value, as TOML reads it.
    pub value: toml::Value,
}

impl Assignment {
    /// `section.key=value`, the value in TOML syntax (bare strings accepted).
    pub fn parse(text: &str) -> Result<Assignment, ScenarioError> {
        let (key, raw) = text.split_once('=').ok_or_else(|| ScenarioError::Set {
            key: text.to_string(),
            message: "expected section.key=value, e.g. train.accum_steps=4".into(),
        })?;
        Assignment::new(key.trim(), raw)
    }

    /// `key` set to `raw`, read as TOML (bare strings accepted).
    pub fn new(key: &str, raw: &str) -> Result<Assignment, ScenarioError> {
        let value = parse_value(raw.trim()).map_err(|e| ScenarioError::Set {
            key: key.to_string(),
            message: e.to_string(),
        })?;
        let key = key.to_string();
        Ok(Assignment { key, value })
    }

    /// A knob's `train.KEY = raw`.
    pub fn knob(knob: &Knob, raw: &str) -> Result<Assignment, ScenarioError> {
        Assignment::new(&format!("train.{}", knob.key), raw)
    }
}

impl std::fmt::Display for Assignment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

/// The sections a `--set` key may name (`section.key`).
pub const SECTIONS: [&str; 3] = ["model", "data", "train"];

/// The keys a section accepts, in declaration order: read from the section's `Deserialize`
/// impl, so they cannot drift from the struct.
pub fn keys_of(section: &str) -> Vec<&'static str> {
    match section {
        "model" => fields::of::<ModelConfig>(),
        "data" => fields::of::<DataConfig>(),
        "train" => fields::of::<TrainConfig>(),
        _ => &[],
    }
    .to_vec()
}

/// A control from the command line: `STEP:KIND[=VALUE]`, e.g. `100:set_accum_steps=8`,
/// `0:set_clip` (clipping off), `50:set_dtype=f16`.
pub fn parse_control_arg(arg: &str) -> Result<TimelineEntry, ControlArgError> {
    let fail = |message: String| ControlArgError {
        arg: arg.to_string(),
        message,
    };
    let usage = "expected STEP:KIND[=VALUE], e.g. 100:set_accum_steps=8";
    let (step, rest) = arg.split_once(':').ok_or_else(|| fail(usage.into()))?;
    let step: u64 = step
        .trim()
        .parse()
        .map_err(|_| fail(format!("`{step}` is not a step number; {usage}")))?;
    let mut table = toml::Table::new();
    let (kind, value) = match rest.split_once('=') {
        Some((k, v)) => (
            k.trim(),
            Some(parse_value(v.trim()).map_err(|e| fail(e.to_string()))?),
        ),
        None => (rest.trim(), None),
    };
    table.insert("kind".into(), toml::Value::String(kind.to_string()));
    let given = value.is_some();
    if let Some(v) = value {
        table.insert("value".into(), v);
    }
    let control: Control = toml::Value::Table(table)
        .try_into()
        .map_err(|e: toml::de::Error| fail(e.message().trim().to_string()))?;
    // Serde ignores a value the kind does not take (`stop=1`): refuse it instead.
    let takes_value = toml::Value::try_from(&control)
        .ok()
        .and_then(|t| t.get("value").cloned())
        .is_some();
    if given && !takes_value {
        return Err(fail(format!(
            "`{kind}` takes no value; write {step}:{kind}"
        )));
    }
    validate_control(&control).map_err(|m| fail(m.to_string()))?;
    Ok(TimelineEntry { step, control })
}

/// A `--set` or `--control` value as TOML reads it: `4` → integer, `1e-3` → float, `true` →
/// bool; text TOML does not read is a string, unless it is a number TOML cannot hold (`1e309`),
/// which is refused as such.
fn parse_value(raw: &str) -> Result<toml::Value, BadValue> {
    let wrapped = format!("v = {raw}");
    match toml::from_str::<toml::Table>(&wrapped) {
        Ok(mut t) => Ok(t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into()))),
        Err(_) => match raw.parse::<f64>() {
            Ok(x) if x.is_infinite() => Err(BadValue::BeyondFloat(raw.into())),
            Ok(_)
                if raw
                    .bytes()
                    .all(|b| b.is_ascii_digit() || b == b'-' || b == b'+') =>
            {
                Err(BadValue::BeyondInteger(raw.into()))
            }
            _ => Ok(toml::Value::String(raw.trim_matches('"').to_string())),
        },
    }
}
