//! The bodies of the disaggregated (prefill/decode) flow, in either engine's protocol
//! ([`EngineKind`](crate::EngineKind), `disagg_protocol` in the configuration).
//!
//! **vLLM** (its disaggregated-prefill proxy's protocol, the NIXL connector's, which vLLM and
//! the engines built on its KV connectors speak), two hops in turn:
//!
//! * **Hop 1**, to the prefill worker, on the client's endpoint: the client's body with
//!   `"stream": false`, `"max_tokens": 1` (and `"max_completion_tokens": 1` when the client
//!   named that field), without `stream_options`, `min_tokens` or `min_completion_tokens`, and
//!   with `kv_transfer_params` asking for a remote decode ([`prefill_body`]).
//! * The prefill worker answers with a JSON body whose `kv_transfer_params` object tells the
//!   decode worker where to pull the KV from ([`kv_transfer_params`]).
//! * **Hop 2**, to the decode worker: the client's body as it came (its own `stream`,
//!   `max_tokens` and `min_tokens`), plus that object when the prefill worker sent a non-empty
//!   one ([`decode_body`]); its response goes back to the client unchanged.
//!
//! Both hops carry the same `X-Request-Id` ([`REQUEST_ID`]).
//!
//! **SGLang** (its engines' bootstrap protocol, as SGLang's model gateway speaks it): one body,
//! the client's with `bootstrap_host` (the prefill worker's host), `bootstrap_port` (its
//! bootstrap server's port, or `null` for the engine's default) and `bootstrap_room` (a number
//! below 2^63 naming this request's KV hand-over) added ([`bootstrap_body`]), sent to the
//! prefill and the decode worker at once. The decode worker pulls the KV of that room from the
//! prefill worker's bootstrap server and streams the answer; the prefill worker's own answer is
//! read and dropped.

use serde_json::{Map, Value, json};

/// The header both hops carry, with the same value.
pub const REQUEST_ID: &str = "x-request-id";

/// The `kv_transfer_params` of hop 1: the prefill worker is to keep the prompt's KV for a
/// remote decode.
pub fn remote_decode_params() -> Value {
    json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

/// Hop 1's body from the client's `body`, a JSON object (the proxy parsed it already; anything
/// else is returned as an error message).
pub fn prefill_body(body: &[u8]) -> Result<Vec<u8>, String> {
    rewrite(body, |obj| {
        obj.insert("stream".to_owned(), Value::Bool(false));
        obj.insert("max_tokens".to_owned(), json!(1));
        if obj.contains_key("max_completion_tokens") {
            obj.insert("max_completion_tokens".to_owned(), json!(1));
        }
        for field in ["stream_options", "min_tokens", "min_completion_tokens"] {
            obj.remove(field);
        }
        obj.insert("kv_transfer_params".to_owned(), remote_decode_params());
    })
}

/// The `kv_transfer_params` of the prefill worker's response `body`, if it is a non-empty
/// object (an engine without a KV connector sends none, or `null`).
pub fn kv_transfer_params(body: &[u8]) -> Option<Value> {
    let value: Value = serde_json::from_slice(body).ok()?;
    match value.get("kv_transfer_params") {
        Some(Value::Object(params)) if !params.is_empty() => Some(Value::Object(params.clone())),
        _ => None,
    }
}

/// Hop 2's body: the client's `body` with `params` (from hop 1) as its `kv_transfer_params`;
/// without params, the client's body unchanged (the decode worker then prefills itself).
pub fn decode_body(body: &[u8], params: Option<Value>) -> Result<Vec<u8>, String> {
    match params {
        Some(params) => with_field(body, "kv_transfer_params", params),
        None => Ok(body.to_vec()),
    }
}

/// The client's `body` with `field` set to `value` (a client's own value is replaced).
pub fn with_field(body: &[u8], field: &str, value: Value) -> Result<Vec<u8>, String> {
    rewrite(body, |obj| {
        obj.insert(field.to_owned(), value);
    })
}

/// The SGLang body sent to both workers: the client's `body` with the bootstrap fields of the
/// prefill worker at `host` (its bootstrap server on `port`; `None` sends `null`, the engine's
/// default port) and the request's `room`. A client's own bootstrap fields are replaced.
pub fn bootstrap_body(body: &[u8], host: &str, port: Option<u16>, room: u64) -> Result<Vec<u8>, String> {
    rewrite(body, |obj| {
        obj.insert("bootstrap_host".to_owned(), json!(host));
        obj.insert("bootstrap_port".to_owned(), json!(port));
        obj.insert("bootstrap_room".to_owned(), json!(room));
    })
}

/// The bootstrap room of the request numbered `id` by the proxy started at `instance`: a
/// number below 2^63 (SGLang reads it as a signed 64-bit integer), the same for the same
/// request, and different for requests of one proxy (SplitMix64's finalizer is a bijection;
/// clearing the top bit pairs at most two inputs).
pub fn bootstrap_room(instance: u64, id: u64) -> u64 {
    let mut z = instance.rotate_left(32) ^ id;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) & (u64::MAX >> 1)
}

/// The host of a worker's base URL `http://host:port`, as the bootstrap host.
pub fn host_of(base: &str) -> String {
    base.parse::<hyper::Uri>()
        .ok()
        .and_then(|uri| uri.host().map(str::to_owned))
        .unwrap_or_default()
}

/// `body`, a JSON object, edited by `edit` (anything else is returned as an error message).
fn rewrite(body: &[u8], edit: impl FnOnce(&mut Map<String, Value>)) -> Result<Vec<u8>, String> {
    let mut obj = match serde_json::from_slice(body) {
        Ok(Value::Object(obj)) => obj,
        Ok(_) => return Err("the body is not a JSON object".to_owned()),
        Err(e) => return Err(format!("the body is not JSON: {e}")),
    };
    edit(&mut obj);
    serde_json::to_vec(&Value::Object(obj)).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn hop_one_bodies() {
        let params = remote_decode_params();
        // (client body, hop-1 body)
        let cases = [
            (
                json!({"model": "m", "prompt": "hi", "max_tokens": 50, "stream": true,
                       "stream_options": {"include_usage": true}, "min_tokens": 5, "temperature": 0.5}),
                json!({"model": "m", "prompt": "hi", "max_tokens": 1, "stream": false,
                       "temperature": 0.5, "kv_transfer_params": params}),
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9,
                       "min_completion_tokens": 2}),
                json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1,
                       "max_tokens": 1, "stream": false, "kv_transfer_params": params}),
            ),
            (
                json!({"prompt": [1, 2, 3]}),
                json!({"prompt": [1, 2, 3], "max_tokens": 1, "stream": false, "kv_transfer_params": params}),
            ),
            // A client's own kv_transfer_params are replaced.
            (
                json!({"prompt": "p", "kv_transfer_params": {"do_remote_prefill": true}}),
                json!({"prompt": "p", "max_tokens": 1, "stream": false, "kv_transfer_params": params}),
            ),
        ];
        for (client, want) in cases {
            let got = prefill_body(&serde_json::to_vec(&client).unwrap()).unwrap();
            assert_eq!(parse(&got), want, "{client}");
        }
        assert!(prefill_body(b"[1]").is_err());
        assert!(prefill_body(b"{").is_err());
    }

    #[test]
    fn hop_two_bodies() {
        let vllm = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "e1", "remote_block_ids": [0, 1, 2], "remote_host": "10.0.0.1",
            "remote_port": 5600, "tp_size": 1});
        // (prefill worker's response, params carried over)
        let responses = [
            (
                json!({"id": "c", "choices": [], "kv_transfer_params": vllm}),
                Some(vllm.clone()),
            ),
            (json!({"id": "c", "choices": [], "kv_transfer_params": {}}), None),
            (
                json!({"id": "c", "choices": [], "kv_transfer_params": null}),
                None,
            ),
            (json!({"id": "c", "choices": []}), None),
        ];
        for (response, want) in responses {
            assert_eq!(
                kv_transfer_params(&serde_json::to_vec(&response).unwrap()),
                want,
                "{response}"
            );
        }
        assert_eq!(kv_transfer_params(b"not json"), None);

        let client = json!({"prompt": "hi", "max_tokens": 50, "stream": true,
            "stream_options": {"include_usage": true}, "min_tokens": 5});
        let bytes = serde_json::to_vec(&client).unwrap();
        let mut want = client.clone();
        want["kv_transfer_params"] = vllm.clone();
        assert_eq!(parse(&decode_body(&bytes, Some(vllm)).unwrap()), want);
        assert_eq!(
            decode_body(&bytes, None).unwrap(),
            bytes,
            "unchanged, byte for byte"
        );
    }

    #[test]
    fn sglang_bodies() {
        let client = json!({"model": "m", "prompt": "hi", "max_tokens": 50, "stream": true,
            "bootstrap_room": 7});
        let bytes = serde_json::to_vec(&client).unwrap();
        let mut want = client.clone();
        want["bootstrap_host"] = json!("10.0.0.2");
        want["bootstrap_port"] = json!(8998);
        want["bootstrap_room"] = json!(42);
        assert_eq!(
            parse(&bootstrap_body(&bytes, "10.0.0.2", Some(8998), 42).unwrap()),
            want
        );
        want["bootstrap_port"] = Value::Null;
        assert_eq!(
            parse(&bootstrap_body(&bytes, "10.0.0.2", None, 42).unwrap()),
            want
        );
        assert!(bootstrap_body(b"[1]", "h", None, 1).is_err());

        assert_eq!(host_of("http://10.0.0.2:30000"), "10.0.0.2");
        assert_eq!(host_of("http://prefill-0.svc:8000"), "prefill-0.svc");
        let rooms: std::collections::HashSet<u64> = (0..10_000).map(|id| bootstrap_room(1234, id)).collect();
        assert_eq!(rooms.len(), 10_000);
        assert!(rooms.iter().all(|&r| r < 1 << 63));
        assert_eq!(bootstrap_room(1234, 5), bootstrap_room(1234, 5));
        assert_ne!(bootstrap_room(1234, 5), bootstrap_room(1235, 5));
    }
}
