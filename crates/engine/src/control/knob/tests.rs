use super::*;

fn knobs() -> Knobs {
    crate::control::test_knobs()
}

/// Each knob names a `Knobs` field and a control kind that exist, every knob-setting
/// control has a row, and each row's actions send its own control: a knob missing from the
/// table, or a row naming a field or control that is not there, fails here.
#[test]
fn every_knob_control_has_one_row_and_every_row_its_parts() {
    let fields = serde_json::to_value(knobs()).unwrap();
    let kinds = <Control as strum::VariantNames>::VARIANTS;
    for knob in KNOBS {
        assert!(
            fields.get(knob.key).is_some(),
            "{}: no Knobs field",
            knob.key
        );
        assert!(kinds.contains(&knob.kind), "{}: no control", knob.kind);
        for a in knob.actions {
            let sent = (a.turn)(&knobs(), &knobs());
            assert_eq!(sent.knob().map(|k| k.key), Some(knob.key), "{}", a.name);
            assert!(!a.keys.is_empty(), "{} has no default key", a.name);
        }
    }
    let not_knobs = ["set_loss_scale", "pause", "resume", "single_step", "stop"];
    for kind in kinds.iter().filter(|k| !not_knobs.contains(k)) {
        assert!(
            Knob::by_kind(kind).is_some(),
            "control {kind} has no knob row"
        );
    }
    let mut names: Vec<&str> = KNOBS
        .iter()
        .flat_map(|k| k.actions)
        .map(|a| a.name)
        .collect();
    let total = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), total, "an action name is used twice");
}

/// docs/FORMAT.md documents every knob: its control kind and its preset key.
#[test]
fn the_format_doc_names_every_knob() {
    let format = include_str!("../../../../../docs/FORMAT.md");
    for knob in KNOBS {
        let kind = format!("`{}`", knob.kind);
        assert!(
            format.contains(&kind),
            "docs/FORMAT.md: no control kind {kind}"
        );
        let key = format!("| `{}` |", knob.key);
        assert!(
            format.contains(&key),
            "docs/FORMAT.md: no [train] row {key}"
        );
    }
}

#[test]
fn values_read_in_the_users_words_and_bounds_hold() {
    let k = knobs();
    let shown = |key: &str| Knob::by_key(key).unwrap().show(&k);
    assert_eq!(shown("accum_steps"), "2");
    assert_eq!(shown("clip"), "1");
    assert_eq!(shown("lr"), "3.00e-3");
    assert_eq!(shown("offload"), "off");
    assert_eq!(shown("zero_grad"), "per-window");
    let accum = Knob::by_key("accum_steps").unwrap();
    assert_eq!(accum.check(Some(&0.into())), Err(OutOfBounds::BelowOne(0)));
    assert!(accum.check(Some(&(MAX_ACCUM_STEPS + 1).into())).is_err());
    let clip = Knob::by_key("clip").unwrap();
    assert!(clip.check(None).is_ok() && clip.check(Some(&(-1.0).into())).is_err());
}
