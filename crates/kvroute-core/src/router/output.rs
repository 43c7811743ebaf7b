//! What the router answers: decisions, queue and rejection outcomes, and the requests it drops.

use std::time::Duration;

use super::load::PrefillLoadHint;
use crate::ids::{RequestId, WorkerKey};

/// Where a disaggregated request's prefill runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillAssignment {
    /// The prefill worker.
    pub worker: WorkerKey,
    /// Prompt blocks cached on it.
    pub overlap_blocks: u32,
}

/// A routing decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The request.
    pub request: RequestId,
    /// The worker that decodes it (and prefills it, unless `prefill` is set).
    pub worker: WorkerKey,
    /// Prompt blocks cached on `worker`.
    pub overlap_blocks: u32,
    /// The prefill worker, when the request is disaggregated.
    pub prefill: Option<PrefillAssignment>,
    /// The prefill load booked for the request on the worker that prefills it. Booked only on
    /// workers that track prefill load (not on decode workers that prefill locally).
    pub hint: PrefillLoadHint,
    /// How long the request waited in the queue.
    pub waited: Duration,
}

/// Why a request was turned away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// No worker can serve it: none that decodes, or all of them draining (with
    /// [`super::WhenEmpty::Reject`]).
    NoEligibleWorker,
    /// Every eligible worker is busy and the queue is full (or disabled).
    QueueFull,
}

/// The answer to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteOutcome {
    /// Routed now.
    Routed(Decision),
    /// Every eligible worker is busy (or, with [`super::WhenEmpty::Queue`], none is eligible);
    /// the request waits, and its decision comes out of a later call that frees capacity or
    /// adds a worker.
    Queued,
    /// Turned away.
    Rejected(RejectReason),
}

/// Why the router dropped an active request from its books.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// It was older than the request TTL: its "finished" was presumably lost.
    Expired,
    /// Its worker was removed.
    WorkerRemoved,
}

/// Something the router reports from an input other than a new request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// A queued request was routed.
    Routed(Decision),
    /// One of this router's active requests was dropped (other replicas' requests are dropped
    /// silently: their own router reports them).
    Dropped {
        /// The request.
        request: RequestId,
        /// Why.
        reason: DropReason,
    },
}
