//! Live serving for kvroute: `kvroute serve`, an OpenAI-compatible proxy driven by the sans-IO
//! router core, and `kvroute mock`, simulated engines behind OpenAI-compatible servers that
//! publish vLLM-format KV events.
//!
//! This is an edge crate: it owns sockets, a Tokio runtime's tasks and the clock. The router's
//! decisions, the engine's scheduling and the wire codecs are the core crates'; this crate only
//! drives them ([`state`] is the one place the proxy touches the `Router`).
//!
//! # Layout
//!
//! * [`config`]: `ServeConfig` and `WorkerConfig` (TOML, unknown keys rejected), validated once.
//! * [`model`]: the tokenizer and chat template of a local model directory, or the built-in tiny
//!   model.
//! * [`disagg`]: the request bodies of the prefill/decode two-hop flow (vLLM's protocol).
//! * [`openai`]: request parsing (prompt forms, limits) and the OpenAI error shape.
//! * [`state`]: the router driver, the request guard that frees load on every exit path, KV-event
//!   application and worker membership.
//! * [`events`]: one ZMQ subscriber per worker feeding the router.
//! * [`proxy`]: the HTTP front, forwarding, health checks, admin API and `/metrics`.
//! * [`metrics`]: Prometheus metrics under Dynamo's names.
//! * [`mock`]: mock workers.
//! * [`net`]: the accept loop and the pooled upstream client (TCP_NODELAY on both legs).

pub mod config;
pub mod disagg;
pub mod events;
pub mod metrics;
pub mod mock;
pub mod model;
pub mod net;
pub mod openai;
pub mod proxy;
pub mod state;

pub use config::{EngineKind, ServeConfig, WorkerConfig};
pub use mock::{MockConfig, MockWorker};
pub use model::Model;
pub use proxy::{ProxyHandle, start};
