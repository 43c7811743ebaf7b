//! What the router property tests share: the fleet they run on, the exporting router's
//! configuration, and the synced view of a router's load.

use std::time::Duration;

use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_core::router::{
    CacheMode, Decider, PolicyConfig, Router, RouterConfig, SyncConfig, SyncMode, WorkerLoad, WorkerRole,
    WorkerSpec,
};

/// What a property test draws of a router's configuration.
pub struct Drawn {
    /// A name of [`PolicyConfig::NAMES`].
    pub policy: &'static str,
    pub cache: CacheMode,
    pub decider: Decider,
    pub seed: u64,
    pub track_output_blocks: bool,
}

/// The configuration of a router that exports its changes for replicas, with blocks of
/// `block_size`, requests expiring after `request_ttl`, and what was drawn; the rest default.
pub fn exporting_config(block_size: u32, request_ttl: Duration, drawn: Drawn) -> RouterConfig {
    RouterConfig {
        block_size,
        seed: drawn.seed,
        policy: PolicyConfig::from_name(drawn.policy).expect("a listed name"),
        decider: drawn.decider,
        cache: drawn.cache,
        request_ttl,
        track_output_blocks: drawn.track_output_blocks,
        sync: SyncConfig {
            mode: SyncMode::Export,
            ..SyncConfig::default()
        },
        ..RouterConfig::default()
    }
}

/// Three aggregated workers (one with two data-parallel ranks) and, with `pd`, a prefill and a
/// decode worker.
pub fn workers(pd: bool) -> Vec<WorkerSpec> {
    let key = |id: u64, rank: u32| WorkerKey::new(WorkerId(id), DpRank(rank));
    let mut specs = vec![
        WorkerSpec::new(key(1, 0), WorkerRole::Aggregated, 40),
        WorkerSpec::new(key(1, 1), WorkerRole::Aggregated, 40),
        WorkerSpec::new(key(2, 0), WorkerRole::Aggregated, 20),
    ];
    if pd {
        specs.push(WorkerSpec::new(key(3, 0), WorkerRole::Prefill, 40));
        specs.push(WorkerSpec::new(key(4, 0), WorkerRole::Decode, 40));
    }
    specs
}

/// Loads per worker, output blocks taken out (they are not synced between replicas).
pub fn synced_loads(router: &Router) -> Vec<(WorkerKey, WorkerLoad)> {
    router
        .metrics()
        .workers
        .iter()
        .map(|w| {
            let mut l = w.load;
            l.decode_blocks -= l.output_blocks;
            l.staged_decode_blocks -= l.output_blocks;
            l.output_blocks = 0;
            (w.spec.key, l)
        })
        .collect()
}
