//! JSON has no NaN or infinity (serde_json writes `null`), but an overflowing fp16 step has an
//! infinite gradient norm and its loss may be NaN. Non-finite values are written as the strings
//! `"NaN"`, `"inf"`, `"-inf"`; reading also accepts `null` (as NaN) from older files.

use serde::{Deserialize, Deserializer, Serializer};

/// Write `x`, non-finite values as strings.
pub(super) fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    if x.is_finite() {
        s.serialize_f64(*x)
    } else if x.is_nan() {
        s.serialize_str("NaN")
    } else if *x > 0.0 {
        s.serialize_str("inf")
    } else {
        s.serialize_str("-inf")
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Repr {
    Number(f64),
    Text(String),
    Null(()),
}

/// Read a number, or `"NaN"`, `"inf"`, `"-inf"` or `null`.
pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    match Repr::deserialize(d)? {
        Repr::Number(x) => Ok(x),
        Repr::Null(()) => Ok(f64::NAN),
        Repr::Text(t) => match t.as_str() {
            "NaN" => Ok(f64::NAN),
            "inf" => Ok(f64::INFINITY),
            "-inf" => Ok(f64::NEG_INFINITY),
            other => Err(serde::de::Error::custom(format!(
                "expected a number, \"NaN\", \"inf\" or \"-inf\", got \"{other}\""
            ))),
        },
    }
}
