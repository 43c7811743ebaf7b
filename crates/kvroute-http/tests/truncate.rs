//! `truncate_prompt_tokens` as the proxy applies it, against a small reference model of vLLM
//! 0.32's rule (`vllm/renderers/params.py`; the observations behind it are in
//! `kvroute-mock`'s tests): with no `truncation_side`, a text keeps its BOS and last N-1 tokens
//! (the tokenizer's own left truncation) and, without special tokens, its last N; token ids
//! keep their last N; with a side, the ids with BOS are sliced from that side; 0 keeps
//! nothing; a prompt longer than the limit is taken once truncated.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use kvroute_http::Model;
use kvroute_http::model::SpecialTokens;
use kvroute_http::openai::{self, Endpoint, Keep, Prompt, Side, Truncation};
use proptest::prelude::*;
use serde_json::json;

const BOS: u32 = 256;

fn bos_model() -> Model {
    Model::from_json(
        include_str!("data/bos-model/tokenizer.json"),
        Some(include_str!("data/bos-model/tokenizer_config.json")),
    )
    .unwrap()
}

/// The reference: what vLLM keeps of `full` (the prompt's ids, `bos` whether the first is the
/// post-processor's BOS) for `keep` tokens from `side` (`None`: the tokenizer's truncation).
fn reference(full: &[u32], bos: bool, keep: usize, side: Option<Side>) -> Vec<u32> {
    if full.len() <= keep {
        return full.to_vec();
    }
    match side {
        _ if keep == 0 => Vec::new(),
        Some(Side::Right) => full[..keep].to_vec(),
        None if bos => [&full[..1], &full[full.len() - (keep - 1)..]].concat(),
        None | Some(Side::Left) => full[full.len() - keep..].to_vec(),
    }
}

fn side() -> impl Strategy<Value = Option<Side>> {
    prop_oneof![Just(None), Just(Some(Side::Left)), Just(Some(Side::Right))]
}

proptest! {
    #[test]
    fn text_and_ids_are_cut_as_vllm_cuts_them(
        text in "[a-z ]{0,120}",
        keep in 0usize..140,
        special in proptest::option::of(any::<bool>()),
        side in side(),
    ) {
        let model = bos_model();
        let truncation = Truncation { keep: Keep::Tokens(keep), side };
        let add = special.unwrap_or(true);
        let full = model.encode(&text, SpecialTokens::from_flag(add)).unwrap();
        let got = openai::engine_tokens(&model, &Prompt::Text(text.clone()), special, Some(truncation), 1_000)
            .unwrap();
        prop_assert_eq!(got, reference(&full, add, keep, side));
        let ids: Vec<u32> = text.bytes().map(u32::from).collect();
        let got = openai::engine_tokens(&model, &Prompt::TokenIds(ids.clone()), special, Some(truncation), 1_000)
            .unwrap();
        prop_assert_eq!(got, reference(&ids, false, keep, side));
    }
}

#[test]
fn minus_one_keeps_the_context_less_the_output_token() {
    let model = bos_model();
    let text = "x".repeat(300);
    let full = model.encode(&text, SpecialTokens::Add).unwrap();
    for (reserves_output, kept) in [(true, 99), (false, 100)] {
        let truncation = Truncation {
            keep: Keep::Context { reserves_output },
            side: None,
        };
        let got =
            openai::engine_tokens(&model, &Prompt::Text(text.clone()), None, Some(truncation), 100).unwrap();
        assert_eq!(got, reference(&full, true, kept, None));
        assert_eq!(got[0], BOS);
    }
}

/// The request's fields, read as vLLM reads them: `-1` reserves an output token for a
/// completion unless its `max_tokens` is `null`, and for a chat only when it names a budget;
/// a prompt past the limit is taken once truncated and refused otherwise; 0 tokens kept is
/// vLLM's empty-prompt refusal.
#[test]
fn the_request_fields_are_read_as_vllm_reads_them() {
    let model = bos_model();
    let limit = 100;
    let parse = |endpoint, body: serde_json::Value| {
        openai::parse(endpoint, &serde_json::to_vec(&body).unwrap(), &model, limit)
    };
    let long = "y".repeat(500);
    let messages = json!([{"role": "user", "content": long}]);
    // (endpoint, body, tokens kept)
    let cases = [
        (
            Endpoint::Completions,
            json!({"prompt": long, "truncate_prompt_tokens": -1}),
            limit - 1,
        ),
        (
            Endpoint::Completions,
            json!({"prompt": long, "truncate_prompt_tokens": -1, "max_tokens": null}),
            limit,
        ),
        (
            Endpoint::Chat,
            json!({"messages": messages, "truncate_prompt_tokens": -1}),
            limit,
        ),
        (
            Endpoint::Chat,
            json!({"messages": messages, "truncate_prompt_tokens": -1, "max_tokens": 5}),
            limit - 1,
        ),
        (
            Endpoint::Chat,
            json!({"messages": messages, "truncate_prompt_tokens": -1, "max_completion_tokens": 5, "max_tokens": null}),
            limit - 1,
        ),
        (
            Endpoint::Completions,
            json!({"prompt": long, "truncate_prompt_tokens": 40, "truncation_side": "right"}),
            40,
        ),
        (
            Endpoint::Completions,
            json!({"prompt": vec![5; 700], "truncate_prompt_tokens": 30}),
            30,
        ),
    ];
    for (endpoint, body, kept) in cases {
        let parsed = parse(endpoint, body.clone()).unwrap_or_else(|e| panic!("{body}: {e:?}"));
        assert_eq!(parsed.tokens.len(), kept, "{body}");
        assert!(parsed.truncation.is_some());
    }
    // Without truncation the same prompts are too long.
    for (endpoint, body) in [
        (Endpoint::Completions, json!({"prompt": long})),
        (Endpoint::Chat, json!({"messages": messages})),
        (Endpoint::Completions, json!({"prompt": vec![5; 700]})),
    ] {
        let e = parse(endpoint, body.clone()).unwrap_err();
        assert_eq!(e.code, "context_length_exceeded", "{body}");
    }
    // Truncated to more than the limit: still too long.
    let e = parse(
        Endpoint::Completions,
        json!({"prompt": long, "truncate_prompt_tokens": 200}),
    )
    .unwrap_err();
    assert_eq!(e.code, "context_length_exceeded");
    let e = parse(
        Endpoint::Completions,
        json!({"prompt": "hello", "truncate_prompt_tokens": 0}),
    )
    .unwrap_err();
    assert_eq!(
        (e.param, e.message.as_str()),
        (
            Some("truncate_prompt_tokens"),
            "The decoder prompt cannot be empty"
        )
    );
    for bad in [json!("middle"), json!(1)] {
        let e = parse(
            Endpoint::Completions,
            json!({"prompt": "hello", "truncate_prompt_tokens": 2, "truncation_side": bad}),
        )
        .unwrap_err();
        assert_eq!(e.param, Some("truncation_side"), "{bad}");
    }
    let e = parse(
        Endpoint::Completions,
        json!({"prompt": "hello", "truncate_prompt_tokens": -2}),
    )
    .unwrap_err();
    assert_eq!(e.param, Some("truncate_prompt_tokens"));
}
