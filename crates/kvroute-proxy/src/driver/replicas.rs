//! Router replicas: the sync transport, and peers' changes, releases and snapshots.

use kvroute_core::ids::WorkerId;
use kvroute_core::router::RouterId;
use kvroute_core::router::replica::Urgency;
use kvroute_sync::{LinkState, SyncItem, WorkerChange};

use crate::config::WorkerConfig;
use crate::worker::WorkerState;

use super::{Driver, DriverState};

impl Driver {
    /// Sends this replica's changes through `sync` from now on (once; a second transport is
    /// stopped and ignored).
    pub fn attach_sync(&self, sync: kvroute_sync::SyncTransport) {
        if let Err(extra) = self.sync.set(sync) {
            extra.stop();
        }
    }

    /// Whether this replica is connected to its peers; `None` without sync.
    pub fn sync_link(&self) -> Option<LinkState> {
        self.sync.get().map(kvroute_sync::SyncTransport::link)
    }

    /// Stops the sync transport, if any (the replica falls silent to its peers).
    pub fn stop_sync(&self) {
        if let Some(sync) = self.sync.get() {
            sync.stop();
        }
    }

    /// Hands an operator's registry change to the peers, if synced: urgent, since it changes
    /// what a peer may route to.
    pub(super) fn announce(&self, change: WorkerChange) {
        if let Some(sync) = self.sync.get() {
            sync.outgoing().push(SyncItem::Worker(change), Urgency::Urgent);
        }
    }

    /// Applies peer `from`'s load changes in order (registry changes are the caller's: they
    /// start tasks). A booking on a worker this replica does not know is skipped.
    pub fn apply_peer_events(&self, from: RouterId, events: &[SyncItem]) {
        let mut inner = self.lock();
        let now = self.now();
        let mut out = Vec::new();
        for wire in events {
            let DriverState { router, registry, .. } = &mut *inner;
            let Some(event) = wire.to_sync(from, |url| registry.find(url)) else {
                continue;
            };
            if let Ok(o) = router.handle_sync_event(now, &event) {
                out.extend(o);
            }
        }
        self.dispatch(&mut inner, out);
        self.settle_drains(&mut inner);
        drop(inner);
        self.notify();
    }

    /// Releases every booking of peer `peer` at once.
    pub fn release_peer(&self, peer: RouterId) {
        let mut inner = self.lock();
        let now = self.now();
        let out = inner.router.handle_peer_lost(now, peer);
        self.dispatch(&mut inner, out);
        self.settle_drains(&mut inner);
        drop(inner);
        self.notify();
    }

    /// This replica's state for a joining peer: its registry (every worker an operator has not
    /// removed, with its drain), its in-flight bookings and its sessions' bindings.
    pub fn sync_snapshot(&self) -> Vec<SyncItem> {
        let inner = self.lock();
        let mut events = Vec::new();
        for (_, w) in inner.registry.iter() {
            if matches!(w.state, WorkerState::Gone) {
                continue;
            }
            let Some(added) = announced(&w.config) else {
                continue;
            };
            events.push(SyncItem::Worker(added));
            if matches!(w.state, WorkerState::Draining { .. } | WorkerState::Drained) {
                events.push(SyncItem::Worker(WorkerChange::Draining { url: w.base.clone() }));
            }
        }
        let name = |id: WorkerId| inner.registry.get(id).map(|w| w.base.clone());
        let (bookings, sessions) = (inner.router.sync_snapshot(), inner.router.session_snapshot());
        events.extend(
            bookings
                .iter()
                .chain(&sessions)
                .filter_map(|e| SyncItem::from_sync(e, name)),
        );
        events
    }

    /// The worker at base URL `url` (no trailing slash), if any.
    pub fn find_worker(&self, url: &str) -> Option<WorkerId> {
        self.lock().registry.find(url)
    }
}

/// How worker `config` is told to the peers: its table without its credential, and whether it
/// has one. `None` if it does not serialize (it always does: plain data).
pub(crate) fn announced(config: &WorkerConfig) -> Option<WorkerChange> {
    let mut value = serde_json::to_value(config).ok()?;
    if let Some(table) = value.as_object_mut() {
        for key in kvroute_sync::wire::SECRET_KEYS {
            table.remove(*key);
        }
    }
    Some(WorkerChange::Added {
        config: value,
        credential: config.api_key.is_some(),
    })
}
