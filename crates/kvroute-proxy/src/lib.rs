//! `kvroute serve`: the router service, an OpenAI-compatible proxy driven by the sans-IO router
//! core.
//!
//! This is an edge crate: it owns sockets, a Tokio runtime's tasks and the clock. The router's
//! decisions and the wire codecs are the core crates'; this crate only drives them ([`driver`] is
//! the one place the proxy touches the `Router`). It knows engines only through their wire
//! formats (OpenAI HTTP, vLLM's KV events over ZMQ): it depends on neither the simulated engine
//! nor the mock workers.
//!
//! # Layout
//!
//! * [`config`]: `ServeConfig` and `WorkerConfig` (TOML, unknown keys rejected), validated once.
//! * [`driver`]: the router driver ([`Shared`]), the request guard that frees load on every exit
//!   path, and what a worker's change of state means for the router.
//! * [`worker`]: a worker's states and the pure transition function between them.
//! * [`registry`]: the workers the proxy knows, their configuration and state.
//! * [`health`]: the health prober.
//! * [`checks`]: registration checks (served model, block size) that mark a worker misconfigured.
//! * [`events`]: the KV-event intake: one ZMQ subscriber per worker rank, applied to the router.
//! * [`proxy`]: the HTTP front: start-up, the inference routes, request ids and `/metrics`.
//! * [`admin`]: the admin API on its own listener: token, listing, add/drain/remove with the
//!   fleet checks.
//! * [`flow`]: a generation request's way to its workers: aggregated, vLLM's two hops, SGLang's
//!   bootstrap pair; and the observed response body.
//! * [`observed`]: the response body that reports chunks and the end to the request guard.
//! * [`coalesce`]: the response body that hands out, in one frame, the chunks already in.
//! * [`metrics`]: Prometheus metrics under Dynamo's names.
//! * [`parity`]: does a worker tokenize as kvroute does (its `/tokenize` against ours)?
//! * [`replicas`]: router replicas sharing load and registry over NATS (`kvroute-sync`).

pub mod admin;
pub mod checks;
pub mod coalesce;
pub mod config;
pub mod driver;
pub mod events;
pub mod flow;
pub mod health;
pub mod metrics;
pub mod observed;
pub mod parity;
pub mod proxy;
pub mod registry;
pub mod replicas;
pub mod worker;

pub use config::{EngineKind, ServeConfig, WorkerConfig};
pub use driver::Shared;
pub use proxy::{ProxyHandle, start};
