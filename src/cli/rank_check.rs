//! What the ranks of one job check together before anything is built: that each was started
//! with rank 0's run (a rank with another model shape would exchange buffers of other sizes),
//! and that none refused to start (a refusal only rank 0 checks would otherwise leave the
//! others waiting in their first collective until `train.comm_timeout`).

use serde_json::Value;

use super::ExitClass;

/// Where `mine` first differs from rank 0's (`theirs`, as JSON text): the field's path and
/// both values, e.g. `scenario.model.d_model is 64 here, 32 on rank 0`; `None` when equal.
pub fn difference(mine: &Value, theirs: &[u8]) -> Option<String> {
    let Ok(theirs) = serde_json::from_slice::<Value>(theirs) else {
        return Some("rank 0's run could not be read".into());
    };
    first_difference(mine, &theirs, String::new())
}

fn first_difference(mine: &Value, theirs: &Value, at: String) -> Option<String> {
    let join = |key: &str| match at.is_empty() {
        true => key.to_string(),
        false => format!("{at}.{key}"),
    };
    match (mine, theirs) {
        (Value::Object(a), Value::Object(b)) => {
            let keys = a.keys().chain(b.keys().filter(|k| !a.contains_key(*k)));
            keys.into_iter().find_map(|k| {
                let (x, y) = (a.get(k), b.get(k));
                first_difference(
                    x.unwrap_or(&Value::Null),
                    y.unwrap_or(&Value::Null),
                    join(k),
                )
            })
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (x, y))| first_difference(x, y, format!("{at}[{i}]"))),
        _ if mine == theirs => None,
        _ => Some(format!("{at} is {mine} here, {theirs} on rank 0")),
    }
}

/// Another rank refused to start (its message is in the job's output); this rank ends with
/// the same class of exit code.
#[derive(Debug, thiserror::Error)]
#[error("rank {rank} refused to start (its message says why); every rank ends with it")]
pub struct PeerRefused {
    /// The first rank that refused.
    pub rank: usize,
    /// Its exit code.
    pub code: u8,
}

/// A refusal this rank has printed already, while the other ranks waited for it; it ends
/// the process with its exit code and is not printed again.
#[derive(Debug, thiserror::Error)]
#[error("(printed above)")]
pub struct Said {
    /// Its exit code.
    pub code: u8,
}

/// Print `e` as `main` prints an error, now, and stand for it.
pub fn say(e: &anyhow::Error) -> Said {
    super::error::print(e);
    Said {
        code: ExitClass::of(e).code(),
    }
}

/// The first rank whose outcome in `codes` (one per rank, 0: ready) is a refusal, as an error.
pub fn peer_refusal(codes: &[u64]) -> Result<(), PeerRefused> {
    match codes.iter().position(|&c| c != 0) {
        Some(rank) => Err(PeerRefused {
            rank,
            code: u8::try_from(codes[rank]).unwrap_or(1),
        }),
        None => Ok(()),
    }
}

impl ExitClass {
    /// The exit code as a number, for the ranks to exchange.
    pub fn code(self) -> u8 {
        match self {
            ExitClass::Usage => 2,
            ExitClass::Failure => 1,
            ExitClass::Signal(n) => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_differing_field_is_named_with_both_values() {
        let a = serde_json::json!({"scenario": {"model": {"d_model": 64, "layers": 1}}});
        let b = serde_json::json!({"scenario": {"model": {"d_model": 32, "layers": 1}}});
        let why = difference(&a, b.to_string().as_bytes()).unwrap();
        assert_eq!(why, "scenario.model.d_model is 64 here, 32 on rank 0");
        assert_eq!(difference(&a, a.to_string().as_bytes()), None);
    }

    #[test]
    fn the_first_refusing_rank_decides_the_exit_code() {
        assert!(peer_refusal(&[0, 0]).is_ok());
        let e = peer_refusal(&[0, 2, 1]).unwrap_err();
        assert_eq!((e.rank, e.code), (1, 2));
    }
}
