//! The KV-event feed: one `kvroute-zmq` subscriber per worker endpoint reports into one channel,
//! and one task applies the reports to the router in arrival order (so a worker's events apply
//! in order). A worker of several data-parallel ranks has one subscriber per rank, on the
//! rank's own endpoints (vLLM's and SGLang's rule: the port plus the rank,
//! [`kvroute_zmq::rank_endpoint`]), and its reports name the rank. Gaps are filled by the
//! subscriber through the rank's replay socket; what it cannot fill arrives as `GapLost`, and
//! that rank's cache view is cleared (never route on blocks that may be gone) and said to be
//! [`ViewState::RebuiltAfterGap`] (a warning, `kvroute_kv_stream_incidents_total{kind=
//! "gap_lost"}`, and the admin listing's `view`) until it is exact again: the engine restarted
//! (its cache is empty, its new run replayed) or cleared its cache. Meanwhile it is rebuilt
//! from the engine's new events (and, with `cache = "predict"`, the router's own decisions),
//! and, for `reannounce-window-ms` after it was cleared, from the engine's re-announcements: a
//! request routed to the rank asks a vLLM engine (worker key `reannounce = "auto"`) for
//! `"vllm_xargs": {"kv_cache_report_mode": "full"}` (`Views::kv_cache_report`), and the
//! engine announces the cached blocks the request reuses again, as stored events from the
//! root. A store of blocks the view holds changes nothing (the index keeps them where they
//! are; `kvroute_index_blocks_stored_total` counts only blocks newly held).
//!
//! While a subscriber catches up through the replay socket (a resync, a gap fill), the rank's
//! view is listed `replaying` (with the sequence number and endpoint asked), then `live` or
//! `rebuilt_after_gap`.
//! While a subscriber runs, its counters are exported from `/metrics` ([`KvSubscriberCounters`]).
//!
//! A worker out of routing for failed health checks keeps its view and its events still
//! apply; when it is back, `Views::resync` has its subscribers check the stream against the
//! engine's replay buffer (see [`kvroute_zmq::ResyncTrigger`]).
//!
//! Reports are converted (and hashed) outside the router's lock, then applied through the
//! driver's one door to the router ([`Shared`]); a drained or removed worker takes none.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_core::index::IndexError;
use kvroute_core::router::{IndexEvent, RouterError};
use kvroute_http::openai::KvCacheReport;
use kvroute_wire::{ApplyConfig, EventBatch, WireEvent};
use tokio::sync::mpsc;

use kvroute_zmq::{
    ReplayReports, ResyncTrigger, SubscriberConfig, SubscriberCounters, SubscriberEvent, SubscriberHandle,
};
use serde::Serialize;

use crate::config::{EngineKind, Reannounce, WorkerConfig};
use crate::driver::{Shared, Upstream};
use crate::metrics::KvSubscriberCounters;
use crate::registry::Registry;
use crate::worker::WorkerState;

/// How far one rank's cache view can be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ViewState {
    /// Every batch of the engine's current run was applied, in order.
    Live,
    /// Batches were lost for good (a gap the replay could not cover, or no replay socket): the
    /// view was cleared then, and holds only what arrived since.
    RebuiltAfterGap {
        /// When the view was cleared, in milliseconds since the Unix epoch.
        since_unix_ms: u64,
        /// Batches lost since the view was last exact.
        lost_batches: u64,
    },
}

/// A worker's view as the admin API lists it: `none` without KV events, else the least
/// trusted of its ranks' states, with the ranks in that state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ViewSummary {
    /// No KV events configured: the router sees the worker's cache only through its own
    /// decisions, if the cache mode predicts.
    None,
    /// Some ranks are catching up through the engine's replay socket (after a reconnection,
    /// when the worker is back from failed health checks, or to fill a gap): the view is
    /// missing what the replay still brings. Then `live` or `rebuilt_after_gap`.
    Replaying {
        /// The earliest sequence number those ranks asked the replay for.
        from_seq: u64,
        /// The replay endpoint asked (of the first of those ranks).
        endpoint: String,
        /// Those ranks.
        ranks: Vec<u32>,
    },
    /// Every rank's view is [`ViewState::Live`].
    Live,
    /// Some ranks lost batches ([`ViewState::RebuiltAfterGap`]).
    RebuiltAfterGap {
        /// The earliest of those ranks' `since_unix_ms`.
        since_unix_ms: u64,
        /// Batches lost, summed over those ranks.
        lost_batches: u64,
        /// Those ranks.
        ranks: Vec<u32>,
    },
}

/// Every subscribed rank's view state and resync trigger.
#[derive(Clone, Debug, Default)]
pub(crate) struct Views(Arc<Mutex<ViewBook>>);

/// Each rank's view.
type ViewBook = BTreeMap<WorkerKey, RankView>;

/// One rank's view: its state, when it was last cleared for lost batches, and its subscriber's
/// resync trigger once started.
#[derive(Debug)]
struct RankView {
    state: ViewState,
    /// Set with [`ViewState::RebuiltAfterGap`]: when the view was last cleared (the start of
    /// the re-announcement window).
    cleared_at: Option<Instant>,
    /// While a replay runs: the sequence number and endpoint it asked.
    replaying: Option<(u64, String)>,
    trigger: Option<ResyncTrigger>,
}

impl Default for RankView {
    fn default() -> Self {
        Self {
            state: ViewState::Live,
            cleared_at: None,
            replaying: None,
            trigger: None,
        }
    }
}

impl Views {
    fn lock(&self) -> std::sync::MutexGuard<'_, ViewBook> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rank `key`'s view is exact again.
    fn exact(&self, key: WorkerKey) {
        let mut views = self.lock();
        let view = views.entry(key).or_default();
        view.state = ViewState::Live;
        view.cleared_at = None;
    }

    fn lost(&self, key: WorkerKey, batches: u64) {
        let mut views = self.lock();
        let entry = views.entry(key).or_default();
        // Cleared again: the window starts again.
        entry.cleared_at = Some(Instant::now());
        entry.state = match entry.state {
            ViewState::Live => ViewState::RebuiltAfterGap {
                since_unix_ms: unix_ms(),
                lost_batches: batches,
            },
            ViewState::RebuiltAfterGap {
                since_unix_ms,
                lost_batches,
            } => ViewState::RebuiltAfterGap {
                since_unix_ms,
                lost_batches: lost_batches.saturating_add(batches),
            },
        };
    }

    /// Rank `key`'s replay from `from` (at `endpoint`) started, or (`None`) ended.
    fn replaying(&self, key: WorkerKey, replay: Option<(u64, String)>) {
        self.lock().entry(key).or_default().replaying = replay;
    }

    fn forget(&self, worker: WorkerId) {
        self.lock().retain(|key, _| key.worker != worker);
    }

    /// Asks each of worker `id`'s subscribers to resync.
    pub(crate) fn resync(&self, id: WorkerId) {
        for view in self.lock().range(rank_keys(id)).map(|(_, v)| v) {
            if let Some(trigger) = &view.trigger {
                trigger.request();
            }
        }
    }

    /// What a request routed to `upstream` asks of its engine's KV events: `Full` (re-announce
    /// the cached blocks it reuses) while the rank's view is rebuilt after lost batches, for at
    /// most `window` after it was cleared, if the worker's engine takes the request field
    /// ([`Reannounce`]); else vLLM's default.
    pub(crate) fn kv_cache_report(&self, upstream: &Upstream, window: Duration) -> KvCacheReport {
        if upstream.reannounce != Reannounce::Auto || upstream.engine != EngineKind::Vllm {
            return KvCacheReport::Incremental;
        }
        let key = WorkerKey::new(upstream.worker, DpRank(upstream.dp_rank));
        let rebuilding = self
            .lock()
            .get(&key)
            .and_then(|v| v.cleared_at)
            .is_some_and(|at| at.elapsed() < window);
        if rebuilding {
            KvCacheReport::Full
        } else {
            KvCacheReport::Incremental
        }
    }

    /// Worker `id`'s view, for the admin API.
    pub(crate) fn summary(&self, id: WorkerId, has_events: bool) -> ViewSummary {
        if !has_events {
            return ViewSummary::None;
        }
        let views = self.lock();
        let mut replaying: Option<(u64, String, Vec<u32>)> = None;
        for (key, view) in views.range(rank_keys(id)) {
            if let Some((from, endpoint)) = &view.replaying {
                let r = replaying.get_or_insert_with(|| (*from, endpoint.clone(), Vec::new()));
                r.0 = r.0.min(*from);
                r.2.push(key.dp_rank.0);
            }
        }
        if let Some((from_seq, endpoint, ranks)) = replaying {
            return ViewSummary::Replaying {
                from_seq,
                endpoint,
                ranks,
            };
        }
        let (mut since, mut lost, mut ranks) = (u64::MAX, 0u64, Vec::new());
        for (key, view) in views.range(rank_keys(id)) {
            if let ViewState::RebuiltAfterGap {
                since_unix_ms,
                lost_batches,
            } = view.state
            {
                since = since.min(since_unix_ms);
                lost = lost.saturating_add(lost_batches);
                ranks.push(key.dp_rank.0);
            }
        }
        if ranks.is_empty() {
            ViewSummary::Live
        } else {
            ViewSummary::RebuiltAfterGap {
                since_unix_ms: since,
                lost_batches: lost,
                ranks,
            }
        }
    }
}

/// The keys of worker `id`'s ranks.
fn rank_keys(id: WorkerId) -> std::ops::RangeInclusive<WorkerKey> {
    WorkerKey::new(id, DpRank(0))..=WorkerKey::new(id, DpRank(u32::MAX))
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Whether worker `id`'s cache view is kept (so its events apply): while it is in the router,
/// and while it is out for failing health checks.
fn keeps_view(registry: &Registry, id: WorkerId) -> bool {
    registry
        .get(id)
        .is_some_and(|w| w.state.in_router() || matches!(w.state, WorkerState::Unhealthy { .. }))
}

/// The feed: a channel into the router, and the subscribers that write to it (one task per
/// rank of each worker).
pub struct EventFeed {
    tx: mpsc::Sender<SubscriberEvent>,
    subscribers: Mutex<HashMap<WorkerId, Vec<tokio::task::JoinHandle<()>>>>,
    exported: KvSubscriberCounters,
    views: Views,
}

/// A subscriber's counters exported for as long as this lives (it lives in the subscriber's
/// task, so stopping the task stops the export).
struct Exported {
    exported: KvSubscriberCounters,
    key: WorkerKey,
    counters: Arc<SubscriberCounters>,
}

impl Drop for Exported {
    fn drop(&mut self) {
        self.exported.remove(self.key, &self.counters);
    }
}

impl std::fmt::Debug for EventFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventFeed").finish_non_exhaustive()
    }
}

impl EventFeed {
    /// Starts the task that applies reports to `shared`'s router.
    pub fn start(shared: Arc<Shared>) -> Self {
        let exported = shared.metrics.kv_subscribers.clone();
        let views = shared.views.clone();
        let (tx, mut rx) = mpsc::channel::<SubscriberEvent>(4096);
        tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                apply_report(&shared, event);
                shared.notify();
            }
        });
        Self {
            tx,
            subscribers: Mutex::new(HashMap::new()),
            exported,
            views,
        }
    }

    /// Starts worker `id`'s subscribers, one per rank, if it has an events endpoint. (The
    /// configuration was checked to give every rank an endpoint; one that has none anyway is
    /// logged and skipped.)
    pub fn subscribe(&self, id: WorkerId, config: &WorkerConfig) {
        let Some(endpoint) = &config.events else { return };
        let mut tasks = Vec::with_capacity(config.dp_size as usize);
        for rank in 0..config.dp_size {
            let endpoints = kvroute_zmq::rank_endpoint(endpoint, rank).and_then(|events| {
                let replay = config
                    .replay
                    .as_deref()
                    .map(|r| kvroute_zmq::rank_endpoint(r, rank))
                    .transpose()?;
                Ok((events, replay))
            });
            let (events, replay) = match endpoints {
                Ok(e) => e,
                Err(e) => {
                    tracing::error!(worker = id.0, rank, error = %e, "no KV-event endpoint for this rank");
                    continue;
                }
            };
            let sub = SubscriberConfig {
                rank: DpRank(rank),
                replay_endpoint: replay,
                topic: config.topic.clone(),
                mode: config.events_mode,
                replay_reports: ReplayReports::On,
                ..SubscriberConfig::new(id, events)
            };
            tasks.push(self.spawn(sub));
        }
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = subs.insert(id, tasks) {
            old.iter().for_each(tokio::task::JoinHandle::abort);
        }
    }

    /// One rank's subscriber. The handle lives in the task: aborting the task drops it, which
    /// stops the subscriber (and ends the export of its counters).
    fn spawn(&self, sub: SubscriberConfig) -> tokio::task::JoinHandle<()> {
        let key = WorkerKey::new(sub.worker, sub.rank);
        let tx = self.tx.clone();
        let exported = self.exported.clone();
        let views = self.views.clone();
        tokio::spawn(async move {
            let handle: SubscriberHandle = match kvroute_zmq::spawn_subscriber(sub, tx).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::error!(worker = key.worker.0, rank = key.dp_rank.0, error = %e, "KV-event subscriber failed to start");
                    return;
                }
            };
            let counters = Arc::clone(handle.counters());
            views.lock().entry(key).or_default().trigger = Some(handle.resync_trigger());
            exported.insert(key, Arc::clone(&counters));
            let export = Exported {
                exported,
                key,
                counters,
            };
            std::future::pending::<()>().await;
            drop((export, handle));
        })
    }

    /// Stops worker `id`'s subscriber.
    pub fn unsubscribe(&self, id: WorkerId) {
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tasks) = subs.remove(&id) {
            tasks.iter().for_each(tokio::task::JoinHandle::abort);
        }
        self.views.forget(id);
    }
}

impl Drop for EventFeed {
    fn drop(&mut self) {
        let subs = self.subscribers.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, tasks) in subs.drain() {
            tasks.iter().for_each(tokio::task::JoinHandle::abort);
        }
    }
}

/// Applies what the subscriber of one rank's stream reported. A batch applies to the rank it
/// names (the engine's publisher fills it in), else to the stream's; a restart or lost batches
/// clear the stream's rank.
fn apply_report(shared: &Shared, event: SubscriberEvent) {
    let incident = |kind: &str| {
        shared
            .metrics
            .kv_stream_incidents
            .with_label_values(&[kind])
            .inc();
    };
    match event {
        SubscriberEvent::Batch { worker, batch } => {
            if batch
                .events
                .iter()
                .any(|e| matches!(e, WireEvent::AllBlocksCleared))
            {
                // The engine emptied its cache: from here on the view is exact again.
                shared.views.exact(worker);
            }
            apply_batch(shared, batch.worker_key(worker), &batch);
        }
        SubscriberEvent::Restarted { worker } => {
            tracing::info!(
                worker = worker.worker.0,
                rank = worker.dp_rank.0,
                "KV-event publisher restarted; clearing the rank's cache view"
            );
            incident("restarted");
            clear(shared, worker);
            // A new engine has an empty cache: the view is exact again.
            shared.views.exact(worker);
        }
        SubscriberEvent::GapLost { worker, missing } => {
            let lost = missing.end.saturating_sub(missing.start);
            tracing::warn!(
                worker = worker.worker.0,
                rank = worker.dp_rank.0,
                missing = lost,
                first = missing.start,
                "KV events lost for good; clearing the rank's cache view, rebuilt from new events"
            );
            incident("gap_lost");
            clear(shared, worker);
            shared.views.lost(worker, lost);
        }
        SubscriberEvent::Replaying {
            worker,
            from,
            endpoint,
        } => {
            tracing::debug!(
                worker = worker.worker.0,
                rank = worker.dp_rank.0,
                from,
                endpoint,
                "catching up through the replay socket"
            );
            shared.views.replaying(worker, Some((from, endpoint)));
            shared.notify();
        }
        SubscriberEvent::Replayed { worker } => {
            shared.views.replaying(worker, None);
            // Waiters on the view's state (tests, the admin listing's readers) see it end.
            shared.notify();
        }
        SubscriberEvent::Error { worker, error } => {
            tracing::debug!(
                worker = worker.worker.0,
                rank = worker.dp_rank.0,
                error,
                "KV event stream error"
            );
            incident("error");
        }
    }
}

fn clear(shared: &Shared, key: WorkerKey) {
    shared.with_router(|router, now, registry| {
        if keeps_view(registry, key.worker) {
            let _ = router.handle_kv_event(now, key, IndexEvent::Cleared);
        }
    });
}

fn apply_batch(shared: &Shared, key: WorkerKey, batch: &EventBatch) {
    let config = ApplyConfig {
        block_size: std::num::NonZeroU32::new(shared.config.block_size).unwrap_or(std::num::NonZeroU32::MIN),
        namespace: None,
        group_idx: 0,
    };
    // A block size other than the router's makes the worker misconfigured (checks.rs).
    if let Some(block_size) = batch.events.iter().find_map(|e| match e {
        WireEvent::BlockStored(b) => Some(b.block_size),
        _ => None,
    }) {
        shared.observe_event_block_size(key.worker, block_size);
    }
    // Convert (and hash) outside the lock.
    let converted: Vec<_> = batch
        .events
        .iter()
        .map(|e| (event_type(e), e.to_kv_event(&config)))
        .collect();
    let counter = &shared.metrics.kv_events;
    shared.with_router(|router, now, registry| {
        if !keeps_view(registry, key.worker) {
            return;
        }
        for (kind, conversion) in converted {
            if conversion.skipped.is_some() {
                counter.with_label_values(&[kind, "skipped"]).inc();
            }
            let Some(event) = conversion.event else { continue };
            let status = match router.handle_kv_event(now, key, event.as_index_event()) {
                Ok(()) => "ok",
                Err(RouterError::Index(IndexError::UnknownParent { .. })) => "parent_block_not_found",
                Err(RouterError::Index(IndexError::UnknownWorker(_))) => "block_not_found",
                Err(_) => "invalid_block",
            };
            counter.with_label_values(&[kind, status]).inc();
        }
    });
}

fn event_type(e: &WireEvent) -> &'static str {
    match e {
        WireEvent::BlockStored(_) => "stored",
        WireEvent::BlockRemoved(_) => "removed",
        WireEvent::AllBlocksCleared => "cleared",
        WireEvent::Unknown { .. } => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::WorkerUrls;

    fn upstream(engine: EngineKind, reannounce: Reannounce) -> Upstream {
        Upstream {
            worker: WorkerId(7),
            dp_rank: 1,
            dp: true,
            urls: Arc::new(WorkerUrls::new("http://127.0.0.1:9".into())),
            bootstrap_port: None,
            engine,
            api_key: None,
            reannounce,
        }
    }

    /// A rank's requests ask for re-announcements only while its view is rebuilt, within the
    /// window, and only of a vLLM engine whose worker allows it; the other ranks never.
    #[test]
    fn reannouncements_are_asked_while_a_view_is_rebuilt_within_the_window_of_vllm_engines() {
        use KvCacheReport::{Full, Incremental};
        let views = Views::default();
        let key = WorkerKey::new(WorkerId(7), DpRank(1));
        let long = Duration::from_secs(300);
        let vllm = upstream(EngineKind::Vllm, Reannounce::Auto);
        assert_eq!(views.kv_cache_report(&vllm, long), Incremental, "live");
        views.lost(key, 3);
        // (upstream, window, wanted)
        let table = [
            (upstream(EngineKind::Vllm, Reannounce::Auto), long, Full),
            (upstream(EngineKind::Vllm, Reannounce::Off), long, Incremental),
            (upstream(EngineKind::Sglang, Reannounce::Auto), long, Incremental),
            (
                upstream(EngineKind::Vllm, Reannounce::Auto),
                Duration::ZERO,
                Incremental,
            ),
            (
                Upstream {
                    dp_rank: 0,
                    ..upstream(EngineKind::Vllm, Reannounce::Auto)
                },
                long,
                Incremental,
            ),
        ];
        for (upstream, window, wanted) in table {
            assert_eq!(
                views.kv_cache_report(&upstream, window),
                wanted,
                "{upstream:?} {window:?}"
            );
        }
        // Exact again (a restart, a cache reset): no more.
        views.exact(key);
        assert_eq!(views.kv_cache_report(&vllm, long), Incremental);
    }
}
