//! What the planner sees of a worker in the router's books: its requests, their prefill and
//! decode load, and the cached blocks only it holds. The live proxy observes its workers this
//! way (a live engine reports no forward passes), and the simulator can too
//! ([`crate::Observe::Router`]), so the two planners are handed the same kind of observation.
//!
//! A worker's queue and KV load are the means of its booked prefill tokens and decode blocks
//! since the previous tick ([`Reader`]), not their values at the tick: on bursty traffic a tick
//! a moment before or after a burst would otherwise see a load many times apart, and a live
//! tick falls wherever the clock puts it.

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
/// tokens and decode blocks integrated over time ([`Router::prefill_token_ns`],
/// [`Router::decode_block_ns`]) at the previous tick, to take the mean queue and KV load over
/// the interval from. A driver observes every worker, then calls [`Reader::end_tick`].
#[derive(Clone, Debug)]
pub struct Reader {
    block_size: u32,
    /// Per worker id: its integrals summed over its ranks, and when.
    last: BTreeMap<u64, (Areas, Timestamp)>,
    /// This tick's readings.
    next: BTreeMap<u64, (Areas, Timestamp)>,
    /// The previous tick (or the planner's start): a worker first seen after it has its means
    /// taken from it, its integrals having started at its first booking.
    since: Option<Timestamp>,
}

/// A worker's integrals: prefill token-nanoseconds, decode block-nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Areas {
    prefill: u128,
    decode: u128,
}

impl Areas {
    fn read(router: &Router, keys: &[WorkerKey], now: Timestamp) -> Self {
        let mut a = Self::default();
        for &key in keys {
            a.prefill += router.prefill_token_ns(key, now).unwrap_or(0);
            a.decode += router.decode_block_ns(key, now).unwrap_or(0);
        }
        a
    }

    /// Neither integral is below `before`'s: they have run on since, not restarted.
    fn since(self, before: Self) -> bool {
        self.prefill >= before.prefill && self.decode >= before.decode
    }
}

impl Reader {
    /// A reader of workers with `block_size`-token blocks, without a previous tick: a worker's
    /// first reading is its load as booked (a snapshot).
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            last: BTreeMap::new(),
            next: BTreeMap::new(),
            since: None,
        }
    }

    /// A reader for a planner started at `start`: a worker it has no reading of has its means
    /// taken from the previous tick (at first, `start`), its integrals having started at its
    /// first booking, after that tick. So where the first tick falls against a burst matters
    /// no more than where any other does. Workers with bookings before `start` are
    /// [`Reader::prime`]d.
    pub fn starting_at(block_size: u32, start: Timestamp) -> Self {
        Self {
            since: Some(start),
            ..Self::new(block_size)
        }
    }

    /// Takes worker `id`'s reading (its ranks `keys`) at the reader's start, as a tick would.
    pub fn prime(&mut self, router: &Router, id: u64, keys: &[WorkerKey]) {
        if let Some(start) = self.since {
            self.last.insert(id, (Areas::read(router, keys, start), start));
        }
    }

    /// Worker `keys` (its ranks) as the planner sees it from `router`'s books at `now`: no
    /// forward passes; its queue and KV load the means since the previous tick, its decoding
    /// requests as booked now.
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
        let areas = Areas::read(router, keys, now);
        let (queued, kv_blocks) = self
            .means(id, areas, now)
            .unwrap_or((b.prefill_tokens, b.decode_blocks));
        WorkerObservation {
            id,
            pool,
            state,
            passes: Vec::new(),
            queued_prefill_tokens: queued,
            decode_seqs: b.decode_seqs,
            kv_tokens: kv_blocks * u64::from(self.block_size),
            in_flight: b.in_flight,
            sole_blocks: sole_blocks(router, keys.iter().copied()),
        }
    }

    /// Closes the tick at `now`: this tick's readings are the next one's starting points. A
    /// worker not observed in it (out of routing for a while) keeps its last reading, so its
    /// means when it is back run from there, not over its whole past; readings are a few bytes
    /// per worker id ever observed.
    pub fn end_tick(&mut self, now: Timestamp) {
        self.last.append(&mut self.next);
        self.since = Some(now);
    }

    /// Worker `id`'s mean queue (tokens) and KV load (blocks) from its last reading to `now`,
    /// given its integrals `areas` now. A worker without one, new since the previous tick, had
    /// no booking before it: its means run from that tick. `None` where neither holds (a reader
    /// without a start, or integrals that restarted, as when a worker left and joined again
    /// under the same id): the caller takes the load as booked now.
    fn means(&mut self, id: u64, areas: Areas, now: Timestamp) -> Option<(u64, u64)> {
        self.next.insert(id, (areas, now));
        let (before, then) = match (self.last.get(&id), self.since) {
            (Some(&(before, then)), _) if areas.since(before) => (before, then),
            (None, Some(since)) => (Areas::default(), since),
            _ => return None,
        };
        if now <= then {
            return None;
        }
        let span = u128::from(now.as_nanos() - then.as_nanos());
        let mean = |area: u128| u64::try_from((area + span / 2) / span).unwrap_or(u64::MAX);
        Some((
            mean(areas.prefill - before.prefill),
            mean(areas.decode - before.decode),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::ids::{DpRank, RequestId, WorkerId};
    use kvroute_core::router::{Prompt, RouteRequest, RouterConfig, WorkerRole, WorkerSpec};

    const MS: u64 = 1_000_000;

    /// A router of 4-token blocks with one aggregated worker, `key`, added at zero.
    fn router_with(key: WorkerKey) -> Router {
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
        router
    }

    #[test]
    fn the_queue_is_its_mean_since_the_previous_tick_wherever_the_tick_falls() {
        let key = WorkerKey::new(WorkerId(1), DpRank(0));
        let mut router = router_with(key);
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
            reader.end_tick(Timestamp(at * MS));
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
        // A reader whose planner started at 1 s, primed then, reads the mean since then at its
        // first tick, though the worker had bookings before.
        let mut primed = Reader::starting_at(4, Timestamp(1000 * MS));
        primed.prime(&router, 1, &[key]);
        assert_eq!(read(&mut primed, &router, 2000), 50);
        // A worker not observed at a tick keeps its reading: at 3 s, after a tick at 2.5 s
        // that did not see it, its mean runs from 2 s (100 tokens throughout).
        reader.end_tick(Timestamp(2500 * MS));
        assert_eq!(read(&mut reader, &router, 3000), 100);
    }

    #[test]
    fn a_worker_added_between_ticks_reads_its_means_since_the_previous_tick() {
        let old = WorkerKey::new(WorkerId(1), DpRank(0));
        let new = WorkerKey::new(WorkerId(2), DpRank(0));
        let mut router = router_with(old);
        let mut reader = Reader::starting_at(4, Timestamp::ZERO);
        let w = reader.observe(
            &router,
            Timestamp(1000 * MS),
            1,
            Pool::Agg,
            WorkerPhase::Ready,
            &[old],
        );
        assert_eq!(w.queued_prefill_tokens, 0);
        reader.end_tick(Timestamp(1000 * MS));
        // The old worker is taken out of routing; the new one, added at 1.5 s, holds a
        // 100-token prompt from 1.6 s to 1.9 s: 30 tokens over the interval from 1 s, though
        // both ticks see its queue empty and it was not there at the first.
        router
            .handle_worker_added(
                Timestamp(1500 * MS),
                WorkerSpec::new(new, WorkerRole::Aggregated, 1000),
            )
            .expect("a new worker");
        router
            .handle_worker_draining(Timestamp(1500 * MS), old)
            .expect("a known worker");
        let tokens: Vec<u32> = (0..100).collect();
        router
            .handle_request(
                Timestamp(1600 * MS),
                &RouteRequest::new(RequestId(1), Prompt::Tokens(&tokens)),
            )
            .expect("a fresh id");
        router
            .handle_first_token(Timestamp(1900 * MS), RequestId(1))
            .expect("a known id");
        let w = reader.observe(
            &router,
            Timestamp(2000 * MS),
            2,
            Pool::Agg,
            WorkerPhase::Ready,
            &[new],
        );
        assert_eq!(w.queued_prefill_tokens, 30);
        // Its 25 blocks, booked from 1.6 s and still active: a mean KV load of 10 blocks (40
        // tokens) over the interval, though 25 are booked at the tick.
        assert_eq!(w.kv_tokens, 40);
    }
}
