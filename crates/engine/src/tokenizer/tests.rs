use super::*;

/// The text the `text-bpe` preset trains on.
const CORPUS: &str = include_str!("../../../../assets/corpus.txt");

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

/// A slice of the corpus: enough for a 300-token BPE, quick to train.
fn text() -> &'static str {
    let mut end = 20_000;
    while !CORPUS.is_char_boundary(end) {
        end -= 1;
    }
    &CORPUS[..end]
}

/// Edit the tokenizer in the cache file at `path`; with `rehash`, the header's hash is made
/// to match again (so only the checks of the tokenizer itself can find the change).
fn corrupt(path: &str, rehash: bool, edit: impl FnOnce(&mut serde_json::Value)) {
    let file = std::fs::read_to_string(path).unwrap();
    let (header, body) = match file.split_once('\n') {
        Some((h, b)) if h.contains("gaccwb-bpe-cache") => (Some(h), b),
        _ => (None, file.as_str()),
    };
    let mut tokenizer: serde_json::Value = serde_json::from_str(body).unwrap();
    edit(&mut tokenizer);
    let body = tokenizer.to_string();
    let out = match header {
        Some(h) => {
            let mut h: serde_json::Value = serde_json::from_str(h).unwrap();
            if rehash {
                h["tokenizer_hash"] = format!("{:016x}", fnv1a64(body.as_bytes())).into();
            }
            format!("{h}\n{body}")
        }
        None => body,
    };
    std::fs::write(path, out).unwrap();
}

/// After the cache at `dir` was damaged: the next run trains afresh, gets what training
/// gives, and leaves a valid cache for the run after.
fn retrained(dir: &Path, vocab: usize) {
    let again = TextTokenizer::trained_for(text(), "corpus", vocab, dir).unwrap();
    assert!(!again.cache_hit, "a damaged cache was used");
    let fresh = train_bpe(text(), vocab).unwrap().to_string(false).unwrap();
    assert_eq!(again.to_json(), fresh);
    let next = TextTokenizer::trained_for(text(), "corpus", vocab, dir).unwrap();
    assert!(next.cache_hit, "the retrained cache was not rewritten");
    assert_eq!(next.to_json(), fresh);
}

#[test]
fn a_cache_of_another_text_is_retrained() {
    let dir = tempfile::tempdir().unwrap();
    let other = TextTokenizer::trained_for(&text()[..10_000], "a", 300, dir.path()).unwrap();
    let mine = TextTokenizer::trained_for(text(), "corpus", 300, dir.path()).unwrap();
    std::fs::copy(&other.info.path, &mine.info.path).unwrap();
    retrained(dir.path(), 300);
}

#[test]
fn a_cache_of_another_vocabulary_size_is_retrained() {
    let dir = tempfile::tempdir().unwrap();
    let small = TextTokenizer::trained_for(text(), "corpus", 260, dir.path()).unwrap();
    let mine = TextTokenizer::trained_for(text(), "corpus", 300, dir.path()).unwrap();
    std::fs::copy(&small.info.path, &mine.info.path).unwrap();
    retrained(dir.path(), 300);
}

#[test]
fn a_cache_with_swapped_ids_is_retrained() {
    let dir = tempfile::tempdir().unwrap();
    let t = TextTokenizer::trained_for(text(), "corpus", 300, dir.path()).unwrap();
    corrupt(&t.info.path, false, |j| {
        let vocab = j["model"]["vocab"].as_object_mut().unwrap();
        let (a, b) = (vocab["a"].clone(), vocab["b"].clone());
        vocab.insert("a".into(), b);
        vocab.insert("b".into(), a);
    });
    retrained(dir.path(), 300);
}

#[test]
fn a_cache_with_another_normalizer_is_retrained() {
    let dir = tempfile::tempdir().unwrap();
    let t = TextTokenizer::trained_for(text(), "corpus", 300, dir.path()).unwrap();
    corrupt(&t.info.path, true, |j| {
        j["normalizer"] = serde_json::json!({ "type": "Lowercase" });
    });
    retrained(dir.path(), 300);
}

#[test]
fn a_cache_with_an_out_of_range_id_is_retrained() {
    let dir = tempfile::tempdir().unwrap();
    let t = TextTokenizer::trained_for(text(), "corpus", 300, dir.path()).unwrap();
    corrupt(&t.info.path, true, |j| {
        j["model"]["vocab"]["zz"] = 50_000.into();
    });
    retrained(dir.path(), 300);
}

#[test]
fn a_cache_path_that_is_not_a_regular_file_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let t = TextTokenizer::trained_for(text(), "corpus", 300, dir.path()).unwrap();
    std::fs::remove_file(&t.info.path).unwrap();
    std::fs::create_dir(&t.info.path).unwrap();
    let e = TextTokenizer::trained_for(text(), "corpus", 300, dir.path())
        .err()
        .expect("a directory in the cache's place is refused")
        .to_string();
    assert!(e.contains(&t.info.path) && e.contains("directory"), "{e}");
}

#[test]
fn a_tokenizer_file_that_never_ends_is_refused_by_name() {
    let e = TextTokenizer::load_file(Path::new("/dev/zero"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("/dev/zero") && e.contains("not a regular file"),
        "{e}"
    );
}
