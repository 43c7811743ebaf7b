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
//! The modules form layers, each using only those before it (checked by the crate's
//! `module_graph` test):
//!
//! * [`config`]: `ServeConfig` and `WorkerConfig` (TOML, unknown keys rejected), validated once.
//! * [`worker`]: a worker's states and the pure transition function between them.
//! * [`checks`]: the registration checks (served model, block size, tokenization) and their
//!   verdicts, which mark a worker misconfigured.
//! * [`views`]: a worker's cache views, one per rank: how far each can be trusted, its resync
//!   trigger.
//! * [`parity`]: does a worker tokenize as kvroute does (its `/tokenize` against ours)?
//! * [`outcome`]: how a request ended (streamed or not, its outcome by cause, its cached-token
//!   report), the vocabulary the request path speaks and the metrics count.
//! * [`metrics`]: Prometheus metrics under Dynamo's names, exported.
//! * [`registry`]: the workers the proxy knows; each entry holds everything the proxy holds for
//!   its worker (configuration, state, verdicts, cache views, KV-event subscribers).
//! * [`driver`]: the router driver ([`Driver`]): the router and the registry under one lock,
//!   the request guard that frees load on every exit path, what a worker's change of state
//!   means for the router, and the one path that removes a worker.
//! * [`events`]: the KV-event intake: one ZMQ subscriber per worker rank, applied to the router.
//! * [`health`]: the health prober and the registration checks' runner.
//! * [`fleet`]: the one door for adding and removing workers ([`Fleet`]), for start-up, the
//!   admin API and peer replicas.
//! * [`discovery`]: workers found rather than listed (DNS names, a watched file): the sans-IO
//!   membership step (what to add, what to retire) and its resolver and file-reading shell.
//! * [`replicas`]: router replicas sharing load and registry over NATS (`kvroute-sync`).
//! * [`observed`]: the response body that reports chunks and the end to the request guard.
//! * [`coalesce`]: the response body that hands out, in one frame, the chunks already in.
//! * [`flow`]: a generation request's way to its workers: aggregated, vLLM's two hops, SGLang's
//!   bootstrap pair; and the observed response body.
//! * [`autoscale`]: the planner's actuators (`process`, `external`, `dry-run`) and the
//!   removal order.
//! * [`admin`]: the admin API on its own listener: token, listing, add/drain/remove with the
//!   fleet checks, the drain that waits, the removal order.
//! * [`tenants`]: a request's tenant and priority, the tenants' rate limits and metrics.
//! * [`proxy`]: the HTTP front: start-up, the inference routes, request ids and `/metrics`.

pub mod adapters;
pub mod admin;
mod app;
pub mod autoscale;
pub mod checks;
pub mod coalesce;
pub mod config;
pub mod discovery;
pub mod driver;
pub mod events;
pub mod fleet;
pub mod flow;
pub mod health;
pub mod metrics;
pub mod observed;
pub mod outcome;
pub mod parity;
pub mod proxy;
pub mod registry;
pub mod replicas;
pub mod tenants;
pub mod views;
pub mod worker;

pub use config::{EngineKind, ServeConfig, WorkerConfig};
pub use driver::{Driver, QueuedRequests};
pub use fleet::Fleet;
pub use proxy::{ModelHandle, ProxyHandle, start};
