//! Validation measures one fixed set of samples, whatever B and K become during the run.

use crate::common;

use candle_core::Device;
use common::TINY;
use gaccwb::control::Control;
use gaccwb::train::Trainer;

#[test]
fn the_validation_set_is_the_same_before_and_after_a_micro_batch_change() {
    let mut s = TINY.scenario();
    s.train.micro_batch = 4;
    s.train.eval_batches = 3;
    let mut t = Trainer::new(s, Device::Cpu).unwrap();
    let (set, loss) = (t.eval_samples(), t.evaluate().unwrap());
    assert_eq!(set, 0..12);
    for control in [
        Control::SetMicroBatch { value: 5 },
        Control::SetAccumSteps { value: 3 },
        Control::SetMicroBatch { value: 1 },
    ] {
        t.apply_control(&control).unwrap();
        assert_eq!(t.eval_samples(), set, "after {}", control.describe());
        // Same weights, same samples, other chunks: equal up to the order of the sums.
        let after = t.evaluate().unwrap();
        assert!(
            (after - loss).abs() <= 1e-5 * loss,
            "after {}: {after} vs {loss}",
            control.describe()
        );
    }
}
