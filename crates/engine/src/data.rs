//! Corpora. Every sample is a pure function of (seed, split, index): a window consumes the next
//! B·K sample indices however it is cut into micro-batches, so runs with different K see the
//! same data sample for sample, and a checkpoint only needs the index.
//!
//! - `Synthetic`: documents from a seeded sparse order-2 Markov chain over a small alphabet. Every
//!   context has the same successor probabilities (in a context-specific order and support), so
//!   the entropy rate is known in closed form whatever the stationary distribution.
//! - `Bytes`: windows of a file's bytes at seeded offsets, with a held-out tail for validation.
//! - `Bpe`: the same windows over the text's BPE token ids (`crate::tokenizer`); the model's
//!   vocabulary is the tokenizer's.

use std::borrow::Cow;

use candle_core::{Device, Result as CResult, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::scenario::{DataConfig, DataOrder, DataSource, ModelConfig, Scenario, TokenizerKind};
use crate::telemetry::TokenizerInfo;

/// Document delimiter (the first input of every synthetic document) and padding value.
pub const DELIM: u32 = 0;

/// Successor probabilities of every context of the synthetic chain.
const SUCCESSOR_PROBS: [f64; 3] = [0.6, 0.3, 0.1];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// Which part of the data a sample comes from; the two never share a sample.
pub enum Split {
    /// The samples the model trains on.
    Train,
    /// The held-out samples evaluation measures.
    Val,
}

/// One training example: `seq_len + 1` tokens, of which the first `len` targets count.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The tokens: inputs are `tokens[..seq_len]`, targets `tokens[1..]`.
    pub tokens: Vec<u32>,
    /// Counted targets: positions `0..len` predict `tokens[1..=len]`; the rest is padding.
    pub len: usize,
    /// Its index in its split's stream (`Corpus::sample`): LoRA's dropout masks are drawn from
    /// it, so a sample gets the same mask however windows are cut.
    pub index: u64,
}

/// Where the samples come from: the synthetic chain, a file's bytes, or a file cut by a BPE.
pub enum Corpus {
    /// The seeded Markov chain (the default).
    Synthetic(Markov),
    /// A file's bytes, one token each.
    Bytes(ByteCorpus),
    /// A file's text cut into BPE tokens.
    Bpe {
        /// The token stream, cut into samples as the bytes are.
        windows: ByteCorpus,
        /// What the header records about the tokenizer.
        tokenizer: TokenizerInfo,
        /// How the tokenizer was obtained, for the run's log.
        provenance: String,
    },
}

/// Why the data could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The data file cannot be read, or its contents cannot be used.
    #[error("data file {path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What is wrong and what to do.
        message: String,
    },
}

impl Corpus {
    /// The corpus `data` describes, shaped for `model` (its sequence length and vocabulary).
    pub fn open(data: &DataConfig, model: &ModelConfig) -> std::result::Result<Corpus, DataError> {
        match data.source {
            DataSource::Synthetic => Ok(Corpus::Synthetic(Markov::new(data, model))),
            DataSource::File | DataSource::Docs => {
                let (name, bytes) = text_source(data)?;
                match data.tokenizer {
                    TokenizerKind::Bytes => {
                        ByteCorpus::from_bytes(bytes, &name, data, model).map(Corpus::Bytes)
                    }
                    TokenizerKind::Bpe => {
                        let docs = documents(&bytes, &name)?;
                        let docs: Vec<&str> = docs.iter().map(|d| d.as_ref()).collect();
                        // The model's end-of-text token belongs to its own tokenizer only.
                        let eos = match data.tokenizer_file {
                            Some(_) => model_eos(model)?,
                            None => None,
                        };
                        let t =
                            crate::tokenizer::tokenize(&docs, &name, data, eos).map_err(|e| {
                                DataError::File {
                                    path: name.clone(),
                                    message: e.to_string(),
                                }
                            })?;
                        let windows =
                            ByteCorpus::from_tokens(t.tokens, &name, "tokens", data, model)?;
                        Ok(Corpus::Bpe {
                            windows,
                            tokenizer: t.info,
                            provenance: t.provenance,
                        })
                    }
                }
            }
        }
    }

    /// Opens the scenario's data and sizes its model's vocabulary from the tokenizer, if any
    /// (the header's config then records the vocabulary used).
    /// A model loaded from a directory keeps its embedding: the tokenizer must fit it.
    pub fn open_sizing(scenario: &mut Scenario) -> std::result::Result<Corpus, DataError> {
        let corpus = Corpus::open(&scenario.data, &scenario.model)?;
        let (Some(vocab), Some(info)) = (corpus.vocab(), corpus.tokenizer()) else {
            return Ok(corpus);
        };
        match &scenario.model.path {
            None => scenario.model.vocab = vocab,
            Some(model) if vocab > scenario.model.vocab => {
                return Err(DataError::File {
                    path: info.path.clone(),
                    message: format!(
                        "the tokenizer has {vocab} tokens but the model at {} embeds {}; use the model's own tokenizer.json",
                        model.display(),
                        scenario.model.vocab
                    ),
                })
            }
            Some(_) => {}
        }
        Ok(corpus)
    }

    /// The vocabulary the data fixes (a tokenizer's), which the model must use.
    pub fn vocab(&self) -> Option<usize> {
        match self {
            Corpus::Bpe { tokenizer, .. } => Some(tokenizer.vocab),
            _ => None,
        }
    }

    /// How the tokenizer was obtained (trained, cache hit, loaded) and how long it took.
    pub fn provenance(&self) -> Option<&str> {
        match self {
            Corpus::Bpe { provenance, .. } => Some(provenance),
            _ => None,
        }
    }

    /// The BPE's description, for a BPE corpus.
    pub fn tokenizer(&self) -> Option<&TokenizerInfo> {
        match self {
            Corpus::Bpe { tokenizer, .. } => Some(tokenizer),
            _ => None,
        }
    }

    /// Sample `index` of `split`: the same for a given seed and index, however windows are cut.
    pub fn sample(&self, split: Split, index: u64) -> Sample {
        match self {
            Corpus::Synthetic(m) => m.sample(split, index),
            Corpus::Bytes(b) | Corpus::Bpe { windows: b, .. } => b.sample(split, index),
        }
    }

    /// Expected loss of a perfect model in nats per counted token, when known in closed form.
    pub fn entropy_floor(&self) -> Option<f64> {
        match self {
            Corpus::Synthetic(m) => Some(m.entropy_floor()),
            Corpus::Bytes(_) | Corpus::Bpe { .. } => None,
        }
    }

    /// Whether there are validation samples to evaluate on.
    pub fn has_validation(&self) -> bool {
        match self {
            Corpus::Synthetic(_) => true,
            Corpus::Bytes(b) | Corpus::Bpe { windows: b, .. } => b.val_len() > b.seq_len,
        }
    }
}

/// A deterministic generator for sample `index` of `split`.
fn sample_rng(seed: u64, split: Split, index: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(match split {
        Split::Train => 1,
        Split::Val => 2,
    });
    rng.set_word_pos(u128::from(index) * 1024);
    ChaCha8Rng::seed_from_u64(rng.random())
}

/// Documents from a seeded sparse order-2 Markov chain over a small alphabet, with an exactly known entropy rate.
pub struct Markov {
    alphabet: usize,
    seq_len: usize,
    min_len: usize,
    max_len: usize,
    seed: u64,
    /// For context (a, b): successors, in the order of SUCCESSOR_PROBS.
    successors: Vec<[u32; 3]>,
}

impl Markov {
    /// The chain `data` seeds, with samples of `model.seq_len` tokens.
    pub fn new(data: &DataConfig, model: &ModelConfig) -> Markov {
        let a = data.alphabet;
        let max_len = if data.max_doc_len == 0 {
            model.seq_len
        } else {
            data.max_doc_len.min(model.seq_len)
        };
        let min_len = data.min_doc_len.clamp(2, max_len.max(2)).min(max_len);
        let mut rng = ChaCha8Rng::seed_from_u64(data.seed ^ 0x6761_6363_7762);
        let successors = (0..a * a)
            .map(|_| {
                let mut s = [0u32; 3];
                for i in 0..3 {
                    loop {
                        let c = rng.random_range(0..a as u32);
                        if !s[..i].contains(&c) {
                            s[i] = c;
                            break;
                        }
                    }
                }
                s
            })
            .collect();
        Markov {
            alphabet: a,
            seq_len: model.seq_len,
            min_len,
            max_len,
            seed: data.seed,
            successors,
        }
    }

    fn sample(&self, split: Split, index: u64) -> Sample {
        let mut rng = sample_rng(self.seed, split, index);
        let len = rng.random_range(self.min_len..=self.max_len);
        let a = self.alphabet as u32;
        let mut symbols: Vec<u32> = Vec::with_capacity(len);
        for i in 0..len {
            let s = if i < 2 {
                rng.random_range(0..a)
            } else {
                let ctx = (symbols[i - 2] * a + symbols[i - 1]) as usize;
                let u: f64 = rng.random();
                let pick = if u < SUCCESSOR_PROBS[0] {
                    0
                } else if u < SUCCESSOR_PROBS[0] + SUCCESSOR_PROBS[1] {
                    1
                } else {
                    2
                };
                self.successors[ctx][pick]
            };
            symbols.push(s);
        }
        let mut tokens = Vec::with_capacity(self.seq_len + 1);
        tokens.push(DELIM);
        tokens.extend(symbols.iter().map(|s| s + 1));
        tokens.resize(self.seq_len + 1, DELIM);
        Sample { tokens, len, index }
    }

    /// Per-context entropy of the chain (nats).
    pub fn entropy_rate() -> f64 {
        -SUCCESSOR_PROBS.iter().map(|p| p * p.ln()).sum::<f64>()
    }

    /// Token-weighted expected loss of the true distribution: the first two symbols of a document
    /// are uniform (ln A nats each), the rest cost the entropy rate. Lengths are uniform in
    /// \[min, max\], so E\[len\] = (min + max) / 2.
    pub fn entropy_floor(&self) -> f64 {
        let mean_len = (self.min_len + self.max_len) as f64 / 2.0;
        let h = Self::entropy_rate();
        let uniform = (self.alphabet as f64).ln();
        (2.0 * uniform + (mean_len - 2.0) * h) / mean_len
    }
}

/// The documents of a text: every line's `text` of a JSONL file (`*.jsonl`), else the whole
/// text as one document.
fn documents<'a>(bytes: &'a [u8], name: &str) -> std::result::Result<Vec<Cow<'a, str>>, DataError> {
    let err = |message: String| DataError::File {
        path: name.to_string(),
        message,
    };
    let text = std::str::from_utf8(bytes).map_err(|e| {
        err(format!(
            "not UTF-8 text (byte {}); data.tokenizer = \"bpe\" needs text, use \"bytes\" for other files",
            e.valid_up_to()
        ))
    })?;
    if !name.ends_with(".jsonl") {
        return Ok(vec![Cow::Borrowed(text)]);
    }
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |why: &str| {
            err(format!(
                "line {}: {why}; each line of a .jsonl file is an object with a string field `text`",
                i + 1
            ))
        };
        let mut value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(&format!("not JSON ({e})")))?;
        match value.get_mut("text").map(serde_json::Value::take) {
            Some(serde_json::Value::String(text)) => docs.push(Cow::Owned(text)),
            Some(_) => return Err(bad("`text` is not a string")),
            None => return Err(bad("no `text` field")),
        }
    }
    if docs.is_empty() {
        return Err(err("no documents: every line is blank".into()));
    }
    Ok(docs)
}

/// The token ids of the text file `path` (plain text, or a `.jsonl` file's `text` fields joined
/// by `eos`) cut by the `tokenizer.json` at `tokenizer`, no special tokens added.
pub fn text_ids(
    path: &std::path::Path,
    tokenizer: &std::path::Path,
    eos: Option<u32>,
) -> std::result::Result<Vec<u32>, DataError> {
    let name = path.display().to_string();
    let bytes =
        crate::limits::read_bounded(path, crate::limits::MAX_DATA_BYTES, "text").map_err(|e| {
            DataError::File {
                path: name.clone(),
                message: e.to_string(),
            }
        })?;
    let docs = documents(&bytes, &name)?;
    let docs: Vec<&str> = docs.iter().map(|d| d.as_ref()).collect();
    let data = DataConfig {
        tokenizer_file: Some(tokenizer.to_path_buf()),
        tokenizer: TokenizerKind::Bpe,
        ..DataConfig::default()
    };
    crate::tokenizer::tokenize(&docs, &name, &data, eos)
        .map(|t| t.tokens)
        .map_err(|e| DataError::File {
            path: name,
            message: e.to_string(),
        })
}

/// The end-of-text token of the model the scenario fine-tunes, which joins documents.
fn model_eos(model: &ModelConfig) -> std::result::Result<Option<u32>, DataError> {
    let Some(path) = &model.path else {
        return Ok(None);
    };
    let spec = crate::model::hf::ModelDir::open(path)
        .and_then(|dir| dir.spec())
        .map_err(|e| DataError::File {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
    Ok(spec.eos)
}

/// The text a file or docs source reads, with the name errors give it.
fn text_source(data: &DataConfig) -> std::result::Result<(String, Vec<u8>), DataError> {
    if data.source == DataSource::Docs {
        return Ok(("the built-in docs corpus".into(), DOCS_CORPUS.to_vec()));
    }
    #[allow(clippy::expect_used)] // `Scenario::validate` refuses a file source with no path
    let path = data
        .path
        .as_deref()
        .expect("validated: file source has a path");
    let bytes = crate::limits::read_bounded(path, crate::limits::MAX_DATA_BYTES, "corpus")
        .map_err(|e| DataError::File {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
    Ok((path.display().to_string(), bytes))
}

/// `data.source = "docs"`: the project's own prose and code, fixed at build time
/// (scripts/assemble-corpus.sh).
pub const DOCS_CORPUS: &[u8] = include_bytes!("../../../assets/corpus.txt");

/// Windows over a token sequence (bytes, or BPE ids).
pub struct ByteCorpus {
    tokens: Vec<u32>,
    train_len: usize,
    seq_len: usize,
    seed: u64,
    order: DataOrder,
}

impl ByteCorpus {
    fn from_bytes(
        bytes: Vec<u8>,
        name: &str,
        data: &DataConfig,
        model: &ModelConfig,
    ) -> std::result::Result<ByteCorpus, DataError> {
        let err = |message: String| DataError::File {
            path: name.to_string(),
            message,
        };
        if bytes.is_empty() {
            return Err(err(
                "it is empty; give a file with at least model.seq_len + 1 bytes".into(),
            ));
        }
        if let Some(pos) = bytes.iter().position(|&b| b as usize >= model.vocab) {
            return Err(err(format!(
                "byte {} at offset {pos} is outside model.vocab ({}); set model.vocab = 256 for arbitrary files",
                bytes[pos], model.vocab
            )));
        }
        let tokens = bytes.into_iter().map(u32::from).collect();
        ByteCorpus::from_tokens(tokens, name, "bytes", data, model)
    }

    /// `tokens` (counted in `unit` in messages) split into training and held-out tail.
    fn from_tokens(
        tokens: Vec<u32>,
        name: &str,
        unit: &str,
        data: &DataConfig,
        model: &ModelConfig,
    ) -> std::result::Result<ByteCorpus, DataError> {
        let train_len = ((tokens.len() as f64) * (1.0 - data.val_fraction)).floor() as usize;
        if train_len < model.seq_len + 1 {
            return Err(DataError::File {
                path: name.to_string(),
                message: format!(
                    "its training split has {train_len} {unit} but model.seq_len + 1 = {} are needed; \
                     use a larger file or a smaller model.seq_len",
                    model.seq_len + 1
                ),
            });
        }
        Ok(ByteCorpus {
            tokens,
            train_len,
            seq_len: model.seq_len,
            seed: data.seed,
            order: data.order,
        })
    }

    fn val_len(&self) -> usize {
        self.tokens.len() - self.train_len
    }

    fn sample(&self, split: Split, index: u64) -> Sample {
        let (start, len) = match split {
            Split::Train => (0, self.train_len),
            Split::Val if self.val_len() > self.seq_len => (self.train_len, self.val_len()),
            Split::Val => (0, self.train_len),
        };
        let window = self.seq_len + 1;
        let offset = match (self.order, split) {
            // Consecutive windows from the split's start, wrapping around at its end.
            (DataOrder::Sequential, Split::Train) => {
                start + (index % (len / window).max(1) as u64) as usize * window
            }
            _ => {
                let mut rng = sample_rng(self.seed, split, index);
                start + rng.random_range(0..=len - window)
            }
        };
        Sample {
            tokens: self.tokens[offset..offset + self.seq_len + 1].to_vec(),
            len: self.seq_len,
            index,
        }
    }
}

/// Device tensors for a micro-batch.
pub struct Batch {
    /// `[B, T]` u32.
    pub inputs: Tensor,
    /// `[B*T]` u32.
    pub targets: Tensor,
    /// `[B*T]` f32: 1 where the target counts.
    pub mask: Tensor,
    /// Counted targets.
    pub tokens: u64,
}

impl Batch {
    /// Stack `samples` into input, target and mask tensors on `device`.
    pub fn new(samples: &[Sample], device: &Device) -> CResult<Batch> {
        let b = samples.len();
        let t = samples[0].tokens.len() - 1;
        let mut inputs = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        let mut mask = Vec::with_capacity(b * t);
        for s in samples {
            inputs.extend_from_slice(&s.tokens[..t]);
            targets.extend_from_slice(&s.tokens[1..]);
            mask.extend((0..t).map(|i| if i < s.len { 1f32 } else { 0.0 }));
        }
        Ok(Batch {
            inputs: Tensor::from_vec(inputs, (b, t), device)?,
            targets: Tensor::from_vec(targets, b * t, device)?,
            mask: Tensor::from_vec(mask, b * t, device)?,
            tokens: samples.iter().map(|s| s.len as u64).sum(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> Corpus {
        let model = ModelConfig {
            seq_len: 32,
            ..Default::default()
        };
        Corpus::open(
            &DataConfig {
                min_doc_len: 4,
                ..Default::default()
            },
            &model,
        )
        .unwrap()
    }

    #[test]
    fn samples_are_a_pure_function_of_the_index() {
        let c = corpus();
        assert_eq!(c.sample(Split::Train, 7), c.sample(Split::Train, 7));
        assert_ne!(c.sample(Split::Train, 7), c.sample(Split::Train, 8));
        assert_ne!(c.sample(Split::Train, 7), c.sample(Split::Val, 7));
    }

    #[test]
    fn documents_vary_in_length_and_pad_with_the_delimiter() {
        let c = corpus();
        let lens: std::collections::BTreeSet<usize> =
            (0..50).map(|i| c.sample(Split::Train, i).len).collect();
        assert!(lens.len() > 5, "lengths {lens:?}");
        for i in 0..50 {
            let s = c.sample(Split::Train, i);
            assert_eq!(s.tokens.len(), 33);
            assert!(s.tokens[s.len + 1..].iter().all(|&t| t == DELIM));
            assert!(s.tokens[1..=s.len].iter().all(|&t| (1..=16).contains(&t)));
        }
    }

    #[test]
    fn empirical_conditional_entropy_matches_the_closed_form() {
        // Count trigram statistics over many documents; the plug-in conditional entropy of
        // positions ≥ 2 must approach the per-context entropy.
        let c = corpus();
        let mut counts = std::collections::HashMap::<(u32, u32, u32), f64>::new();
        let mut ctx = std::collections::HashMap::<(u32, u32), f64>::new();
        for i in 0..4000 {
            let s = c.sample(Split::Train, i);
            for w in s.tokens[1..=s.len].windows(3) {
                *counts.entry((w[0], w[1], w[2])).or_default() += 1.0;
                *ctx.entry((w[0], w[1])).or_default() += 1.0;
            }
        }
        let total: f64 = counts.values().sum();
        let h: f64 = counts
            .iter()
            .map(|(&(a, b, _), &n)| -n / total * (n / ctx[&(a, b)]).ln())
            .sum();
        assert!(
            (h - Markov::entropy_rate()).abs() < 0.03,
            "plug-in {h} vs {}",
            Markov::entropy_rate()
        );
    }
}
