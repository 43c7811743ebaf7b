//! Tokenization conformance: `Model::encode` gives the token ids that Hugging Face's reference
//! `tokenizers` gives, on tokenizers shaped like real models' (Llama-3, Qwen2, GPT-2 and a
//! SentencePiece-style Llama-2). The fixtures and their expected ids are written by
//! `tests/data/tokenizers/gen.py`.

use kvroute_http::model::{Model, SpecialTokens};
use serde_json::Value;

const CASES: &str = include_str!("data/tokenizers/cases.json");

fn tokenizer_json(name: &str) -> &'static str {
    match name {
        "llama3" => include_str!("data/tokenizers/llama3.json"),
        "qwen2" => include_str!("data/tokenizers/qwen2.json"),
        "gpt2" => include_str!("data/tokenizers/gpt2.json"),
        "llama2" => include_str!("data/tokenizers/llama2.json"),
        other => panic!("cases.json names a tokenizer without a fixture: {other}"),
    }
}

#[test]
fn encode_matches_the_reference_implementation() {
    let cases: Value = serde_json::from_str(CASES).unwrap();
    let tokenizers = cases["tokenizers"].as_object().unwrap();
    assert_eq!(tokenizers.len(), 4);
    for (name, cases) in tokenizers {
        let model = Model::from_json(tokenizer_json(name), None).unwrap();
        let cases = cases.as_array().unwrap();
        assert!(cases.len() >= 10, "{name}: too few cases");
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            assert_eq!(
                model.encode(text, SpecialTokens::Omit).unwrap(),
                expected,
                "{name}: {text:?}"
            );
        }
    }
}

#[test]
fn byte_level_tokenizers_decode_back_to_the_text() {
    let cases: Value = serde_json::from_str(CASES).unwrap();
    for name in ["llama3", "gpt2"] {
        let model = Model::from_json(tokenizer_json(name), None).unwrap();
        for case in cases["tokenizers"][name].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            if text.contains("<|") {
                continue; // special tokens are skipped when decoding
            }
            assert_eq!(
                model.decode(&model.encode(text, SpecialTokens::Omit).unwrap()),
                text,
                "{name}"
            );
        }
    }
}

#[test]
fn vocab_size_counts_the_model_and_its_added_tokens() {
    for name in ["llama3", "qwen2", "gpt2", "llama2"] {
        let json = tokenizer_json(name);
        let value: Value = serde_json::from_str(json).unwrap();
        let model = Model::from_json(json, None).unwrap();
        let most = value["model"]["vocab"].as_object().unwrap().len() as u32;
        assert!(model.vocab_size() >= most, "{name}");
        assert!(model.vocab_size() <= 800, "{name}: trained to 800 tokens");
    }
}

#[test]
fn a_tokenizer_that_is_not_json_is_an_error() {
    let err = Model::from_json("{not json", None).unwrap_err();
    assert!(err.to_string().starts_with("tokenizer.json"), "{err}");
    let err = Model::from_json(r#"{"model": {"type": "Nope"}}"#, None).unwrap_err();
    assert!(err.to_string().starts_with("tokenizer.json"), "{err}");
}

/// The BOS model (`tests/data/bos-model`, shaped like the tokenizer real vLLM runs were made
/// with): its post-processor adds BOS, as Hugging Face's `tokenizers` does when asked to add
/// special tokens (`cases.json`, written by it), and only then.
#[test]
fn the_post_processors_bos_is_added_only_when_asked() {
    let model = Model::from_json(
        include_str!("data/bos-model/tokenizer.json"),
        Some(include_str!("data/bos-model/tokenizer_config.json")),
    )
    .unwrap();
    let cases: Value = serde_json::from_str(include_str!("data/bos-model/cases.json")).unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        for (key, special) in [
            ("with_special", SpecialTokens::Add),
            ("without_special", SpecialTokens::Omit),
        ] {
            let expected: Vec<u32> = serde_json::from_value(case[key].clone()).unwrap();
            assert_eq!(model.encode(text, special).unwrap(), expected, "{key}: {text:?}");
        }
    }
    // The config's `"add_bos_token": false` disagrees with the post-processor: named, and the
    // post-processor followed.
    assert_eq!(model.warnings().len(), 1, "{:?}", model.warnings());
    assert!(model.warnings()[0].contains("add_bos_token: false"));
    // The template brings its own BOS: a chat prompt tokenized without special tokens has one.
    let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
    let text = model.render_chat(&messages, true).unwrap();
    let ids = model.encode(&text, SpecialTokens::Omit).unwrap();
    assert_eq!(&ids[..2], &[256, 258], "one BOS, then the header");
}

/// The longest token in characters is vLLM's `max_chars_per_token` for each fixture: the values
/// below are what vLLM 0.32's `get_cached_tokenizer` (`vllm/tokenizers/hf.py`) gives for the
/// same files, loaded with `PreTrainedTokenizerFast(tokenizer_file=...)`.
#[test]
fn the_longest_token_is_vllms_max_chars_per_token() {
    let tiny = Model::tiny().unwrap();
    assert_eq!(tiny.max_chars_per_token(), 13);
    for (name, want) in [("llama3", 13), ("qwen2", 13), ("gpt2", 13), ("llama2", 24)] {
        let model = Model::from_json(tokenizer_json(name), None).unwrap();
        assert_eq!(model.max_chars_per_token(), want, "{name}");
    }
}

/// vLLM's check of a text's length before tokenizing (`TokenizeParams._text_len_check`):
/// characters, not bytes, against the token limit times the longest token; the refusal in
/// vLLM's words (the message below is what vLLM 0.32's check raises for 833 characters at 64
/// tokens and this tokenizer).
#[test]
fn text_past_the_limit_in_characters_is_refused_as_vllm_refuses_it() {
    use kvroute_http::openai::{TextTooLong, check_text_len};
    let tiny = Model::tiny().unwrap();
    let max_chars = 64 * 13;
    assert_eq!(check_text_len(&tiny, &"x".repeat(max_chars), 64), Ok(()));
    // Two bytes a character: twice the bytes, the same characters, still taken.
    assert_eq!(check_text_len(&tiny, &"é".repeat(max_chars), 64), Ok(()));
    let refused = check_text_len(&tiny, &"é".repeat(max_chars + 1), 64).unwrap_err();
    assert_eq!(
        refused,
        TextTooLong {
            chars: max_chars + 1,
            max_chars,
            max_tokens: 64
        }
    );
    assert_eq!(
        refused.vllm_message(),
        "This model's maximum context length is 64 tokens. However, your prompt contains 833 \
         characters (more than 832 characters, which is the upper bound for 64 input tokens). \
         Please reduce the length of the input prompt."
    );
    // No limit to speak of: nothing is counted or refused.
    assert_eq!(check_text_len(&tiny, &"x".repeat(10_000), usize::MAX), Ok(()));
}
