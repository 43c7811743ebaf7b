//! `kvroute serve`: the router service, an OpenAI-compatible proxy driven by the sans-IO router
//! core.
//!
//! This is an edge crate: it owns sockets, a Tokio runtime's tasks and the clock. The router's
//! decisions and the wire codecs are the core crates'; this crate only drives them ([`state`] is
//! the one place the proxy touches the `Router`). It knows engines only through their wire
//! formats (OpenAI HTTP, vLLM's KV events over ZMQ): it depends on neither the simulated engine
//! nor the mock workers.
//!
//! # Layout
//!
//! * [`config`]: `ServeConfig` and `WorkerConfig` (TOML, unknown keys rejected), validated once.
//! * [`state`]: the router driver, the request guard that frees load on every exit path, KV-event
//!   application and worker membership.
//! * [`events`]: one ZMQ subscriber per worker feeding the router.
//! * [`proxy`]: the HTTP front, forwarding, health checks, admin API and `/metrics`.
//! * [`metrics`]: Prometheus metrics under Dynamo's names.

pub mod config;
pub mod events;
pub mod metrics;
pub mod proxy;
pub mod state;

pub use config::{EngineKind, ServeConfig, WorkerConfig};
pub use proxy::{ProxyHandle, start};
