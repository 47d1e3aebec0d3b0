//! The knobs' one link to the configuration: read from it at the start, written back into it
//! when a run's knobs must be saved (a recording started mid-run, a checkpoint). Each knob's
//! `Knobs` field and `[train]` key share the name the knob table gives (`control::KNOBS`), so
//! both directions are serde moving those keys, with no line per knob.

use serde_json::{Map, Value};

use super::{Scenario, TrainConfig};
use crate::control::Knobs;

impl Knobs {
    /// The knobs a configuration starts with: each field from the `[train]` key of its name.
    pub fn from_scenario(s: &Scenario) -> Knobs {
        // A `[train]` table has every knob's key with a value of the knob's type.
        #[allow(clippy::expect_used)]
        serde_json::from_value(Value::Object(as_object(&s.train))).expect("[train] holds the knobs")
    }

    /// Write the knobs back into a configuration (the header of a recording started mid-run, a
    /// checkpoint): every `Knobs` field replaces the `[train]` key of its name.
    pub fn write_into(&self, t: &mut TrainConfig) {
        let mut config = as_object(t);
        for (key, value) in as_object(self) {
            config.insert(key, value);
        }
        // The same keys with values of the same types as the ones they replace.
        #[allow(clippy::expect_used)]
        let written = serde_json::from_value(Value::Object(config)).expect("knobs fit [train]");
        *t = written;
    }
}

/// The knobs of the default configuration (`Scenario::default()`'s `[train]`): one source for
/// every default, so a new knob needs no literal in a test.
impl Default for Knobs {
    fn default() -> Knobs {
        Knobs::from_scenario(&Scenario::default())
    }
}

/// A struct's fields by name, as serde writes them (`None` as null).
fn as_object(value: &impl serde::Serialize) -> Map<String, Value> {
    match serde_json::to_value(value) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{Checkpointing, Dtype, KNOBS};

    /// Every knob's key is a `[train]` key and a `Knobs` field: a value set in the preset
    /// reaches the knobs, and a knob's value written back reaches the preset.
    #[test]
    fn knobs_round_trip_through_the_configuration() {
        let mut s = Scenario::default();
        s.train.accum_steps = 4;
        s.train.clip = None;
        s.train.checkpointing = Checkpointing::Every(2);
        let mut k = Knobs::from_scenario(&s);
        assert_eq!(
            (k.accum_steps, k.clip, k.checkpointing),
            (4, None, Checkpointing::Every(2))
        );
        k.dtype = Dtype::Bf16;
        k.clip = Some(0.5);
        let mut t = TrainConfig::default();
        k.write_into(&mut t);
        assert_eq!(
            (t.dtype, t.clip, t.accum_steps),
            (Dtype::Bf16, Some(0.5), 4)
        );
        let config = as_object(&t);
        let knobs = as_object(&k);
        for knob in KNOBS {
            assert!(
                config.contains_key(knob.key),
                "{}: no [train] key",
                knob.key
            );
            assert_eq!(config.get(knob.key), knobs.get(knob.key), "{}", knob.key);
        }
    }
}
