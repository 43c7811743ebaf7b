//! Where a big chat body's CPU goes in the proxy's parse path: JSON parse, the whole parse
//! (field checks, flattening, template rendering, tokenization), rendering alone, tokenization
//! alone, and the forwarded-body rewrite of a stream that asks for its usage chunk; then, with
//! the conversation cache on, a cold body under the default prompt limit (131,072 tokens) and a
//! follow-up turn of the same conversation.
//!
//! `cargo bench -p kvroute-http --bench chat` prints one JSON line per (model, body shape) with
//! each stage's mean over the rounds, in milliseconds of the thread's CPU time (Linux's
//! `/proc/thread-self/schedstat`; the median wall time where it cannot be read), so that a
//! loaded machine slows the figures less. `-- followup <tiny|llama3> <n>` profiles one follow-up turn instead
//! ([`followup`]).

use std::hint::black_box;
use std::time::Instant;

use kvroute_http::Model;
use kvroute_http::model::SpecialTokens;
use kvroute_http::openai::{self, Endpoint, Prompt};
use serde_json::{Value, json};

/// A chat body of about `bytes` bytes in `messages` messages of English-like text.
fn body(bytes: usize, messages: usize, stream: bool) -> Vec<u8> {
    let words = [
        "the ",
        "quick ",
        "brown ",
        "fox ",
        "jumps ",
        "over ",
        "lazy ",
        "dog, ",
        "and ",
        "then ",
        "answers: ",
        "routing ",
        "blocks ",
        "tokens. ",
        "Context ",
        "number ",
        "42 ",
        "follows\n",
    ];
    let per = bytes / messages;
    let list: Vec<Value> = (0..messages)
        .map(|i| {
            let mut text = String::with_capacity(per + 16);
            let mut w = i;
            while text.len() < per {
                text.push_str(words[w % words.len()]);
                w = w.wrapping_mul(31).wrapping_add(7);
            }
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": text})
        })
        .collect();
    serde_json::to_vec(&json!({"model": "m", "messages": list, "max_tokens": 8, "stream": stream}))
        .expect("a JSON value serializes")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// This thread's CPU time so far, ms (none off Linux).
fn cpu_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: f64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(ns / 1e6)
}

/// `f`'s CPU time, ms: the mean over `rounds` (the kernel counts a thread's CPU time in
/// scheduler ticks, too coarse for one round); the median of the wall times where the CPU
/// time is unknown.
fn time(rounds: usize, mut f: impl FnMut()) -> f64 {
    let mut runs = Vec::with_capacity(rounds);
    let c0 = cpu_ms();
    for _ in 0..rounds {
        let t0 = Instant::now();
        f();
        runs.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    match (c0, cpu_ms()) {
        (Some(a), Some(b)) => (b - a) / rounds.max(1) as f64,
        _ => median(runs),
    }
}

/// The bodies of a conversation's turns, as `kvroute bench chat` sends them (unary).
fn conversation(c: usize, turns: usize, message_bytes: usize) -> Vec<Vec<u8>> {
    kvroute_http::sample::conversation(c, turns, message_bytes, false)
}

/// `chat -- followup <tiny|llama3> <n>`: the last turn of `n` 32-turn conversations of about
/// 32K tokens (as `kvroute bench chat` sends them), each parsed with the cache on after the
/// turn before it was; prints µs per turn. For a profiler (callgrind): run it with `n` and with
/// 0 and take the difference.
fn followup(model: &Model, n: usize) {
    // Messages sized as `kvroute bench chat` sizes them: the last turn about 32K tokens.
    let probe: Value = serde_json::from_slice(&conversation(0, 1, 4096)[0]).expect("JSON");
    let text = model.render_chat(&probe["messages"], true).expect("renders");
    let probe_tokens = model.encode(&text, SpecialTokens::Omit).expect("encodes").len();
    let message_bytes = 32_768 * 4096 / probe_tokens.max(1) / 64;
    model.chat_cache().set_limit(256 << 20);
    let conversations: Vec<Vec<Vec<u8>>> = (0..n).map(|c| conversation(c, 32, message_bytes)).collect();
    let max = 131_072;
    for turns in &conversations {
        openai::parse(Endpoint::Chat, &turns[30], model, max).expect("parses");
    }
    let (t0, c0) = (Instant::now(), cpu_ms());
    let mut tokens = 0;
    for turns in &conversations {
        tokens = measured_followup(model, &turns[31], max);
    }
    let ms = match (c0, cpu_ms()) {
        (Some(a), Some(b)) => b - a,
        _ => t0.elapsed().as_secs_f64() * 1e3,
    };
    let us = ms * 1e3 / n.max(1) as f64;
    let body_bytes = conversations.first().map_or(0, |t| t[31].len());
    println!(
        "{}",
        json!({"followups": n, "tokens": tokens, "body_bytes": body_bytes, "cpu_us_per_followup": us})
    );
}

/// One follow-up turn's parse, apart so that a profiler can collect it alone
/// (`valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*measured_followup*'`).
#[inline(never)]
fn measured_followup(model: &Model, body: &[u8], max: usize) -> usize {
    black_box(openai::parse(Endpoint::Chat, black_box(body), model, max).expect("parses"))
        .tokens
        .len()
}

fn main() {
    let chatml = kvroute_http::model::TINY_TOKENIZER_CONFIG_JSON;
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "followup") {
        let model = match args.get(i + 1).map(String::as_str) {
            Some("llama3") => {
                Model::from_json(include_str!("../tests/data/tokenizers/llama3.json"), Some(chatml))
                    .expect("the llama3 fixture loads")
            }
            _ => Model::tiny().expect("the tiny model loads"),
        };
        let n = args.get(i + 2).and_then(|n| n.parse().ok()).unwrap_or(200);
        followup(&model, n);
        return;
    }
    let models = [
        ("tiny", Model::tiny().expect("the tiny model loads")),
        (
            "llama3-shaped",
            Model::from_json(include_str!("../tests/data/tokenizers/llama3.json"), Some(chatml))
                .expect("the llama3 fixture loads"),
        ),
    ];
    let rounds = 15;
    for (name, model) in &models {
        for (size, messages) in [(4 << 20, 1), (4 << 20, 1000), (128 << 10, 64)] {
            let bytes = body(size, messages, true);
            let max = usize::MAX >> 8;
            let parsed = openai::parse(Endpoint::Chat, &bytes, model, max).expect("the body parses");
            let Prompt::Chat { messages: flat, .. } = &parsed.prompt else {
                unreachable!("a chat body")
            };
            let text = model.render_chat(flat, true).expect("it renders");
            let json_ms = time(rounds, || {
                black_box(serde_json::from_slice::<Value>(black_box(&bytes)).expect("JSON"));
            });
            let parse_ms = time(rounds, || {
                black_box(openai::parse(Endpoint::Chat, black_box(&bytes), model, max).expect("parses"));
            });
            let render_ms = time(rounds, || {
                black_box(model.render_chat(black_box(flat), true).expect("renders"));
            });
            let encode_ms = time(rounds, || {
                black_box(
                    model
                        .encode(black_box(&text), SpecialTokens::Omit)
                        .expect("encodes"),
                );
            });
            let rewrite_ms = time(rounds, || {
                black_box(
                    openai::engine_body(&parsed, black_box(&bytes), openai::KvCacheReport::Incremental)
                        .expect("rewrites"),
                );
            });
            // The cache off: over the default limit (stopped early where the tokenizer allows).
            let off_over_limit_ms = time(rounds, || {
                black_box(openai::parse(Endpoint::Chat, black_box(&bytes), model, 131_072).ok());
            });
            // The conversation cache on: a cold body under the default prompt limit (refused
            // once over it), and a follow-up turn (the body plus one short message; each round
            // a new one) after the body was seen.
            model.chat_cache().set_limit(1 << 30);
            let over_limit_ms = time(rounds, || {
                model.chat_cache().set_limit(0);
                model.chat_cache().set_limit(1 << 30);
                black_box(openai::parse(Endpoint::Chat, black_box(&bytes), model, 131_072).ok());
            });
            openai::parse(Endpoint::Chat, &bytes, model, max).expect("the body parses");
            let followups: Vec<Vec<u8>> = (0..rounds)
                .map(|i| {
                    let mut value: Value = serde_json::from_slice(&bytes).expect("JSON");
                    let list = value["messages"].as_array_mut().expect("messages");
                    list.push(json!({"role": "assistant", "content": format!("reply {i}")}));
                    list.push(json!({"role": "user", "content": format!("and question {i}?")}));
                    serde_json::to_vec(&value).expect("serializes")
                })
                .collect();
            let mut next = followups.iter();
            let followup_ms = time(rounds, || {
                let body = next.next().expect("one per round");
                black_box(openai::parse(Endpoint::Chat, black_box(body), model, max).expect("parses"));
            });
            model.chat_cache().set_limit(0);
            println!(
                "{}",
                json!({
                    "model": name, "body_bytes": bytes.len(), "messages": messages,
                    "tokens": parsed.tokens.len(), "json_ms": json_ms, "parse_ms": parse_ms,
                    "render_ms": render_ms, "encode_ms": encode_ms, "stream_rewrite_ms": rewrite_ms,
                    "off_over_default_limit_ms": off_over_limit_ms,
                    "cached_cold_over_default_limit_ms": over_limit_ms, "cached_followup_parse_ms": followup_ms,
                })
            );
        }
    }
}
