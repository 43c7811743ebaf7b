//! The bodies of the disaggregated (prefill/decode) two-hop flow, in the protocol of vLLM's
//! disaggregated-prefill proxy (the NIXL connector's), which vLLM and the engines built on its
//! KV connectors speak:
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
    let mut obj = object(body)?;
    obj.insert("stream".to_owned(), Value::Bool(false));
    obj.insert("max_tokens".to_owned(), json!(1));
    if obj.contains_key("max_completion_tokens") {
        obj.insert("max_completion_tokens".to_owned(), json!(1));
    }
    for field in ["stream_options", "min_tokens", "min_completion_tokens"] {
        obj.remove(field);
    }
    obj.insert("kv_transfer_params".to_owned(), remote_decode_params());
    serde_json::to_vec(&Value::Object(obj)).map_err(|e| e.to_string())
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
    let Some(params) = params else {
        return Ok(body.to_vec());
    };
    let mut obj = object(body)?;
    obj.insert("kv_transfer_params".to_owned(), params);
    serde_json::to_vec(&Value::Object(obj)).map_err(|e| e.to_string())
}

fn object(body: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err("the body is not a JSON object".to_owned()),
        Err(e) => Err(format!("the body is not JSON: {e}")),
    }
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
}
