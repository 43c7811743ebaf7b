//! What the planner sees of a worker in the router's books: its requests, their prefill and
//! decode load, and the cached blocks only it holds. The live proxy observes its workers this
//! way (a live engine reports no forward passes), and the simulator can too
//! ([`crate::Observe::Router`]), so the two planners are handed the same kind of observation.

use kvroute_core::ids::WorkerKey;
use kvroute_core::router::Router;

use crate::config::Pool;
use crate::observation::{WorkerObservation, WorkerPhase};

/// One worker's load as the router books it, summed over its ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Booked {
    /// Prompt tokens of its requests still in prefill.
    pub prefill_tokens: u64,
    /// Its requests past prefill.
    pub decode_seqs: u32,
    /// Its active decode blocks.
    pub decode_blocks: u64,
    /// Its requests.
    pub in_flight: u32,
}

/// The load `router` books on the ranks `keys` of one worker.
pub fn booked(router: &Router, keys: impl IntoIterator<Item = WorkerKey>) -> Booked {
    let mut b = Booked::default();
    for key in keys {
        if let Some(load) = router.worker_load(key) {
            b.prefill_tokens += load.prefill_tokens;
            b.decode_seqs += load.requests - load.prefill_requests;
            b.decode_blocks += load.decode_blocks;
            b.in_flight += load.requests;
        }
    }
    b
}

/// Cached blocks of the ranks `keys` that no other worker holds in `router`'s index (walks
/// their blocks: for ticks and scrapes, not the request path).
pub fn sole_blocks(router: &Router, keys: impl IntoIterator<Item = WorkerKey>) -> u64 {
    keys.into_iter()
        .map(|key| router.index().sole_blocks(key) as u64)
        .sum()
}

/// Worker `keys` (its ranks) as the planner sees it from `router`'s books: no forward passes,
/// its queue, decoding requests and KV from the bookings, with `block_size`-token blocks.
pub fn observe(
    router: &Router,
    id: u64,
    pool: Pool,
    state: WorkerPhase,
    keys: &[WorkerKey],
    block_size: u32,
) -> WorkerObservation {
    let b = booked(router, keys.iter().copied());
    WorkerObservation {
        id,
        pool,
        state,
        passes: Vec::new(),
        queued_prefill_tokens: b.prefill_tokens,
        decode_seqs: b.decode_seqs,
        kv_tokens: b.decode_blocks * u64::from(block_size),
        in_flight: b.in_flight,
        sole_blocks: sole_blocks(router, keys.iter().copied()),
    }
}
