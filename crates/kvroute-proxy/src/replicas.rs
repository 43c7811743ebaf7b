//! Router replicas: the proxy's side of replica sync ([`kvroute_sync`]). The transport hands
//! peers' messages here; load changes go to the router driver ([`crate::driver`]), registry
//! changes to the same paths an operator's change takes (an added worker gets its KV-event
//! subscriber and registration checks, as one added through the admin API does).
//!
//! **No credential on the wire.** A worker is told to the peers without its `api-key`
//! (`announced`), saying only whether it has one; a replica calls a peer's worker with the
//! `api-key` of its own `[[worker]]` table for that URL, else with `peer-worker-api-key`, and
//! refuses a worker that needs a credential it does not have.

use std::sync::Arc;

use kvroute_core::router::RouterId;
use kvroute_sync::{Secret, Sync, SyncHost, SyncMetrics, WireEvent, WorkerChange};

use crate::config::WorkerConfig;
use crate::driver::Shared;

/// How a peer's added worker is started here (the proxy's own add path).
pub type AddWorker = Box<dyn Fn(WorkerConfig) -> Result<(), String> + Send + std::marker::Sync>;

struct Host {
    shared: Arc<Shared>,
    add: AddWorker,
    /// The credential for peers' workers that this replica's own tables do not name.
    peer_key: Option<Secret>,
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

impl SyncHost for Host {
    fn apply(&self, from: RouterId, events: &[WireEvent]) {
        // Load changes in runs, registry changes one by one, all in order.
        let mut run = 0;
        for (i, event) in events.iter().enumerate() {
            if let WireEvent::Worker(change) = event {
                self.shared.apply_peer_events(from, &events[run..i]);
                self.worker_change(change);
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

impl Host {
    fn worker_change(&self, change: &WorkerChange) {
        let WorkerChange::Added { config, credential } = change else {
            self.shared.apply_peer_worker_change(change);
            return;
        };
        let mut config = match serde_json::from_value::<WorkerConfig>(config.clone()) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "a peer's worker configuration was refused");
                return;
            }
        };
        if self
            .shared
            .find_worker(config.url.trim_end_matches('/'))
            .is_some()
        {
            return;
        }
        let url = config.url.clone();
        let own = &self.shared.config.workers;
        config.api_key = match resolve_credential(own, self.peer_key.as_ref(), &url, *credential) {
            Ok(key) => key,
            Err(e) => {
                tracing::warn!(url, "a peer's worker was refused: {e}");
                return;
            }
        };
        match (self.add)(config) {
            Ok(()) => tracing::info!(url, "worker added by a peer replica"),
            Err(e) => tracing::warn!(url, error = e, "a peer's worker was refused"),
        }
    }
}

/// The credential this replica calls a peer's worker at `url` with: the `api-key` of its own
/// `[[worker]]` table for that URL in `own` (none if the table has none), else, when the peer
/// calls it with one (`credential`), `peer_key` (`peer-worker-api-key`); an error when the
/// peer does and this replica has none.
fn resolve_credential(
    own: &[WorkerConfig],
    peer_key: Option<&Secret>,
    url: &str,
    credential: bool,
) -> Result<Option<String>, String> {
    let base = url.trim_end_matches('/');
    match (own.iter().find(|w| w.url.trim_end_matches('/') == base), peer_key) {
        (Some(table), _) => Ok(table.api_key.clone()),
        (None, _) if !credential => Ok(None),
        (None, Some(key)) => Ok(Some(key.expose().to_owned())),
        (None, None) => Err(
            "its peer calls its engine with a credential (api-key), which replicas \
             never send each other, and this replica has none for it: set \
             peer-worker-api-key-file, or give the worker a [[worker]] table with its api-key"
                .to_owned(),
        ),
    }
}

/// Starts replica sync when `nats` is configured: connects, joins (this replica takes its
/// peers' registry and in-flight load before it serves), and attaches the transport to the
/// driver. Nothing without `nats`.
pub async fn start(shared: &Arc<Shared>, id: RouterId, add: AddWorker) -> Result<(), String> {
    let Some(config) = shared.config.sync_config().map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let peer_key = shared.config.peer_worker_api_key().map_err(|e| e.to_string())?;
    let metrics = SyncMetrics::new(shared.metrics.registry()).map_err(|e| e.to_string())?;
    let host = Arc::new(Host {
        shared: Arc::clone(shared),
        add,
        peer_key,
    });
    let sync = Sync::start(id, config, host, metrics)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(replica = format!("{:016x}", id.0), "replica sync on NATS");
    shared.attach_sync(sync);
    Ok(())
}

#[cfg(test)]
mod tests {
    use kvroute_sync::wire::{Body, Envelope, WIRE_VERSION, decode, encode};
    use proptest::prelude::*;

    use super::*;

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
                v: WIRE_VERSION,
                from: 1,
                body: Body::Snapshot { peers: vec![], part: 0, last: true, events: vec![WireEvent::Worker(added)] },
            });
            let text = String::from_utf8(bytes.clone()).unwrap();
            // The key itself, and as JSON escapes it.
            let escaped = serde_json::to_string(&key).unwrap();
            prop_assert!(!text.contains(&key) && !text.contains(escaped.trim_matches('"')), "{}", text);
            let Body::Snapshot { events, .. } = decode(&bytes).unwrap().body else { panic!() };
            let [WireEvent::Worker(WorkerChange::Added { config: sent, credential })] = &events[..] else {
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
