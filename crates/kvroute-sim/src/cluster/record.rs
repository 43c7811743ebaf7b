//! What a run records: each request's state and the run's totals, from which the report is
//! computed.

use kvroute_core::time::Timestamp;

use crate::report::Outcome;

/// One request's state during a run.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ReqState {
    pub(crate) arrived: Option<Timestamp>,
    pub(crate) routed: Option<Timestamp>,
    pub(crate) worker: Option<u32>,
    pub(crate) overlap_blocks: u32,
    /// When the client received its first token.
    pub(crate) first_token: Option<Timestamp>,
    /// With HTTP latency: a message (the request, or its finish) is on its way.
    pub(crate) in_transit: bool,
    /// With HTTP latency: when its last message arrives (its messages arrive in order).
    pub(crate) http_last: Timestamp,
    pub(crate) finished: Option<Timestamp>,
    pub(crate) rejected: bool,
    /// The prefill worker of a disaggregated request.
    pub(crate) prefill_worker: Option<u32>,
    /// Whether it runs on its prefill worker and will move to its decode worker after.
    pub(crate) in_prefill: bool,
    /// The worker computing its prompt, until its first token (the planner's queued prefill).
    pub(crate) queued_on: Option<u32>,
    /// The router replica that routed it.
    pub(crate) replica: u32,
    /// Whether it counts in its decode worker's in-flight requests (load imbalance).
    pub(crate) counted: bool,
    /// When an engine first scheduled it (the start of that pass).
    pub(crate) admitted: Option<Timestamp>,
    /// Prompt tokens its engine found cached at that first scheduling.
    pub(crate) cached_tokens: Option<u32>,
}

/// What every pass that decodes a request reads and writes of it, kept apart from its
/// [`ReqState`] in a dense array: a busy engine's pass touches each of its running requests,
/// whose states lie scattered over the requests in flight, so these 16 bytes are all it reads.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Tokens {
    /// When an engine emitted its last token.
    pub(crate) last_token: Timestamp,
    /// Tokens emitted.
    pub(crate) output_tokens: u32,
    /// Whether an engine emitted its first token (with HTTP latency, before the client has it).
    pub(crate) emitted_first: bool,
}

impl ReqState {
    pub(crate) fn outcome(&self) -> Outcome {
        if self.finished.is_some() {
            Outcome::Completed
        } else if self.rejected {
            Outcome::Rejected
        } else {
            Outcome::Unfinished
        }
    }
}

/// Totals a run accumulates; the report is computed from them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Totals {
    pub(crate) arrived: u64,
    pub(crate) completed: u64,
    pub(crate) rejected_by_router: u64,
    pub(crate) rejected_by_engine: u64,
    pub(crate) dropped_by_router: u64,
    pub(crate) steps: u64,
    pub(crate) busy_nanos: u64,
    pub(crate) prefill_busy_nanos: u64,
    pub(crate) kv_transfers: u64,
    pub(crate) kv_transfers_done: u64,
    pub(crate) kv_transfer_bytes: u64,
    pub(crate) kv_transfer_blocks: u64,
    pub(crate) kv_transfer_hit_blocks: u64,
    pub(crate) kv_transfer_nanos: u64,
    pub(crate) kv_import_waits: u64,
    pub(crate) kv_import_wait_nanos: u64,
    pub(crate) preemptions: u64,
    pub(crate) hit_tokens: u64,
    pub(crate) query_tokens: u64,
    pub(crate) kv_events_published: u64,
    pub(crate) kv_events_lost: u64,
    pub(crate) kv_events_refused: u64,
    pub(crate) stale_lifecycle_events: u64,
    pub(crate) sync_events_published: u64,
    pub(crate) sync_events_lost: u64,
    pub(crate) sync_events_refused: u64,
    pub(crate) sync_messages_lost: u64,
    pub(crate) end: Timestamp,
    pub(crate) itl: crate::stats::Sketch,
}
