//! Router replicas: the proxy's side of replica sync ([`kvroute_sync`]). The transport hands
//! peers' messages here; load changes go to the router driver ([`crate::driver`]), registry
//! changes to the fleet ([`Fleet::apply_peer_change`]): the same add and remove paths an
//! operator's change takes (an added worker gets its KV-event subscribers and registration
//! checks; a removed one loses them, its cache view and its series).
//!
//! **No credential on the wire.** A worker is told to the peers without its `api-key`
//! (`driver::announced`), saying only whether it has one; a replica calls a peer's
//! worker with the `api-key` of its own `[[worker]]` table for that URL, else with
//! `peer-worker-api-key`, and refuses a worker that needs a credential it does not have
//! (`fleet::resolve_credential`).

use std::sync::Arc;

use kvroute_core::router::RouterId;
use kvroute_sync::{Secret, SyncHost, SyncItem, SyncMetrics, SyncTransport};

use crate::driver::Driver;
use crate::fleet::Fleet;

struct Host {
    driver: Arc<Driver>,
    fleet: Arc<Fleet>,
    /// The credential for peers' workers that this replica's own tables do not name.
    peer_key: Option<Secret>,
}

impl SyncHost for Host {
    fn apply(&self, from: RouterId, events: &[SyncItem]) {
        // Load changes in runs, registry changes one by one, all in order.
        let mut run = 0;
        for (i, event) in events.iter().enumerate() {
            if let SyncItem::Worker(change) = event {
                self.driver.apply_peer_events(from, &events[run..i]);
                self.fleet.apply_peer_change(change, self.peer_key.as_ref());
                run = i + 1;
            }
        }
        if run < events.len() {
            self.driver.apply_peer_events(from, &events[run..]);
        }
    }

    fn peer_lost(&self, peer: RouterId) {
        self.driver.release_peer(peer);
    }

    fn snapshot(&self) -> Vec<SyncItem> {
        self.driver.sync_snapshot()
    }
}

/// Starts replica sync when `nats` is configured: connects, joins (this replica takes its
/// peers' registry and in-flight load before it serves), and attaches the transport to the
/// driver. Nothing without `nats`.
pub async fn start(fleet: &Arc<Fleet>, id: RouterId) -> Result<(), String> {
    let driver = fleet.driver();
    let Some(config) = driver.config.sync_config().map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let peer_key = driver.config.peer_worker_api_key().map_err(|e| e.to_string())?;
    let metrics = SyncMetrics::new(driver.metrics.registry()).map_err(|e| e.to_string())?;
    let host = Arc::new(Host {
        driver: Arc::clone(driver),
        fleet: Arc::clone(fleet),
        peer_key,
    });
    let sync = SyncTransport::start(id, config, host, metrics)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(replica = format!("{:016x}", id.0), "replica sync on NATS");
    driver.attach_sync(sync);
    Ok(())
}

#[cfg(test)]
mod tests {
    use kvroute_sync::wire::{Body, Envelope, decode, encode};
    use proptest::prelude::*;

    use kvroute_sync::WorkerChange;

    use super::*;
    use crate::config::WorkerConfig;
    use crate::driver::announced;
    use crate::fleet::resolve_credential;

    proptest! {
        /// Whatever a worker's credential (as long as real ones are, so that it cannot occur in
        /// the message by chance), the sync message that announces the worker does not carry
        /// it, decodes, and gives back the same table without it.
        #[test]
        fn no_sync_message_carries_a_workers_credential(key in "[!-~]{24,64}", dp in 1u32..8) {
            let config = WorkerConfig {
                api_key: Some(key.clone()),
                dp_size: dp,
                ..WorkerConfig::new("http://10.0.0.5:8000")
            };
            let added = announced(&config).unwrap();
            let bytes = encode(&Envelope {
                from: 1,
                body: Body::Snapshot { peers: vec![], part: 0, last: true, seq: 0, events: vec![SyncItem::Worker(added)] },
            });
            let text = String::from_utf8_lossy(&bytes);
            // The key itself, and as JSON escapes it.
            let escaped = serde_json::to_string(&key).unwrap();
            prop_assert!(!text.contains(&key) && !text.contains(escaped.trim_matches('"')), "{}", text);
            let Body::Snapshot { events, .. } = decode(&bytes).unwrap().body else { panic!() };
            let [SyncItem::Worker(WorkerChange::Added { config: sent, credential })] = &events[..] else {
                panic!("{events:?}")
            };
            prop_assert!(*credential, "the peer is told the worker has one");
            let back: WorkerConfig = serde_json::from_value(sent.clone()).unwrap();
            prop_assert_eq!(back, WorkerConfig { api_key: None, ..config });
        }
    }

    #[test]
    fn a_peers_worker_takes_this_replicas_own_credential() {
        let url = "http://10.0.0.5:8000";
        let own = [WorkerConfig {
            api_key: Some("own-key".into()),
            ..WorkerConfig::new(format!("{url}/"))
        }];
        let keyless = [WorkerConfig::new(url)];
        let peer_key = Secret::new("peer-key");
        /// (own tables, peer-worker-api-key, the peer has a credential, the result: the key
        /// used, or a word of the error)
        type Case<'a> = (
            &'a [WorkerConfig],
            Option<&'a Secret>,
            bool,
            Result<Option<&'a str>, &'a str>,
        );
        let cases: &[Case] = &[
            (&own, Some(&peer_key), true, Ok(Some("own-key"))),
            (&own, None, false, Ok(Some("own-key"))),
            (&keyless, Some(&peer_key), true, Ok(None)),
            (&[], Some(&peer_key), true, Ok(Some("peer-key"))),
            (&[], Some(&peer_key), false, Ok(None)),
            (&[], None, false, Ok(None)),
            (&[], None, true, Err("set peer-worker-api-key-file")),
        ];
        for (i, (tables, key, has, want)) in cases.iter().enumerate() {
            let got = resolve_credential(tables, *key, url, *has);
            match (got, want) {
                (Ok(got), Ok(want)) => assert_eq!(got.as_deref(), *want, "case {i}"),
                (Err(e), Err(want)) => assert!(e.contains(want), "case {i}: {e}"),
                (got, want) => panic!("case {i}: {got:?}, want {want:?}"),
            }
        }
    }
}
