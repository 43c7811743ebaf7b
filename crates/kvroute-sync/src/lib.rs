//! Router replica sync over NATS: several router replicas, one fleet, one view of its load.
//!
//! This is an edge crate: it owns a NATS connection, a Tokio task and the clock. What is synced
//! and how it applies is the router core's ([`kvroute_core::router::SyncEvent`],
//! `Router::handle_sync_event`), and so is the protocol that says when to heartbeat, ask for
//! snapshots, drop duplicates and release a silent peer
//! ([`kvroute_core::router::replica::ReplicaProtocol`], which the simulator runs too); this crate
//! moves its messages as bytes, and a host (the proxy's router driver) applies what it says,
//! through [`SyncHost`].
//!
//! * [`wire`]: the versioned binary format of one message, with a decoder that never panics and
//!   names another version's message as such.
//! * [`connect`]: the NATS connection's credentials and TLS, and a refusal told from an outage.
//! * [`transport`]: [`SyncTransport::start`], the task, and [`Outgoing`], the bounded queue routing hands
//!   its events to without ever waiting.
//! * [`metrics`]: the `kvroute_sync_*` Prometheus metrics.
//! * [`server`]: a local `nats-server` child process (tests, `kvroute demo --replicas`).
//!
//! # Subjects
//!
//! Under a prefix (`kvroute` by default; two fleets with different prefixes can share a server):
//! `<prefix>.events` carries numbered batches of changes (and a replica's whole state after it
//! reconnects), `<prefix>.heartbeat` heartbeats, `<prefix>.join` the snapshot requests of a
//! replica that (re)joins, and `<prefix>.to.<id>` what is addressed to replica `<id>` (a
//! snapshot request to it, its peers' snapshot answers).

pub mod connect;
pub mod metrics;
pub mod server;
pub mod transport;
pub mod wire;

pub use connect::{ClientCertificate, NatsAuth, NatsTls, Secret};
pub use metrics::SyncMetrics;
pub use transport::{
    LinkState, NatsSyncConfig, Outgoing, SyncError, SyncHost, SyncTransport, fresh_router_id,
};
pub use wire::{Body, DecodeError, Envelope, Format, SyncItem, WorkerChange, WorkerRef, decode, encode};
