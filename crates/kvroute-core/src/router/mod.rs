//! The router core: choosing a worker from cache overlap and predicted load, sans-IO.
//!
//! The live proxy and the simulator both drive this code. It reads no clock: every input carries
//! the time, and outputs are returned values.
//!
//! # Grammar
//!
//! * **Construction.** [`Router::new`] takes a [`RouterConfig`], validated once.
//! * **Inputs** are `handle_*(now, ..)` calls. Time is a [`Timestamp`] chosen by the driver and
//!   must not go backwards (an earlier time is treated as the latest one seen, and counted).
//!   - a request: [`Router::handle_request`] answers with a [`RouteOutcome`] (routed, queued or
//!     rejected);
//!   - lifecycle: [`Router::handle_first_token`] (prefill done), [`Router::handle_output_block`]
//!     (generation crossed a block boundary), [`Router::handle_finished`],
//!     [`Router::handle_cancelled`];
//!   - cache: [`Router::handle_kv_event`];
//!   - fleet: [`Router::handle_worker_added`], [`Router::handle_worker_draining`],
//!     [`Router::handle_worker_suspended`] (out of routing, bookings and cache view kept),
//!     [`Router::handle_worker_removed`], [`Router::handle_adapters`] (the LoRA adapters a worker
//!     serves: a request naming one goes only to those workers);
//!   - replicas: [`Router::handle_sync_event`] (a peer's load change; see the `sync` module for
//!     duplicates, tombstones and ordering), [`Router::handle_peer_lost`] (release a silent
//!     peer's bookings);
//!   - time: [`Router::handle_tick`] (request expiry, cache-record expiry, queue re-check).
//! * **Outputs.** An input that can free capacity returns the [`Output`]s it caused: queued
//!   requests it released ([`Output::Routed`]) and requests it dropped ([`Output::Dropped`]).
//!   Replica events wait in an outbox for [`Router::poll_sync_event`];
//!   [`Router::sync_snapshot`] lists this router's in-flight bookings for a joining replica.
//! * **Queries** take `&self`: [`Router::next_deadline`] (when to call `handle_tick` next),
//!   [`Router::metrics`], [`Router::worker_load`], [`Router::check_invariants`]. The dry run
//!   [`Router::candidates`] (the snapshot a policy would see) takes `&mut self` only for its
//!   scratch buffers: it books nothing and moves no clock.
//!
//! # Routing a request
//!
//! 1. Hash the prompt (once) into local and sequence hashes at the router's block size.
//! 2. Overlap per worker: the KV-event [`RunIndex`], and/or the router's record of its own
//!    recent decisions ([`CacheMode`]); the larger of the two.
//! 3. Candidates: workers that decode (aggregated and decode workers), not draining, not busy
//!    ([`BusyThresholds`]). None eligible: rejected, or queued with [`WhenEmpty::Queue`]. All
//!    busy: queued ([`QueueConfig`]).
//! 4. The policy picks one ([`policy`]), unless the request's session is bound to a worker in
//!    routing that is not overloaded: it goes there ([`session`]). If it is a decode worker and
//!    the [`Decider`] says so, a prefill worker is picked from the prefill pool by the prefill
//!    policy.
//! 5. The prefill load hint is computed once ([`PrefillLoadHint::new`]) and the decision is
//!    booked in one place: the load tracker, the recent-decision record, the policies' own views
//!    and the replica outbox. A peer's booking goes through the same place.
//!
//! # Invariants
//!
//! * Every per-worker total equals a recomputation from the active requests; debug builds check
//!   it after every change, and [`Router::check_invariants`] checks it on demand.
//! * No load outlives its request: a lost "finished" is dropped after
//!   [`RouterConfig::request_ttl`].
//! * The same configuration (seed included) and the same inputs give the same outputs: the only
//!   randomness is the router's seeded [`Rng`], and everything that reaches an output is iterated
//!   in worker-key order or in an order set by the inputs alone (the fleet's idle and loaded
//!   sets, in the order workers joined them).
//! * The queue is non-empty only while every eligible worker is busy (or none is eligible):
//!   every input that frees capacity or adds a worker re-checks it.

mod adapters;
mod busy;
mod chain_trie;
mod churn;
mod config;
mod cost;
mod disagg;
mod fair;
mod fleet;
mod load;
mod lows;
mod metrics;
mod output;
pub mod policy;
mod queue;
mod recent;
pub mod replica;
mod request;
mod rng;
mod scan;
pub mod select;
pub mod session;
pub mod spec;
mod sync;
mod worker;

use std::collections::VecDeque;
use std::sync::Arc;

pub use crate::index::{IndexEvent, stored_blocks};
pub use busy::BusyThresholds;
pub use config::{CacheMode, ConfigError, RouterConfig};
pub use cost::{CostParams, cost};
pub use disagg::{Decider, UnknownDecider};
pub use fair::{FairConfig, TenantId, served_tokens};
pub use load::{
    ActiveDepth, DecodeProjection, PrefillLoadHint, PrefillModel, Projection, WorkerLoad,
    effective_prefill_tokens, max_cached_blocks, project,
};
pub use metrics::{RouterCounters, RouterMetrics, WorkerMetrics};
pub use output::{Decision, DropReason, Output, PrefillAssignment, RejectReason, RouteOutcome};
pub use policy::{Candidate, Policy, PolicyConfig, UnknownPolicy};
pub use queue::{QueueConfig, QueueOrder, WhenEmpty};
pub use recent::RecentConfig;
pub use request::{Prompt, RequestView, RouteRequest};
pub use rng::Rng;
pub use session::{SessionConfig, SessionId, SessionOutcome};
pub use spec::{OptionError, RouterOptions, RouterSpec, SpecError};
pub use sync::{Booking, LoadChange, PeerTracker, RouterId, SyncConfig, SyncEvent, SyncMode};
pub use worker::{WorkerRole, WorkerSpec};

use adapters::Adapters;
use fair::FairShare;
use fleet::{Fleet, FleetError, RequestKey};
use queue::{WaitQueue, Waiting};
use recent::RecentChains;
use request::Prepared;
use scan::{ArgminScratch, Stage};
use session::SessionTable;
use sync::{Mark, Tombstones};

use crate::hash::{HashSalt, PromptHasher, sequence_hashes_shared};
use crate::ids::{LocalBlockHash, RequestId, SequenceHash, WorkerKey};
use crate::index::{IndexConfig, IndexError, OverlapScores, RunIndex, Tier};
use crate::time::Timestamp;

/// An input the router refuses. Nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// The request is neither active nor queued (finished already, expired, or never routed).
    #[error("unknown request {0:?}")]
    UnknownRequest(RequestId),
    /// A request with this id is already active or queued.
    #[error("request {0:?} is already active or queued")]
    DuplicateRequest(RequestId),
    /// The worker is not in the fleet.
    #[error("unknown worker {0}")]
    UnknownWorker(WorkerKey),
    /// The worker is already in the fleet.
    #[error("worker {0} is already in the fleet")]
    DuplicateWorker(WorkerKey),
    /// A worker must have room for at least one block.
    #[error("worker {0} has a KV capacity of zero blocks")]
    ZeroCapacity(WorkerKey),
    /// A prompt given as block hashes, or continuing an earlier one, claims fewer tokens than its
    /// (earlier) full blocks hold.
    #[error("request {request:?}: {blocks} full blocks do not fit in {prompt_tokens} prompt tokens")]
    InconsistentPrompt {
        /// The request.
        request: RequestId,
        /// Full blocks given.
        blocks: usize,
        /// Prompt tokens claimed.
        prompt_tokens: u64,
    },
    /// The router runs in approximate mode and takes no KV events.
    #[error("KV events are disabled (approximate mode)")]
    KvEventsDisabled,
    /// The index refused a KV event.
    #[error(transparent)]
    Index(#[from] IndexError),
}

/// A prompt's depth in a router's own views of one worker ([`Router::view_depths`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ViewDepths {
    /// In the record of recent decisions (approximate mode, predict-on-route).
    pub recent: Option<u32>,
    /// In the decode policy's own view (`sglang-cache-aware`'s tree).
    pub policy: Option<u32>,
}

/// Why a request could not be placed now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Blocked {
    NoWorker,
    Busy,
}

/// Buffers reused across decisions, so the hot path allocates only the booked chain.
#[derive(Clone, Debug, Default)]
struct Scratch {
    locals: Vec<LocalBlockHash>,
    scores: OverlapScores,
    /// Overlap per worker slot; 0 but at the slots in `overlapping`.
    overlaps: Vec<u32>,
    /// Blocks past `overlaps` held only on a slower tier, per worker slot; 0 but at the slots
    /// in `overlapping`.
    tier_overlaps: Vec<u32>,
    /// The index's tier runs of one prompt (reused).
    tier_runs: Vec<(WorkerKey, u32)>,
    /// The slots `compute_overlaps` may have set above 0, ascending, each once.
    overlapping: Vec<usize>,
    candidates: Vec<Candidate>,
    /// The argmin scan's buffers.
    argmin: ArgminScratch,
}

/// The router; see the module docs.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    rng: Rng,
    policy: Box<dyn Policy>,
    prefill_policy: Box<dyn Policy>,
    index: RunIndex,
    recent: Option<RecentChains>,
    fleet: Fleet,
    adapters: Adapters,
    queue: WaitQueue,
    fair: FairShare,
    counters: RouterCounters,
    outbox: VecDeque<SyncEvent>,
    tombstones: Tombstones,
    sessions: SessionTable,
    last_now: Timestamp,
    scratch: Scratch,
}

impl Router {
    /// A router with no workers.
    pub fn new(config: RouterConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let mut policy = config.policy.build();
        let mut prefill_policy = config.prefill_policy.as_ref().unwrap_or(&config.policy).build();
        policy.set_replica_rank(config.replica_rank);
        prefill_policy.set_replica_rank(config.replica_rank);
        // The argmin scan visits the loaded workers by floor under the cost's weights.
        let weights = |p: &PolicyConfig| match p {
            PolicyConfig::Kv(c) | PolicyConfig::Dynamo(c) => Some(c.cost),
            _ => None,
        };
        let mut fleet = Fleet::default();
        let (decode, prefill) = (
            weights(&config.policy),
            weights(config.prefill_policy.as_ref().unwrap_or(&config.policy)),
        );
        if decode.is_some() || prefill.is_some() {
            fleet.order_by(decode, prefill, config.block_size);
        }
        let recent = match config.cache {
            CacheMode::Events => None,
            CacheMode::EventsWithPrediction(r) | CacheMode::Approximate(r) => Some(RecentChains::new(r)),
        };
        Ok(Self {
            rng: Rng::new(config.seed),
            policy,
            prefill_policy,
            index: RunIndex::new(IndexConfig {
                max_blocks_per_worker: config.max_blocks_per_worker,
                ..IndexConfig::default()
            }),
            recent,
            fleet,
            adapters: Adapters::default(),
            queue: WaitQueue::new(config.queue),
            fair: FairShare::new(config.fair.clone()),
            counters: RouterCounters::default(),
            outbox: VecDeque::new(),
            tombstones: Tombstones::default(),
            sessions: SessionTable::default(),
            last_now: Timestamp::ZERO,
            scratch: Scratch::default(),
            config,
        })
    }

    /// Sets this router's rank among its replicas (see [`RouterConfig::replica_rank`]), e.g. its
    /// place in the sorted ids of the live peers and itself.
    pub fn set_replica_rank(&mut self, rank: u32) {
        self.config.replica_rank = rank;
        self.policy.set_replica_rank(rank);
        self.prefill_policy.set_replica_rank(rank);
    }

    /// The configuration the router was built with.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    // ---- inputs: requests ----

    /// Routes `request`: a decision now, a place in the queue, or a rejection.
    pub fn handle_request(
        &mut self,
        now: Timestamp,
        request: &RouteRequest<'_>,
    ) -> Result<RouteOutcome, RouterError> {
        let now = self.advance(now);
        if self.fleet.contains(self.key(request.id)) || self.queue.contains(request.id) {
            return Err(RouterError::DuplicateRequest(request.id));
        }
        let prepared = self.prepare(now, request)?;
        let locals = std::mem::take(&mut self.scratch.locals);
        let placed = self.place(now, &prepared, &locals);
        let outcome = match placed {
            Ok(decision) => RouteOutcome::Routed(decision),
            // A queue of no capacity is no queue: nothing to wait in.
            Err(Blocked::NoWorker)
                if self.config.queue.when_empty == WhenEmpty::Reject || self.config.queue.capacity == 0 =>
            {
                self.counters.rejected_no_worker += 1;
                RouteOutcome::Rejected(RejectReason::NoEligibleWorker)
            }
            Err(blocked) => {
                let outcome = self.enqueue(Waiting {
                    request: prepared,
                    locals: locals.as_slice().into(),
                });
                if blocked == Blocked::NoWorker && outcome == RouteOutcome::Queued {
                    self.counters.queued_without_worker += 1;
                }
                outcome
            }
        };
        self.scratch.locals = locals;
        Ok(outcome)
    }

    /// Request `id` produced its first token: its prefill is done.
    pub fn handle_first_token(&mut self, now: Timestamp, id: RequestId) -> Result<Vec<Output>, RouterError> {
        let now = self.advance(now);
        self.known(id, |fleet, key| fleet.prefill_done(key))?;
        self.export(id, LoadChange::PrefillDone);
        Ok(self.release(now))
    }

    /// Request `id`'s generation crossed a block boundary. Ignored unless
    /// [`RouterConfig::track_output_blocks`] is set.
    pub fn handle_output_block(&mut self, now: Timestamp, id: RequestId) -> Result<(), RouterError> {
        self.advance(now);
        if self.config.track_output_blocks {
            self.known(id, |fleet, key| fleet.add_output_block(key))?;
        }
        Ok(())
    }

    /// Request `id` finished.
    pub fn handle_finished(&mut self, now: Timestamp, id: RequestId) -> Result<Vec<Output>, RouterError> {
        let now = self.advance(now);
        self.known(id, |fleet, key| fleet.free(key))?;
        self.export(id, LoadChange::Freed);
        Ok(self.release(now))
    }

    /// Request `id` was cancelled: taken out of the queue if it waits there, freed otherwise.
    pub fn handle_cancelled(&mut self, now: Timestamp, id: RequestId) -> Result<Vec<Output>, RouterError> {
        if self.queue.remove(id) {
            self.advance(now);
            self.counters.cancelled_in_queue += 1;
            return Ok(Vec::new());
        }
        self.handle_finished(now, id)
    }

    // ---- inputs: cache, fleet, replicas, time ----

    /// Applies a KV event of `worker` to the index.
    pub fn handle_kv_event(
        &mut self,
        now: Timestamp,
        worker: WorkerKey,
        event: IndexEvent<'_>,
    ) -> Result<(), RouterError> {
        self.advance(now);
        if matches!(self.config.cache, CacheMode::Approximate(_)) {
            return Err(RouterError::KvEventsDisabled);
        }
        let result = self.index.apply_event(worker, event);
        if let (Ok(()), IndexEvent::Removed { blocks }) = (&result, event) {
            self.fleet.record_evictions(worker, self.last_now, blocks.len());
        }
        if result.is_err() {
            self.counters.kv_events_refused += 1;
        }
        Ok(result?)
    }

    /// Adds a worker, idle, with an empty cache view; or brings back one taken out by
    /// [`Router::handle_worker_suspended`], with the view kept since and the requests still
    /// booked on it. Queued requests may now be released to it.
    pub fn handle_worker_added(
        &mut self,
        now: Timestamp,
        spec: WorkerSpec,
    ) -> Result<Vec<Output>, RouterError> {
        let now = self.advance(now);
        if spec.capacity_blocks == 0 {
            return Err(RouterError::ZeroCapacity(spec.key));
        }
        if self.fleet.resume(spec.key) {
            return Ok(self.release(now));
        }
        if !self.fleet.add_worker(spec) {
            return Err(RouterError::DuplicateWorker(spec.key));
        }
        self.index.add_worker(spec.key);
        Ok(self.release(now))
    }

    /// Marks a worker as draining: it keeps its requests and takes no new ones.
    pub fn handle_worker_draining(&mut self, now: Timestamp, worker: WorkerKey) -> Result<(), RouterError> {
        self.advance(now);
        if self.fleet.drain(worker) {
            Ok(())
        } else {
            Err(RouterError::UnknownWorker(worker))
        }
    }

    /// Sets the LoRA adapters `worker` serves (replacing what it served before): requests naming
    /// an adapter go only to workers that serve it. Queued requests may now be released to it.
    /// The worker need not be in the fleet yet; [`Router::handle_worker_removed`] forgets them.
    pub fn handle_adapters(&mut self, now: Timestamp, worker: WorkerKey, adapters: &[&str]) -> Vec<Output> {
        let now = self.advance(now);
        if self.adapters.set(worker, adapters) {
            self.release(now)
        } else {
            Vec::new()
        }
    }

    /// Removes a worker and forgets its cache and its adapters; its active requests are
    /// dropped (a suspended worker's too).
    pub fn handle_worker_removed(
        &mut self,
        now: Timestamp,
        worker: WorkerKey,
    ) -> Result<Vec<Output>, RouterError> {
        let now = self.advance(now);
        self.adapters.remove_worker(worker);
        let Some(dropped) = self.fleet.remove_worker(worker) else {
            // Known to the index alone: nothing booked, only its cache to forget.
            return match self.index.remove_worker(worker) {
                Ok(()) => Ok(Vec::new()),
                Err(_) => Err(RouterError::UnknownWorker(worker)),
            };
        };
        self.forget_decisions(worker);
        self.counters.sessions_released += self.sessions.release_worker(worker);
        // The index knows every fleet worker, so this cannot fail.
        let _ = self.index.remove_worker(worker);
        let mut out = self.dropped(dropped, DropReason::WorkerRemoved);
        out.extend(self.release(now));
        Ok(out)
    }

    /// Takes a worker out of routing for failing its health checks: it takes no new requests,
    /// but the requests booked on it stay booked until they end (they may well finish: a
    /// health check can fail for a loaded engine), and what the index knows of its cache is
    /// kept: its KV events still apply (its event stream tells whether its cache survived).
    /// [`Router::handle_worker_added`] with the same key brings it back, with that view and
    /// whatever is still booked; [`Router::handle_worker_removed`] drops both. The router's
    /// record of its own decisions there is forgotten. Suspending a suspended worker changes
    /// nothing.
    pub fn handle_worker_suspended(
        &mut self,
        now: Timestamp,
        worker: WorkerKey,
    ) -> Result<Vec<Output>, RouterError> {
        self.advance(now);
        if !self.fleet.suspend(worker) {
            return Err(RouterError::UnknownWorker(worker));
        }
        self.forget_decisions(worker);
        self.counters.sessions_released += self.sessions.release_worker(worker);
        Ok(Vec::new())
    }

    /// Forgets the router's record of its own decisions on `worker` (the recent-decision
    /// record and the policies' views).
    fn forget_decisions(&mut self, worker: WorkerKey) {
        if let Some(recent) = &mut self.recent {
            recent.remove_worker(worker);
        }
        self.policy.worker_removed(worker);
        self.prefill_policy.worker_removed(worker);
    }

    /// Applies another replica's load change; this router's own events are dropped. Duplicates
    /// change nothing, a Freed or PrefillDone before its Added leaves a tombstone, and an Added
    /// after its Freed is not booked (see the `sync` module). Errs only if an Added names a worker not in
    /// the fleet.
    pub fn handle_sync_event(
        &mut self,
        now: Timestamp,
        event: &SyncEvent,
    ) -> Result<Vec<Output>, RouterError> {
        let now = self.advance(now);
        if event.router == self.config.router_id {
            self.counters.sync_echoes += 1;
            return Ok(Vec::new());
        }
        if let LoadChange::Session { session, worker } = event.change {
            // A binding to a worker not in routing here is not learned: the session's next
            // booking binds it. One known here already is newer than a snapshot's.
            if self.fleet.get(worker).is_some_and(|w| !w.suspended) {
                let max = self.config.sessions.max_sessions;
                if self.sessions.learn(now, session, worker, max) {
                    self.counters.sync_applied += 1;
                } else {
                    self.counters.sync_duplicates += 1;
                }
            }
            return Ok(Vec::new());
        }
        let key = (event.router, event.request);
        let active = self.fleet.contains(key);
        let mark = self.tombstones.get(key);
        match &event.change {
            LoadChange::Added(_) if active || mark == Some(Mark::Freed) => {
                if active {
                    self.counters.sync_duplicates += 1;
                } else {
                    self.counters.sync_stale_added += 1;
                }
                return Ok(Vec::new());
            }
            LoadChange::Added(booking) => {
                self.commit(now, key, booking.clone())?;
                if mark == Some(Mark::PrefillDone) {
                    self.tombstones.remove(key);
                    self.fleet.prefill_done(key);
                }
            }
            LoadChange::PrefillDone if active => {
                self.fleet.prefill_done(key);
            }
            LoadChange::PrefillDone | LoadChange::Freed if mark == Some(Mark::Freed) => {
                self.counters.sync_duplicates += 1;
                return Ok(Vec::new());
            }
            LoadChange::PrefillDone if mark.is_some() => {
                // A second PrefillDone before the Added.
                self.counters.sync_duplicates += 1;
                return Ok(Vec::new());
            }
            LoadChange::Session { .. } => {}
            LoadChange::PrefillDone | LoadChange::Freed => {
                let new_mark = if matches!(event.change, LoadChange::Freed) {
                    Mark::Freed
                } else {
                    Mark::PrefillDone
                };
                if !(new_mark == Mark::Freed && self.fleet.free(key)) {
                    self.counters.sync_early += 1;
                }
                let cap = self.config.sync.max_tombstones;
                self.counters.tombstones_evicted += self.tombstones.mark(now, key, new_mark, cap);
            }
        }
        self.counters.sync_applied += 1;
        Ok(self.release(now))
    }

    /// Releases every booking of peer `peer` at once (it went silent past the heartbeat
    /// timeout, or left) and forgets its tombstones; queued requests may now be released.
    /// Its recorded prompts stay in the cache views: the workers still hold them.
    pub fn handle_peer_lost(&mut self, now: Timestamp, peer: RouterId) -> Vec<Output> {
        let now = self.advance(now);
        if peer == self.config.router_id {
            return Vec::new();
        }
        self.counters.peers_lost += 1;
        for key in self.fleet.keys_of(peer) {
            self.fleet.free(key);
            self.counters.peer_bookings_released += 1;
        }
        self.tombstones.forget_router(peer);
        self.release(now)
    }

    /// Drops requests older than the request TTL, expires the record of recent decisions, and
    /// re-checks the queue.
    pub fn handle_tick(&mut self, now: Timestamp) -> Vec<Output> {
        let now = self.advance(now);
        let mut out = Vec::new();
        if let Some(cutoff) = now.as_nanos().checked_sub(self.ttl_nanos()) {
            let expired = self.fleet.expire(Timestamp(cutoff));
            out = self.dropped(expired, DropReason::Expired);
        }
        if let Some(recent) = &mut self.recent {
            recent.expire(now);
        }
        if let Some(cutoff) = now.as_nanos().checked_sub(self.session_ttl_nanos()) {
            self.counters.sessions_expired += self.sessions.expire(Timestamp(cutoff));
        }
        if let Some(cutoff) = now.as_nanos().checked_sub(self.ttl_nanos()) {
            self.counters.tombstones_expired += self.tombstones.expire(Timestamp(cutoff));
        }
        out.extend(self.release(now));
        out
    }

    // ---- outputs and queries ----

    /// The next replica event to send, oldest first (only with [`SyncMode::Export`]).
    pub fn poll_sync_event(&mut self) -> Option<SyncEvent> {
        self.outbox.pop_front()
    }

    /// This router's own in-flight bookings as replica events, for a joining replica: per
    /// request its Added, then its PrefillDone if its prefill is done; requests in admission
    /// order (then by id). Applied to a fresh router with the same workers, they give it this
    /// router's load (output blocks aside). Exported events that follow in the outbox may
    /// overlap the snapshot; duplicates and tombstones make that harmless.
    pub fn sync_snapshot(&self) -> Vec<SyncEvent> {
        let router = self.config.router_id;
        let mut events = Vec::new();
        for (request, booking, prefill_done) in self.fleet.bookings_of(router) {
            let mut booking = booking.clone();
            // A prefill worker removed after the prefill it did: no longer part of the booking.
            if prefill_done {
                booking.prefill_worker = booking.prefill_worker.filter(|&w| self.fleet.get(w).is_some());
            }
            events.push(SyncEvent {
                router,
                request,
                change: LoadChange::Added(booking),
            });
            if prefill_done {
                events.push(SyncEvent {
                    router,
                    request,
                    change: LoadChange::PrefillDone,
                });
            }
        }
        events
    }

    /// Every session's binding as replica events ([`LoadChange::Session`]), least recently used
    /// first, for a joining replica (sent after [`Router::sync_snapshot`]).
    pub fn session_snapshot(&self) -> Vec<SyncEvent> {
        self.sessions
            .bindings()
            .map(|(session, worker)| SyncEvent {
                router: self.config.router_id,
                request: RequestId(0),
                change: LoadChange::Session { session, worker },
            })
            .collect()
    }

    /// The worker session `session` is bound to here, if any.
    pub fn session_worker(&self, session: SessionId) -> Option<WorkerKey> {
        self.sessions.worker_of(session)
    }

    /// When [`Router::handle_tick`] has work next: a request reaching the TTL, a recorded
    /// decision or a session expiring, or a queue re-check (none while no worker is eligible:
    /// only a worker added or back in routing can release a request then, and that input
    /// releases it). A tick before then is harmless.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        let expiry = self
            .fleet
            .oldest()
            .map(|t| Timestamp(t.as_nanos().saturating_add(self.ttl_nanos())));
        let recent = self.recent.as_ref().and_then(RecentChains::next_expiry);
        let recheck = (!self.queue.is_empty() && self.has_eligible_worker())
            .then(|| self.last_now + self.queue.recheck_interval());
        let tombstone = self
            .tombstones
            .oldest()
            .map(|t| Timestamp(t.as_nanos().saturating_add(self.ttl_nanos())));
        let session = self
            .sessions
            .oldest()
            .map(|t| Timestamp(t.as_nanos().saturating_add(self.session_ttl_nanos())));
        [expiry, recent, recheck, tombstone, session]
            .into_iter()
            .flatten()
            .min()
    }

    /// Requests waiting in the queue now.
    pub fn queued_now(&self) -> usize {
        self.queue.len()
    }

    /// Requests waiting in the queue now per tenant, in tenant order (tenants with none left
    /// out).
    pub fn queued_per_tenant(&self) -> Vec<(TenantId, usize)> {
        self.queue.waiting_per_tenant().collect()
    }

    /// Each tenant's virtual token counter (the queue's fair share): the tokens charged to
    /// it divided by its weight, plus any lift, in tenant order.
    pub fn fair_counters(&self) -> Vec<(TenantId, f64)> {
        self.fair.snapshot()
    }

    /// Requests waiting in the queue now for want of any eligible worker (all of them, while no
    /// worker is eligible; none otherwise).
    pub fn queued_without_worker_now(&self) -> usize {
        if self.queue.is_empty() || self.has_eligible_worker() {
            0
        } else {
            self.queue.len()
        }
    }

    /// A snapshot of the counters and of every worker's state.
    pub fn metrics(&self) -> RouterMetrics {
        let workers = self
            .fleet
            .workers()
            .iter()
            .map(|w| WorkerMetrics {
                spec: w.spec,
                draining: w.draining,
                load: w.load(),
                cached_blocks: self.index.block_count(w.spec.key) as u64,
            })
            .collect();
        RouterMetrics {
            counters: self.counters,
            queued_now: self.queued_now(),
            queued_without_worker_now: self.queued_without_worker_now(),
            active_now: self.fleet.active_count(),
            tombstones_now: self.tombstones.len(),
            sessions_now: self.sessions.len(),
            index: self.index.stats(),
            workers,
        }
    }

    /// A worker's booked load.
    pub fn worker_load(&self, worker: WorkerKey) -> Option<WorkerLoad> {
        self.fleet.get(worker).map(|w| w.load())
    }

    /// `worker`'s booked prefill tokens ([`WorkerLoad::prefill_tokens`]) integrated over time,
    /// in token-nanoseconds, from when it joined up to `now` (a reading before the router's
    /// clock counts up to that clock). Two readings give the mean queue between them, however
    /// the bookings came and went: what the planner observes as a worker's queue.
    pub fn prefill_token_ns(&self, worker: WorkerKey, now: Timestamp) -> Option<u128> {
        self.fleet
            .get(worker)
            .map(|w| w.areas_at(now.max(self.last_now)).0)
    }

    /// `worker`'s booked decode blocks ([`WorkerLoad::decode_blocks`]) integrated over time, in
    /// block-nanoseconds, as [`Router::prefill_token_ns`] integrates its prefill tokens: two
    /// readings give the mean KV load between them.
    pub fn decode_block_ns(&self, worker: WorkerKey, now: Timestamp) -> Option<u128> {
        self.fleet
            .get(worker)
            .map(|w| w.areas_at(now.max(self.last_now)).1)
    }

    /// How deep `chain` is in this router's own views of `worker` at `now`: the record of recent
    /// decisions (if the cache mode keeps one) and the decode policy's view (if it keeps one).
    /// For diagnostics and tests: replicas that applied each other's bookings answer alike.
    pub fn view_depths(&self, worker: WorkerKey, chain: &[SequenceHash], now: Timestamp) -> ViewDepths {
        ViewDepths {
            recent: self.recent.as_ref().map(|r| r.depth(worker, chain, now)),
            policy: self.policy.view_depth(worker, chain, now),
        }
    }

    /// The KV index (read-only).
    pub fn index(&self) -> &RunIndex {
        &self.index
    }

    /// The candidates the policy would see for `request` at `now` (busy workers left out), in
    /// worker order, without routing or booking anything.
    pub fn candidates(
        &mut self,
        now: Timestamp,
        request: &RouteRequest<'_>,
    ) -> Result<Vec<Candidate>, RouterError> {
        let prepared = self.prepare(now, request)?;
        let locals = std::mem::take(&mut self.scratch.locals);
        self.compute_overlaps(now, &locals, &prepared.chain);
        self.scratch.locals = locals;
        let at = now.max(self.last_now);
        let _ = self.fill_candidates(Stage::Decode, &prepared.chain, prepared.adapter.as_deref(), at);
        Ok(self.scratch.candidates.clone())
    }

    /// Checks that every worker's running totals equal a recomputation from the active requests.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.fleet.check_invariants()?;
        self.sessions.check_invariants()?;
        if let Some((s, w)) = self
            .sessions
            .bindings()
            .find(|&(_, w)| self.fleet.get(w).is_none_or(|w| w.suspended))
        {
            return Err(format!("session {s:?} bound to {w}, not in routing"));
        }
        if self
            .queue
            .iter()
            .any(|w| self.has_free_worker(w.request.adapter.as_deref()))
        {
            return Err(format!(
                "{} requests wait while a worker is free",
                self.queue.len()
            ));
        }
        Ok(())
    }

    // ---- the decision ----

    /// Hashes `request`'s prompt: local hashes into `scratch.locals`, the chain into the result.
    fn prepare(&mut self, now: Timestamp, request: &RouteRequest<'_>) -> Result<Prepared, RouterError> {
        let block_size = self.config.block_size;
        let locals = &mut self.scratch.locals;
        // The chain is hashed straight into the shared slice a booking keeps: no copy of it.
        let (chain, prompt_tokens) = match request.prompt {
            Prompt::Tokens(tokens) => {
                let salt = HashSalt {
                    lora_name: request.lora_name,
                    namespace: request.cache_salt,
                };
                let chain = PromptHasher::new(block_size as usize, &salt).hash_prompt_shared(tokens, locals);
                (chain, tokens.len() as u64)
            }
            Prompt::Continues { tokens, earlier } => {
                let salt = HashSalt {
                    lora_name: request.lora_name,
                    namespace: request.cache_salt,
                };
                let chain = PromptHasher::new(block_size as usize, &salt)
                    .hash_prompt_after(tokens, earlier, locals)
                    .ok_or(RouterError::InconsistentPrompt {
                        request: request.id,
                        blocks: earlier.blocks(),
                        prompt_tokens: tokens.len() as u64,
                    })?;
                (chain, tokens.len() as u64)
            }
            Prompt::Blocks {
                locals: given,
                prompt_tokens,
            } => {
                if prompt_tokens < given.len() as u64 * u64::from(block_size) {
                    return Err(RouterError::InconsistentPrompt {
                        request: request.id,
                        blocks: given.len(),
                        prompt_tokens,
                    });
                }
                locals.clear();
                locals.extend_from_slice(given);
                (sequence_hashes_shared(given), prompt_tokens)
            }
        };
        Ok(Prepared {
            id: request.id,
            arrived: now,
            prompt_tokens,
            chain,
            priority: request.priority,
            tenant: request.tenant,
            expected_output_tokens: request.expected_output_tokens,
            session: request.session,
            adapter: request.lora_name.filter(|n| !n.is_empty()).map(Arc::from),
        })
    }

    /// Chooses the workers for `request` and books it.
    fn place(
        &mut self,
        now: Timestamp,
        request: &Prepared,
        locals: &[LocalBlockHash],
    ) -> Result<Decision, Blocked> {
        self.compute_overlaps(now, locals, &request.chain);
        let mut view = request.view(now, self.config.block_size);
        if self.weighs_fleet_load() {
            view.fleet_load = self.fleet_load();
        }
        let adapter = request.adapter.as_deref();
        let stay = request
            .session
            .and_then(|s| self.session_stay(s, &request.chain))
            .filter(|c| self.adapters.serves(adapter, c.spec.key));
        let chosen = match stay {
            Some(c) => c,
            None => self.choose(Stage::Decode, &view, adapter)?,
        };
        let prefill = self.choose_prefill(&view, &chosen, adapter);
        let prefill_overlap = prefill.map_or(chosen.overlap_blocks, |p| p.overlap_blocks);
        let hint = PrefillLoadHint::new(
            request.prompt_tokens,
            prefill_overlap,
            self.config.block_size,
            self.config.prefill_model.as_ref(),
        );
        let booking = Booking {
            worker: chosen.worker(),
            overlap_blocks: chosen.overlap_blocks,
            prefill_worker: prefill.map(|p| p.worker()),
            prompt_tokens: request.prompt_tokens,
            chain: Arc::clone(&request.chain),
            hint,
            expected_output_tokens: request.expected_output_tokens,
            session: request.session,
            tenant: request.tenant,
        };
        // Both workers were just taken from the fleet and the id was checked on admission, so
        // this cannot fail; if it ever does, the request is turned away rather than half booked.
        if let Err(e) = self.commit(now, self.key(request.id), booking) {
            if cfg!(debug_assertions) {
                panic!("booking a fresh decision failed: {e}");
            }
            return Err(Blocked::NoWorker);
        }
        self.counters.routed += 1;
        self.counters.prompt_blocks += u64::from(view.prompt_blocks());
        self.counters.overlap_blocks += u64::from(chosen.overlap_blocks);
        Ok(Decision {
            request: request.id,
            worker: chosen.worker(),
            overlap_blocks: chosen.overlap_blocks,
            prefill: prefill.map(|p| PrefillAssignment {
                worker: p.worker(),
                overlap_blocks: p.overlap_blocks,
            }),
            hint,
            waited: now.saturating_since(request.arrived),
        })
    }

    /// How loaded the fleet is, in `[0, 1]`: the load of the least loaded worker that computes
    /// prompts (aggregated and prefill workers, not draining), a worker's load being the larger
    /// of its booked requests over its `max_requests` and its booked decode blocks over its
    /// capacity; 0 while one of them has nothing booked, or if there is none. The cost's
    /// `fleet_weight` reads it ([`RequestView::fleet_load`]).
    pub fn fleet_load(&self) -> f64 {
        self.fleet.load_of_least_loaded_computing()
    }

    /// Whether a policy of this router reads the fleet's load (a cost policy with a positive
    /// `fleet_weight`), so that the others spare [`Router::fleet_load`]'s pass over the fleet.
    fn weighs_fleet_load(&self) -> bool {
        std::iter::once(&self.config.policy)
            .chain(&self.config.prefill_policy)
            .any(|p| matches!(p, PolicyConfig::Kv(c) | PolicyConfig::Dynamo(c) if c.cost.fleet_weight > 0.0))
    }

    /// The candidate of `session`'s worker if the session stays there (see the `session`
    /// module): in routing, decoding, neither busy nor overloaded. The overlaps are computed.
    fn session_stay(&self, session: SessionId, chain: &[SequenceHash]) -> Option<Candidate> {
        let worker = self.sessions.worker_of(session)?;
        let slot = self.fleet.slot(worker)?;
        let w = self.fleet.workers().get(slot)?;
        if w.draining || !w.spec.role.tracks_decode() {
            return None;
        }
        if self.config.sessions.overloaded.is_busy(&w.spec, &w.load()) {
            return None;
        }
        let overlap = scan::Overlap {
            gpu: self.scratch.overlaps.get(slot).copied().unwrap_or(0),
            tier: self.scratch.tier_overlaps.get(slot).copied().unwrap_or(0),
        };
        scan::candidate(w, overlap, chain, &self.config.busy, self.last_now)
    }

    /// The prefill worker for a request whose decode goes to `decode`, if it is disaggregated.
    fn choose_prefill(
        &mut self,
        view: &RequestView<'_>,
        decode: &Candidate,
        adapter: Option<&str>,
    ) -> Option<Candidate> {
        let applies = decode.spec.role == WorkerRole::Decode
            && self.fleet.has_prefill_workers()
            && self
                .config
                .decider
                .disaggregate(view.prompt_tokens, decode.overlap_blocks, view.block_size);
        if !applies {
            return None;
        }
        let Ok(pick) = self.choose(Stage::Prefill, view, adapter) else {
            self.counters.disagg_without_prefill_worker += 1;
            return None;
        };
        self.counters.disaggregated += 1;
        Some(pick)
    }

    /// Fills `scratch.overlaps` with each worker's cached prefix of the prompt.
    fn compute_overlaps(&mut self, now: Timestamp, locals: &[LocalBlockHash], chain: &[SequenceHash]) {
        let Scratch {
            scores,
            overlaps,
            tier_overlaps,
            tier_runs,
            overlapping,
            ..
        } = &mut self.scratch;
        // Only the slots set last time are cleared (by position: a worker added or removed since
        // shifted the slots, not the positions written): no pass over the fleet.
        for &slot in overlapping.iter() {
            if let Some(o) = overlaps.get_mut(slot) {
                *o = 0;
            }
            if let Some(o) = tier_overlaps.get_mut(slot) {
                *o = 0;
            }
        }
        overlapping.clear();
        overlaps.resize(self.fleet.workers().len(), 0);
        tier_overlaps.resize(self.fleet.workers().len(), 0);
        debug_assert!(
            overlaps.iter().all(|&o| o == 0),
            "an overlap left from a past decision"
        );
        let mut tiered = false;
        if !matches!(self.config.cache, CacheMode::Approximate(_)) {
            self.index.find_matches_into(locals, false, scores);
            for (worker, depth) in scores.iter() {
                if let Some(slot) = self.fleet.slot(worker) {
                    overlaps[slot] = depth;
                    overlapping.push(slot);
                }
            }
            // A slower tier's run past each worker's GPU depth, kept for now as the depth the
            // run reaches (the recent record below may raise the GPU depth into it).
            tier_runs.clear();
            tiered = self.index.has_tier_blocks();
            if tiered {
                for tier in Tier::ALL {
                    self.index
                        .tier_runs_into(tier, chain, |w| scores.depth(w), tier_runs);
                    for &(worker, run) in tier_runs.iter() {
                        if let Some(slot) = self.fleet.slot(worker) {
                            let reach = overlaps[slot] + run;
                            tier_overlaps[slot] = tier_overlaps[slot].max(reach);
                            overlapping.push(slot);
                        }
                    }
                }
            }
        }
        if let Some(recent) = &self.recent {
            let fleet = &self.fleet;
            let slot = |key| {
                let slot = fleet.slot(key);
                overlapping.extend(slot);
                slot
            };
            recent.raise_depths(chain, now, slot, overlaps);
        }
        overlapping.sort_unstable();
        overlapping.dedup();
        // The tier's blocks past the GPU depth, as it now stands.
        if tiered {
            for &slot in overlapping.iter() {
                tier_overlaps[slot] = tier_overlaps[slot].saturating_sub(overlaps[slot]);
            }
        }
    }

    /// Books a decision (this router's or a replica's) in the one place where bookings happen:
    /// load, recent-decision record, the policies' own views, and (this router's) the outbox.
    fn commit(&mut self, now: Timestamp, key: RequestKey, booking: Booking) -> Result<(), RouterError> {
        self.fleet.book(now, key, booking.clone()).map_err(|e| match e {
            FleetError::UnknownWorker(w) => RouterError::UnknownWorker(w),
            FleetError::DuplicateRequest => RouterError::DuplicateRequest(key.1),
        })?;
        self.fair.charge(
            booking.tenant,
            served_tokens(booking.prompt_tokens, booking.expected_output_tokens),
        );
        if let Some(recent) = &mut self.recent {
            for worker in std::iter::once(booking.worker).chain(booking.prefill_worker) {
                recent.record(worker, &booking.chain, now);
            }
        }
        let view = RequestView {
            now,
            id: key.1,
            prompt_tokens: booking.prompt_tokens,
            block_size: self.config.block_size,
            chain: &booking.chain,
            fleet_load: 0.0,
        };
        self.policy.routed(&view, booking.worker);
        if let Some(p) = booking.prefill_worker {
            self.prefill_policy.routed(&view, p);
        }
        // A peer's booking on a worker suspended here binds nothing: it is out of routing here.
        if let Some(session) = booking.session
            && self.fleet.get(booking.worker).is_some_and(|w| !w.suspended)
        {
            let max = self.config.sessions.max_sessions;
            let (outcome, evicted) = self.sessions.bind(now, session, booking.worker, max);
            self.counters.sessions_evicted += evicted;
            if key.0 == self.config.router_id {
                *match outcome {
                    SessionOutcome::New => &mut self.counters.session_new,
                    SessionOutcome::Hit => &mut self.counters.session_hits,
                    SessionOutcome::Moved => &mut self.counters.session_moves,
                } += 1;
            }
        }
        if key.0 == self.config.router_id {
            self.export(key.1, LoadChange::Added(booking));
        }
        Ok(())
    }

    // ---- the queue ----

    fn enqueue(&mut self, waiting: Waiting) -> RouteOutcome {
        if self.queue.push(waiting, &mut self.fair) {
            self.counters.queued += 1;
            RouteOutcome::Queued
        } else {
            self.counters.rejected_queue_full += 1;
            RouteOutcome::Rejected(RejectReason::QueueFull)
        }
    }

    /// Routes queued requests while an eligible worker is not busy. A request for an adapter
    /// none of whose workers is free waits on, in its place, while requests behind it go.
    fn release(&mut self, now: Timestamp) -> Vec<Output> {
        let mut out = Vec::new();
        let mut held = Vec::new();
        while !self.queue.is_empty() && self.has_free_worker(None) {
            let Some((key, waiting)) = self.queue.pop(&self.fair) else {
                break;
            };
            if waiting.request.adapter.is_some() && !self.has_free_worker(waiting.request.adapter.as_deref())
            {
                held.push((key, waiting));
                continue;
            }
            match self.place(now, &waiting.request, &waiting.locals) {
                Ok(decision) => {
                    self.counters.released += 1;
                    out.push(Output::Routed(decision));
                }
                Err(_) => {
                    // Unreachable while busy depends only on load: put it back and stop.
                    held.push((key, waiting));
                    break;
                }
            }
        }
        for (key, waiting) in held {
            self.queue.put_back(key, waiting);
        }
        out
    }

    /// Whether some worker that decodes (and serves `adapter`, if one is named) is neither
    /// draining nor busy.
    fn has_free_worker(&self, adapter: Option<&str>) -> bool {
        self.fleet.workers().iter().any(|w| {
            w.spec.role.tracks_decode()
                && !w.draining
                && self.adapters.serves(adapter, w.spec.key)
                && !self.config.busy.is_busy(&w.spec, &w.load())
        })
    }

    /// Whether some worker that decodes is not draining (busy or not): without one, the
    /// queue's requests wait for want of any worker.
    fn has_eligible_worker(&self) -> bool {
        self.fleet
            .workers()
            .iter()
            .any(|w| w.spec.role.tracks_decode() && !w.draining)
    }

    // ---- helpers ----

    fn key(&self, id: RequestId) -> RequestKey {
        (self.config.router_id, id)
    }

    fn ttl_nanos(&self) -> u64 {
        u64::try_from(self.config.request_ttl.as_nanos()).unwrap_or(u64::MAX)
    }

    fn session_ttl_nanos(&self) -> u64 {
        u64::try_from(self.config.sessions.idle_ttl.as_nanos()).unwrap_or(u64::MAX)
    }

    /// Applies a lifecycle change to this router's request `id`, or counts and reports it as
    /// unknown.
    fn known(
        &mut self,
        id: RequestId,
        change: impl FnOnce(&mut Fleet, RequestKey) -> bool,
    ) -> Result<(), RouterError> {
        let key = self.key(id);
        if change(&mut self.fleet, key) {
            Ok(())
        } else {
            self.counters.unknown_request_events += 1;
            Err(RouterError::UnknownRequest(id))
        }
    }

    /// Reports `dropped` requests: this router's as outputs (and freed replica events); other
    /// replicas' silently, as those replicas drop them too.
    fn dropped(&mut self, dropped: Vec<RequestKey>, reason: DropReason) -> Vec<Output> {
        let counter = match reason {
            DropReason::Expired => &mut self.counters.expired,
            DropReason::WorkerRemoved => &mut self.counters.dropped_with_worker,
        };
        *counter += dropped.len() as u64;
        let own: Vec<RequestId> = dropped
            .into_iter()
            .filter(|&(router, _)| router == self.config.router_id)
            .map(|(_, id)| id)
            .collect();
        for &id in &own {
            self.export(id, LoadChange::Freed);
        }
        own.into_iter()
            .map(|request| Output::Dropped { request, reason })
            .collect()
    }

    fn export(&mut self, request: RequestId, change: LoadChange) {
        if self.config.sync.mode == SyncMode::Export {
            self.outbox.push_back(SyncEvent {
                router: self.config.router_id,
                request,
                change,
            });
        }
    }

    /// `now`, or the latest time seen if `now` is earlier.
    fn advance(&mut self, now: Timestamp) -> Timestamp {
        if now < self.last_now {
            self.counters.clock_went_back += 1;
            return self.last_now;
        }
        self.last_now = now;
        self.fleet.set_clock(now);
        now
    }
}
