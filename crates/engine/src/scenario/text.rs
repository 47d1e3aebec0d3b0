//! Pointing at what the user wrote: a key's place in TOML text, and a likely misspelling.

/// Byte offset of a dotted key (`train.clip`, `timeline[2].control`) in TOML text, so a value
/// error points at the value the user wrote. `None` when the key is not written (a default).
pub(super) fn span_of_key(text: &str, key: &str) -> Option<usize> {
    use toml::de::{DeTable, DeValue};
    let root = DeTable::parse(text).ok()?;
    let mut table = root.get_ref();
    let mut found = None;
    for part in key.split('.') {
        let (name, index) = match part.split_once('[') {
            Some((n, rest)) => (n, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (part, None),
        };
        let value = table.iter().find(|(k, _)| k.get_ref() == name)?.1;
        let value = match (value.get_ref(), index) {
            (DeValue::Array(items), Some(i)) => items.get(i)?,
            _ => value,
        };
        found = Some(value.span().start);
        match value.get_ref() {
            DeValue::Table(t) => table = t,
            _ => break,
        }
    }
    found
}

/// serde's "unknown field `acum_steps`, expected one of `steps`, ..." becomes
/// "unknown field `acum_steps`, did you mean `accum_steps`? (expected one of ...)"; the same for
/// unknown variants (`dtype = "f61"`, `kind = "set_acum_steps"`).
pub(super) fn explain_serde_message(message: &str) -> String {
    let Some((what, expected)) = message.split_once(", expected one of ") else {
        return message.to_string();
    };
    let Some(given) = what.split('`').nth(1) else {
        return message.to_string();
    };
    let candidates: Vec<&str> = expected
        .split(", ")
        .map(|c| c.trim().trim_matches('`'))
        .collect();
    match nearest(given, &candidates) {
        Some(best) => format!("{what}, did you mean `{best}`? (expected one of {expected})"),
        None => message.to_string(),
    }
}

/// The candidate closest to `given`, if it is close enough to be a likely misspelling.
pub fn nearest<'a>(given: &str, candidates: &[&'a str]) -> Option<&'a str> {
    // Edits (a swap counts as one) first; similarity of prefixes breaks ties and catches
    // longer slips such as `micro_batch_size`.
    let max_edits = (given.chars().count() / 3).max(1);
    candidates
        .iter()
        .map(|c| {
            (
                strsim::osa_distance(given, c),
                strsim::jaro_winkler(given, c),
                *c,
            )
        })
        .filter(|(edits, similarity, _)| *edits <= max_edits || *similarity >= 0.9)
        .min_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)))
        .map(|(_, _, c)| c)
}

/// 1-based line and column of a byte offset.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before
        .rsplit('\n')
        .next()
        .map(|l| l.chars().count())
        .unwrap_or(0)
        + 1;
    (line, col)
}
