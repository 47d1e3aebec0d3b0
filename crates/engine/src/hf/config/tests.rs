use super::*;

fn err(text: &str) -> String {
    parse(Path::new("c.json"), text).unwrap_err().to_string()
}

const LLAMA: &str = r#"{"model_type": "llama", "vocab_size": 8, "hidden_size": 64,
    "num_attention_heads": 4, "num_hidden_layers": 2, "max_position_embeddings": 32,
    "intermediate_size": 128}"#;

#[test]
fn refusals_name_the_file_and_the_field() {
    assert!(err(r#"{"model_type": "t5"}"#)
        .starts_with("c.json: model_type `t5` is not supported; supported: gpt2, gpt_neox, llama"));
    assert_eq!(
        err(r#"{"vocab_size": 8}"#),
        "c.json: field `model_type` is missing (model_type (any) needs it)"
    );
    assert_eq!(
        err(&LLAMA.replace("\"intermediate_size\": 128", "\"rope_theta\": 1")),
        "c.json: field `intermediate_size` is missing (model_type llama needs it)"
    );
    assert!(
        err(&LLAMA.replace("\"hidden_size\": 64", "\"hidden_size\": -1")).starts_with(
            "c.json: field `hidden_size`: expected a positive integer up to 2147483648, got -1"
        )
    );
    assert!(err("[1]").contains("top level"));
    assert!(err("{").starts_with("c.json: not JSON"));
    let moe = LLAMA.replace("llama", "mixtral").replace(
        "\"intermediate_size\"",
        "\"num_local_experts\": 2, \"num_experts_per_tok\": 3, \"intermediate_size\"",
    );
    assert!(err(&moe).contains("`num_experts_per_tok`: 3 experts per token, but only 2"));
}

#[test]
fn defaults_of_the_optional_fields() {
    let a = parse(Path::new("c.json"), LLAMA).unwrap();
    assert_eq!((a.kv_heads, a.head_dim, a.tied), (4, 16, false));
    assert_eq!((a.seq_len, a.max_context), (32, 32));
    let grouped = LLAMA.replace(
        "\"intermediate_size\"",
        "\"num_key_value_heads\": 3, \"intermediate_size\"",
    );
    assert!(err(&grouped).contains("`num_key_value_heads`: 3 key/value heads"));
    // Gemma ties its head unless told otherwise; Gemma 2 slides every other layer by 4096.
    let gemma2 = parse(Path::new("c.json"), &LLAMA.replace("llama", "gemma2")).unwrap();
    assert!(gemma2.tied && gemma2.post_norms && gemma2.scaled_embedding);
    assert_eq!(
        gemma2.sliding,
        Some(crate::hf::Sliding {
            window: 4096,
            layers: 1
        })
    );
    assert!(!gemma2.attention_softcap, "no cap given, none applied");
}

#[test]
fn a_byte_order_mark_is_accepted() {
    let a = parse(Path::new("c.json"), &format!("\u{feff}{LLAMA}")).unwrap();
    assert_eq!(a.family, "llama");
}

#[test]
fn a_multimodal_wrapper_is_read_through_its_text_config_or_refused_with_a_hint() {
    let wrapped =
        format!(r#"{{"model_type": "llava", "vision_config": {{}}, "text_config": {LLAMA}}}"#);
    let a = parse(Path::new("c.json"), &wrapped).unwrap();
    assert_eq!(
        (a.family.as_str(), a.wrapper.as_deref()),
        ("llama", Some("llava"))
    );
    assert_eq!(
        a.param_count(),
        parse(Path::new("c.json"), LLAMA).unwrap().param_count()
    );
    let thin =
        r#"{"model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": 8}}"#;
    assert_eq!(
        err(thin),
        "c.json: field `text_config.hidden_size` is missing (model_type llama needs it)"
    );
    let unknown = r#"{"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}"#;
    let e = err(unknown);
    assert!(
        e.starts_with("c.json: text_config.model_type `gemma3_text` is not supported (the language model of this `gemma3`; ")
            && e.contains("save `text_config` as a config.json"),
        "{e}"
    );
}

#[test]
fn only_a_regular_file_of_bounded_size_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let e = read_config(dir.path()).unwrap_err().to_string();
    assert!(
        e.ends_with("not a regular file; give the model's config.json itself"),
        "{e}"
    );
    // A device that never ends is refused before anything is read from it.
    if Path::new("/dev/zero").exists() {
        assert!(matches!(
            read_config(Path::new("/dev/zero")),
            Err(HfConfigError::NotAFile { .. })
        ));
    }
    let big = dir.path().join("config.json");
    // Sparse: nothing this large is allocated (the counting allocator's test runs beside).
    std::fs::File::create(&big)
        .unwrap()
        .set_len(MAX_BYTES + 1)
        .unwrap();
    assert!(matches!(
        read_config(&big),
        Err(HfConfigError::TooLarge { .. })
    ));
    std::fs::write(&big, LLAMA).unwrap();
    assert_eq!(read_config(&big).unwrap().family, "llama");
    std::fs::write(&big, [0xff, 0xfe, b'{']).unwrap();
    assert!(read_config(&big)
        .unwrap_err()
        .to_string()
        .contains("not UTF-8"));
}

#[cfg(unix)]
#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("config.json");
    let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `name` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    assert!(matches!(
        read_config(&fifo),
        Err(HfConfigError::NotAFile { .. })
    ));
}
