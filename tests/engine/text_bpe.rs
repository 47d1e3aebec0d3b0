//! Real text with a subword vocabulary: the `text-bpe` preset trains a byte-level BPE on the
//! built-in docs corpus, sizes the model from it, records it in the header, and learns.

use candle_core::Device;
use gaccwb::train::Trainer;

use crate::common;

use common::TINY;

/// `text-bpe` with [`TINY`] (the tokenizer still sizes the vocabulary, 8192, so the head is what
/// it is in the preset) and no timeline.
fn tiny_text_bpe() -> gaccwb::scenario::Scenario {
    let mut s = TINY.onto(gaccwb::presets::resolve("text-bpe").unwrap());
    s.train.micro_batch = 8;
    s.train.accum_steps = 1;
    s.timeline.clear();
    s
}

#[test]
fn text_bpe_sizes_the_model_from_the_tokenizer_and_the_loss_falls() {
    const STEPS: usize = 30;
    let mut t = Trainer::new(tiny_text_bpe(), Device::Cpu).unwrap();
    let info = t
        .header()
        .tokenizer
        .expect("a BPE run records its tokenizer");
    assert_eq!(info.kind, "bpe");
    assert_eq!(
        info.vocab, 8192,
        "the docs corpus supports a full 8k vocabulary"
    );
    assert_eq!(t.scenario().model.vocab, info.vocab);
    assert_eq!(t.header().config.model.vocab, info.vocab);
    assert!(
        t.header().entropy_floor.is_none(),
        "real text has no known floor"
    );
    assert!(
        t.corpus().has_validation(),
        "validation reads the held-out tail"
    );
    println!("{}", t.corpus().provenance().unwrap());
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        match t.train_step(|| true) {
            Ok(step) => losses.push(step.loss),
            Err(_) => panic!("step {} failed", losses.len() + 1),
        }
    }
    let val = t.evaluate().unwrap();
    let start = losses[0];
    let end = losses[STEPS - 5..].iter().sum::<f64>() / 5.0;
    println!(
        "loss {start:.3} -> {end:.3} over {STEPS} steps (ln 8192 = {:.3}); val {val:.3}",
        (8192f64).ln()
    );
    assert!(
        end < start - 1.0,
        "loss did not fall: {start:.3} -> {end:.3}"
    );
    assert!(val < start, "validation {val:.3} vs first loss {start:.3}");
}

#[test]
fn a_bad_tokenizer_file_fails_the_run_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("my-tokenizer.json");
    std::fs::write(&path, "[1, 2, 3]").unwrap();
    let mut s = tiny_text_bpe();
    s.set(&format!("data.tokenizer_file={}", path.display()))
        .unwrap();
    let Err(err) = Trainer::new(s, Device::Cpu) else {
        panic!("a bad tokenizer file must be refused");
    };
    let err = err.to_string();
    assert!(err.contains("my-tokenizer.json"), "{err}");
}

#[test]
fn bpe_without_text_is_refused_naming_the_key() {
    let mut s = gaccwb::scenario::Scenario::default();
    let err = s.set("data.tokenizer=bpe").unwrap_err().to_string();
    assert!(
        err.contains("data.tokenizer") && err.contains("docs"),
        "{err}"
    );
}
