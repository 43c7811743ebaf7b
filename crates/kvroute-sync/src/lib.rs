//! Router replica sync over NATS: several router replicas, one fleet, one view of its load.
//!
//! This is an edge crate: it owns a NATS connection, Tokio tasks and the clock. What is synced
//! and how it applies is the router core's ([`kvroute_core::router::SyncEvent`],
//! `Router::handle_sync_event`); this crate carries it, and a host (the proxy's router driver)
//! applies it, through [`SyncHost`].
//!
//! * [`wire`]: the versioned JSON format of one message, with a decoder that never panics.
//! * [`connect`]: the NATS connection's credentials and TLS, and a refusal told from an outage.
//! * [`transport`]: [`Sync::start`], the tasks, and [`Outgoing`], the bounded queue routing hands
//!   its events to without ever waiting.
//! * [`metrics`]: the `kvroute_sync_*` Prometheus metrics.
//! * [`server`]: a local `nats-server` child process (tests, `kvroute demo --replicas`).
//!
//! # Subjects
//!
//! Under a prefix (`kvroute` by default; two fleets with different prefixes can share a server):
//! `<prefix>.events` carries batches of changes (and a replica's whole state after it
//! reconnects), `<prefix>.heartbeat` heartbeats, and `<prefix>.join` the snapshot requests of a
//! replica that (re)joins, answered on its reply subject by every replica that hears it.

pub mod connect;
pub mod metrics;
pub mod server;
pub mod transport;
pub mod wire;

pub use connect::{ClientCertificate, NatsAuth, NatsTls, Secret};
pub use metrics::SyncMetrics;
pub use transport::{LinkState, Outgoing, Sync, SyncConfig, SyncError, SyncHost, fresh_router_id};
pub use wire::{Body, DecodeError, Envelope, WireEvent, WorkerChange, WorkerRef, decode, encode};
