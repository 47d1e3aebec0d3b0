use super::*;

/// The LR rules see W·K·B: with the LR tuned at 4 samples (B = 2), two ranks at K = 2 get
/// the factor one process gets at K = 4, twice that of K = 2; unset, the base is the
/// starting W·K·B, so a run starts at its LR however many ranks it has.
#[test]
fn the_lr_rules_count_every_ranks_samples() {
    let linear = |ranks: usize, k: usize, base: usize| {
        let mut s = Scenario::default();
        (s.train.micro_batch, s.train.accum_steps) = (2, k);
        s.train.base_batch = base;
        LrRule::Linear.factor(ranks * k * 2, s.base_batch(ranks))
    };
    assert_eq!(linear(2, 2, 4), 2.0);
    assert_eq!(linear(1, 4, 4), 2.0);
    assert_eq!(linear(1, 2, 4), 1.0);
    assert_eq!(linear(2, 2, 0), 1.0);
}

#[test]
fn set_overrides_and_rejects_unknown_keys() {
    let mut s = Scenario::default();
    s.set("train.accum_steps=4").unwrap();
    s.set("train.lr=0").unwrap();
    s.set("train.dtype=bf16").unwrap();
    assert_eq!(s.train.accum_steps, 4);
    assert_eq!(s.train.lr, 0.0);
    assert_eq!(s.train.dtype, Dtype::Bf16);
    let err = s.set("train.acum_steps=4").unwrap_err().to_string();
    assert!(
        err.contains("unknown key `acum_steps`, did you mean `accum_steps`?"),
        "{err}"
    );
    let err = s.set("train.accum_steps=0").unwrap_err().to_string();
    assert!(err.contains("at least 1"), "{err}");
    let err = s.set("train.dtype=f8").unwrap_err().to_string();
    assert!(err.contains("f8"), "{err}");
}

#[test]
fn lora_dropout_is_a_probability_below_one() {
    let mut s = Scenario::default();
    s.set("train.lora_dropout=0.1").unwrap();
    assert_eq!(s.train.lora_dropout, 0.1);
    for bad in ["1", "-0.1", "1.5"] {
        let err = s.set(&format!("train.lora_dropout={bad}")).unwrap_err();
        assert!(err.to_string().contains("below 1"), "{bad}: {err}");
    }
}

#[test]
fn command_line_controls_parse_like_timeline_entries() {
    let e = parse_control_arg("100:set_accum_steps=8").unwrap();
    assert_eq!(
        (e.step, e.control),
        (100, Control::SetAccumSteps { value: 8 })
    );
    let e = parse_control_arg("0:set_clip").unwrap();
    assert_eq!(e.control, Control::SetClip { value: None });
    let e = parse_control_arg("5:set_dtype=f16").unwrap();
    assert_eq!(e.control, Control::SetDtype { value: Dtype::F16 });
    let err = |arg: &str| parse_control_arg(arg).unwrap_err().to_string();
    assert!(err("x:set_clip").contains("step number"));
    assert!(err("3:set_accum_steps=0").contains("at least 1"));
    assert!(err("3:set_acum_steps=2").contains("set_acum_steps"));
    assert_eq!(parse_control_arg("5:stop").unwrap().control, Control::Stop);
    let e = err("5:stop=1");
    assert!(e.contains("`stop` takes no value"), "{e}");
    let e = err("5:set_lr=1e309");
    assert!(e.contains("beyond the largest number"), "{e}");
}

#[test]
fn numbers_toml_cannot_hold_are_named_as_such() {
    let mut s = Scenario::default();
    let err = s.set("train.lr=1e309").unwrap_err().to_string();
    assert!(err.contains("`1e309`: beyond the largest number"), "{err}");
    let err = s
        .set("train.steps=99999999999999999999")
        .unwrap_err()
        .to_string();
    assert!(err.contains("beyond the largest integer"), "{err}");
    s.set("train.lr=1e-3").unwrap();
}

#[test]
fn keys_of_matches_the_structs() {
    // Options serialise only when set: each is set here.
    let root = toml::Value::try_from(Scenario {
        model: ModelConfig {
            path: Some("m".into()),
            adapter: Some("a".into()),
            ..Default::default()
        },
        data: DataConfig {
            path: Some("x".into()),
            tokenizer_file: Some("t.json".into()),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    for section in SECTIONS {
        let mut actual: Vec<String> = root[section].as_table().unwrap().keys().cloned().collect();
        let mut listed: Vec<String> = keys_of(section).iter().map(|s| s.to_string()).collect();
        // `clip` is an Option that serialises only when set; it is on by default.
        actual.sort();
        listed.sort();
        assert_eq!(actual, listed, "section {section}");
    }
}

#[test]
fn parse_errors_name_file_line_and_column() {
    let err = Scenario::from_toml("[train]\nmicro_batch = \"eight\"\n", "p.toml")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("p.toml:2:"), "{err}");
}
