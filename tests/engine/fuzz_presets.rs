//! Property tests: the preset parser and `--set` return errors, never panic, on any input.
//! Case counts are fixed here so the suite reports how much it tried.

use gaccwb::presets;
use gaccwb::scenario::Scenario;
use proptest::prelude::*;

const ARBITRARY_CASES: u32 = 2000;
const MUTATION_CASES: u32 = 2000;

/// Built-in preset text with a few bytes replaced, inserted or removed: inputs that are mostly
/// valid TOML, which reach far deeper into the parser than random strings do.
fn mutated_preset() -> impl Strategy<Value = String> {
    let texts: Vec<&'static str> = presets::BUILTIN.iter().map(|(_, t)| *t).collect();
    (
        proptest::sample::select(texts),
        proptest::collection::vec((any::<prop::sample::Index>(), 0u8..3, any::<char>()), 1..6),
    )
        .prop_map(|(text, edits)| {
            let mut chars: Vec<char> = text.chars().collect();
            for (at, op, c) in edits {
                if chars.is_empty() {
                    break;
                }
                let i = at.index(chars.len());
                match op {
                    0 => chars[i] = c,
                    1 => chars.insert(i, c),
                    _ => {
                        chars.remove(i);
                    }
                }
            }
            chars.into_iter().collect()
        })
}

/// Snippets that look like preset lines, recombined in any order.
fn preset_like() -> impl Strategy<Value = String> {
    let pieces = prop_oneof![
        Just("[model]\n".to_string()),
        Just("[train]\n".to_string()),
        Just("[data]\n".to_string()),
        Just("[[timeline]]\n".to_string()),
        "[a-z_]{1,12} = -?[0-9]{1,20}\n",
        "[a-z_]{1,12} = \"[a-z0-9-]{0,8}\"\n",
        "[a-z_]{1,12} = -?[0-9]\\.[0-9]e-?[0-9]{1,3}\n",
        "step = [0-9]{1,20}\n",
        "control = \\{ kind = \"set_[a-z_]{1,12}\", value = [0-9a-z\"\\.]{0,6} \\}\n",
        "(d_model|heads|layers|seq_len|vocab|micro_batch|accum_steps) = [0-9]{1,4}\n",
        "(lr|clip|loss_scale|val_fraction) = (nan|inf|-inf|-1\\.0|0\\.0|1e308)\n",
    ];
    proptest::collection::vec(pieces, 0..16).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(ARBITRARY_CASES))]

    #[test]
    fn arbitrary_text_never_panics(text in any::<String>()) {
        let _ = Scenario::from_toml(&text, "fuzz.toml");
    }

    #[test]
    fn preset_like_text_never_panics(text in preset_like()) {
        if let Ok(s) = Scenario::from_toml(&text, "fuzz.toml") {
            // Whatever the parser accepts must pass validation on its own.
            prop_assert!(s.validate().is_ok());
        }
    }

    #[test]
    fn set_never_panics(assignment in "[a-z_.]{0,20}=?[ -~]{0,12}") {
        let mut s = Scenario::default();
        let _ = s.set(&assignment);
        prop_assert!(s.validate().is_ok());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(MUTATION_CASES))]

    #[test]
    fn mutated_presets_never_panic(text in mutated_preset()) {
        match Scenario::from_toml(&text, "fuzz.toml") {
            Ok(s) => prop_assert!(s.validate().is_ok()),
            // Every error names the file and a place in it.
            Err(e) => prop_assert!(e.to_string().starts_with("fuzz.toml"), "{}", e),
        }
    }
}
