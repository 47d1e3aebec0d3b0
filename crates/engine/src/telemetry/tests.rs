use super::*;
use crate::control::LrRule;

#[test]
fn control_event_has_the_documented_shape() {
    let e = Event::Control(ControlEvent {
        step: 5,
        origin: Origin::Key,
        control: Control::SetAccumSteps { value: 8 },
    });
    let json = serde_json::to_value(&e).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"type":"control","step":5,"origin":"key","control":{"kind":"set_accum_steps","value":8}})
    );
    let back: Event = serde_json::from_value(json).unwrap();
    assert_eq!(back, e);
}

#[test]
fn lr_rules_scale_as_named() {
    assert_eq!(LrRule::None.factor(64, 16), 1.0);
    assert_eq!(LrRule::Linear.factor(64, 16), 4.0);
    assert_eq!(LrRule::Sqrt.factor(64, 16), 2.0);
}
