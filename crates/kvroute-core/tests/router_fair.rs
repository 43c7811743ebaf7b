//! The queue's order under tenants and priorities, against a small reference model: a list of
//! the waiting requests and each tenant's virtual token counter, kept in exact integers (weights
//! are powers of two, so the router's fixed point is exact too and ties agree).
//!
//! One worker that is busy while it holds any request, so each finish releases exactly one
//! waiting request; peers' bookings (a peer's Added, then its Freed) charge their tenants as
//! this router's own do.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::{DpRank, RequestId, WorkerId, WorkerKey};
use kvroute_core::router::{
    Booking, BusyThresholds, FairConfig, LoadChange, Output, PrefillLoadHint, Prompt, RouteOutcome,
    RouteRequest, Router, RouterConfig, RouterId, SyncEvent, TenantId, WorkerRole, WorkerSpec, served_tokens,
};
use kvroute_core::time::Timestamp;
use proptest::prelude::*;

const BLOCK: u32 = 4;
/// Counter units per token of a weight-1 tenant in the model: the largest weight.
const SCALE: u128 = 8;

fn worker() -> WorkerKey {
    WorkerKey::new(WorkerId(1), DpRank(0))
}

#[derive(Clone, Debug)]
enum Op {
    /// A request of tenant, priority, prompt blocks, output hint.
    Arrive(u32, i32, u32, Option<u32>),
    /// The request on the worker finishes.
    Finish,
    /// A peer books (and frees) a request of tenant, prompt tokens.
    Peer(u32, u64),
    /// The waiting request at this index (modulo) is cancelled.
    Cancel(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..4, 0i32..3, 1u32..5, prop::option::of(0u32..40))
            .prop_map(|(t, p, b, o)| Op::Arrive(t, p, b, o)),
        3 => Just(Op::Finish),
        1 => (0u32..4, 1u64..100).prop_map(|(t, n)| Op::Peer(t, n)),
        1 => any::<usize>().prop_map(Op::Cancel),
    ]
}

struct Waiting {
    id: u64,
    tenant: u32,
    priority: i32,
    tokens: u64,
    seq: u64,
}

/// The reference: VTC written plainly.
struct Model {
    /// Counter units per token, per tenant (`SCALE / weight`).
    per_token: Vec<u128>,
    counters: BTreeMap<u32, u128>,
    waiting: Vec<Waiting>,
    active: Option<u64>,
    seq: u64,
}

impl Model {
    fn counter(&self, t: u32) -> u128 {
        self.counters.get(&t).copied().unwrap_or(0)
    }

    fn charge(&mut self, t: u32, tokens: u64) {
        *self.counters.entry(t).or_insert(0) += u128::from(tokens) * self.per_token[t as usize];
    }

    fn wait(&mut self, id: u64, tenant: u32, priority: i32, tokens: u64) {
        if !self.waiting.iter().any(|w| w.tenant == tenant) {
            let floor = if self.waiting.is_empty() {
                self.counters.values().copied().max().unwrap_or(0)
            } else {
                self.waiting
                    .iter()
                    .map(|w| self.counter(w.tenant))
                    .min()
                    .unwrap_or(0)
            };
            let c = self.counters.entry(tenant).or_insert(0);
            *c = (*c).max(floor);
        }
        self.waiting.push(Waiting {
            id,
            tenant,
            priority,
            tokens,
            seq: self.seq,
        });
        self.seq += 1;
    }

    /// The request served next: the highest priority, then the smallest counter, then the
    /// earliest arrival.
    fn serve(&mut self) -> Option<u64> {
        let top = self.waiting.iter().map(|w| w.priority).max()?;
        let (i, _) = self
            .waiting
            .iter()
            .enumerate()
            .filter(|(_, w)| w.priority == top)
            .min_by_key(|(_, w)| (self.counter(w.tenant), w.seq))?;
        let w = self.waiting.remove(i);
        self.charge(w.tenant, w.tokens);
        self.active = Some(w.id);
        Some(w.id)
    }
}

fn routed(out: &[Output]) -> Vec<u64> {
    out.iter()
        .filter_map(|o| match o {
            Output::Routed(d) => Some(d.request.0),
            _ => None,
        })
        .collect()
}

fn peer_booking(tenant: u32, tokens: u64) -> Booking {
    let prompt: Vec<u32> = (0..tokens as u32).collect();
    let (mut locals, mut chain) = (Vec::new(), Vec::new());
    BlockHasher::new(BLOCK as usize, &HashSalt::NONE).hash_prompt(&prompt, &mut locals, &mut chain);
    Booking {
        worker: worker(),
        overlap_blocks: 0,
        prefill_worker: None,
        prompt_tokens: tokens,
        chain: Arc::from(chain),
        hint: PrefillLoadHint::new(tokens, 0, BLOCK, None),
        expected_output_tokens: None,
        tenant: TenantId(tenant),
        session: None,
    }
}

proptest! {
    #[test]
    fn the_queue_serves_priority_then_the_tenant_furthest_behind_its_share(
        weight_logs in prop::collection::vec(0u32..4, 4),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let weights: Vec<NonZeroU32> = weight_logs
            .iter()
            .map(|&l| NonZeroU32::new(1 << l).expect("a power of two"))
            .collect();
        let mut r = Router::new(RouterConfig {
            block_size: BLOCK,
            busy: BusyThresholds { requests_fraction: Some(0.0), ..BusyThresholds::default() },
            fair: FairConfig { weights: weights.clone() },
            ..RouterConfig::default()
        })
        .unwrap();
        r.handle_worker_added(Timestamp::ZERO, WorkerSpec::new(worker(), WorkerRole::Aggregated, 1 << 20))
            .unwrap();
        let mut model = Model {
            per_token: weights.iter().map(|w| SCALE / u128::from(w.get())).collect(),
            counters: BTreeMap::new(),
            waiting: Vec::new(),
            active: None,
            seq: 0,
        };
        let mut now = Timestamp::ZERO;
        let mut next_id = 0u64;
        let mut peer_id = 0u64;
        for op in ops {
            now = now + Duration::from_millis(1);
            match op {
                Op::Arrive(tenant, priority, blocks, hint) => {
                    let id = next_id;
                    next_id += 1;
                    let prompt: Vec<u32> = (0..blocks * BLOCK).map(|j| id as u32 * 1000 + j).collect();
                    let request = RouteRequest {
                        priority,
                        tenant: TenantId(tenant),
                        expected_output_tokens: hint,
                        ..RouteRequest::new(RequestId(id), Prompt::Tokens(&prompt))
                    };
                    let outcome = r.handle_request(now, &request).unwrap();
                    let tokens = served_tokens(prompt.len() as u64, hint);
                    if model.active.is_none() {
                        prop_assert!(matches!(outcome, RouteOutcome::Routed(_)), "{:?}", outcome);
                        model.charge(tenant, tokens);
                        model.active = Some(id);
                    } else {
                        prop_assert_eq!(outcome, RouteOutcome::Queued);
                        model.wait(id, tenant, priority, tokens);
                    }
                }
                Op::Finish => {
                    let Some(id) = model.active.take() else { continue };
                    let out = r.handle_finished(now, RequestId(id)).unwrap();
                    let expected: Vec<u64> = model.serve().into_iter().collect();
                    prop_assert_eq!(routed(&out), expected);
                }
                Op::Peer(tenant, tokens) => {
                    peer_id += 1;
                    let event = |change| SyncEvent { router: RouterId(9), request: RequestId(peer_id), change };
                    let added = r.handle_sync_event(now, &event(LoadChange::Added(peer_booking(tenant, tokens)))).unwrap();
                    prop_assert!(added.is_empty());
                    let freed = r.handle_sync_event(now, &event(LoadChange::Freed)).unwrap();
                    // The worker is free again only if no request of ours holds it, and then
                    // nothing waits.
                    prop_assert!(freed.is_empty());
                    model.charge(tenant, tokens);
                }
                Op::Cancel(i) => {
                    if model.waiting.is_empty() {
                        continue;
                    }
                    let w = model.waiting.remove(i % model.waiting.len());
                    prop_assert_eq!(r.handle_cancelled(now, RequestId(w.id)).unwrap(), Vec::new());
                }
            }
            let mut per_tenant: BTreeMap<u32, usize> = BTreeMap::new();
            for w in &model.waiting {
                *per_tenant.entry(w.tenant).or_insert(0) += 1;
            }
            let got: BTreeMap<u32, usize> = r.queued_per_tenant().into_iter().map(|(t, n)| (t.0, n)).collect();
            prop_assert_eq!(got, per_tenant);
            let counters: BTreeMap<u32, f64> = r
                .fair_counters()
                .into_iter()
                .filter(|&(_, c)| c > 0.0)
                .map(|(t, c)| (t.0, c))
                .collect();
            let expected: BTreeMap<u32, f64> = model
                .counters
                .iter()
                .filter(|&(_, &c)| c > 0)
                .map(|(&t, &c)| (t, c as f64 / SCALE as f64))
                .collect();
            prop_assert_eq!(counters, expected);
            prop_assert!(r.check_invariants().is_ok());
        }
    }
}

/// A tenant bursting ten times as many requests as another, of equal weight, while the worker
/// serves one at a time: the other tenant's requests are never more than one place behind their
/// turn (its share of the served tokens is at least half, less one request's worth).
#[test]
fn a_burst_does_not_starve_a_steady_tenant() {
    let mut r = Router::new(RouterConfig {
        block_size: BLOCK,
        busy: BusyThresholds {
            requests_fraction: Some(0.0),
            ..BusyThresholds::default()
        },
        ..RouterConfig::default()
    })
    .unwrap();
    r.handle_worker_added(
        Timestamp::ZERO,
        WorkerSpec::new(worker(), WorkerRole::Aggregated, 1 << 20),
    )
    .unwrap();
    let mut now = Timestamp::ZERO;
    let mut id = 0u64;
    let mut arrive = |r: &mut Router, now: Timestamp, tenant: u32| {
        let prompt: Vec<u32> = (0..4 * BLOCK).map(|j| id as u32 * 1000 + j).collect();
        let request = RouteRequest {
            tenant: TenantId(tenant),
            ..RouteRequest::new(RequestId(id), Prompt::Tokens(&prompt))
        };
        let outcome = r.handle_request(now, &request).unwrap();
        id += 1;
        outcome
    };
    // Tenant 1 bursts 100 requests at once; tenant 2 sends one per service slot.
    let mut active = match arrive(&mut r, now, 1) {
        RouteOutcome::Routed(d) => d.request,
        other => panic!("{other:?}"),
    };
    for _ in 0..99 {
        assert_eq!(arrive(&mut r, now, 1), RouteOutcome::Queued);
    }
    let mut served = Vec::new();
    for _ in 0..40 {
        now = now + Duration::from_millis(10);
        arrive(&mut r, now, 2);
        let out = r.handle_finished(now, active).unwrap();
        let next = routed(&out);
        assert_eq!(next.len(), 1);
        active = RequestId(next[0]);
        // The burst took ids 0 to 99.
        served.push(if next[0] < 100 { 1 } else { 2 });
    }
    let steady = served.iter().filter(|&&t| t == 2).count();
    assert!(
        steady >= served.len() / 2 - 1,
        "tenant 2 got {steady} of {} slots: {served:?}",
        served.len()
    );
}
