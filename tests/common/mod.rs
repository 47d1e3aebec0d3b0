//! Shared by the integration tests: the smallest model that still exercises every layer type.

use gaccwb::scenario::Scenario;

/// A 2-layer, 32-wide GPT over a 32-token vocabulary with 32-token samples; no evaluation.
pub fn tiny_scenario() -> Scenario {
    let mut s = Scenario::default();
    s.model.vocab = 32;
    s.model.d_model = 32;
    s.model.layers = 2;
    s.model.heads = 2;
    s.model.seq_len = 32;
    s.train.eval_every = 0;
    s
}
