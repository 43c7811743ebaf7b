//! What the planner sees of a worker in the router's books: its requests, their prefill and
//! decode load, and the cached blocks only it holds. The live proxy observes its workers this
//! way (a live engine reports no forward passes), and the simulator can too
//! ([`crate::Observe::Router`]), so the two planners are handed the same kind of observation.
//!
//! A worker's queue is the mean of its booked prefill tokens since the previous tick
//! ([`Reader`]), not their value at the tick: on bursty traffic a tick a moment before or
//! after a burst would otherwise see a queue many times apart, and a live tick falls wherever
//! the clock puts it.

use std::collections::BTreeMap;

use kvroute_core::ids::WorkerKey;
use kvroute_core::router::Router;
use kvroute_core::time::Timestamp;

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

/// Reads workers from the router's books for one planner, keeping each one's booked prefill
/// tokens integrated over time ([`Router::prefill_token_ns`]) at the previous tick, to take the
/// mean queue over the interval from. A driver observes every worker, then calls
/// [`Reader::end_tick`].
#[derive(Clone, Debug)]
pub struct Reader {
    block_size: u32,
    /// Per worker id: token-nanoseconds summed over its ranks, and when.
    last: BTreeMap<u64, (u128, Timestamp)>,
    /// This tick's readings.
    next: BTreeMap<u64, (u128, Timestamp)>,
}

impl Reader {
    /// A reader of workers with `block_size`-token blocks.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            last: BTreeMap::new(),
            next: BTreeMap::new(),
        }
    }

    /// Worker `keys` (its ranks) as the planner sees it from `router`'s books at `now`: no
    /// forward passes; its queue the mean since the previous tick, its decoding requests and KV
    /// as booked now.
    pub fn observe(
        &mut self,
        router: &Router,
        now: Timestamp,
        id: u64,
        pool: Pool,
        state: WorkerPhase,
        keys: &[WorkerKey],
    ) -> WorkerObservation {
        let b = booked(router, keys.iter().copied());
        let area = keys
            .iter()
            .filter_map(|&key| router.prefill_token_ns(key, now))
            .sum();
        WorkerObservation {
            id,
            pool,
            state,
            passes: Vec::new(),
            queued_prefill_tokens: self.mean(id, area, now, b.prefill_tokens),
            decode_seqs: b.decode_seqs,
            kv_tokens: b.decode_blocks * u64::from(self.block_size),
            in_flight: b.in_flight,
            sole_blocks: sole_blocks(router, keys.iter().copied()),
        }
    }

    /// Closes a tick: this tick's readings are the next one's starting points; workers not
    /// observed in it are forgotten.
    pub fn end_tick(&mut self) {
        self.last = std::mem::take(&mut self.next);
    }

    /// The mean of worker `id`'s queue from the previous tick to `now`, given its integral
    /// `area` now; `snapshot`, its queue now, for a worker seen for the first time (or whose
    /// integral restarted, as when it left and joined again).
    fn mean(&mut self, id: u64, area: u128, now: Timestamp, snapshot: u64) -> u64 {
        self.next.insert(id, (area, now));
        match self.last.get(&id) {
            Some(&(before, then)) if now > then && area >= before => {
                let span = u128::from(now.as_nanos() - then.as_nanos());
                let mean = (area - before + span / 2) / span;
                u64::try_from(mean).unwrap_or(u64::MAX)
            }
            _ => snapshot,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::ids::{DpRank, RequestId, WorkerId};
    use kvroute_core::router::{Prompt, RouteRequest, RouterConfig, WorkerRole, WorkerSpec};

    const MS: u64 = 1_000_000;

    #[test]
    fn the_queue_is_its_mean_since_the_previous_tick_wherever_the_tick_falls() {
        let key = WorkerKey::new(WorkerId(1), DpRank(0));
        let mut router = Router::new(RouterConfig {
            block_size: 4,
            ..RouterConfig::default()
        })
        .expect("a valid config");
        router
            .handle_worker_added(
                Timestamp::ZERO,
                WorkerSpec::new(key, WorkerRole::Aggregated, 1000),
            )
            .expect("a new worker");
        let mut reader = Reader::new(4);
        let read = |reader: &mut Reader, router: &Router, at: u64| {
            let w = reader.observe(
                router,
                Timestamp(at * MS),
                1,
                Pool::Agg,
                WorkerPhase::Ready,
                &[key],
            );
            reader.end_tick();
            w.queued_prefill_tokens
        };
        // First reading: the queue as booked (nothing).
        assert_eq!(read(&mut reader, &router, 0), 0);
        // A 100-token prompt waits from 200 ms to 700 ms of a 1 s interval: a mean of 50,
        // though the queue is empty at both ticks.
        let tokens: Vec<u32> = (0..100).collect();
        router
            .handle_request(
                Timestamp(200 * MS),
                &RouteRequest::new(RequestId(1), Prompt::Tokens(&tokens)),
            )
            .expect("a fresh id");
        router
            .handle_first_token(Timestamp(700 * MS), RequestId(1))
            .expect("a known id");
        assert_eq!(read(&mut reader, &router, 1000), 50);
        // Another waits from 1.5 s on: at 2 s it is half the interval's mean and all of a
        // snapshot; a new reader (no previous tick) reads the snapshot.
        router
            .handle_request(
                Timestamp(1500 * MS),
                &RouteRequest::new(RequestId(2), Prompt::Tokens(&tokens)),
            )
            .expect("a fresh id");
        assert_eq!(read(&mut reader, &router, 2000), 50);
        assert_eq!(read(&mut Reader::new(4), &router, 2000), 100);
        // A worker no longer observed is forgotten at the end of the tick.
        reader.end_tick();
        assert!(reader.last.is_empty());
    }
}
