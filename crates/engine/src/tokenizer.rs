//! Subword tokenizers for text corpora: a byte-level BPE trained on the corpus itself (seeded by
//! nothing: the trainer breaks ties by pair id, so the same text and size give the same
//! vocabulary) and cached by the text's hash, or a `tokenizer.json` the user brings (GPT-2's,
//! for example). Both go through Hugging Face's `tokenizers` crate without its C regex engine.
//!
//! Cache: `$XDG_CACHE_HOME/gaccwb/tokenizers/` (else `~/.cache/...`, else the temp dir), one file
//! per (text hash, vocabulary size, trainer version); never beside the user's file.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

use crate::scenario::DataConfig;
use crate::telemetry::TokenizerInfo;

/// Bumped when training changes (options, crate version), so old cache entries are not reused.
const TRAINER_VERSION: &str = "bpe1-tokenizers0.23";

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer file {path}: {message}")]
    File { path: String, message: String },
    #[error("training a BPE tokenizer on {data}: {message}")]
    Train { data: String, message: String },
}

/// A loaded tokenizer with what the header records about it.
pub struct TextTokenizer {
    inner: Tokenizer,
    pub info: TokenizerInfo,
    /// A trained tokenizer came from the cache rather than from training.
    pub cache_hit: bool,
    /// Time spent training or loading.
    pub elapsed: Duration,
}

impl TextTokenizer {
    /// Token ids of `text`, with no special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner.decode(ids, false).map_err(|e| e.to_string())
    }

    /// The tokenizer's JSON (the cache file's content).
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
        let json =
            std::fs::read_to_string(path).map_err(|e| err(format!("cannot read it: {e}")))?;
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
            elapsed: started.elapsed(),
        })
    }

    /// The BPE of `vocab` tokens for `text` (named `data` in messages): from `cache_dir` when it
    /// holds one for this text, else trained and written there. A cache that cannot be written
    /// costs a retrain next time, not the run.
    pub fn trained_for(
        text: &str,
        data: &str,
        vocab: usize,
        cache_dir: &Path,
    ) -> Result<TextTokenizer, TokenizerError> {
        let started = Instant::now();
        let key = format!(
            "{:016x}-v{vocab}-{TRAINER_VERSION}.json",
            fnv1a64(text.as_bytes())
        );
        let path = cache_dir.join(key);
        if let Ok(json) = std::fs::read_to_string(&path) {
            if let Ok(inner) = Tokenizer::from_bytes(json.as_bytes()) {
                return Ok(TextTokenizer {
                    info: info("bpe", inner.get_vocab_size(true), &json, &path),
                    inner,
                    cache_hit: true,
                    elapsed: started.elapsed(),
                });
            }
        }
        let inner = train_bpe(text, vocab).map_err(|message| TokenizerError::Train {
            data: data.to_string(),
            message,
        })?;
        let json = inner
            .to_string(false)
            .expect("a trained tokenizer serialises");
        write_cache(&path, &json);
        Ok(TextTokenizer {
            info: info("bpe", inner.get_vocab_size(true), &json, &path),
            inner,
            cache_hit: false,
            elapsed: started.elapsed(),
        })
    }
}

/// A text's token ids and what the header records about the tokenizer (dropped afterwards: the
/// run needs only the ids, and its memory would land in the ledger's `other`).
pub struct Tokenized {
    pub tokens: Vec<u32>,
    pub info: TokenizerInfo,
    /// One line for the run's log: trained, cached or loaded, and how long it took.
    pub provenance: String,
}

/// Tokenizes `bytes` (the data named `name`) with the BPE `data` asks for. The error says what
/// is wrong with the data; the caller names the file.
pub fn tokenize(bytes: &[u8], name: &str, data: &DataConfig) -> Result<Tokenized, String> {
    let err = |message: String| message;
    let text = std::str::from_utf8(bytes).map_err(|e| {
        err(format!(
            "not UTF-8 text (byte {}); data.tokenizer = \"bpe\" needs text, use \"bytes\" for other files",
            e.valid_up_to()
        ))
    })?;
    let tokenizer = match &data.tokenizer_file {
        Some(path) => TextTokenizer::load_file(path),
        None => TextTokenizer::trained_for(text, name, data.vocab, &default_cache_dir()),
    }
    .map_err(|e| err(e.to_string()))?;
    let mut tokens = tokenizer
        .encode(text)
        .map_err(|e| err(format!("tokenizing it with {}: {e}", tokenizer.info.path)))?;
    if let Some(&id) = tokens
        .iter()
        .find(|&&id| id as usize >= tokenizer.info.vocab)
    {
        return Err(err(format!(
            "{} gives token id {id}, outside its vocabulary of {}; the tokenizer file is inconsistent",
            tokenizer.info.path, tokenizer.info.vocab
        )));
    }
    tokens.shrink_to_fit();
    let how = match (tokenizer.info.kind.as_str(), tokenizer.cache_hit) {
        ("file", _) => "loaded",
        (_, true) => "cache hit",
        _ => "trained",
    };
    Ok(Tokenized {
        provenance: format!(
            "tokenizer: {how} {} ({} tokens, hash {}) in {:.0} ms; {} bytes -> {} tokens",
            tokenizer.info.path,
            tokenizer.info.vocab,
            tokenizer.info.hash,
            tokenizer.elapsed.as_secs_f64() * 1e3,
            bytes.len(),
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
        hash: format!("{:016x}", fnv1a64(json.as_bytes())),
        path: path.display().to_string(),
    }
}

/// Writes through a temporary name so a concurrent reader never sees half a file.
fn write_cache(path: &Path, json: &str) {
    let Some(dir) = path.parent() else { return };
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, json))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// A byte-level BPE (GPT-2's pre-tokenizer and decoder, no prefix space) of at most `vocab`
/// tokens. The 256 byte symbols are always in it, so every text round-trips.
pub fn train_bpe(text: &str, vocab: usize) -> Result<Tokenizer, String> {
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(vocab)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer
        .train(&mut trainer, std::iter::once(text))
        .map_err(|e| e.to_string())?;
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
mod tests {
    use super::*;

    /// The text the `text-bpe` preset trains on.
    const CORPUS: &str = include_str!("../../../assets/corpus.txt");

    #[test]
    fn decode_of_encode_is_the_shipped_text() {
        let dir = tempfile::tempdir().unwrap();
        let t = TextTokenizer::trained_for(CORPUS, "corpus", 8192, dir.path()).unwrap();
        let ids = t.encode(CORPUS).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), CORPUS);
        assert!(ids.iter().all(|&i| (i as usize) < t.info.vocab));
        println!(
            "vocab {}: {} bytes -> {} tokens ({:.2} bytes/token)",
            t.info.vocab,
            CORPUS.len(),
            ids.len(),
            CORPUS.len() as f64 / ids.len() as f64
        );
    }

    #[test]
    fn training_is_deterministic_and_the_cache_hits() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let first = TextTokenizer::trained_for(CORPUS, "corpus", 8192, a.path()).unwrap();
        let second = TextTokenizer::trained_for(CORPUS, "corpus", 8192, b.path()).unwrap();
        assert!(!first.cache_hit && !second.cache_hit);
        assert_eq!(
            first.to_json(),
            second.to_json(),
            "same text, same vocabulary"
        );
        assert_eq!(first.info.hash, second.info.hash);
        let hit = TextTokenizer::trained_for(CORPUS, "corpus", 8192, a.path()).unwrap();
        assert!(hit.cache_hit);
        assert_eq!(hit.info.hash, first.info.hash);
        println!(
            "trained in {:?}, cache hit in {:?}",
            first.elapsed, hit.elapsed
        );
        assert!(hit.elapsed < first.elapsed);
    }

    #[test]
    fn a_bad_tokenizer_file_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, "{ not json").unwrap();
        let err = TextTokenizer::load_file(&path).err().unwrap().to_string();
        assert!(
            err.contains("tokenizer.json") && err.contains("not a Hugging Face"),
            "{err}"
        );
        let missing = TextTokenizer::load_file(&dir.path().join("nope.json"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            missing.contains("nope.json") && missing.contains("cannot read"),
            "{missing}"
        );
    }

    #[test]
    fn a_saved_tokenizer_loads_with_the_same_hash() {
        let dir = tempfile::tempdir().unwrap();
        let trained = TextTokenizer::trained_for(CORPUS, "corpus", 512, dir.path()).unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, trained.to_json()).unwrap();
        let loaded = TextTokenizer::load_file(&path).unwrap();
        assert_eq!(loaded.info.hash, trained.info.hash);
        assert_eq!(loaded.info.vocab, 512);
        let text = "gradient accumulation: B·K tokens";
        assert_eq!(loaded.encode(text).unwrap(), trained.encode(text).unwrap());
    }
}
