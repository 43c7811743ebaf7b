//! The conversation cache is exact: a chat prompt tokenized through it, whatever it holds, equals
//! the prompt tokenized whole, on the repository's tokenizer fixtures (byte-level BPEs shaped like
//! Llama-3, Qwen2 and GPT-2, a SentencePiece-style Llama-2, one with `prepend_scheme: first`, the
//! tiny and BOS models), over generated conversations whose messages end mid-word, in whitespace,
//! in multi-byte characters, are empty, or hold special tokens' text and pieces of it. The block
//! hashes a turn keeps beside its entries give a follow-up the chain of its prompt hashed whole.

use kvroute_core::hash::{HashSalt, PromptHasher, PromptHashes};
use kvroute_http::model::{Model, SpecialTokens, TINY_TOKENIZER_CONFIG_JSON};
use kvroute_http::prefix_cache::{AddedToken, Boundaries, Encoded, TextCuts, Turn};
use proptest::prelude::*;
use serde_json::{Value, json};

const BOS_TOKENIZER: &str = include_str!("data/bos-model/tokenizer.json");
const BOS_CONFIG: &str = include_str!("data/bos-model/tokenizer_config.json");

/// Every fixture with a chat template: (name, model).
fn models() -> Vec<(&'static str, Model)> {
    let chatml = Some(TINY_TOKENIZER_CONFIG_JSON);
    let fixture = |json: &str| Model::from_json(json, chatml).expect("the fixture loads");
    // Llama-2's fixture, its SentencePiece normalizer swapped for a Metaspace pre-tokenizer
    // that prepends only where the input opens: the one rule that looks at where a piece is.
    let mut first: Value =
        serde_json::from_str(include_str!("data/tokenizers/llama2.json")).expect("llama2.json is JSON");
    first["normalizer"] = Value::Null;
    first["pre_tokenizer"] =
        json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false});
    vec![
        ("tiny", Model::tiny().expect("the tiny model loads")),
        (
            "bos",
            Model::from_json(BOS_TOKENIZER, Some(BOS_CONFIG)).expect("the BOS model loads"),
        ),
        ("llama3", fixture(include_str!("data/tokenizers/llama3.json"))),
        ("qwen2", fixture(include_str!("data/tokenizers/qwen2.json"))),
        ("gpt2", fixture(include_str!("data/tokenizers/gpt2.json"))),
        ("llama2", fixture(include_str!("data/tokenizers/llama2.json"))),
        ("metaspace-first", fixture(&first.to_string())),
    ]
}

/// Pieces of message text, adversarial at a boundary: whitespace runs, words cut in two,
/// combining marks and multi-byte characters, digits, contractions, and special tokens' text
/// whole and in pieces.
const FRAGMENTS: &[&str] = &[
    "",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    " \n ",
    "hello",
    "world",
    "Hel",
    "lo,",
    " wor",
    "ld.",
    "é",
    "e\u{301}",
    "\u{301}",
    "日本語",
    "🙂",
    "👍🏽",
    "1",
    "23",
    "4567",
    "'s",
    "don't",
    "▁",
    "<",
    "|>",
    "<|",
    "<|im",
    "_start|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|begin_of_text|>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "the quick brown fox ",
    // Around a cut inside text (before a space after an ASCII letter).
    "a ",
    "I ",
    " b",
    "'ll ",
    "'S ",
    "e\u{301} ",
    "\u{17f} ",
    "x\r\n",
    "Z  ",
    "9 ",
    "k\u{301}",
];

fn content() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..8).prop_map(|parts| parts.concat())
}

/// A conversation: an optional system message, then alternating user and assistant messages.
fn conversation() -> impl Strategy<Value = Vec<Value>> {
    (any::<bool>(), prop::collection::vec(content(), 1..10)).prop_map(|(system, contents)| {
        let mut messages = Vec::new();
        if system {
            messages.push(json!({"role": "system", "content": "You are terse.  "}));
        }
        for (i, c) in contents.into_iter().enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": c}));
        }
        messages
    })
}

/// Tokenizes `text` through the cache and whole, and asserts they agree; returns the tokens
/// reused from the cache.
fn check(model: &Model, name: &str, text: &str) -> usize {
    let (encoded, lookup) = model
        .encode_chat(text, SpecialTokens::Omit, usize::MAX)
        .expect("the text tokenizes");
    let whole = model
        .encode(text, SpecialTokens::Omit)
        .expect("the text tokenizes");
    assert_eq!(encoded, Encoded::Tokens(whole), "{name}: {text:?}");
    lookup.reused_tokens
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Turn by turn (each turn's prompt the conversation so far, with and without a generation
    /// prompt, and each asked twice), through one cache per model: always equal to tokenizing
    /// whole, and from the second turn on (the templates write special tokens around each
    /// message) a follow-up reuses the cached history.
    #[test]
    fn cached_chat_tokens_equal_whole_tokenization(messages in conversation(), small in any::<bool>()) {
        for (name, model) in &models() {
            // A small bound evicts all the time; a large one keeps everything.
            model.chat_cache().set_limit(if small { 4096 } else { 1 << 24 });
            for turn in 1..=messages.len() {
                let so_far = Value::Array(messages[..turn].to_vec());
                for generation_prompt in [true, false] {
                    let text = model.render_chat(&so_far, generation_prompt).expect("renders");
                    let reused = check(model, name, &text);
                    if turn > 1 && generation_prompt && !small {
                        prop_assert!(reused > 0, "{name}: turn {turn} reused nothing");
                    }
                    check(model, name, &text);
                }
            }
            prop_assert!(model.chat_cache().bytes() <= model.chat_cache().limit(), "{name}");
        }
    }

    /// The rule itself, on every fixture and boundary token: tokenizing `P + X + R` whole equals
    /// tokenizing `P` and `X + R` apart, and the second starts with `X`.
    #[test]
    fn a_text_cut_before_a_boundary_token_tokenizes_as_a_whole(p in content(), r in content()) {
        for (name, model) in &models() {
            let boundaries: Vec<String> = model.chat_boundaries().texts().map(str::to_owned).collect();
            prop_assert!(!boundaries.is_empty(), "{name}: its template writes boundary tokens");
            for x in &boundaries {
                let whole = model.encode(&format!("{p}{x}{r}"), SpecialTokens::Omit).expect("tokenizes");
                let mut parts = model.encode(&p, SpecialTokens::Omit).expect("tokenizes");
                let tail = model.encode(&format!("{x}{r}"), SpecialTokens::Omit).expect("tokenizes");
                let first = model.encode(x, SpecialTokens::Omit).expect("tokenizes");
                prop_assert_eq!(&tail[..1], &first[..], "{}: {:?} opens its piece", name, x);
                parts.extend(tail);
                prop_assert_eq!(whole, parts, "{}: {:?} + {:?} + {:?}", name, p, x, r);
            }
        }
    }
}

/// A chat prompt through the cache as the proxy routes it: its tokens (equal to tokenizing it
/// whole), and, when they went through the cache, its block hashes under `salt` after the kept
/// ones (kept in turn), with the turn. The hashes are checked against the prompt hashed whole.
fn hashed_turn(model: &Model, text: &str, block: usize, salt: &HashSalt<'_>) -> Option<(PromptHashes, Turn)> {
    let (encoded, _, turn) = model
        .encode_chat_turn(text, SpecialTokens::Omit, usize::MAX)
        .expect("the text tokenizes");
    let whole = model
        .encode(text, SpecialTokens::Omit)
        .expect("the text tokenizes");
    assert_eq!(encoded, Encoded::Tokens(whole.clone()), "{text:?}");
    let turn = turn?;
    let hasher = PromptHasher::new(block, salt);
    let hashes = turn.hashes(&hasher, &whole);
    assert_eq!(hashes, PromptHashes::new(&hasher, &whole), "{text:?}");
    Some((hashes, turn))
}

/// A turn's salt: none, a cache salt, an adapter, or both.
fn salt_of(choice: u8) -> HashSalt<'static> {
    HashSalt {
        lora_name: (choice & 1 != 0).then_some("adapter"),
        namespace: (choice & 2 != 0).then_some("tenant"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Turn by turn through one cache per model, each turn under a salt drawn anew (so hashes
    /// kept under one salt meet a prompt under another), with the cache emptied or bounded
    /// small between turns and an earlier message edited (the prefix diverges): the hashes
    /// after the kept ones always equal the prompt hashed whole, and the cache, hashes
    /// counted, stays within its bound.
    #[test]
    fn kept_hashes_give_a_follow_up_the_whole_prompts_chain(
        messages in conversation(),
        block in prop_oneof![Just(1usize), Just(4), Just(16)],
        salts in prop::collection::vec(0u8..4, 10),
        emptied in prop::collection::vec(any::<bool>(), 10),
        small in any::<bool>(),
        edit in any::<prop::sample::Index>(),
    ) {
        for (_, model) in &models() {
            let limit = if small { 4096 } else { 1 << 24 };
            model.chat_cache().set_limit(limit);
            let mut messages = messages.clone();
            for turn in 1..=messages.len() {
                if emptied[turn - 1] {
                    model.chat_cache().set_limit(0);
                    model.chat_cache().set_limit(limit);
                }
                if turn == messages.len() && turn > 1 {
                    // The last turn edits an earlier message.
                    let at = edit.index(turn - 1);
                    let content = messages[at]["content"].as_str().unwrap_or_default().to_owned();
                    messages[at]["content"] = Value::from(format!("{content} (edited)"));
                }
                let so_far = Value::Array(messages[..turn].to_vec());
                let text = model.render_chat(&so_far, true).expect("renders");
                hashed_turn(model, &text, block, &salt_of(salts[turn - 1]));
                prop_assert!(model.chat_cache().bytes() <= limit);
            }
        }
    }
}

/// A follow-up under the same salt hashes only the blocks past its previous turn's (kept
/// beside the cache's entries, counted in its bytes); under another salt, after the cache was
/// emptied, or past an edited message, it hashes what it must, and always gets the chain of
/// its prompt hashed whole (`hashed_turn` checks it).
#[test]
fn a_follow_up_hashes_only_its_new_blocks_under_its_salt() {
    let model = Model::tiny().expect("loads");
    model.chat_cache().set_limit(64 << 20);
    let block = 16;
    let plain = salt_of(0);
    let mut messages = vec![json!({"role": "system", "content": "You answer briefly."})];
    // The next user message's prompt; the assistant's answer follows.
    let render = |messages: &mut Vec<Value>, content: String| {
        messages.push(json!({"role": "user", "content": content}));
        let text = model
            .render_chat(&Value::Array(messages.clone()), true)
            .expect("renders");
        messages.push(json!({"role": "assistant", "content": "ok ".repeat(40)}));
        text
    };
    // The (kept, hashed) blocks counted since the last call.
    let mut counted = model.chat_cache().kept_and_hashed_blocks();
    let mut counted_since = || {
        let now = model.chat_cache().kept_and_hashed_blocks();
        let since = ((now.0 - counted.0) as usize, (now.1 - counted.1) as usize);
        counted = now;
        since
    };
    let first = render(&mut messages, "a".repeat(500));
    let before = model.chat_cache().bytes();
    let (hashes, turn) = hashed_turn(&model, &first, block, &plain).expect("through the cache");
    assert!(turn.earlier().is_none(), "a miss has nothing kept");
    let blocks = hashes.blocks();
    assert_eq!(counted_since(), (0, blocks));
    assert!(
        model.chat_cache().bytes() >= before + 16 * blocks,
        "the hashes are counted"
    );

    let second = render(&mut messages, "b".repeat(500));
    let (hashes, turn) = hashed_turn(&model, &second, block, &plain).expect("through the cache");
    let earlier = turn.earlier().expect("the first turn's hashes are kept").blocks();
    assert!(
        earlier >= blocks - 1 && earlier <= blocks,
        "{earlier} of {blocks}"
    );
    assert!(hashes.blocks() > earlier);
    assert_eq!(counted_since(), (earlier, hashes.blocks() - earlier));

    // Another salt: the kept (unsalted) hashes are found, not used.
    let salted = salt_of(2);
    let third = render(&mut messages, "c".repeat(500));
    let (hashes, turn) = hashed_turn(&model, &third, block, &salted).expect("through the cache");
    assert!(turn.earlier().is_some_and(|e| e.blocks() > 0));
    assert_eq!(counted_since(), (0, hashes.blocks()));
    let tokens = model.encode(&third, SpecialTokens::Omit).expect("tokenizes");
    let unsalted = PromptHashes::new(&PromptHasher::new(block, &plain), &tokens);
    assert!(hashes.chain().iter().zip(unsalted.chain()).all(|(a, b)| a != b));

    // Emptied: nothing kept.
    model.chat_cache().set_limit(0);
    model.chat_cache().set_limit(64 << 20);
    let fourth = render(&mut messages, "d".repeat(500));
    let (hashes, turn) = hashed_turn(&model, &fourth, block, &salted).expect("through the cache");
    assert!(turn.earlier().is_none());
    assert_eq!(counted_since(), (0, hashes.blocks()));

    // The follow-up, now that the fourth turn's salted hashes are kept.
    let fifth = render(&mut messages, "e".repeat(500));
    let (hashes, turn) = hashed_turn(&model, &fifth, block, &salted).expect("through the cache");
    let earlier = turn.earlier().expect("kept").blocks();
    assert!(earlier > 0 && hashes.blocks() > earlier);
    assert_eq!(counted_since(), (earlier, hashes.blocks() - earlier));

    // An edit in the first user message: only the system prompt's entry is still a prefix.
    messages[1]["content"] = Value::from("z".repeat(500));
    let edited = render(&mut messages, "f".repeat(500));
    let (hashes, turn) = hashed_turn(&model, &edited, block, &salted).expect("through the cache");
    assert!(turn.earlier().is_none_or(|e| e.blocks() < 4), "{turn:?}");
    assert!(hashes.blocks() > earlier);

    // The collector exports the counts.
    let (kept, hashed) = model.chat_cache().kept_and_hashed_blocks();
    assert!(kept > 0 && hashed > 0);
    let value = exported(&model);
    assert_eq!(
        value("kvroute_tokenizer_cache_kept_hash_blocks_total"),
        Some(kept as f64)
    );
    assert_eq!(
        value("kvroute_tokenizer_cache_hashed_blocks_total"),
        Some(hashed as f64)
    );
}

/// The fixtures' pipelines that text may be cut in (a regex or space split, BPE, no
/// normalizer or NFC), and those it may not (a SentencePiece-style BPE over the whole text).
#[test]
fn text_cuts_are_known_per_pipeline() {
    let cuts: Vec<(&str, TextCuts)> = models().iter().map(|(name, m)| (*name, m.text_cuts())).collect();
    let want = [
        ("tiny", TextCuts::SpaceAfterLetter),
        ("bos", TextCuts::SpaceAfterLetter),
        ("llama3", TextCuts::SpaceAfterLetter),
        ("qwen2", TextCuts::SpaceAfterLetter),
        ("gpt2", TextCuts::SpaceAfterLetter),
        ("llama2", TextCuts::Nowhere),
        ("metaspace-first", TextCuts::Nowhere),
    ];
    assert_eq!(cuts, want);
    // An added token with whitespace in it, or that eats whitespace on its right, could match
    // across a cut: no cut then.
    for (field, value) in [("content", json!("a b")), ("rstrip", json!(true))] {
        let mut tokenizer: Value =
            serde_json::from_str(include_str!("data/tokenizers/llama3.json")).expect("JSON");
        tokenizer["added_tokens"][0][field] = value;
        let model = Model::from_json(&tokenizer.to_string(), None).expect("loads");
        assert_eq!(model.text_cuts(), TextCuts::Nowhere, "{field}");
    }
}

/// Texts long enough to be tokenized in slices: the fragments, many times over.
fn long_text() -> impl Strategy<Value = String> {
    prop::collection::vec(content(), 1..6).prop_map(|parts| {
        let unit = parts.concat();
        let mut text = String::new();
        let mut i = 0usize;
        while text.len() < 72 << 10 {
            text.push_str(&unit);
            text.push_str(FRAGMENTS[i % FRAGMENTS.len()]);
            i += 1;
        }
        text
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// The rule itself, at every cut it allows in `p + r` (adversarial text on both sides),
    /// on every fixture whose pipeline allows cuts: tokenizing the two sides apart equals
    /// tokenizing the whole.
    #[test]
    fn a_text_cut_inside_text_tokenizes_as_a_whole(p in content(), r in content()) {
        for (name, model) in &models() {
            let cuts = model.text_cuts();
            for text in [format!("{p}{r}"), format!("{p}a {r}"), format!("{p}<|im_end|>{r} x y")] {
                let whole = model.encode(&text, SpecialTokens::Omit).expect("tokenizes");
                let mut at = cuts.next(&text, 0);
                while let Some(c) = at {
                    prop_assert!(cuts != TextCuts::Nowhere);
                    let mut parts = model.encode(&text[..c], SpecialTokens::Omit).expect("tokenizes");
                    parts.extend(model.encode(&text[c..], SpecialTokens::Omit).expect("tokenizes"));
                    prop_assert_eq!(&whole, &parts, "{}: {:?} cut at {}", name, text, c);
                    at = cuts.next(&text, c + 1);
                }
            }
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// A long message (tokenized in slices), through the cache on and off, in a conversation
    /// and as a follow-up turn: equal to tokenizing whole; and under a limit it is refused
    /// after the first slices past it.
    #[test]
    fn a_long_message_tokenized_in_slices_equals_whole(text in long_text()) {
        for (name, model) in &models() {
            for limit in [0, 1 << 24] {
                model.chat_cache().set_limit(limit);
                let mut messages = vec![json!({"role": "user", "content": text})];
                for turn in 0..2 {
                    let rendered = model
                        .render_chat(&Value::Array(messages.clone()), true)
                        .expect("renders");
                    check(model, name, &rendered);
                    messages.push(json!({"role": "assistant", "content": format!("{turn} {text}")}));
                }
                let rendered = model.render_chat(&Value::Array(messages), true).expect("renders");
                let whole = model.encode(&rendered, SpecialTokens::Omit).expect("tokenizes").len();
                let (encoded, lookup) = model
                    .encode_chat(&rendered, SpecialTokens::Omit, 1000)
                    .expect("tokenizes");
                prop_assert!(matches!(encoded, Encoded::TooLong(n) if n > 1000 && n <= whole), "{name}: {encoded:?}");
                if model.text_cuts() != TextCuts::Nowhere && limit == 0 {
                    prop_assert!(lookup.tokenized_bytes < rendered.len() / 2, "{name}: {lookup:?}");
                }
            }
        }
    }
}

/// A long conversation grown turn by turn: every turn but the first tokenizes only its new text
/// (a few hundred bytes), reuses the rest, and equals whole tokenization; the counters say so.
#[test]
fn a_follow_up_turn_tokenizes_only_its_new_text() {
    let model = Model::from_json(
        include_str!("data/tokenizers/llama3.json"),
        Some(TINY_TOKENIZER_CONFIG_JSON),
    )
    .expect("loads");
    model.chat_cache().set_limit(64 << 20);
    let mut messages = vec![json!({"role": "system", "content": "You answer briefly."})];
    for turn in 0..32 {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": format!("message {turn}: {}", "the quick brown fox ".repeat(20))}));
        if role == "assistant" {
            continue;
        }
        let text = model
            .render_chat(&Value::Array(messages.clone()), true)
            .expect("renders");
        let (encoded, lookup) = model
            .encode_chat(&text, SpecialTokens::Omit, usize::MAX)
            .expect("tokenizes");
        assert_eq!(
            encoded,
            Encoded::Tokens(model.encode(&text, SpecialTokens::Omit).expect("tokenizes"))
        );
        if turn > 0 {
            assert!(lookup.reused_tokens > 0, "turn {turn}");
            assert!(
                lookup.tokenized_bytes < 1000,
                "turn {turn} tokenized {} bytes",
                lookup.tokenized_bytes
            );
        }
    }
    let (hits, misses) = model.chat_cache().hits_and_misses();
    assert_eq!((hits, misses), (15, 1));
    assert!(model.chat_cache().bytes() > 0);
    // The collector exports them.
    let value = exported(&model);
    assert_eq!(value("kvroute_tokenizer_cache_hits_total"), Some(15.0));
    assert_eq!(value("kvroute_tokenizer_cache_misses_total"), Some(1.0));
}

/// The cache stays within its bound however much goes through it, and stays exact; a bound of
/// zero turns it off and empties it.
#[test]
fn the_cache_stays_within_its_bound() {
    let model = Model::tiny().expect("loads");
    let limit = 256 << 10;
    model.chat_cache().set_limit(limit);
    for conversation in 0..50 {
        let mut messages = Vec::new();
        for turn in 0..8 {
            messages.push(
                json!({"role": "user", "content": format!("{conversation} {turn} {}", "x".repeat(2000))}),
            );
            let text = model
                .render_chat(&Value::Array(messages.clone()), true)
                .expect("renders");
            check(&model, "tiny", &text);
            assert!(model.chat_cache().bytes() <= limit);
            messages.push(json!({"role": "assistant", "content": "ok"}));
        }
    }
    assert!(model.chat_cache().entries() > 0);
    model.chat_cache().set_limit(0);
    assert_eq!((model.chat_cache().bytes(), model.chat_cache().entries()), (0, 0));
}

/// Past the limit the cache stops at the first piece that crosses it, and says so.
#[test]
fn a_conversation_past_the_limit_stops_early() {
    let model = Model::tiny().expect("loads");
    model.chat_cache().set_limit(1 << 20);
    let messages: Vec<Value> = (0..100)
        .map(|i| json!({"role": "user", "content": format!("{i}: {}", "y".repeat(1000))}))
        .collect();
    let text = model.render_chat(&Value::Array(messages), true).expect("renders");
    let (encoded, lookup) = model
        .encode_chat(&text, SpecialTokens::Omit, 5000)
        .expect("tokenizes");
    let Encoded::TooLong(at_least) = encoded else {
        panic!("over the limit: {encoded:?}")
    };
    assert!(at_least > 5000);
    assert!(
        lookup.tokenized_bytes < text.len() / 4,
        "stopped early: {lookup:?}"
    );
}

/// Which added tokens may be cut before: not one that eats whitespace on its left, matches
/// only as a word, is matched after normalization, starts with whitespace, or whose start
/// another token could overlap; and only those the template writes.
#[test]
fn boundary_tokens_are_those_no_match_can_cross() {
    let token = |content: &str, id| AddedToken {
        content: content.to_owned(),
        id,
        normalized: false,
        lstrip: false,
        rstrip: false,
        single_word: false,
    };
    let added = vec![
        token("<|a|>", 1),
        AddedToken {
            lstrip: true,
            ..token("<|b|>", 2)
        },
        AddedToken {
            single_word: true,
            ..token("<|c|>", 3)
        },
        AddedToken {
            normalized: true,
            ..token("<|d|>", 4)
        },
        token(" <|e|>", 5),
        token("<|f|>", 6),
        token("zz<|f", 7),
        token("<|g|>", 8),
    ];
    let template = "<|a|><|b|><|c|><|d|> <|e|><|f|>zz<|f";
    let boundaries = Boundaries::new(&added, Some(template));
    // `<|f|>` is out (`zz<|f` could match across its start); `zz<|f` itself is in; `<|g|>` is
    // not in the template.
    assert_eq!(boundaries.texts().collect::<Vec<_>>(), vec!["<|a|>", "zz<|f"]);
    assert!(Boundaries::new(&added, None).is_empty(), "no template, no cut");
}

/// The value of each counter `model`'s conversation cache exports, by name.
fn exported(model: &Model) -> impl Fn(&str) -> Option<f64> {
    let registry = prometheus::Registry::new();
    registry
        .register(model.chat_cache().collector())
        .expect("registers");
    let families = registry.gather();
    move |name| {
        families
            .iter()
            .find(|f| f.name() == name)
            .map(|f| f.get_metric()[0].get_counter().get_value())
    }
}
