//! `train.memory_budget`: how much memory a run may use, as bytes (`6442450944`), a size with a
//! unit (`"6 GiB"`, `"512 MiB"`, `"8 GB"`) or a share of the device's total (`"80%"`).
//! Resolved to bytes once the device is known (`resolve`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The largest budget in bytes: what a preset can write back (TOML's largest integer).
pub const MAX_BUDGET_BYTES: u64 = i64::MAX as u64;

#[derive(Clone, Copy, Debug, Default, PartialEq)]
/// How much memory a run may use (`train.memory_budget`, `--budget`).
pub enum MemoryBudget {
    /// No budget: the guard does nothing (the default).
    #[default]
    Off,
    /// A fixed number of bytes.
    Bytes(u64),
    /// Percent of the device's total memory, in (0, 100].
    Percent(f64),
}

impl MemoryBudget {
    /// Parse `"6 GiB"`, `"6GiB"`, `"1.5 TiB"`, `"8 GB"`, `"123"` (bytes), `"80%"` or `"off"`.
    pub fn parse(text: &str) -> Result<MemoryBudget, BudgetError> {
        let t = text.trim();
        let bad = |why: &'static str| BudgetError::Unreadable {
            text: text.to_string(),
            why,
        };
        if t.is_empty() {
            return Err(bad("empty"));
        }
        if t.eq_ignore_ascii_case("off") || t.eq_ignore_ascii_case("none") {
            return Ok(MemoryBudget::Off);
        }
        if let Some(number) = t.strip_suffix('%') {
            let p: f64 = number.trim().parse().map_err(|_| bad("not a number"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(bad("a share must be above 0% and at most 100%"));
            }
            return Ok(MemoryBudget::Percent(p));
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (number, unit) = (t[..split].trim(), t[split..].trim());
        let value: f64 = number.parse().map_err(|_| bad("not a number"))?;
        let scale = unit_bytes(unit).ok_or_else(|| bad("unknown unit"))?;
        if scale == 1.0 && number.contains('.') {
            return Err(bad(
                "bytes are a whole number (or give a unit: \"1.5 GiB\")",
            ));
        }
        let bytes = value * scale;
        if bytes >= MAX_BUDGET_BYTES as f64 {
            return Err(bad("beyond the largest budget, 2^63 - 1 bytes (8 EiB)"));
        }
        if bytes < 1.0 {
            return Err(bad("must be at least 1 byte"));
        }
        Ok(MemoryBudget::Bytes(bytes as u64))
    }

    /// Bytes, given the device's total memory (needed only for a percentage).
    pub fn resolve(&self, device_total: Option<u64>) -> Result<Option<u64>, BudgetError> {
        match *self {
            MemoryBudget::Off => Ok(None),
            MemoryBudget::Bytes(b) => Ok(Some(b)),
            MemoryBudget::Percent(p) => match device_total {
                Some(total) => Ok(Some((total as f64 * p / 100.0) as u64)),
                None => Err(BudgetError::ShareOfUnknownTotal { percent: p }),
            },
        }
    }
}

/// A memory budget that cannot be read, or not resolved to bytes.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BudgetError {
    /// The text is not a size, a share or "off".
    #[error(
        "memory budget `{text}`: {why}; expected bytes (6442450944), a size (\"6 GiB\", \
         \"512 MiB\", \"8 GB\"), a share of the device (\"80%\") or \"off\""
    )]
    Unreadable {
        /// The budget as given.
        text: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A percentage on a device whose total memory is unknown.
    #[error(
        "train.memory_budget = \"{percent}%\" needs the device's total memory, which is \
         unknown here; give a size instead, e.g. \"6 GiB\""
    )]
    ShareOfUnknownTotal {
        /// The share asked for.
        percent: f64,
    },
}

fn unit_bytes(unit: &str) -> Option<f64> {
    let binary = ["b", "kib", "mib", "gib", "tib"];
    let decimal = ["b", "kb", "mb", "gb", "tb"];
    let u = unit.to_ascii_lowercase();
    if u.is_empty() {
        return Some(1.0);
    }
    if let Some(i) = binary.iter().position(|b| *b == u) {
        return Some(1024f64.powi(i as i32));
    }
    decimal
        .iter()
        .position(|d| *d == u)
        .map(|i| 1000f64.powi(i as i32))
}

impl std::fmt::Display for MemoryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryBudget::Off => f.write_str("off"),
            MemoryBudget::Bytes(b) => write!(f, "{b} B"),
            MemoryBudget::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl Serialize for MemoryBudget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            // An integer stays an integer so a preset written back reads the same.
            MemoryBudget::Bytes(b) if *b <= i64::MAX as u64 => s.serialize_i64(*b as i64),
            other => s.serialize_str(&other.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for MemoryBudget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "train.memory_budget: expected bytes (6442450944) or a string (\"6 GiB\", \"80%\")",
            )
        })? {
            Raw::Bytes(0) => Err(serde::de::Error::custom(
                "train.memory_budget: 0 bytes; use \"off\" for no budget",
            )),
            Raw::Bytes(b) => Ok(MemoryBudget::Bytes(b)),
            Raw::Text(t) => MemoryBudget::parse(&t).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_as_bytes_sizes_and_shares() {
        let gib = 1u64 << 30;
        assert_eq!(
            MemoryBudget::parse("6 GiB"),
            Ok(MemoryBudget::Bytes(6 * gib))
        );
        assert_eq!(
            MemoryBudget::parse("6GiB"),
            Ok(MemoryBudget::Bytes(6 * gib))
        );
        assert_eq!(
            MemoryBudget::parse("1.5 MiB"),
            Ok(MemoryBudget::Bytes(3 << 19))
        );
        assert_eq!(
            MemoryBudget::parse("8 GB"),
            Ok(MemoryBudget::Bytes(8_000_000_000))
        );
        assert_eq!(MemoryBudget::parse("123"), Ok(MemoryBudget::Bytes(123)));
        assert_eq!(MemoryBudget::parse("80%"), Ok(MemoryBudget::Percent(80.0)));
        assert_eq!(MemoryBudget::parse("off"), Ok(MemoryBudget::Off));
        for bad in ["6 GiBs", "x GiB", "0%", "120%", "0", "", "  "] {
            assert!(MemoryBudget::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            MemoryBudget::Percent(50.0).resolve(Some(1000)),
            Ok(Some(500))
        );
        assert!(MemoryBudget::Percent(50.0)
            .resolve(None)
            .unwrap_err()
            .to_string()
            .contains("6 GiB"));
    }

    /// `1.5` read as 1 byte, and a number beyond 2^64 was "at least 1 byte".
    #[test]
    fn fractional_bytes_and_numbers_beyond_the_largest_are_refused_saying_why() {
        let why = |text: &str| MemoryBudget::parse(text).unwrap_err().to_string();
        assert!(why("1.5").contains("whole number"), "{}", why("1.5"));
        assert!(why("18446744073709551616").contains("beyond the largest budget"));
        assert!(why("9223372036854775808").contains("beyond the largest budget"));
        assert!(why("0.5 B").contains("whole number"));
        assert_eq!(
            MemoryBudget::parse("1 TiB"),
            Ok(MemoryBudget::Bytes(1 << 40))
        );
    }

    #[test]
    fn budgets_read_from_toml_integers_and_strings() {
        #[derive(Deserialize, Serialize)]
        struct T {
            b: MemoryBudget,
        }
        let t: T = toml::from_str("b = 1024").unwrap();
        assert_eq!(t.b, MemoryBudget::Bytes(1024));
        let t: T = toml::from_str("b = \"80%\"").unwrap();
        assert_eq!(t.b, MemoryBudget::Percent(80.0));
        let back: T = toml::from_str(&toml::to_string(&t).unwrap()).unwrap();
        assert_eq!(back.b, t.b);
        let err = toml::from_str::<T>("b = \"6 GiBs\"")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("unknown unit"), "{err}");
    }
}
