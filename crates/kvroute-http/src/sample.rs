//! Chat conversations for benchmarks: deterministic English-like text that grows turn by turn,
//! the shape `kvroute bench chat` sends and `cargo bench -p kvroute-http --bench chat` parses.

use serde_json::json;

/// The request bodies of conversation `c`, turn by turn: a system message, then `turns` user
/// messages each after an assistant reply, every message about `message_bytes` long, its text
/// seeded by `c`; `max_tokens` 8, model `tiny`, streamed or not.
pub fn conversation(c: usize, turns: usize, message_bytes: usize, stream: bool) -> Vec<Vec<u8>> {
    let words = [
        "routing ", "the ", "blocks ", "of ", "a ", "long ", "chat, ", "turn ", "by ", "turn; ", "cache ",
        "prefix ", "tokens ", "engine ", "worker. ", "Why? ", "Because ", "42 ", "fleets ", "grow\n",
    ];
    let text = |seed: usize| {
        let mut s = format!("[{c}.{seed}] ");
        let mut w = seed.wrapping_mul(2_654_435_761).wrapping_add(c);
        while s.len() < message_bytes {
            s.push_str(words[w % words.len()]);
            w = w
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407)
                >> 7;
        }
        s
    };
    let mut messages =
        vec![json!({"role": "system", "content": format!("You are assistant {c}; answer briefly.")})];
    let mut bodies = Vec::with_capacity(turns);
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": text(2 * t)}));
        let body = json!({"model": "tiny", "messages": messages, "max_tokens": 8, "stream": stream});
        bodies.push(body.to_string().into_bytes());
        messages.push(json!({"role": "assistant", "content": text(2 * t + 1)}));
    }
    bodies
}
