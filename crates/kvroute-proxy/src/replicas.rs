//! Router replicas: the proxy's side of replica sync ([`kvroute_sync`]). The transport hands
//! peers' messages here; load changes go to the router driver ([`crate::driver`]), registry
//! changes to the fleet ([`Fleet::apply_peer_change`]): the same add and remove paths an
//! operator's change takes (an added worker gets its KV-event subscribers and registration
//! checks; a removed one loses them, its cache view and its series).

use std::sync::Arc;

use kvroute_core::router::RouterId;
use kvroute_sync::{Sync, SyncHost, SyncMetrics, WireEvent};

use crate::driver::Shared;
use crate::fleet::Fleet;

struct Host {
    shared: Arc<Shared>,
    fleet: Arc<Fleet>,
}

impl SyncHost for Host {
    fn apply(&self, from: RouterId, events: &[WireEvent]) {
        // Load changes in runs, registry changes one by one, all in order.
        let mut run = 0;
        for (i, event) in events.iter().enumerate() {
            if let WireEvent::Worker(change) = event {
                self.shared.apply_peer_events(from, &events[run..i]);
                self.fleet.apply_peer_change(change);
                run = i + 1;
            }
        }
        if run < events.len() {
            self.shared.apply_peer_events(from, &events[run..]);
        }
    }

    fn peer_lost(&self, peer: RouterId) {
        self.shared.release_peer(peer);
    }

    fn snapshot(&self) -> Vec<WireEvent> {
        self.shared.sync_snapshot()
    }
}

/// Starts replica sync when `nats` is configured: connects, joins (this replica takes its
/// peers' registry and in-flight load before it serves), and attaches the transport to the
/// driver. Nothing without `nats`.
pub async fn start(fleet: &Arc<Fleet>, id: RouterId) -> Result<(), String> {
    let shared = fleet.shared();
    let Some(config) = shared.config.sync_config() else {
        return Ok(());
    };
    let metrics = SyncMetrics::new(shared.metrics.registry()).map_err(|e| e.to_string())?;
    let host = Arc::new(Host {
        shared: Arc::clone(shared),
        fleet: Arc::clone(fleet),
    });
    let sync = Sync::start(id, config, host, metrics)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(replica = format!("{:016x}", id.0), "replica sync on NATS");
    shared.attach_sync(sync);
    Ok(())
}
