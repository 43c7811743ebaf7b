//! The body the proxy forwards to an engine, and vLLM's per-request KV-event report mode.

use serde_json::{Map, Value};

use super::{ApiError, Parsed, Prompt};

/// What vLLM's engine publishes of a request's prefix-cache hits, asked for per request in
/// `vllm_xargs` ([`KV_CACHE_REPORT_MODE`]). vLLM (0.32, `Request.kv_cache_report_mode`) reads
/// the key from the request's extra arguments, default `incremental`; any value but `full`
/// means incremental.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheReport {
    /// Only blocks newly cached are announced (`BlockStored`): vLLM's default.
    #[default]
    Incremental,
    /// The blocks a request reuses from the prefix cache are announced again, as one
    /// `BlockStored` of the whole hit from the root, each time the request's prefix is looked
    /// up (`KVCacheManager.get_computed_blocks`).
    Full,
}

impl KvCacheReport {
    /// The value vLLM reads: `full` for [`KvCacheReport::Full`].
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Incremental => "incremental",
            Self::Full => "full",
        }
    }

    /// The mode `vllm_xargs` (a request's, if it has them) asks for, as vLLM reads it: `full`
    /// is full, any other value (or none) incremental. `None` when the key is absent.
    pub fn from_xargs(xargs: Option<&Value>) -> Option<Self> {
        let value = xargs?.get(KV_CACHE_REPORT_MODE)?;
        Some(match value.as_str() {
            Some("full") => Self::Full,
            _ => Self::Incremental,
        })
    }
}

/// The `vllm_xargs` key of vLLM's per-request KV-event report mode ([`KvCacheReport`]). The
/// only `vllm_xargs` key the proxy reads or writes: the others are the client's business.
pub const KV_CACHE_REPORT_MODE: &str = "kv_cache_report_mode";

/// The body the proxy sends the engine for a client's `body` (parsed as `parsed`), or `None`
/// when it is the client's as it came:
///
/// * [`INTERNAL_FIELDS`](super::INTERNAL_FIELDS) are stripped. Stripped rather than refused: they mean nothing to the
///   client's request (text comes back either way), only to the flows kvroute runs, which set
///   their own (as they already replace a client's bootstrap fields and rank); a client built
///   for another gateway keeps working, and a hostile one steers nothing. Each strip is logged.
/// * a completion's text prompt is replaced by the token ids the router routed on (Dynamo's
///   design): the engine adds nothing to token ids, so routing and engine cannot disagree on
///   the prompt's blocks. The answer is the same text. Not with `echo`, whose answer would show
///   the decoded ids instead of the client's text: that request keeps its text.
/// * a stream whose client did not ask for usage asks for it (`stream_options.include_usage`,
///   the client's other stream options kept): vLLM reports a stream's cached tokens only in its
///   final usage chunk, which the proxy then takes out of the client's stream
///   ([`Parsed::usage_requested_for_client`]).
///
/// * `report` is vLLM's KV-event report mode the proxy wants from the worker(s) it routed to
///   (`Full` while their cache view is rebuilt): set as `vllm_xargs.kv_cache_report_mode`,
///   merged into the client's `vllm_xargs`, whose other keys are kept. A client's own
///   `kv_cache_report_mode` is the proxy's to set: stripped (and the `vllm_xargs` it leaves
///   empty with it) when `report` is incremental.
///
/// One parse and one serialization, whatever of these applies; none when only a stream's
/// `stream_options` is to be added to a body that has none (spliced in).
pub fn engine_body(parsed: &Parsed, body: &[u8], report: KvCacheReport) -> Result<Option<Vec<u8>>, ApiError> {
    let replace_prompt = matches!(parsed.prompt, Prompt::Text(_)) && !parsed.echo;
    let ask_usage = parsed.usage_requested_for_client();
    let set_report = report == KvCacheReport::Full || parsed.kv_cache_report.is_some();
    let strip = !parsed.internal_fields.is_empty() || !parsed.internal_xargs.is_empty();
    if !strip && !replace_prompt && !ask_usage && !set_report {
        return Ok(None);
    }
    if !strip && !replace_prompt && !set_report && !parsed.stream_options {
        // Only `stream_options` to add, and the body has none: spliced in after the opening
        // brace (the body is an object with at least `stream`), so a big body is neither
        // parsed again nor serialized.
        if let Some(open) = body.iter().position(|b| !b.is_ascii_whitespace())
            && body[open] == b'{'
        {
            const USAGE: &[u8] = br#""stream_options":{"include_usage":true},"#;
            let mut out = Vec::with_capacity(body.len() + USAGE.len());
            out.extend_from_slice(&body[..=open]);
            out.extend_from_slice(USAGE);
            out.extend_from_slice(&body[open + 1..]);
            return Ok(Some(out));
        }
    }
    let mut obj = match serde_json::from_slice(body) {
        Ok(Value::Object(obj)) => obj,
        _ => return Err(ApiError::bad_request("body", "the body must be a JSON object")),
    };
    if !parsed.internal_fields.is_empty() {
        tracing::info!(fields = ?parsed.internal_fields, "stripped internal fields from a client's request");
        for field in &parsed.internal_fields {
            obj.remove(*field);
        }
    }
    if !parsed.internal_xargs.is_empty() {
        tracing::info!(fields = ?parsed.internal_xargs, "stripped internal fields from a client's vllm_xargs");
        if let Some(Value::Object(xargs)) = obj.get_mut("vllm_xargs") {
            for field in &parsed.internal_xargs {
                xargs.remove(*field);
            }
            if xargs.is_empty() {
                obj.remove("vllm_xargs");
            }
        }
    }
    if replace_prompt {
        obj.insert("prompt".to_owned(), Value::from(parsed.tokens.clone()));
    }
    if set_report {
        set_kv_cache_report(&mut obj, report);
    }
    if ask_usage {
        let options = obj
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if !options.is_object() {
            // `null`: the field rules let nothing else through.
            *options = Value::Object(Map::new());
        }
        if let Value::Object(options) = options {
            options.insert("include_usage".to_owned(), Value::Bool(true));
        }
    }
    serde_json::to_vec(&obj)
        .map(Some)
        .map_err(|e| ApiError::bad_request("body", e.to_string()))
}

/// Sets `obj`'s `vllm_xargs.kv_cache_report_mode` to `report` (`Full`), or takes it out
/// (`Incremental`, vLLM's default), keeping the client's other `vllm_xargs`.
fn set_kv_cache_report(obj: &mut Map<String, Value>, report: KvCacheReport) {
    match report {
        KvCacheReport::Full => {
            let xargs = obj
                .entry("vllm_xargs")
                .or_insert_with(|| Value::Object(Map::new()));
            if !xargs.is_object() {
                // `null`: the field rules let nothing else through.
                *xargs = Value::Object(Map::new());
            }
            if let Value::Object(xargs) = xargs {
                xargs.insert(KV_CACHE_REPORT_MODE.to_owned(), Value::from(report.as_str()));
            }
        }
        KvCacheReport::Incremental => {
            if let Some(Value::Object(xargs)) = obj.get_mut("vllm_xargs") {
                xargs.remove(KV_CACHE_REPORT_MODE);
                if xargs.is_empty() {
                    obj.remove("vllm_xargs");
                }
            }
        }
    }
}
