//! `kvroute bench sync --live` on a few requests: the synced pass carries every change of every
//! request to the peers (the bench itself fails if a replica still books a peer's request after
//! it), the unsynced one sends nothing, and the summary is made of the rounds. Needs
//! `nats-server` (skipped without it locally, a failure in CI).

use std::time::Duration;

use kvroute::bench::sync_live::{LiveConfig, PassReport, run};
use kvroute_sync::server::NatsServer;
use kvroute_testkit::{External, require};

#[test]
fn a_synced_pass_carries_every_change_and_an_unsynced_one_sends_nothing() {
    if !require(External::NatsServer, NatsServer::binary().is_some()) {
        return;
    }
    let config = LiveConfig {
        requests: 30,
        rounds: 2,
        speedup: 100.0,
        lazy: Duration::from_millis(20),
    };
    let mut passes: Vec<PassReport> = Vec::new();
    let summary = run(&config, &mut |p| passes.push(p.clone())).unwrap();
    assert_eq!(passes.len(), 4, "a synced and an unsynced pass a round");
    for (i, p) in passes.iter().enumerate() {
        // Round 1 syncs first, round 2 last.
        assert_eq!(p.synced, i == 0 || i == 3, "pass {i}: {p:?}");
        assert_eq!(p.requests, summary.requests, "every request routed: {p:?}");
        if p.synced {
            assert_eq!(
                p.events,
                3 * p.requests as u64,
                "booked, prefill done, freed: {p:?}"
            );
            assert!(p.messages > 0 && p.bytes > 0, "{p:?}");
        } else {
            assert_eq!((p.messages, p.events, p.bytes), (0, 0, 0), "{p:?}");
        }
    }
    assert_eq!(summary.sync_cpu_ms_per_request.len(), 2);
    assert!(summary.min_ms <= summary.median_ms && summary.median_ms <= summary.max_ms);
}
