//! Property tests of the router's load bookkeeping: random interleavings of request lifecycles
//! (routes, first tokens, output blocks, completions, cancellations, expiries, replica events, KV
//! events, draining and removed workers) under random configurations.
//!
//! * After every input, [`Router::check_invariants`] holds: every worker's running totals equal a
//!   recomputation from the active requests (debug builds also check inside every mutation, and
//!   a negative total would overflow and panic).
//! * After every input, each worker's booked prefill tokens and decode blocks integrated over time
//!   ([`Router::prefill_token_ns`], [`Router::decode_block_ns`]) equal sums recomputed from the
//!   loads between inputs.
//! * After every request is finished, every worker's load is exactly zero: no phantom load.
//! * A replica that applies every event another router exports ends with the same per-worker
//!   load as that router (output blocks aside: they are not synced).
//! * A request naming a LoRA adapter is only ever routed (at once or out of the queue) to
//!   workers serving it at that moment, by a reference record of each worker's adapters.

#[path = "support/fleet.rs"]
mod fleet;

use std::collections::BTreeMap;

use fleet::{Drawn, exporting_config, synced_loads, workers};
use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::{RequestId, WorkerKey};
use kvroute_core::router::{
    Booking, BusyThresholds, CacheMode, Decider, IndexEvent, LoadChange, Output, PolicyConfig,
    PrefillLoadHint, Prompt, RecentConfig, RouteOutcome, RouteRequest, Router, RouterConfig, RouterId,
    SyncConfig, SyncEvent, TenantId, WhenEmpty, WorkerSpec, stored_blocks,
};
use kvroute_core::time::Timestamp;
use proptest::prelude::*;
use proptest::test_runner::Config;

const BLOCK: u32 = 4;

/// A prompt built from a shared prefix family and a private tail, so that prompts share
/// prefixes of many lengths.
#[derive(Clone, Debug)]
struct PromptSpec {
    prefix: u32,
    prefix_blocks: u32,
    tail: u32,
    tail_blocks: u32,
    partial: u32,
}

impl PromptSpec {
    fn tokens(&self) -> Vec<u32> {
        let block = |family: u32, k: u32| (0..BLOCK).map(move |j| family * 10_000 + k * BLOCK + j);
        let mut tokens: Vec<u32> = (0..self.prefix_blocks)
            .flat_map(|k| block(self.prefix + 1, k))
            .collect();
        tokens.extend((0..self.tail_blocks).flat_map(|k| block(100 + self.tail, k)));
        tokens.extend((0..self.partial).map(|j| 9_999_000 + j));
        tokens
    }
}

fn prompt() -> impl Strategy<Value = PromptSpec> {
    (0..3u32, 0..6u32, 0..50u32, 0..4u32, 0..3u32).prop_map(
        |(prefix, prefix_blocks, tail, tail_blocks, partial)| PromptSpec {
            prefix,
            prefix_blocks,
            tail,
            tail_blocks,
            partial,
        },
    )
}

#[derive(Clone, Debug)]
enum Op {
    /// A request, naming adapter `ADAPTERS[a]` if any.
    Route(PromptSpec, i32, Option<usize>),
    /// A worker now serves the adapters of this bit mask.
    Adapters(usize, u8),
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
    Replica(usize, PromptSpec, u32),
    ReplicaFirst(usize),
    ReplicaFree(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prompt(), -1..2i32, prop::option::weighted(0.3, 0..ADAPTERS.len()))
            .prop_map(|(p, prio, a)| Op::Route(p, prio, a)),
        1 => (any::<usize>(), 0..4u8).prop_map(|(w, mask)| Op::Adapters(w, mask)),
        4 => any::<usize>().prop_map(Op::FirstToken),
        2 => any::<usize>().prop_map(Op::OutputBlock),
        4 => any::<usize>().prop_map(Op::Finish),
        1 => any::<usize>().prop_map(Op::Cancel),
        2 => (0..4_000u64).prop_map(Op::Advance),
        1 => Just(Op::Tick),
        2 => (any::<usize>(), prompt()).prop_map(|(w, p)| Op::Stored(w, p)),
        1 => any::<usize>().prop_map(Op::Cleared),
        1 => any::<usize>().prop_map(Op::Drain),
        1 => any::<usize>().prop_map(Op::Remove),
        2 => (any::<usize>(), prompt(), 0..4u32).prop_map(|(w, p, c)| Op::Replica(w, p, c)),
        1 => any::<usize>().prop_map(Op::ReplicaFirst),
        1 => any::<usize>().prop_map(Op::ReplicaFree),
    ]
}

fn config() -> impl Strategy<Value = (RouterConfig, bool)> {
    let policy = prop::sample::select(PolicyConfig::NAMES.to_vec());
    let cache = prop_oneof![
        Just(CacheMode::Events),
        Just(CacheMode::EventsWithPrediction(RecentConfig {
            ttl: Some(std::time::Duration::from_secs(2)),
            max_blocks: 16,
            prune_ratio: 0.5
        })),
        Just(CacheMode::Approximate(RecentConfig {
            ttl: Some(std::time::Duration::from_secs(5)),
            max_blocks: 64,
            prune_ratio: 0.8
        })),
    ];
    let busy = prop_oneof![
        Just(BusyThresholds::default()),
        Just(BusyThresholds {
            prefill_tokens: Some(24),
            ..BusyThresholds::default()
        }),
        Just(BusyThresholds {
            decode_blocks_fraction: Some(0.5),
            ..BusyThresholds::default()
        }),
    ];
    let decider = prop_oneof![
        Just(Decider::Always),
        Just(Decider::Never),
        (0..20u64).prop_map(|t| Decider::PrefixThreshold { uncached_tokens: t }),
    ];
    (
        policy,
        cache,
        busy,
        decider,
        0..4usize,
        any::<u64>(),
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(WhenEmpty::ALL.to_vec()),
    )
        .prop_map(
            |(policy, cache, busy, decider, queue, seed, track_output, pd, when_empty)| {
                let drawn = Drawn {
                    policy,
                    cache,
                    decider,
                    seed,
                    track_output_blocks: track_output,
                };
                let config = RouterConfig {
                    busy,
                    queue: kvroute_core::router::QueueConfig {
                        capacity: queue,
                        when_empty,
                        ..Default::default()
                    },
                    ..exporting_config(BLOCK, std::time::Duration::from_secs(20), drawn)
                };
                (config, pd)
            },
        )
}

/// The LoRA adapters requests may name.
const ADAPTERS: [&str; 2] = ["a", "b"];

/// Drives a router (and a replica that applies its exported events) through `ops`.
struct Run {
    /// The reference: the adapter each request names, the adapters each worker serves.
    adapter_of: BTreeMap<RequestId, &'static str>,
    serving: BTreeMap<WorkerKey, Vec<&'static str>>,
    /// Decisions that sent a request to a worker not serving its adapter.
    wrong: Vec<String>,
    router: Router,
    replica: Router,
    specs: Vec<WorkerSpec>,
    now: Timestamp,
    issued: u64,
    replica_issued: u64,
}

impl Run {
    fn new(config: RouterConfig, pd: bool) -> Self {
        let replica_config = RouterConfig {
            router_id: RouterId(2),
            sync: SyncConfig::default(),
            ..config.clone()
        };
        let mut run = Self {
            adapter_of: BTreeMap::new(),
            serving: BTreeMap::new(),
            wrong: Vec::new(),
            router: Router::new(config).expect("a valid config"),
            replica: Router::new(replica_config).expect("a valid config"),
            specs: workers(pd),
            now: Timestamp::ZERO,
            issued: 0,
            replica_issued: 0,
        };
        for spec in run.specs.clone() {
            run.router
                .handle_worker_added(run.now, spec)
                .expect("a new worker");
            run.replica
                .handle_worker_added(run.now, spec)
                .expect("a new worker");
        }
        run
    }

    /// Notes every decision among `outputs` that sent a request to a worker (decode or
    /// prefill) not serving the adapter it names.
    fn check(&mut self, outputs: &[Output]) {
        for out in outputs {
            let Output::Routed(d) = out else { continue };
            let Some(&adapter) = self.adapter_of.get(&d.request) else {
                continue;
            };
            for worker in std::iter::once(d.worker).chain(d.prefill.map(|p| p.worker)) {
                if !self.serving.get(&worker).is_some_and(|s| s.contains(&adapter)) {
                    self.wrong
                        .push(format!("{:?} (adapter {adapter}) on {worker}", d.request));
                }
            }
        }
    }

    fn apply(&mut self, op: &Op) {
        let out = self.step(op);
        self.check(&out);
    }

    /// Applies `op`; the outputs it caused (decisions among them).
    fn step(&mut self, op: &Op) -> Vec<Output> {
        let mut out = Vec::new();
        let now = self.now;
        let (issued, replica_issued) = (self.issued, self.replica_issued);
        let keys: Vec<WorkerKey> = self.specs.iter().map(|s| s.key).collect();
        let id = |pick: usize| RequestId(pick as u64 % issued.max(1));
        let worker = |pick: usize| keys[pick % keys.len()];
        let r = &mut self.router;
        match op {
            Op::Route(p, prio, adapter) => {
                let tokens = p.tokens();
                let mut request = RouteRequest::new(RequestId(self.issued), Prompt::Tokens(&tokens));
                request.priority = *prio;
                let name: Option<&'static str> = adapter.map(|a| ADAPTERS[a]);
                request.lora_name = name;
                if let Some(name) = name {
                    self.adapter_of.insert(request.id, name);
                }
                self.issued += 1;
                if let RouteOutcome::Routed(d) = r.handle_request(now, &request).expect("a fresh id") {
                    out.push(Output::Routed(d));
                }
            }
            Op::Adapters(w, mask) => {
                let names: Vec<&'static str> = (0..ADAPTERS.len())
                    .filter(|i| mask & (1 << i) != 0)
                    .map(|i| ADAPTERS[i])
                    .collect();
                let key = worker(*w);
                // The reference first: the decisions this causes go to the worker now serving.
                self.serving.insert(key, names.clone());
                out = self.router.handle_adapters(now, key, &names);
            }
            Op::FirstToken(i) => out = r.handle_first_token(now, id(*i)).unwrap_or_default(),
            Op::OutputBlock(i) => drop(r.handle_output_block(now, id(*i))),
            Op::Finish(i) => out = r.handle_finished(now, id(*i)).unwrap_or_default(),
            Op::Cancel(i) => out = r.handle_cancelled(now, id(*i)).unwrap_or_default(),
            Op::Advance(ms) => self.now = Timestamp(now.0 + ms * 1_000_000),
            Op::Tick => out = r.handle_tick(now),
            Op::Stored(w, p) => {
                let (mut locals, mut chain) = (Vec::new(), Vec::new());
                let hasher = BlockHasher::new(BLOCK as usize, &HashSalt::NONE);
                hasher.hash_prompt(&p.tokens(), &mut locals, &mut chain);
                let blocks = stored_blocks(&locals, &chain);
                let worker = worker(*w);
                drop(r.handle_kv_event(
                    now,
                    worker,
                    IndexEvent::Stored {
                        parent: None,
                        blocks: &blocks,
                    },
                ));
            }
            Op::Cleared(w) => drop(r.handle_kv_event(now, worker(*w), IndexEvent::Cleared)),
            Op::Drain(w) => drop(r.handle_worker_draining(now, worker(*w))),
            Op::Remove(w) => {
                out = r.handle_worker_removed(now, worker(*w)).unwrap_or_default();
                // A removed worker serves nothing.
                self.serving.remove(&worker(*w));
            }
            Op::Replica(w, p, cached) => {
                let tokens = p.tokens();
                let (mut locals, mut chain) = (Vec::new(), Vec::new());
                BlockHasher::new(BLOCK as usize, &HashSalt::NONE).hash_prompt(
                    &tokens,
                    &mut locals,
                    &mut chain,
                );
                let cached = (*cached).min(chain.len() as u32);
                let booking = Booking {
                    worker: worker(*w),
                    overlap_blocks: cached,
                    prefill_worker: None,
                    prompt_tokens: tokens.len() as u64,
                    chain: chain.into(),
                    hint: PrefillLoadHint::new(tokens.len() as u64, cached, BLOCK, None),
                    expected_output_tokens: None,
                    session: None,
                    tenant: TenantId::OTHER,
                };
                let request = RequestId(self.replica_issued);
                self.replica_issued += 1;
                let event = SyncEvent {
                    router: RouterId(7),
                    request,
                    change: LoadChange::Added(booking),
                };
                out = r.handle_sync_event(now, &event).unwrap_or_default();
            }
            Op::ReplicaFirst(i) | Op::ReplicaFree(i) => {
                let change = if matches!(op, Op::ReplicaFirst(_)) {
                    LoadChange::PrefillDone
                } else {
                    LoadChange::Freed
                };
                let request = RequestId(*i as u64 % replica_issued.max(1));
                out = r
                    .handle_sync_event(
                        now,
                        &SyncEvent {
                            router: RouterId(7),
                            request,
                            change,
                        },
                    )
                    .unwrap_or_default();
            }
        }
        self.forward();
        // Fleet changes reach every replica (after the events they caused).
        match op {
            Op::Drain(w) => drop(self.replica.handle_worker_draining(now, worker(*w))),
            Op::Remove(w) => drop(self.replica.handle_worker_removed(now, worker(*w))),
            _ => {}
        }
        out
    }

    /// Applies the router's exported events to the replica.
    fn forward(&mut self) {
        while let Some(event) = self.router.poll_sync_event() {
            // The replica may have removed no worker the router still books on, so this applies.
            self.replica
                .handle_sync_event(self.now, &event)
                .expect("the replica applies every exported event");
        }
    }

    /// Finishes everything, releasing queued requests until none is left.
    fn finish_all(&mut self) {
        for _ in 0..self.issued + 2 {
            for id in 0..self.issued {
                let out = self.router.handle_cancelled(self.now, RequestId(id));
                self.check(&out.unwrap_or_default());
            }
            for id in 0..self.replica_issued {
                let event = SyncEvent {
                    router: RouterId(7),
                    request: RequestId(id),
                    change: LoadChange::Freed,
                };
                let _ = self.router.handle_sync_event(self.now, &event);
            }
            self.forward();
            let m = self.router.metrics();
            if m.active_now == 0 && m.queued_now == 0 {
                return;
            }
        }
    }
}

/// Every worker's booked prefill tokens and decode blocks.
fn loads(router: &Router) -> Vec<(WorkerKey, [u64; 2])> {
    router
        .metrics()
        .workers
        .iter()
        .map(|w| (w.spec.key, [w.load.prefill_tokens, w.load.decode_blocks]))
        .collect()
}

/// Adds `before`, loads held for `span` nanoseconds, to `areas`, for the workers `router` still
/// has (forgetting the others).
fn accrue(
    areas: &mut BTreeMap<WorkerKey, [u128; 2]>,
    router: &Router,
    before: Vec<(WorkerKey, [u64; 2])>,
    span: u128,
) {
    areas.retain(|key, _| router.worker_load(*key).is_some());
    for (key, load) in before {
        if router.worker_load(key).is_some() {
            let area = areas.entry(key).or_default();
            for (a, l) in area.iter_mut().zip(load) {
                *a += u128::from(l) * span;
            }
        }
    }
}

proptest! {
    #![proptest_config(Config { cases: 256, ..Config::default() })]

    #[test]
    fn random_lifecycles_keep_totals_exact_and_drain_to_zero(
        (config, pd) in config(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut run = Run::new(config, pd);
        // The booked prefill tokens and decode blocks integrated over time, recomputed from
        // snapshots: loads change only at inputs, so between two inputs each worker's are constant.
        let mut areas: BTreeMap<WorkerKey, [u128; 2]> = BTreeMap::new();
        for op in &ops {
            let (before, then) = (loads(&run.router), run.now);
            run.apply(op);
            if let Err(e) = run.router.check_invariants() {
                return Err(TestCaseError::fail(format!("after {op:?}: {e}")));
            }
            prop_assert!(run.replica.check_invariants().is_ok());
            accrue(&mut areas, &run.router, before, u128::from(run.now.0 - then.0));
            for (key, [prefill, decode]) in &areas {
                prop_assert_eq!(run.router.prefill_token_ns(*key, run.now), Some(*prefill), "worker {} after {:?}", key, op);
                prop_assert_eq!(run.router.decode_block_ns(*key, run.now), Some(*decode), "worker {} after {:?}", key, op);
            }
        }
        // The replica holds exactly the router's own requests: its loads are the router's minus
        // the requests the router got from replica 7. Compare once those are gone.
        for id in 0..run.replica_issued {
            let event = SyncEvent { router: RouterId(7), request: RequestId(id), change: LoadChange::Freed };
            let _ = run.router.handle_sync_event(run.now, &event);
        }
        run.forward();
        prop_assert_eq!(synced_loads(&run.replica), synced_loads(&run.router));
        run.finish_all();
        let m = run.router.metrics();
        prop_assert_eq!((m.active_now, m.queued_now), (0, 0));
        for w in &m.workers {
            prop_assert!(w.load.is_idle(), "worker {} kept load {:?}", w.spec.key, w.load);
        }
        prop_assert!(synced_loads(&run.replica).iter().all(|(_, l)| l.is_idle()));
        prop_assert!(run.wrong.is_empty(), "requests on workers not serving their adapter: {:?}", run.wrong);
    }
}
