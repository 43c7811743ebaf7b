//! Session affinity against a small reference model: random interleavings of session requests,
//! completions, fleet changes (added, drained, suspended, resumed, removed workers), ticks and
//! time, under random table sizes, idle times and overload thresholds.
//!
//! The model is a list of (session, worker, last use), kept by the rule in the `session`
//! module's docs, written out plainly: a request of a session bound to a worker in routing that
//! is not overloaded goes there; any other goes where the policy sends it, and the session is
//! bound there. After every input the router's bindings equal the model's, and its invariants
//! hold. A second property: two routers exchanging their bookings send a session's requests,
//! handed to either alternately, to one worker while it is not overloaded.

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_core::ids::{DpRank, RequestId, WorkerId, WorkerKey};
use kvroute_core::router::{
    BusyThresholds, Output, Prompt, RouteOutcome, RouteRequest, Router, RouterConfig, RouterId,
    SessionConfig, SessionId, SyncMode, WorkerRole, WorkerSpec,
};
use kvroute_core::time::Timestamp;
use proptest::prelude::*;

const BLOCK: u32 = 4;
const WORKERS: u32 = 4;
const MAX_REQUESTS: u64 = 4;

#[derive(Clone, Debug)]
enum Op {
    /// Route a request of session `s` (or none) with prompt family `p`.
    Route(Option<u8>, u8),
    /// Finish the `i`-th active request (modulo).
    Finish(usize),
    Add(u32),
    Drain(u32),
    Suspend(u32),
    Remove(u32),
    /// Move time on by this many milliseconds and tick.
    Tick(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (proptest::option::weighted(0.9, 0..6u8), 0..5u8).prop_map(|(s, p)| Op::Route(s, p)),
        4 => any::<usize>().prop_map(Op::Finish),
        1 => (0..WORKERS).prop_map(Op::Add),
        1 => (0..WORKERS).prop_map(Op::Drain),
        1 => (0..WORKERS).prop_map(Op::Suspend),
        1 => (0..WORKERS).prop_map(Op::Remove),
        2 => (0..400u32).prop_map(Op::Tick),
    ]
}

fn key(n: u32) -> WorkerKey {
    WorkerKey::new(WorkerId(u64::from(n)), DpRank(0))
}

fn spec(n: u32) -> WorkerSpec {
    let mut spec = WorkerSpec::new(key(n), WorkerRole::Aggregated, 1000);
    spec.max_requests = MAX_REQUESTS;
    spec
}

fn tokens(family: u8, n: u64) -> Vec<u32> {
    // A shared family prefix, then a tail of the request's own.
    let mut t: Vec<u32> = (0..3 * BLOCK).map(|j| u32::from(family) * 1000 + j).collect();
    t.extend((0..BLOCK).map(|j| 1_000_000 + (n as u32) * BLOCK + j));
    t
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Routing,
    Draining,
    Suspended,
}

/// The reference model.
#[derive(Default)]
struct Model {
    workers: BTreeMap<u32, State>,
    /// Active requests: id → worker.
    active: BTreeMap<u64, u32>,
    /// (session, worker, last use), least recently used first.
    sessions: Vec<(SessionId, u32, Timestamp)>,
}

impl Model {
    fn bound(&self, s: SessionId) -> Option<u32> {
        self.sessions.iter().find(|e| e.0 == s).map(|e| e.1)
    }

    fn overloaded(&self, w: u32, fraction: f64) -> bool {
        let n = self.active.values().filter(|&&x| x == w).count();
        n as f64 > fraction * MAX_REQUESTS as f64
    }

    fn bind(&mut self, s: SessionId, w: u32, now: Timestamp, max: usize) {
        self.sessions.retain(|e| e.0 != s);
        self.sessions.push((s, w, now));
        while self.sessions.len() > max {
            self.sessions.remove(0);
        }
    }

    fn release(&mut self, w: u32) {
        self.sessions.retain(|e| e.1 != w);
    }
}

fn session(s: u8) -> SessionId {
    SessionId::from_header(format!("conversation-{s}"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn sessions_follow_the_reference_model(
        ops in proptest::collection::vec(op(), 1..120),
        max_sessions in 1..8usize,
        ttl_ms in 100..1000u64,
        fraction in prop_oneof![Just(0.25), Just(0.5), Just(1.0)],
        seed in any::<u64>(),
    ) {
        let config = RouterConfig {
            seed,
            block_size: BLOCK,
            sessions: SessionConfig {
                max_sessions,
                idle_ttl: Duration::from_millis(ttl_ms),
                overloaded: BusyThresholds {
                    requests_fraction: Some(fraction),
                    ..BusyThresholds::default()
                },
            },
            ..RouterConfig::default()
        };
        let mut router = Router::new(config).unwrap();
        let mut model = Model::default();
        let mut now = Timestamp::ZERO;
        let mut next = 0u64;
        for w in 0..2 {
            router.handle_worker_added(now, spec(w)).unwrap();
            model.workers.insert(w, State::Routing);
        }
        for op in &ops {
            match *op {
                Op::Route(s, family) => {
                    next += 1;
                    let tokens = tokens(family, next);
                    let mut request = RouteRequest::new(RequestId(next), Prompt::Tokens(&tokens));
                    request.session = s.map(session);
                    let outcome = router.handle_request(now, &request).unwrap();
                    let RouteOutcome::Routed(d) = outcome else {
                        // Rejected: no worker in routing at all.
                        prop_assert!(!model.workers.values().any(|&s| s == State::Routing));
                        continue;
                    };
                    let worker = d.worker.worker.0 as u32;
                    prop_assert_eq!(model.workers.get(&worker), Some(&State::Routing));
                    if let Some(s) = request.session {
                        let stays = model.bound(s).filter(|w| {
                            model.workers.get(w) == Some(&State::Routing)
                                && !model.overloaded(*w, fraction)
                        });
                        if let Some(w) = stays {
                            prop_assert_eq!(worker, w, "a session left a worker that was not overloaded");
                        }
                        model.bind(s, worker, now, max_sessions);
                    }
                    model.active.insert(next, worker);
                }
                Op::Finish(i) => {
                    if model.active.is_empty() {
                        continue;
                    }
                    let id = *model.active.keys().nth(i % model.active.len()).unwrap();
                    model.active.remove(&id);
                    router.handle_finished(now, RequestId(id)).unwrap();
                }
                Op::Add(w) => {
                    let resumable = model.workers.get(&w) == Some(&State::Suspended);
                    if model.workers.contains_key(&w) && !resumable {
                        continue;
                    }
                    router.handle_worker_added(now, spec(w)).unwrap();
                    model.workers.insert(w, State::Routing);
                }
                Op::Drain(w) => {
                    if let Some(state) = model.workers.get_mut(&w) {
                        router.handle_worker_draining(now, key(w)).unwrap();
                        *state = State::Draining;
                    }
                }
                Op::Suspend(w) => {
                    if let Some(state) = model.workers.get_mut(&w) {
                        router.handle_worker_suspended(now, key(w)).unwrap();
                        *state = State::Suspended;
                        model.release(w);
                    }
                }
                Op::Remove(w) => {
                    if model.workers.remove(&w).is_some() {
                        router.handle_worker_removed(now, key(w)).unwrap();
                        model.active.retain(|_, &mut x| x != w);
                        model.release(w);
                    }
                }
                Op::Tick(ms) => {
                    now = now + Duration::from_millis(u64::from(ms));
                    let outputs = router.handle_tick(now);
                    prop_assert!(outputs.iter().all(|o| !matches!(o, Output::Routed(_))));
                    let cutoff = now.as_nanos().saturating_sub(ttl_ms * 1_000_000);
                    if now.as_nanos() >= ttl_ms * 1_000_000 {
                        model.sessions.retain(|e| e.2.as_nanos() > cutoff);
                    }
                }
            }
            router.check_invariants().map_err(TestCaseError::fail)?;
            for s in (0..6).map(session) {
                let want = model.bound(s).map(key);
                prop_assert_eq!(router.session_worker(s), want, "session {:?} after {:?}", s, op);
            }
            prop_assert_eq!(router.metrics().sessions_now, model.sessions.len());
        }
    }

    #[test]
    fn a_session_sent_to_two_replicas_alternately_stays_on_one_worker(
        prompts in proptest::collection::vec(0..5u8, 2..30),
        seed in any::<u64>(),
    ) {
        let replica = |id: u64| {
            let mut config = RouterConfig {
                seed: seed ^ id,
                block_size: BLOCK,
                router_id: RouterId(id),
                ..RouterConfig::default()
            };
            config.sync.mode = SyncMode::Export;
            let mut r = Router::new(config).unwrap();
            for w in 0..WORKERS {
                r.handle_worker_added(Timestamp::ZERO, spec(w)).unwrap();
            }
            r
        };
        let mut routers = [replica(1), replica(2)];
        let s = session(0);
        let mut first = None;
        for (n, &family) in prompts.iter().enumerate() {
            let now = Timestamp::from_millis(n as u64);
            let (a, b) = (n % 2, 1 - n % 2);
            let tokens = tokens(family, n as u64);
            let mut request = RouteRequest::new(RequestId(n as u64), Prompt::Tokens(&tokens));
            request.session = Some(s);
            let RouteOutcome::Routed(d) = routers[a].handle_request(now, &request).unwrap() else {
                return Err(TestCaseError::fail("no worker"));
            };
            // Finished at once: no worker is ever overloaded, so the session never moves.
            routers[a].handle_finished(now, d.request).unwrap();
            prop_assert_eq!(*first.get_or_insert(d.worker), d.worker);
            while let Some(event) = routers[a].poll_sync_event() {
                routers[b].handle_sync_event(now, &event).unwrap();
            }
        }
        for r in &routers {
            prop_assert_eq!(r.session_worker(s), first);
        }
    }
}
