//! Property tests of replica sync: two routers over one fleet, each exporting its load changes
//! to the other, against the simplest reference there is: the router that made a decision.
//!
//! * **Same state.** After every input, the two routers book the same load on every worker
//!   (output blocks aside: they are not synced), and every prompt seen so far is as deep in each
//!   one's record of recent decisions and in each one's policy view (the SGLang-like tree) as in
//!   the other's: a peer's booking reaches everything a local booking reaches.
//! * **Snapshot.** A fresh router that applies both routers' [`Router::sync_snapshot`] books the
//!   same load.
//! * **Out of order.** A replica handed one router's events shuffled, some repeated, ends with
//!   that router's load once it has them all (tombstones and idempotence).
//!
//! Both routers get the same KV events (each subscribes to every engine) and the same fleet
//! changes; each request is routed by one of them, whose id it carries.

#[path = "support/fleet.rs"]
mod fleet;

use fleet::{Drawn, exporting_config, synced_loads, workers};
use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::{DpRank, RequestId, SequenceHash, WorkerId, WorkerKey};
use kvroute_core::router::{
    CacheMode, Decider, IndexEvent, PolicyConfig, Prompt, RecentConfig, RouteRequest, Router, RouterConfig,
    RouterId, SyncEvent, WorkerRole, WorkerSpec, stored_blocks,
};
use kvroute_core::time::Timestamp;
use proptest::prelude::*;
use proptest::test_runner::Config;

const BLOCK: u32 = 4;

fn tokens((family, prefix_blocks, tail, tail_blocks): (u32, u32, u32, u32)) -> Vec<u32> {
    let block = |f: u32, k: u32| (0..BLOCK).map(move |j| f * 10_000 + k * BLOCK + j);
    let mut t: Vec<u32> = (0..prefix_blocks).flat_map(|k| block(family + 1, k)).collect();
    t.extend((0..tail_blocks).flat_map(|k| block(100 + tail, k)));
    t
}

fn chain(tokens: &[u32]) -> Vec<SequenceHash> {
    let (mut locals, mut chain) = (Vec::new(), Vec::new());
    BlockHasher::new(BLOCK as usize, &HashSalt::NONE).hash_prompt(tokens, &mut locals, &mut chain);
    chain
}

type PromptSpec = (u32, u32, u32, u32);

fn prompt() -> impl Strategy<Value = PromptSpec> {
    (0..3u32, 0..6u32, 0..40u32, 0..4u32)
}

#[derive(Clone, Debug)]
enum Op {
    /// Router 0 or 1 routes a request.
    Route(bool, PromptSpec),
    FirstToken(usize),
    OutputBlock(usize),
    Finish(usize),
    Cancel(usize),
    Advance(u64),
    Tick,
    Stored(usize, PromptSpec),
    Cleared(usize),
    Drain(usize),
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<bool>(), prompt()).prop_map(|(r, p)| Op::Route(r, p)),
        4 => any::<usize>().prop_map(Op::FirstToken),
        1 => any::<usize>().prop_map(Op::OutputBlock),
        4 => any::<usize>().prop_map(Op::Finish),
        1 => any::<usize>().prop_map(Op::Cancel),
        2 => (0..3_000u64).prop_map(Op::Advance),
        1 => Just(Op::Tick),
        2 => (any::<usize>(), prompt()).prop_map(|(w, p)| Op::Stored(w, p)),
        1 => any::<usize>().prop_map(Op::Cleared),
        1 => any::<usize>().prop_map(Op::Drain),
        1 => any::<usize>().prop_map(Op::Remove),
    ]
}

fn config() -> impl Strategy<Value = (RouterConfig, bool)> {
    let policy = prop::sample::select(PolicyConfig::NAMES.to_vec());
    // Caps large enough that pruning (whose order among equal stamps follows insertion) never
    // runs: the routers record the same prompts, not necessarily in the same order.
    let recent = |ttl| RecentConfig {
        ttl: Some(std::time::Duration::from_secs(ttl)),
        max_blocks: 1 << 20,
        prune_ratio: 0.8,
    };
    let cache = prop_oneof![
        Just(CacheMode::Events),
        Just(CacheMode::EventsWithPrediction(recent(2))),
        Just(CacheMode::Approximate(recent(5))),
    ];
    let decider = prop_oneof![Just(Decider::Always), Just(Decider::Never)];
    (policy, cache, decider, any::<u64>(), any::<bool>(), any::<bool>()).prop_map(
        |(policy, cache, decider, seed, track_output, pd)| {
            let drawn = Drawn {
                policy,
                cache,
                decider,
                seed,
                track_output_blocks: track_output,
            };
            let config = exporting_config(BLOCK, std::time::Duration::from_secs(60), drawn);
            (config, pd)
        },
    )
}

struct Pair {
    routers: [Router; 2],
    specs: Vec<WorkerSpec>,
    now: Timestamp,
    /// Every request routed: which router, its id.
    requests: Vec<(usize, RequestId)>,
    /// Every prompt routed or stored, as chains: the probes of the views.
    probes: Vec<Vec<SequenceHash>>,
    /// Everything router 0 exported, in order.
    exported: Vec<SyncEvent>,
}

impl Pair {
    fn new(config: &RouterConfig, pd: bool) -> Self {
        let make = |id| {
            Router::new(RouterConfig {
                router_id: RouterId(id),
                seed: config.seed.wrapping_add(id),
                ..config.clone()
            })
            .expect("a valid config")
        };
        let mut pair = Self {
            routers: [make(1), make(2)],
            specs: workers(pd),
            now: Timestamp::ZERO,
            requests: Vec::new(),
            probes: Vec::new(),
            exported: Vec::new(),
        };
        for spec in pair.specs.clone() {
            for r in &mut pair.routers {
                r.handle_worker_added(Timestamp::ZERO, spec)
                    .expect("a new worker");
            }
        }
        pair
    }

    fn apply(&mut self, op: &Op) {
        let now = self.now;
        let keys: Vec<WorkerKey> = self.specs.iter().map(|s| s.key).collect();
        let worker = |pick: usize| keys[pick % keys.len()];
        let request =
            |pick: usize| (!self.requests.is_empty()).then(|| self.requests[pick % self.requests.len()]);
        match op {
            Op::Route(second, p) => {
                let t = tokens(*p);
                let id = RequestId(self.requests.len() as u64);
                let which = usize::from(*second);
                self.routers[which]
                    .handle_request(now, &RouteRequest::new(id, Prompt::Tokens(&t)))
                    .expect("a fresh id");
                self.requests.push((which, id));
                self.probes.push(chain(&t));
            }
            Op::FirstToken(i) | Op::OutputBlock(i) | Op::Finish(i) | Op::Cancel(i) => {
                let Some((which, id)) = request(*i) else { return };
                let r = &mut self.routers[which];
                match op {
                    Op::FirstToken(_) => drop(r.handle_first_token(now, id)),
                    Op::OutputBlock(_) => drop(r.handle_output_block(now, id)),
                    Op::Finish(_) => drop(r.handle_finished(now, id)),
                    _ => drop(r.handle_cancelled(now, id)),
                }
            }
            Op::Advance(ms) => self.now = Timestamp(now.0 + ms * 1_000_000),
            Op::Tick => {
                for r in &mut self.routers {
                    drop(r.handle_tick(now));
                }
            }
            Op::Stored(w, p) => {
                let t = tokens(*p);
                let (mut locals, mut chain) = (Vec::new(), Vec::new());
                BlockHasher::new(BLOCK as usize, &HashSalt::NONE).hash_prompt(&t, &mut locals, &mut chain);
                let blocks = stored_blocks(&locals, &chain);
                for r in &mut self.routers {
                    let event = IndexEvent::Stored {
                        parent: None,
                        blocks: &blocks,
                    };
                    drop(r.handle_kv_event(now, worker(*w), event));
                }
                self.probes.push(chain);
            }
            Op::Cleared(w) => {
                for r in &mut self.routers {
                    drop(r.handle_kv_event(now, worker(*w), IndexEvent::Cleared));
                }
            }
            Op::Drain(w) => {
                for r in &mut self.routers {
                    drop(r.handle_worker_draining(now, worker(*w)));
                }
            }
            Op::Remove(w) => {
                for r in &mut self.routers {
                    drop(r.handle_worker_removed(now, worker(*w)));
                }
            }
        }
        self.forward();
    }

    /// Hands each router's exported events to the other until both outboxes are empty.
    fn forward(&mut self) {
        loop {
            let mut moved = false;
            for from in 0..2 {
                while let Some(event) = self.routers[from].poll_sync_event() {
                    moved = true;
                    if from == 0 {
                        self.exported.push(event.clone());
                    }
                    self.routers[1 - from]
                        .handle_sync_event(self.now, &event)
                        .expect("the peer knows every worker the router books on");
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// The first difference between the two routers' states, if any.
    fn difference(&self) -> Option<String> {
        let [a, b] = &self.routers;
        if synced_loads(a) != synced_loads(b) {
            return Some(format!(
                "loads differ:\n{:?}\n{:?}",
                synced_loads(a),
                synced_loads(b)
            ));
        }
        for probe in &self.probes {
            for spec in &self.specs {
                let (x, y) = (
                    a.view_depths(spec.key, probe, self.now),
                    b.view_depths(spec.key, probe, self.now),
                );
                if x != y {
                    return Some(format!("views of {} differ: {x:?} vs {y:?}", spec.key));
                }
            }
        }
        None
    }
}

proptest! {
    #![proptest_config(Config { cases: 256, ..Config::default() })]

    #[test]
    fn a_peer_fed_the_events_holds_the_state_of_the_router_that_made_them(
        (config, pd) in config(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut pair = Pair::new(&config, pd);
        for op in &ops {
            pair.apply(op);
            for r in &pair.routers {
                prop_assert!(r.check_invariants().is_ok());
            }
            if let Some(diff) = pair.difference() {
                return Err(TestCaseError::fail(format!("after {op:?}: {diff}")));
            }
        }
        // A replica joining now, warmed by both snapshots, books the same load.
        let mut fresh = Router::new(RouterConfig { router_id: RouterId(3), ..config.clone() })
            .expect("a valid config");
        for w in pair.routers[0].metrics().workers {
            fresh.handle_worker_added(pair.now, w.spec).expect("a new worker");
        }
        for r in &pair.routers {
            for event in r.sync_snapshot() {
                fresh.handle_sync_event(pair.now, &event).expect("a snapshot names known workers");
            }
        }
        prop_assert_eq!(synced_loads(&fresh), synced_loads(&pair.routers[0]));
        prop_assert!(fresh.check_invariants().is_ok());
    }

    #[test]
    fn shuffled_and_repeated_events_converge_to_the_senders_load(
        (config, pd) in config(),
        ops in prop::collection::vec(op(), 1..60),
        shuffle in any::<u64>(),
        repeats in prop::collection::vec(any::<usize>(), 0..10),
    ) {
        let mut pair = Pair::new(&config, pd);
        // Only router 0 routes here; router 1 is a bystander whose copy is not compared.
        for op in &ops {
            let op = match op {
                Op::Route(_, p) => Op::Route(false, *p),
                other => other.clone(),
            };
            pair.apply(&op);
        }
        let mut events = pair.exported.clone();
        for &i in &repeats {
            if !events.is_empty() {
                let again = events[i % events.len()].clone();
                events.push(again);
            }
        }
        // A seeded Fisher-Yates shuffle.
        let mut rng = kvroute_core::router::Rng::new(shuffle);
        for i in (1..events.len()).rev() {
            events.swap(i, rng.below(i + 1));
        }
        let mut late = Router::new(RouterConfig { router_id: RouterId(3), ..config.clone() })
            .expect("a valid config");
        // Every worker the events may name; the ones router 0 removed go at the end (the
        // requests it dropped with them are freed in the events).
        for spec in &pair.specs {
            late.handle_worker_added(Timestamp::ZERO, *spec).expect("a new worker");
        }
        for event in &events {
            if let Err(e) = late.handle_sync_event(pair.now, event) {
                return Err(TestCaseError::fail(format!("{event:?}: {e}")));
            }
            prop_assert!(late.check_invariants().is_ok());
        }
        let kept: Vec<WorkerKey> = pair.routers[0].metrics().workers.iter().map(|w| w.spec.key).collect();
        for spec in &pair.specs {
            if !kept.contains(&spec.key) {
                late.handle_worker_removed(pair.now, spec.key).expect("a known worker");
            }
        }
        // Router 1 routed nothing: router 0's load is its own requests' alone.
        prop_assert_eq!(synced_loads(&late), synced_loads(&pair.routers[0]));
    }
}

/// Replicas of different ranks that see the same idle fleet at the same moment spread over the
/// near-best workers with `kv`'s spread tolerance; without it, the argmin is rank-blind.
#[test]
fn replica_ranks_spread_concurrent_decisions_over_the_near_best() {
    let pick = |rank: u32, spread: f64| {
        let mut policy = PolicyConfig::from_name("kv").expect("kv");
        if let PolicyConfig::Kv(c) = &mut policy {
            c.spread_tolerance = spread;
        }
        let mut router = Router::new(RouterConfig {
            block_size: BLOCK,
            policy,
            replica_rank: rank,
            ..RouterConfig::default()
        })
        .expect("a valid config");
        for id in 1..=4 {
            let spec = WorkerSpec::new(
                WorkerKey::new(WorkerId(id), DpRank(0)),
                WorkerRole::Aggregated,
                40,
            );
            router
                .handle_worker_added(Timestamp::ZERO, spec)
                .expect("a new worker");
        }
        // A cached prefix a little cheaper on worker 4: still within 5 % of the others.
        let t = tokens((0, 1, 1, 20));
        let (mut locals, mut chain) = (Vec::new(), Vec::new());
        BlockHasher::new(BLOCK as usize, &HashSalt::NONE).hash_prompt(&t, &mut locals, &mut chain);
        let blocks = stored_blocks(&locals[..1], &chain[..1]);
        let event = IndexEvent::Stored {
            parent: None,
            blocks: &blocks,
        };
        router
            .handle_kv_event(Timestamp::ZERO, WorkerKey::new(WorkerId(4), DpRank(0)), event)
            .expect("a store");
        match router
            .handle_request(
                Timestamp::ZERO,
                &RouteRequest::new(RequestId(1), Prompt::Tokens(&t)),
            )
            .expect("routed")
        {
            kvroute_core::router::RouteOutcome::Routed(d) => d.worker.worker.0,
            other => panic!("{other:?}"),
        }
    };
    // Ranked by cost then worker order: 4 (one block cached), then 1, 2, 3.
    assert_eq!((1..=4).map(|r| pick(r, 0.05)).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert!((0..4).all(|r| pick(r, 0.0) == 4), "the argmin, whatever the rank");
    assert_eq!(pick(0, 0.05), 4, "rank 0 is one router");
    // Out of tolerance, the cheaper worker is the only near-best one.
    assert_eq!(pick(2, 0.001), 4);
}
