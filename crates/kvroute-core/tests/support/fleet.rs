//! What the router property tests share: the fleet they run on and the synced view of a
//! router's load.

use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_core::router::{Router, WorkerLoad, WorkerRole, WorkerSpec};

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
