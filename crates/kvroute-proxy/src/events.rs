//! The KV-event feed: one `kvroute-zmq` subscriber per worker endpoint reports into one channel,
//! and one task applies the reports to the router in arrival order (so a worker's events apply
//! in order). A worker of several data-parallel ranks has one subscriber per rank, on the
//! rank's own endpoints (vLLM's and SGLang's rule: the port plus the rank,
//! [`kvroute_zmq::rank_endpoint`]), and its reports name the rank. Gaps are filled by the
//! subscriber through the rank's replay socket; what it cannot fill arrives as `GapLost`, and
//! that rank's cache view is cleared (never route on blocks that may be gone). While a
//! subscriber runs, its counters are exported from `/metrics` ([`KvSubscriberCounters`]).
//!
//! Reports are converted (and hashed) outside the router's lock, then applied through the
//! driver's one door to the router ([`Shared`]); a worker out of the router takes none.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_core::index::IndexError;
use kvroute_core::router::{IndexEvent, RouterError};
use kvroute_wire::{ApplyConfig, EventBatch, WireEvent};
use tokio::sync::mpsc;

use kvroute_zmq::{SubscriberConfig, SubscriberCounters, SubscriberEvent, SubscriberHandle};

use crate::config::WorkerConfig;
use crate::driver::Shared;
use crate::metrics::KvSubscriberCounters;

/// The feed: a channel into the router, and the subscribers that write to it (one task per
/// rank of each worker).
pub struct EventFeed {
    tx: mpsc::Sender<SubscriberEvent>,
    subscribers: Mutex<HashMap<WorkerId, Vec<tokio::task::JoinHandle<()>>>>,
    exported: KvSubscriberCounters,
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
        tokio::spawn(async move {
            let handle: SubscriberHandle = match kvroute_zmq::spawn_subscriber(sub, tx).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::error!(worker = key.worker.0, rank = key.dp_rank.0, error = %e, "KV-event subscriber failed to start");
                    return;
                }
            };
            let counters = Arc::clone(handle.counters());
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
        SubscriberEvent::Batch { worker, batch } => apply_batch(shared, batch.worker_key(worker), &batch),
        SubscriberEvent::Restarted { worker } => {
            incident("restarted");
            clear(shared, worker);
        }
        SubscriberEvent::GapLost { worker, missing } => {
            tracing::warn!(
                worker = worker.worker.0,
                rank = worker.dp_rank.0,
                missing = missing.end.saturating_sub(missing.start),
                "KV events lost; clearing the rank's cache view"
            );
            incident("gap_lost");
            clear(shared, worker);
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
        if registry.get(key.worker).is_some() {
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
        if !registry.in_router(key.worker) {
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
