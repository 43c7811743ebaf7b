//! Replica synchronization (the model; no transport yet): the active-load changes one router
//! makes, as events another router replica can apply, so that replicas that route to the same
//! fleet see each other's load.
//!
//! A router exports an event for every booking it makes ([`LoadChange::Added`], with the load
//! hint it computed), every first token ([`LoadChange::PrefillDone`]) and every request it frees
//! ([`LoadChange::Freed`], including expiries and requests dropped with a removed worker).
//! Events carry the exporting router's [`RouterId`]; a router drops events with its own id, so
//! echoes through a shared channel are harmless. As in Dynamo, output-block growth is not
//! synced. A later issue carries these events over the network.

use std::sync::Arc;

use super::load::PrefillLoadHint;
use crate::ids::{RequestId, SequenceHash, WorkerKey};

/// A router replica's identity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouterId(pub u64);

/// Everything needed to book a request's load: what a decision commits to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Booking {
    /// The worker that decodes the request.
    pub worker: WorkerKey,
    /// Prompt blocks cached on `worker` at admission (the staged projection's cached prefix).
    pub overlap_blocks: u32,
    /// The prefill worker, when disaggregated.
    pub prefill_worker: Option<WorkerKey>,
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// Sequence hashes of the prompt's full blocks.
    pub chain: Arc<[SequenceHash]>,
    /// The prefill load, booked on the worker that prefills.
    pub hint: PrefillLoadHint,
    /// The request's output-length hint.
    pub expected_output_tokens: Option<u32>,
}

/// One active-load change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadChange {
    /// A request was booked.
    Added(Booking),
    /// Its first token came: prefill is done.
    PrefillDone,
    /// It left the books.
    Freed,
}

/// An active-load change made by router `router` for its request `request`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncEvent {
    /// The router that made the change.
    pub router: RouterId,
    /// The request, in that router's ids.
    pub request: RequestId,
    /// The change.
    pub change: LoadChange,
}
