//! Chat templates render to the text Hugging Face's `apply_chat_template` renders (what vLLM
//! calls), byte for byte: `tests/data/chat-templates/cases.json` holds four templates (blocks
//! on their own lines, Python string methods, `tojson` with and without `indent`, tools,
//! documents, template kwargs) rendered by `transformers` on four conversations (a tool call
//! among them) with each set of options (`gen.py` writes it).

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use kvroute_http::Model;
use kvroute_http::chat_template::ChatOptions;
use kvroute_http::openai::{self, Endpoint};
use serde_json::{Map, Value};

const TOKENIZER: &str = include_str!("data/bos-model/tokenizer.json");
const CONFIG: &str = include_str!("data/bos-model/tokenizer_config.json");
const CASES: &str = include_str!("data/chat-templates/cases.json");
const VLLM_CASES: &str = include_str!("data/chat-templates/vllm_tokenize.json");
const TEMPLATES: &str = include_str!("data/chat-templates/templates.json");

/// The BOS model with `template` as its chat template.
fn model(template: &str) -> Model {
    let mut config: Value = serde_json::from_str(CONFIG).unwrap();
    config["chat_template"] = Value::from(template);
    Model::from_json(TOKENIZER, Some(&config.to_string())).unwrap()
}

/// The case's options as the proxy reads them from a request.
fn options(given: &Map<String, Value>) -> ChatOptions {
    let mut kwargs = given.clone();
    let mut flag = |name: &str| kwargs.remove(name).and_then(|v| v.as_bool()).unwrap_or(false);
    let (add_generation_prompt, continue_final_message) =
        (flag("add_generation_prompt"), flag("continue_final_message"));
    ChatOptions {
        add_generation_prompt,
        continue_final_message,
        tools: kwargs.remove("tools"),
        documents: kwargs.remove("documents"),
        kwargs,
    }
}

#[test]
fn templates_render_what_hugging_face_renders() {
    let fixture: Value = serde_json::from_str(CASES).unwrap();
    let mut checked = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let model = model(fixture["templates"][name].as_str().unwrap());
        let options = options(case["options"].as_object().unwrap());
        let ours = model.render_chat_with(&case["messages"], &options);
        match case["rendered"].as_str() {
            Some(want) => {
                assert_eq!(ours.as_deref(), Ok(want), "{name}: {options:?}");
                checked += 1;
            }
            None => assert!(ours.is_err(), "{name}: Hugging Face refused it"),
        }
    }
    assert_eq!(checked, 84);
}

/// Chat requests as OpenAI's clients send them (tool calls' arguments as JSON strings, tools
/// without descriptions or with extra keys, content parts, reasoning, template kwargs,
/// `reasoning_effort`, documents, `continue_final_message`) parse to the prompt token ids a
/// real vLLM 0.32 engine ran for the same chat completions on the same tokenizer and templates
/// (`data/chat-templates/vllm_tokenize.json`, written by `vllm_tokenize.py`).
#[test]
fn chat_requests_tokenize_as_vllm_tokenizes_them() {
    let fixture: Value = serde_json::from_str(VLLM_CASES).unwrap();
    let templates: Value = serde_json::from_str(TEMPLATES).unwrap();
    let mut checked = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let model = model(templates[name].as_str().unwrap());
        let body = serde_json::to_vec(&case["body"]).unwrap();
        let parsed = openai::parse(Endpoint::Chat, &body, &model, 1 << 20);
        match case.get("tokens") {
            Some(tokens) => {
                let tokens: Vec<u32> = serde_json::from_value(tokens.clone()).unwrap();
                let ours = parsed.unwrap_or_else(|e| panic!("{name} {}: {e:?}", case["body"]));
                assert_eq!(ours.tokens, tokens, "{name} {}", case["body"]);
                checked += 1;
            }
            None => assert!(parsed.is_err(), "{name} {}: vLLM refused it", case["body"]),
        }
    }
    assert!(checked > 0);
}
