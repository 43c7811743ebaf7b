//! The KV-event feed: one `kvroute-zmq` subscriber per worker endpoint reports into one channel,
//! and one task applies the reports to the router in arrival order (so a worker's events apply
//! in order). A worker of several data-parallel ranks has one subscriber per rank, on the
//! rank's own endpoints (vLLM's and SGLang's rule: the port plus the rank,
//! [`kvroute_zmq::rank_endpoint`]), and its reports name the rank. Gaps are filled by the
//! subscriber through the rank's replay socket; what it cannot fill arrives as `GapLost`, and
//! that rank's cache view is cleared (never route on blocks that may be gone) and said to be
//! [`ViewState::RebuiltAfterGap`](crate::views::ViewState::RebuiltAfterGap) (a warning, `kvroute_kv_stream_incidents_total{kind=
//! "gap_lost"}`, and the admin listing's `view`) until it is exact again: the engine restarted
//! (its cache is empty, its new run replayed) or cleared its cache. Meanwhile it is rebuilt
//! from the engine's new events (and, with `cache = "predict"`, the router's own decisions),
//! and, for `reannounce-window-ms` after it was cleared, from the engine's re-announcements: a
//! request routed to the rank asks a vLLM engine (worker key `reannounce = "auto"`) for
//! `"vllm_xargs": {"kv_cache_report_mode": "full"}` (`WorkerViews::kv_cache_report`), and the
//! engine announces the cached blocks the request reuses again, as stored events from the
//! root. A store of blocks the view holds changes nothing (the index keeps them where they
//! are; `kvroute_index_blocks_stored_total` counts only blocks newly held).
//!
//! While a subscriber catches up through the replay socket (a resync, a gap fill), the rank's
//! view is listed `replaying` (with the sequence number and endpoint asked), then `live` or
//! `rebuilt_after_gap`.
//! While a subscriber runs, its counters are exported from `/metrics` ([`KvSubscriberCounters`]).
//! A worker's subscribers are its own ([`Subscribers`], kept in its registry entry): they stop
//! when it is removed, by whichever path.
//!
//! A worker out of routing for failed health checks keeps its view and its events still
//! apply; when it is back, `WorkerViews::resync` has its subscribers check the stream against the
//! engine's replay buffer (see [`kvroute_zmq::ResyncTrigger`]).
//!
//! Reports are converted (and hashed) outside the router's lock, then applied through the
//! driver's one door to the router ([`Driver`]); a drained or removed worker takes none.

use std::sync::{Arc, Weak};

use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_core::index::IndexError;
use kvroute_core::router::{IndexEvent, RouterError};
use kvroute_wire::{ApplyConfig, EventBatch, WireEvent};
use kvroute_zmq::{ReplayReports, SubscriberConfig, SubscriberCounters, SubscriberEvent, SubscriberHandle};
use tokio::sync::mpsc;

use crate::config::WorkerConfig;
use crate::driver::Driver;
use crate::metrics::KvSubscriberCounters;
use crate::registry::{Registry, Subscribers};
use crate::worker::WorkerState;

/// Whether worker `id`'s cache view is kept (so its events apply): while it is in the router,
/// and while it is out for failing health checks.
fn keeps_view(registry: &Registry, id: WorkerId) -> bool {
    registry
        .get(id)
        .is_some_and(|w| w.state.in_router() || matches!(w.state, WorkerState::Unhealthy { .. }))
}

/// The feed: a channel into the router, and how a worker's subscribers that write to it are
/// started (one task per rank; the worker's registry entry owns them).
pub struct EventFeed {
    tx: mpsc::Sender<SubscriberEvent>,
    exported: KvSubscriberCounters,
    /// Where a started subscriber's resync trigger goes (its worker's views); weak, as the
    /// driver owns the subscribers.
    driver: Weak<Driver>,
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
    /// Starts the task that applies reports to `driver`'s router.
    pub fn start(driver: Arc<Driver>) -> Self {
        let exported = driver.metrics.kv_subscribers.clone();
        let weak = Arc::downgrade(&driver);
        let (tx, mut rx) = mpsc::channel::<SubscriberEvent>(4096);
        tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                apply_report(&driver, event);
                driver.notify();
            }
        });
        Self {
            tx,
            exported,
            driver: weak,
        }
    }

    /// Starts worker `id`'s subscribers, one per rank, if it has an events endpoint; they run
    /// until the returned [`Subscribers`] is dropped. (The configuration was checked to give
    /// every rank an endpoint; one that has none anyway is logged and skipped.)
    pub(crate) fn subscribe(&self, id: WorkerId, config: &WorkerConfig) -> Subscribers {
        let Some(endpoint) = &config.events else {
            return Subscribers::default();
        };
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
        Subscribers::new(tasks)
    }

    /// One rank's subscriber. The handle lives in the task: aborting the task drops it, which
    /// stops the subscriber (and ends the export of its counters).
    fn spawn(&self, sub: SubscriberConfig) -> tokio::task::JoinHandle<()> {
        let key = WorkerKey::new(sub.worker, sub.rank);
        let tx = self.tx.clone();
        let exported = self.exported.clone();
        let driver = Weak::clone(&self.driver);
        tokio::spawn(async move {
            let handle: SubscriberHandle = match kvroute_zmq::spawn_subscriber(sub, tx).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::error!(worker = key.worker.0, rank = key.dp_rank.0, error = %e, "KV-event subscriber failed to start");
                    return;
                }
            };
            let counters = Arc::clone(handle.counters());
            if let Some(driver) = driver.upgrade() {
                let trigger = handle.resync_trigger();
                driver.update_views(key.worker, |v| v.set_trigger(key.dp_rank, trigger));
            }
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
}

/// Applies what the subscriber of one rank's stream reported. A batch applies to the rank it
/// names (the engine's publisher fills it in), else to the stream's; a restart or lost batches
/// clear the stream's rank.
fn apply_report(driver: &Driver, event: SubscriberEvent) {
    let incident = |kind: &str| {
        driver
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
                driver.update_views(worker.worker, |v| v.exact(worker.dp_rank));
            }
            apply_batch(driver, batch.worker_key(worker), &batch);
        }
        SubscriberEvent::Restarted { worker } => {
            tracing::info!(
                worker = worker.worker.0,
                rank = worker.dp_rank.0,
                "KV-event publisher restarted; clearing the rank's cache view"
            );
            incident("restarted");
            clear(driver, worker);
            // A new engine has an empty cache: the view is exact again.
            driver.update_views(worker.worker, |v| v.exact(worker.dp_rank));
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
            clear(driver, worker);
            driver.update_views(worker.worker, |v| v.lost(worker.dp_rank, lost));
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
            driver.update_views(worker.worker, |v| {
                v.replaying(worker.dp_rank, Some((from, endpoint)));
            });
            driver.notify();
        }
        SubscriberEvent::Replayed { worker } => {
            driver.update_views(worker.worker, |v| v.replaying(worker.dp_rank, None));
            // Waiters on the view's state (tests, the admin listing's readers) see it end.
            driver.notify();
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

fn clear(driver: &Driver, key: WorkerKey) {
    driver.with_router(|router, now, registry| {
        if keeps_view(registry, key.worker) {
            let _ = router.handle_kv_event(now, key, IndexEvent::Cleared);
        }
    });
}

fn apply_batch(driver: &Driver, key: WorkerKey, batch: &EventBatch) {
    let config = ApplyConfig {
        block_size: std::num::NonZeroU32::new(driver.config.routing.block_size)
            .unwrap_or(std::num::NonZeroU32::MIN),
        namespace: None,
        group_idx: 0,
    };
    // A block size other than the router's makes the worker misconfigured (checks.rs).
    if let Some(block_size) = batch.events.iter().find_map(|e| match e {
        WireEvent::BlockStored(b) => Some(b.block_size),
        _ => None,
    }) {
        driver.observe_event_block_size(key.worker, block_size);
    }
    // Convert (and hash) outside the lock.
    let converted: Vec<_> = batch
        .events
        .iter()
        .map(|e| (event_type(e), e.to_kv_event(&config)))
        .collect();
    let counter = &driver.metrics.kv_events;
    driver.with_router(|router, now, registry| {
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
