//! Metric snapshots: counters that only grow, and gauges read at the time of the snapshot.

use super::load::WorkerLoad;
use super::worker::WorkerSpec;
use crate::index::IndexStats;

/// Counters of what the router did. They only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouterCounters {
    /// Requests routed (directly or out of the queue).
    pub routed: u64,
    /// Requests that entered the queue.
    pub queued: u64,
    /// Of those, requests queued because no worker was eligible at all
    /// ([`super::WhenEmpty::Queue`]).
    pub queued_without_worker: u64,
    /// Queued requests routed later.
    pub released: u64,
    /// Requests rejected because no worker could serve them.
    pub rejected_no_worker: u64,
    /// Requests rejected because every eligible worker was busy and the queue was full.
    pub rejected_queue_full: u64,
    /// Queued requests cancelled before they were routed.
    pub cancelled_in_queue: u64,
    /// Active requests dropped by the request TTL (a lost "finished").
    pub expired: u64,
    /// Active requests dropped because their worker was removed.
    pub dropped_with_worker: u64,
    /// Requests whose prefill went to a prefill worker.
    pub disaggregated: u64,
    /// Requests the decider would have disaggregated but no prefill worker was available for.
    pub disagg_without_prefill_worker: u64,
    /// Prompt blocks of routed requests.
    pub prompt_blocks: u64,
    /// Of those, blocks cached on the chosen worker: `overlap_blocks / prompt_blocks` is the
    /// block-weighted predicted hit rate.
    pub overlap_blocks: u64,
    /// Lifecycle events for requests the router does not know (finished twice, expired, ...).
    pub unknown_request_events: u64,
    /// Replica events applied.
    pub sync_applied: u64,
    /// Replica events dropped as this router's own echoes.
    pub sync_echoes: u64,
    /// Replica events that repeated one already applied (an Added for a booked request, a
    /// PrefillDone or Freed for a freed one, a snapshot's binding of a session already bound):
    /// nothing changed.
    pub sync_duplicates: u64,
    /// Replica Addeds that came after their request's Freed (a tombstone): not booked.
    pub sync_stale_added: u64,
    /// Replica PrefillDone or Freed events that came before their Added: a tombstone was left.
    pub sync_early: u64,
    /// Tombstones dropped by the request TTL.
    pub tombstones_expired: u64,
    /// Tombstones evicted by the cap ([`super::SyncConfig::max_tombstones`]).
    pub tombstones_evicted: u64,
    /// Peers declared lost ([`super::Router::handle_peer_lost`]).
    pub peers_lost: u64,
    /// Bookings released with a lost peer.
    pub peer_bookings_released: u64,
    /// KV events refused by the index (see [`IndexStats`] for which kind).
    pub kv_events_refused: u64,
    /// Inputs whose time was earlier than an earlier input's (treated as the later time).
    pub clock_went_back: u64,
    /// This router's requests of a session not bound yet (which bound it).
    pub session_new: u64,
    /// This router's requests of a bound session that stayed on its worker.
    pub session_hits: u64,
    /// This router's requests of a bound session that moved it to another worker.
    pub session_moves: u64,
    /// Sessions released with their worker (removed or suspended).
    pub sessions_released: u64,
    /// Sessions forgotten after their idle time.
    pub sessions_expired: u64,
    /// Sessions evicted by the cap, least recently used first.
    pub sessions_evicted: u64,
}

/// One worker's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerMetrics {
    /// The worker as added.
    pub spec: WorkerSpec,
    /// Whether it takes no new requests.
    pub draining: bool,
    /// Its booked load.
    pub load: WorkerLoad,
    /// Blocks the KV index says it holds.
    pub cached_blocks: u64,
}

/// A snapshot of the router's metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouterMetrics {
    /// Counters.
    pub counters: RouterCounters,
    /// Requests waiting in the queue now.
    pub queued_now: usize,
    /// Of those, requests waiting for want of any worker: all of them while no worker that
    /// decodes is in routing (with [`super::WhenEmpty::Queue`]), none otherwise.
    pub queued_without_worker_now: usize,
    /// Requests booked now (this router's and other replicas').
    pub active_now: usize,
    /// Tombstones of peers' requests kept now.
    pub tombstones_now: usize,
    /// Sessions bound now.
    pub sessions_now: usize,
    /// The KV index's counters.
    pub index: IndexStats,
    /// Every worker, ordered by worker key.
    pub workers: Vec<WorkerMetrics>,
}
