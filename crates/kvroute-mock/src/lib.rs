//! `kvroute mock`: simulated engines as OpenAI-compatible workers.
//!
//! Each mock worker is a [`kvroute_engine::Engine`] driven in real time (divided by the engine's
//! `speedup`) by one task, behind its own HTTP server: `/v1/completions` and
//! `/v1/chat/completions` (streaming or not, with `usage` and
//! `prompt_tokens_details.cached_tokens`), `/v1/models`, `/health` and a vLLM-like `/metrics`.
//! The engine's KV events go out in vLLM's wire format on a ZMQ PUB socket with a replay socket
//! ([`kvroute_zmq::EventPublisher`]). Prompts are tokenized with the same [`Model`](kvroute_http::model::Model) as the proxy,
//! so the blocks the proxy hashes are the blocks the engine caches.
//!
//! The driver loop: take requests as they arrive ([`Engine::add_request`](kvroute_engine::Engine::add_request) at the arrival time);
//! when the engine has work, run one pass ([`Engine::step`](kvroute_engine::Engine::step)), sleep until the pass ends (taking
//! new requests meanwhile), then deliver its tokens, first tokens and completions and publish its
//! events. A request whose client left is aborted in the engine, as vLLM does
//! ([`EngineHost::abort`](kvroute_engine::EngineHost::abort)): its blocks are freed, what it
//! cached stays cached, and `kvroute_mock_requests_aborted_total` counts it.
//!
//! Errors come in vLLM's shape (`{"error": {..., "code": <status>}}`): an unknown `model` is a
//! 404, `max_tokens` below 1 or beyond the context left after the prompt a 400, with vLLM's
//! messages. `usage.prompt_tokens_details.cached_tokens` follows vLLM under
//! `--enable-prompt-tokens-details` (left out when zero; [`MockConfig::cached_tokens`]).
//!
//! # Prefill/decode
//!
//! Any mock worker speaks both sides of vLLM's disaggregated-prefill protocol (NIXL connector),
//! whatever role it is configured under (the role only tells the proxy how to route to it):
//!
//! * a request whose `kv_transfer_params.do_remote_decode` is true is prefilled (one output
//!   token) and answered with `kv_transfer_params` naming this worker as the remote engine
//!   (`do_remote_prefill: true`, its engine id, the prompt's block indices, its host and port,
//!   the request's `X-Request-Id`);
//! * a request whose `kv_transfer_params.do_remote_prefill` is true is imported
//!   by the rule of [`kvroute_engine::host`], the simulator's too: one that can never fit is
//!   refused, one that finds no free blocks waits, in order, for a pass to free some; the
//!   prompt's blocks it holds are hits, the rest are reserved), its KV lands
//!   after the transfer time of the blocks it lacks ([`KvTransfer::duration`](kvroute_engine::KvTransfer::duration), the simulator's
//!   link model), then [`Engine::complete_import`](kvroute_engine::Engine::complete_import) caches the prompt and the request decodes
//!   from the token the prefill worker sampled. Its `cached_tokens` are the prompt blocks it
//!   already held. KV events of an import started during a pass follow the pass's, in the
//!   engine's order; transfers land between passes.
//!
//! They speak SGLang's bootstrap protocol too, where the role decides the side, since both
//! workers get the same body: a request with `bootstrap_room` (and `bootstrap_host`) on a
//! `prefill` worker is prefilled (one output token) and its room marked ready when that token
//! is out; on any other worker it waits for its room to be ready (at most [`BOOTSTRAP_TIMEOUT`])
//! and is then imported as above. The rooms live in memory shared by the workers of one
//! [`start()`] (standing in for the prefill worker's bootstrap server), so the prefill and decode
//! workers of a pair must be started together.

mod config;
mod driver;
mod handlers;
mod lora;
mod metrics;
mod openai;
mod parse;
mod rooms;
mod start;
mod vllm;

pub use config::{MockConfig, MockError};
pub use lora::LoraModule;
pub use rooms::BOOTSTRAP_TIMEOUT;
pub use start::{MockWorker, SEEN_KEPT, SeenKvRequest, start};
