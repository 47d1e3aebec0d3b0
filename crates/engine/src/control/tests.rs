use super::*;

#[test]
fn a_change_names_the_knob_and_both_values() {
    let knobs = Knobs {
        micro_batch: 32,
        ..test_knobs()
    };
    let change = Control::SetMicroBatch { value: 4 }.describe_change(&knobs);
    assert_eq!(change, "B 32→4");
    let change = Control::SetDtype { value: Dtype::Bf16 }.describe_change(&knobs);
    assert_eq!(change, "dtype f32→bf16");
    let scale = Control::SetLossScale { value: 1024.0 };
    assert_eq!(scale.describe_change(&knobs), scale.describe());
}
