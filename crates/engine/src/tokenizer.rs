//! Subword tokenizers for text corpora: a byte-level BPE trained on the corpus itself (seeded by
//! nothing: the trainer breaks ties by pair id, so the same text and size give the same
//! vocabulary) and cached by the text's hash, or a `tokenizer.json` the user brings (GPT-2's,
//! for example). Both go through Hugging Face's `tokenizers` crate without its C regex engine.
//!
//! Cache: `$XDG_CACHE_HOME/gaccwb/tokenizers/` (else `~/.cache/...`, else the temp dir), one file
//! per (text hash, vocabulary size, trainer version); never beside the user's file. A cache file
//! is one JSON line saying what the tokenizer was trained on and with (the text's hash and
//! length, the vocabulary asked for and obtained, the trainer version, the tokenizer's own hash),
//! then the tokenizer's JSON. A file whose line does not match this text and these settings, or
//! whose tokenizer is not what this trainer makes (another normalizer, ids that are not exactly
//! 0..V-1), is retrained and replaced; a cache path that is not a regular file is refused.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

use crate::safe_write::{self, Overwrite};
use crate::scenario::DataConfig;
use crate::telemetry::TokenizerInfo;

/// Bumped when training changes (options, crate version), so old cache entries are not reused.
const TRAINER_VERSION: &str = "bpe1-tokenizers0.23";
/// The first line's `format`: what says a file is one of these cache files.
const CACHE_FORMAT: &str = "gaccwb-bpe-cache-1";

/// Why no tokenizer could be had for the text.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `data.tokenizer_file` cannot be read or is not a tokenizer.
    #[error("tokenizer file {path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// Training a BPE on the text failed.
    #[error("training a BPE tokenizer on {data}: {message}")]
    Train {
        /// The text's name.
        data: String,
        /// What `tokenizers` said.
        message: String,
    },
    /// The cache holds a file gaccwb may not replace.
    #[error("tokenizer cache {path}: {message}")]
    Cache {
        /// The cache file.
        path: String,
        /// Why it was refused.
        message: String,
    },
}

/// A loaded tokenizer with what the header records about it.
pub struct TextTokenizer {
    inner: Tokenizer,
    /// What the recording's header says about it: kind, vocabulary, hash, file.
    pub info: TokenizerInfo,
    /// A trained tokenizer came from the cache rather than from training.
    pub cache_hit: bool,
    /// What went wrong with the cache, when something did (an invalid file retrained, a file
    /// that could not be written).
    pub cache_note: Option<String>,
    /// Time spent training or loading.
    pub elapsed: Duration,
}

impl TextTokenizer {
    /// Token ids of `text`, with no special tokens added.
    pub fn encode(&self, text: &str) -> tokenizers::Result<Vec<u32>> {
        self.inner.encode(text, false).map(|e| e.get_ids().to_vec())
    }

    /// The text of token ids, with no special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> tokenizers::Result<String> {
        self.inner.decode(ids, false)
    }

    /// The tokenizer's JSON (the cache file's content).
    #[allow(clippy::expect_used)] // a tokenizer built or loaded by `tokenizers` serialises
    pub fn to_json(&self) -> String {
        self.inner
            .to_string(false)
            .expect("a tokenizer built or loaded here serialises")
    }

    /// Loads `path` (a `tokenizer.json`).
    pub fn load_file(path: &Path) -> Result<TextTokenizer, TokenizerError> {
        let started = Instant::now();
        let err = |message: String| TokenizerError::File {
            path: path.display().to_string(),
            message,
        };
        let limit = crate::limits::MAX_TOKENIZER_BYTES;
        let json = crate::limits::read_bounded_text(path, limit, "tokenizer file")
            .map_err(|e| err(format!("cannot read it: {e}")))?;
        let inner = Tokenizer::from_bytes(json.as_bytes()).map_err(|e| {
            err(format!(
                "not a Hugging Face tokenizer.json ({e}); give the tokenizer.json of a \
                 tokenizers-format tokenizer, or drop data.tokenizer_file to train one"
            ))
        })?;
        let vocab = inner.get_vocab_size(true);
        if vocab == 0 {
            return Err(err("its vocabulary is empty".into()));
        }
        Ok(TextTokenizer {
            info: info("file", vocab, &json, path),
            inner,
            cache_hit: false,
            cache_note: None,
            elapsed: started.elapsed(),
        })
    }

    /// The BPE of `vocab` tokens for `text` (named `data` in messages): from `cache_dir` when it
    /// holds a valid one for this text and vocabulary, else trained and written there. A cache
    /// that cannot be written costs a retrain next time, not the run; a cache path that is not a
    /// regular file is refused.
    pub fn trained_for(
        text: &str,
        data: &str,
        vocab: usize,
        cache_dir: &Path,
    ) -> Result<TextTokenizer, TokenizerError> {
        let started = Instant::now();
        let expected = CacheHeader::expected(text, vocab);
        let path = cache_dir.join(format!(
            "{}-v{vocab}-{TRAINER_VERSION}.json",
            expected.corpus_hash
        ));
        let cache_err = |message: String| TokenizerError::Cache {
            path: path.display().to_string(),
            message,
        };
        let stale = match read_cache(&path, &expected) {
            Ok(Some((inner, json))) => {
                return Ok(TextTokenizer {
                    info: info("bpe", inner.get_vocab_size(true), &json, &path),
                    inner,
                    cache_hit: true,
                    cache_note: None,
                    elapsed: started.elapsed(),
                })
            }
            Ok(None) => None,
            Err(CacheProblem::Invalid(why)) => Some(format!("the cache file was invalid ({why})")),
            Err(CacheProblem::Refused(message)) => return Err(cache_err(message)),
        };
        let inner = train_bpe(text, vocab).map_err(|e| TokenizerError::Train {
            data: data.to_string(),
            message: e.to_string(),
        })?;
        #[allow(clippy::expect_used)] // a tokenizer `tokenizers` just trained serialises
        let json = inner
            .to_string(false)
            .expect("a trained tokenizer serialises");
        let header = CacheHeader {
            vocab: inner.get_vocab_size(true),
            tokenizer_hash: hash_hex(json.as_bytes()),
            ..expected
        };
        let unwritten = write_cache(&path, &header, &json)
            .err()
            .map(|e| format!("not cached: {e}"));
        let notes: Vec<String> = stale.into_iter().chain(unwritten).collect();
        Ok(TextTokenizer {
            info: info("bpe", inner.get_vocab_size(true), &json, &path),
            inner,
            cache_hit: false,
            cache_note: (!notes.is_empty()).then(|| notes.join("; ")),
            elapsed: started.elapsed(),
        })
    }
}

/// The first line of a cache file: what its tokenizer was trained on and with.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct CacheHeader {
    format: String,
    corpus_hash: String,
    corpus_bytes: u64,
    vocab_requested: usize,
    /// The vocabulary obtained (a short text gives fewer tokens than asked for).
    vocab: usize,
    trainer: String,
    /// FNV-1a of the tokenizer's JSON that follows.
    tokenizer_hash: String,
}

impl CacheHeader {
    /// The header a cache for `text` and `vocab` must have (its `vocab` and `tokenizer_hash`
    /// are the trained tokenizer's, unknown here).
    fn expected(text: &str, vocab: usize) -> CacheHeader {
        CacheHeader {
            format: CACHE_FORMAT.into(),
            corpus_hash: hash_hex(text.as_bytes()),
            corpus_bytes: text.len() as u64,
            vocab_requested: vocab,
            vocab: 0,
            trainer: TRAINER_VERSION.into(),
            tokenizer_hash: String::new(),
        }
    }

    /// Why `self` (read from a file) does not belong to the cache `expected` describes.
    fn mismatch(&self, expected: &CacheHeader) -> Option<String> {
        let e = expected;
        if self.format != e.format {
            Some(format!("format {:?}, not {:?}", self.format, e.format))
        } else if (&self.corpus_hash, self.corpus_bytes) != (&e.corpus_hash, e.corpus_bytes) {
            Some("trained on another text".into())
        } else if self.vocab_requested != e.vocab_requested {
            let v = self.vocab_requested;
            Some(format!("trained for {v} tokens, not {}", e.vocab_requested))
        } else if self.trainer != e.trainer {
            Some(format!("trained by {}, not {}", self.trainer, e.trainer))
        } else if !(1..=e.vocab_requested).contains(&self.vocab) {
            Some(format!("a vocabulary of {} tokens", self.vocab))
        } else {
            None
        }
    }
}

/// Why a cache file was not used.
enum CacheProblem {
    /// Not a valid cache for this text: retrained and replaced.
    Invalid(String),
    /// Not a regular file: neither read nor replaced.
    Refused(String),
}

/// The tokenizer cached at `path` and its JSON, if a valid one for `expected` is there.
fn read_cache(
    path: &Path,
    expected: &CacheHeader,
) -> Result<Option<(Tokenizer, String)>, CacheProblem> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        _ => safe_write::check(path, "tokenizer cache", &Overwrite::ours()).map_err(|e| {
            CacheProblem::Refused(format!("{e}; remove it to let gaccwb cache there"))
        })?,
    }
    let limit = crate::limits::MAX_TOKENIZER_BYTES;
    let text = crate::limits::read_bounded_text(path, limit, "tokenizer cache")
        .map_err(|e| CacheProblem::Invalid(e.to_string()))?;
    let invalid = |why: String| CacheProblem::Invalid(why);
    let (first, json) = text
        .split_once('\n')
        .ok_or_else(|| invalid("not a gaccwb cache file: no header line".into()))?;
    let header: CacheHeader = serde_json::from_str(first)
        .map_err(|e| invalid(format!("not a gaccwb cache file: {e}")))?;
    if let Some(why) = header.mismatch(expected) {
        return Err(invalid(why));
    }
    if header.tokenizer_hash != hash_hex(json.as_bytes()) {
        return Err(invalid("its tokenizer was changed after training".into()));
    }
    let inner = Tokenizer::from_bytes(json.as_bytes())
        .map_err(|e| invalid(format!("not a tokenizer: {e}")))?;
    check_trained_shape(&inner, header.vocab).map_err(|e| invalid(e.to_string()))?;
    Ok(Some((inner, json.to_string())))
}

/// How a cached tokenizer differs from what `train_bpe` makes.
#[derive(Debug, thiserror::Error)]
enum NotTrainedHere {
    #[error("another {0} than this trainer's")]
    Part(&'static str),
    #[error("added tokens this trainer does not make")]
    AddedTokens,
    #[error("its token ids are not exactly 0..{last}")]
    Ids { last: usize },
    #[error("the byte symbol {0:?} is missing")]
    MissingByte(char),
}

/// `inner` is what `train_bpe` makes: its pipeline (normalizer, pre-tokenizer, post-processor,
/// decoder, no added tokens, no truncation or padding), and ids exactly 0..`vocab`-1 with every
/// byte symbol among them.
fn check_trained_shape(inner: &Tokenizer, vocab: usize) -> Result<(), NotTrainedHere> {
    let names = [
        "normalizer",
        "pre-tokenizer",
        "post-processor",
        "decoder",
        "truncation",
        "padding",
    ];
    let (found, wanted) = (pipeline_parts(inner), pipeline_parts(&pipeline()));
    if let Some(i) = (0..names.len()).find(|&i| found[i] != wanted[i]) {
        return Err(NotTrainedHere::Part(names[i]));
    }
    if !inner.get_added_tokens_decoder().is_empty() {
        return Err(NotTrainedHere::AddedTokens);
    }
    let tokens = inner.get_vocab(true);
    let mut ids: Vec<u32> = tokens.values().copied().collect();
    ids.sort_unstable();
    if ids.len() != vocab || ids.iter().enumerate().any(|(i, &id)| id as usize != i) {
        return Err(NotTrainedHere::Ids { last: vocab - 1 });
    }
    if let Some(missing) = ByteLevel::alphabet()
        .into_iter()
        .find(|c| !tokens.contains_key(&c.to_string()))
    {
        return Err(NotTrainedHere::MissingByte(missing));
    }
    Ok(())
}

/// A tokenizer's parts other than its vocabulary and merges, as JSON, to compare.
fn pipeline_parts(t: &Tokenizer) -> [String; 6] {
    let json = |r: serde_json::Result<String>| r.unwrap_or_else(|e| e.to_string());
    [
        json(serde_json::to_string(&t.get_normalizer())),
        json(serde_json::to_string(&t.get_pre_tokenizer())),
        json(serde_json::to_string(&t.get_post_processor())),
        json(serde_json::to_string(&t.get_decoder())),
        json(serde_json::to_string(&t.get_truncation())),
        json(serde_json::to_string(&t.get_padding())),
    ]
}

/// A text's token ids and what the header records about the tokenizer (dropped afterwards: the
/// run needs only the ids, and its memory would land in the ledger's `other`).
pub struct Tokenized {
    /// The text's token ids, in order.
    pub tokens: Vec<u32>,
    /// What the header records about the tokenizer used.
    pub info: TokenizerInfo,
    /// One line for the run's log: trained, cached or loaded, and how long it took.
    pub provenance: String,
}

/// Why a text could not be cut into tokens; the caller names the file.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The tokenizer could not be loaded or trained.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The tokenizer failed on the text.
    #[error("tokenizing it with {path}: {err}")]
    Encode {
        /// The tokenizer's file.
        path: String,
        /// What `tokenizers` said.
        err: tokenizers::Error,
    },
    /// A tokenizer file whose ids exceed its own vocabulary.
    #[error(
        "{path} gives token id {id}, outside its vocabulary of {vocab}; the tokenizer file is \
         inconsistent"
    )]
    IdOutOfVocabulary {
        /// The tokenizer's file.
        path: String,
        /// The id it gave.
        id: u32,
        /// Its vocabulary size.
        vocab: usize,
    },
}

/// Tokenizes `documents` (the data named `name`) with the BPE `data` asks for, joined by
/// `eos` when the model has an end-of-text token. The error says what is wrong with the data;
/// the caller names the file.
pub fn tokenize(
    documents: &[&str],
    name: &str,
    data: &DataConfig,
    eos: Option<u32>,
) -> Result<Tokenized, TokenizeError> {
    let tokenizer = match &data.tokenizer_file {
        Some(path) => TextTokenizer::load_file(path),
        None => {
            let text = documents.join("\n");
            TextTokenizer::trained_for(&text, name, data.vocab, &default_cache_dir())
        }
    }?;
    let mut tokens = Vec::new();
    for (i, doc) in documents.iter().enumerate() {
        if i > 0 {
            tokens.extend(eos);
        }
        let ids = tokenizer.encode(doc).map_err(|err| TokenizeError::Encode {
            path: tokenizer.info.path.clone(),
            err,
        })?;
        tokens.extend(ids);
    }
    if let Some(&id) = tokens
        .iter()
        .find(|&&id| id as usize >= tokenizer.info.vocab)
    {
        return Err(TokenizeError::IdOutOfVocabulary {
            path: tokenizer.info.path.clone(),
            id,
            vocab: tokenizer.info.vocab,
        });
    }
    let bytes: usize = documents.iter().map(|d| d.len()).sum();
    tokens.shrink_to_fit();
    let how = match (tokenizer.info.kind.as_str(), tokenizer.cache_hit) {
        ("file", _) => "loaded",
        (_, true) => "cache hit",
        _ => "trained",
    };
    let note = tokenizer
        .cache_note
        .as_ref()
        .map(|n| format!(" ({n})"))
        .unwrap_or_default();
    Ok(Tokenized {
        provenance: format!(
            "tokenizer: {how} {}{note} ({} tokens, hash {}) in {:.0} ms; {} bytes -> {} tokens",
            tokenizer.info.path,
            tokenizer.info.vocab,
            tokenizer.info.hash,
            tokenizer.elapsed.as_secs_f64() * 1e3,
            bytes,
            tokens.len()
        ),
        tokens,
        info: tokenizer.info,
    })
}

fn info(kind: &str, vocab: usize, json: &str, path: &Path) -> TokenizerInfo {
    TokenizerInfo {
        kind: kind.to_string(),
        vocab,
        hash: hash_hex(json.as_bytes()),
        path: path.display().to_string(),
    }
}

fn hash_hex(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a64(bytes))
}

/// The header line, then the tokenizer, written through a temporary name (a concurrent reader
/// never sees half a file) over a regular file only.
fn write_cache(path: &Path, header: &CacheHeader, json: &str) -> Result<(), CacheWriteError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|err| CacheWriteError::Dir {
            dir: dir.to_path_buf(),
            err,
        })?;
    }
    let line = serde_json::to_string(header).map_err(CacheWriteError::Header)?;
    let content = format!("{line}\n{json}");
    safe_write::write_file(
        path,
        content.as_bytes(),
        "tokenizer cache",
        &Overwrite::ours(),
    )?;
    Ok(())
}

/// Why a trained tokenizer was not cached (the run goes on; the log says so).
#[derive(Debug, thiserror::Error)]
enum CacheWriteError {
    #[error("creating {}: {err}", dir.display())]
    Dir { dir: PathBuf, err: std::io::Error },
    #[error("the cache header: {0}")]
    Header(serde_json::Error),
    #[error(transparent)]
    Write(#[from] safe_write::WriteError),
}

/// The untrained tokenizer `train_bpe` starts from: an empty BPE with GPT-2's byte-level
/// pre-tokenizer and decoder (no prefix space).
fn pipeline() -> Tokenizer {
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    tokenizer
}

/// A byte-level BPE (GPT-2's pre-tokenizer and decoder, no prefix space) of at most `vocab`
/// tokens. The 256 byte symbols are always in it, so every text round-trips.
pub fn train_bpe(text: &str, vocab: usize) -> tokenizers::Result<Tokenizer> {
    let mut tokenizer = pipeline();
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(vocab)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer.train(&mut trainer, std::iter::once(text))?;
    Ok(tokenizer)
}

/// Where trained tokenizers are cached.
pub fn default_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })
        .unwrap_or_else(std::env::temp_dir);
    base.join("gaccwb").join("tokenizers")
}

/// FNV-1a, 64 bits: a stable content hash for cache keys and the header (not for security).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests;
