//! The HTTP edge that kvroute's two services share: the proxy (`kvroute-proxy`) and the mock
//! engine workers (`kvroute-mock`) speak the same OpenAI-compatible protocol from its two ends,
//! and meet only through it.
//!
//! This is an edge crate: it owns sockets and Tokio tasks. It holds what both ends must agree
//! on, so that it is written once:
//!
//! * [`openai`]: request parsing (prompt forms, limits), the OpenAI error shape, and the typed
//!   response shapes ([`openai::types`]).
//! * [`model`]: the tokenizer and chat template of a local model directory, or the built-in tiny
//!   model; [`chat_template`]: templates rendered as Hugging Face renders them.
//! * [`prefix_cache`]: tokenize once per conversation: a bounded cache of rendered chat
//!   prefixes' tokens, exact by the special-token cut rule it documents.
//! * [`disagg`]: the request bodies of the prefill/decode protocols (vLLM's `kv_transfer_params`,
//!   SGLang's bootstrap rooms).
//! * [`EngineKind`]: the engine family, for what OpenAI's API leaves open.
//! * [`net`]: the accept loop and the pooled upstream client (TCP_NODELAY on both legs).

pub mod chat_template;
pub mod disagg;
pub mod model;
pub mod net;
pub mod openai;
pub mod prefix_cache;
pub mod sample;

pub use model::Model;

use serde::{Deserialize, Serialize};

/// An engine family, for what OpenAI's API leaves open: how a request names the data-parallel
/// rank that is to serve it (a worker's `engine`), and how prefill and decode workers hand a
/// request's KV over (the fleet's `disagg_protocol`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// vLLM: the `X-data-parallel-rank` header; two hops with `kv_transfer_params`.
    #[default]
    Vllm,
    /// SGLang: a `data_parallel_rank` field in the body; bootstrap host, port and room sent to
    /// both workers at once (as SGLang's gateway does both).
    Sglang,
}

impl EngineKind {
    /// The name in configuration and flags.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [Self::Vllm, Self::Sglang]
            .into_iter()
            .find(|e| e.name() == s)
            .ok_or_else(|| format!("{s:?}: vllm or sglang"))
    }
}
