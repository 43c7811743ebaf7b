//! Tokenization parity with a worker: does the engine turn a chat conversation (and a completion
//! prompt) into the tokens kvroute routes on?
//!
//! Completions need no check for routing (the proxy sends the engine its own token ids, see
//! [`kvroute_http::openai::engine_body`]), but a chat request is rendered and tokenized by the
//! engine: a different chat template, tokenizer or special-token rule there makes every block
//! differ, and the cache is never hit. [`check`] asks the worker's `/tokenize` (vLLM's,
//! `TokenizeChatRequest` and `TokenizeCompletionRequest`) for a fixed conversation and a fixed
//! completion prompt, and compares with what [`kvroute_http::openai::parse`] gives for the
//! same bodies. The completion prompt is checked too: it tells whether the engine adds the
//! special tokens kvroute adds (vLLM may follow `tokenizer_config.json`'s `add_bos_token`
//! where kvroute follows `tokenizer.json`), which changes what the model sees.

use std::time::Duration;

use axum::http::{StatusCode, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use kvroute_http::model::Model;
use kvroute_http::net::HttpClient;
use kvroute_http::openai::types::Tokenized;
use kvroute_http::openai::{self, Endpoint};

use crate::checks::Worker;
use serde_json::{Value, json};

/// The largest `/tokenize` answer read.
const MAX_ANSWER: usize = 4 << 20;

/// What a parity check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parity {
    /// The worker tokenizes both prompts as kvroute does.
    Match,
    /// The worker's tokens differ from kvroute's for a prompt of `endpoint`'s kind.
    Mismatch {
        /// The kind of prompt (chat: rendered with the template; completions: a text).
        endpoint: Endpoint,
        /// The first position at which the token ids differ (the shorter length if one list
        /// is a prefix of the other).
        position: usize,
        /// kvroute's length.
        ours: usize,
        /// The worker's length.
        theirs: usize,
    },
    /// The worker serves no `/tokenize` (404): parity cannot be checked.
    Unsupported,
}

/// Why a parity check could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ParityError {
    /// The request to the worker failed or timed out.
    #[error("asking {url}: {message}")]
    Request {
        /// The URL asked.
        url: String,
        /// What failed.
        message: String,
    },
    /// The worker answered something other than a `/tokenize` answer.
    #[error("{url} answered {status}: {body}")]
    Answer {
        /// The URL asked.
        url: String,
        /// Its status.
        status: StatusCode,
        /// The start of its body, or what was wrong with it.
        body: String,
    },
    /// kvroute could not tokenize its own probe (the model has no chat template, say).
    #[error("kvroute's own tokenization of the {endpoint:?} probe failed: {message}")]
    Ours {
        /// The probe's kind.
        endpoint: Endpoint,
        /// Why.
        message: String,
    },
}

/// The fixed probes: a short conversation (no system message: some templates refuse one;
/// roles alternate, as some require) and a completion prompt, as `/tokenize` bodies for
/// `model_name`.
pub fn probes(model_name: &str) -> [(Endpoint, Value); 2] {
    [
        (
            Endpoint::Chat,
            json!({
                "model": model_name,
                "messages": [
                    {"role": "user", "content": "Hello! What is 2 + 2?"},
                    {"role": "assistant", "content": "2 + 2 = 4."},
                    {"role": "user", "content": "Thanks. And 3 + 3?"},
                ],
                "add_generation_prompt": true,
            }),
        ),
        (
            Endpoint::Completions,
            json!({"model": model_name, "prompt": "The quick brown fox jumps over the lazy dog."}),
        ),
    ]
}

/// Checks the worker at `base` (`http://host:port`) against `model`: each probe of [`probes`]
/// sent to its `/tokenize` (within `timeout` each) and compared with kvroute's tokens. The first
/// mismatch is the answer; a 404 is [`Parity::Unsupported`].
pub async fn check(
    client: &HttpClient,
    worker: Worker<'_>,
    model_name: &str,
    model: &Model,
    timeout: Duration,
) -> Result<Parity, ParityError> {
    let url = format!("{}/tokenize", worker.base.trim_end_matches('/'));
    for (endpoint, body) in probes(model_name) {
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let ours = openai::parse(endpoint, &bytes, model, usize::MAX >> 8)
            .map_err(|e| ParityError::Ours {
                endpoint,
                message: e.message,
            })?
            .tokens;
        let Some(theirs) = ask(client, &url, worker.api_key, bytes, timeout).await? else {
            return Ok(Parity::Unsupported);
        };
        if let Some(position) = first_difference(&ours, &theirs) {
            return Ok(Parity::Mismatch {
                endpoint,
                position,
                ours: ours.len(),
                theirs: theirs.len(),
            });
        }
    }
    Ok(Parity::Match)
}

/// Runs [`check`] and logs what it found: a mismatch loudly (a warning naming the worker, the
/// prompt kind and where the tokens part), an unsupported worker or a failed check as such. A
/// worker that cannot be reached yet is asked again by the registration checks
/// ([`crate::checks`]) when its health checks pass.
pub async fn check_and_log(
    client: &HttpClient,
    worker: Worker<'_>,
    model_name: &str,
    model: &Model,
    timeout: Duration,
) -> Result<Parity, ParityError> {
    let result = check(client, worker, model_name, model, timeout).await;
    let base = worker.base;
    match &result {
        Ok(Parity::Match) => tracing::info!(worker = %base, "tokenization matches the worker's /tokenize"),
        Ok(Parity::Mismatch {
            endpoint,
            position,
            ours,
            theirs,
        }) => tracing::warn!(
            worker = %base,
            endpoint = endpoint.path(),
            position,
            ours,
            theirs,
            "MISCONFIGURED: the worker tokenizes differently from kvroute (another tokenizer, chat \
             template or special-token rule): its prompts' blocks will not match the router's, \
             and its cache will not be hit; give kvroute the worker's model directory"
        ),
        Ok(Parity::Unsupported) => tracing::info!(
            worker = %base,
            "the worker serves no /tokenize: tokenization parity is not checked"
        ),
        Err(e) => tracing::warn!(worker = %base, error = %e, "tokenization parity check failed"),
    }
    result
}

/// The registration check's verdict on what [`check`] found: a mismatch makes the worker
/// misconfigured; a worker without `/tokenize` passes (nothing to compare); a check that could
/// not be made gives no verdict.
pub fn verdict(found: Result<Parity, ParityError>) -> Option<Result<(), String>> {
    match found {
        Ok(Parity::Match | Parity::Unsupported) => Some(Ok(())),
        Ok(Parity::Mismatch {
            endpoint,
            position,
            ours,
            theirs,
        }) => Some(Err(format!(
            "it tokenizes {} prompts otherwise: the tokens part at position {position} \
             (kvroute {ours} tokens, the worker {theirs}); give kvroute the worker's model directory",
            endpoint.path()
        ))),
        Err(_) => None,
    }
}

/// The first position at which `a` and `b` differ, if they do.
fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => Some(i),
        None if a.len() != b.len() => Some(a.len().min(b.len())),
        None => None,
    }
}

/// POSTs `body` to `url` (with the worker's credential) and reads the `tokens` of the answer; `None` on
/// a 404.
async fn ask(
    client: &HttpClient,
    url: &str,
    api_key: Option<&str>,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<Option<Vec<u32>>, ParityError> {
    let failed = |message: String| ParityError::Request {
        url: url.to_owned(),
        message,
    };
    let request = crate::checks::with_credential(hyper::Request::post(url), api_key)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| failed(e.to_string()))?;
    let exchange = async {
        let response = client.request(request).await.map_err(|e| failed(e.to_string()))?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| failed(format!("reading the answer: {e}")))?
            .to_bytes();
        Ok::<_, ParityError>((status, bytes))
    };
    let (status, bytes) = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| failed("no answer in time".to_owned()))??;
    if status == StatusCode::NOT_FOUND {
        return Ok(None);
    }
    let bad = |body: String| ParityError::Answer {
        url: url.to_owned(),
        status,
        body,
    };
    if !status.is_success() {
        return Err(bad(String::from_utf8_lossy(&bytes).chars().take(300).collect()));
    }
    serde_json::from_slice::<Tokenized>(&bytes)
        .map(|answer| Some(answer.tokens))
        .map_err(|e| bad(format!("not vLLM's /tokenize answer: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_difference_is_found() {
        // (ours, theirs, first difference)
        let cases: &[(&[u32], &[u32], Option<usize>)] = &[
            (&[1, 2, 3], &[1, 2, 3], None),
            (&[], &[], None),
            (&[1, 2, 3], &[9, 1, 2, 3], Some(0)),
            (&[1, 2, 3], &[1, 2], Some(2)),
            (&[1, 2], &[1, 2, 3], Some(2)),
            (&[1, 5, 3], &[1, 2, 3], Some(1)),
        ];
        for (ours, theirs, expected) in cases {
            assert_eq!(first_difference(ours, theirs), *expected, "{ours:?} {theirs:?}");
        }
    }
}
