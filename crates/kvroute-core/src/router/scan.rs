//! Choosing a worker: the scan over the fleet that feeds the policy.
//!
//! Two scans, one decision:
//!
//! * **The full scan** ([`Router::fill_candidates`], then [`Policy::select`]): a [`Candidate`] per
//!   eligible worker (its load snapshot, the depth of the prompt in its active set, its
//!   projection), for any policy.
//! * **The argmin scan**, for policies whose pick is the argmin of the cost
//!   ([`Policy::argmin_cost`]: `kv` and `dynamo` at temperature 0 without replica spread). A
//!   worker with nothing booked has a candidate that depends only on its spec (its key aside) and
//!   its overlap with the prompt, and [`cost()`] reads nothing else, so such a worker is scored
//!   once per distinct (spec class, overlap) (a class: the specs equal but for the key) and every
//!   other idle worker with the same pair reuses that cost; loaded workers are scored as in the
//!   full scan. The costs then go, as they come, through the argmin of the full scan
//!   ([`argmin_keyed`], the same code as [`super::select::argmin`]) in the same worker order, so
//!   the pick and the generator's draws are those of the full scan; only the winner's candidate
//!   is built. In a large fleet most workers are idle, and the per-worker cost of a decision
//!   drops from a candidate (a load snapshot, a trie probe, a projection and a cost) to a few
//!   comparisons and, on a tie, the draw.
//!
//! Debug builds run the full scan after every argmin scan and compare the picks and the
//! generator's state.

use super::cost::{CostParams, cost};
use super::fleet::FleetWorker;
use super::load::project;
use super::policy::{Candidate, Policy};
use super::request::RequestView;
use super::select::argmin_keyed;
use super::worker::WorkerRole;
use super::{Blocked, Router, Scratch};
use crate::ids::SequenceHash;

/// Which pool a scan chooses from, with its policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Workers that decode (aggregated and decode workers), with the decode policy.
    Decode,
    /// Prefill workers, with the prefill policy.
    Prefill,
}

impl Stage {
    fn admits(self, role: WorkerRole) -> bool {
        match self {
            Stage::Decode => role.tracks_decode(),
            Stage::Prefill => role == WorkerRole::Prefill,
        }
    }
}

/// The most distinct (spec, overlap) pairs of idle workers remembered per decision; further
/// ones are scored one by one.
const IDLE_MEMO: usize = 16;

/// The cost shared by idle workers of this spec class (their specs equal but for the key) and
/// overlap; `None` if busy.
#[derive(Clone, Copy, Debug)]
pub(super) struct IdleCost {
    class: u32,
    overlap_blocks: u32,
    cost: Option<f64>,
}

/// `w`'s candidate for a prompt of `chain` of which it caches `overlap` leading blocks, or `None`
/// if it is busy. The one place a candidate is built.
fn candidate(
    w: &FleetWorker,
    overlap: u32,
    chain: &[SequenceHash],
    busy: &super::BusyThresholds,
) -> Option<Candidate> {
    let load = w.load();
    if busy.is_busy(&w.spec, &load) {
        return None;
    }
    let blocks = chain.len() as u32;
    let overlap_blocks = overlap.min(blocks);
    // Active requests tend to leave the prompt where its cached prefix ends (a shared system
    // prompt): a good first probe.
    let depth = if w.spec.role.tracks_decode() {
        w.depth(chain, overlap_blocks)
    } else {
        Default::default()
    };
    Some(Candidate {
        spec: w.spec,
        overlap_blocks,
        load,
        projection: project(w.spec.role, &load, blocks, overlap_blocks, depth),
    })
}

impl Router {
    fn policy_of(&self, stage: Stage) -> &dyn Policy {
        match stage {
            Stage::Decode => self.policy.as_ref(),
            Stage::Prefill => self.prefill_policy.as_ref(),
        }
    }

    /// Chooses a worker of `stage`'s pool for `view` with `stage`'s policy, the overlaps being
    /// in `scratch.overlaps`. Errs if no worker is eligible, or if every eligible one is busy.
    pub(super) fn choose(&mut self, stage: Stage, view: &RequestView<'_>) -> Result<Candidate, Blocked> {
        let Some(params) = self.policy_of(stage).argmin_cost().copied() else {
            return self.full_scan(stage, view);
        };
        #[cfg(debug_assertions)]
        let rng_before = self.rng.clone();
        let pick = self.argmin_scan(stage, &params, view);
        #[cfg(debug_assertions)]
        {
            let rng_after = std::mem::replace(&mut self.rng, rng_before);
            let full = self.full_scan(stage, view);
            assert_eq!(pick, full, "the argmin scan and the full scan disagree");
            assert_eq!(self.rng, rng_after, "the argmin scan drew differently");
        }
        pick
    }

    /// The full scan: every candidate, then the policy.
    pub(super) fn full_scan(&mut self, stage: Stage, view: &RequestView<'_>) -> Result<Candidate, Blocked> {
        self.fill_candidates(stage, view.chain)?;
        let policy = match stage {
            Stage::Decode => &mut self.policy,
            Stage::Prefill => &mut self.prefill_policy,
        };
        let candidates = &self.scratch.candidates;
        let pick = policy.select(view, candidates, &mut self.rng);
        Ok(candidates[pick.min(candidates.len() - 1)])
    }

    /// Fills `scratch.candidates` with the workers of `stage`'s pool, not draining and not busy.
    /// Errs if no worker is eligible, or if every eligible one is busy.
    pub(super) fn fill_candidates(&mut self, stage: Stage, chain: &[SequenceHash]) -> Result<(), Blocked> {
        let Scratch {
            overlaps, candidates, ..
        } = &mut self.scratch;
        candidates.clear();
        let mut eligible = 0;
        for (w, &overlap) in self.fleet.workers().iter().zip(overlaps.iter()) {
            if w.draining || !stage.admits(w.spec.role) {
                continue;
            }
            eligible += 1;
            candidates.extend(candidate(w, overlap, chain, &self.config.busy));
        }
        match (eligible, candidates.is_empty()) {
            (0, _) => Err(Blocked::NoWorker),
            (_, true) => Err(Blocked::Busy),
            _ => Ok(()),
        }
    }

    /// The argmin scan (see the module docs).
    fn argmin_scan(
        &mut self,
        stage: Stage,
        params: &CostParams,
        view: &RequestView<'_>,
    ) -> Result<Candidate, Blocked> {
        let Scratch { overlaps, idle, .. } = &mut self.scratch;
        idle.clear();
        let busy = &self.config.busy;
        let chain: &[SequenceHash] = view.chain;
        let blocks = chain.len() as u32;
        let workers = self.fleet.workers();
        let mut eligible = 0;
        let scored = workers
            .iter()
            .zip(overlaps.iter())
            .enumerate()
            .filter_map(|(slot, (w, &overlap))| {
                if w.draining || !stage.admits(w.spec.role) {
                    return None;
                }
                eligible += 1;
                let score = || candidate(w, overlap, chain, busy).map(|c| cost(params, view, &c));
                let value = if w.is_idle() {
                    let overlap_blocks = overlap.min(blocks);
                    let same = |m: &&IdleCost| m.overlap_blocks == overlap_blocks && m.class == w.class;
                    match idle.iter().find(same) {
                        Some(m) => m.cost,
                        None => {
                            let cost = score();
                            if idle.len() < IDLE_MEMO {
                                idle.push(IdleCost {
                                    class: w.class,
                                    overlap_blocks,
                                    cost,
                                });
                            }
                            cost
                        }
                    }
                } else {
                    score()
                };
                value.map(|v| (slot, v))
            });
        let pick = argmin_keyed(scored, &mut self.rng);
        match (eligible, pick) {
            (0, _) => Err(Blocked::NoWorker),
            (_, None) => Err(Blocked::Busy),
            // The same inputs as when it was scored, so not busy.
            (_, Some(slot)) => candidate(&workers[slot], overlaps[slot], chain, busy).ok_or(Blocked::Busy),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The argmin scan against the full scan (the reference): over random fleets (roles, specs,
    //! draining), loads (routed requests in every phase), overlaps (KV events, the recent
    //! record), busy thresholds and policies, every decision's pick and the generator's state
    //! after it are the same, at both stages.

    use std::time::Duration;

    use proptest::prelude::*;

    use super::Stage;
    use crate::hash::{BlockHasher, HashSalt};
    use crate::ids::{DpRank, RequestId, WorkerId, WorkerKey};
    use crate::router::policy::CostPolicyConfig;
    use crate::router::{
        BusyThresholds, CacheMode, CostParams, Decider, DecodeProjection, IndexEvent, PolicyConfig, Prompt,
        RecentConfig, RouteRequest, Router, RouterConfig, WorkerRole, WorkerSpec, stored_blocks,
    };
    use crate::time::Timestamp;

    const BLOCK: u32 = 4;

    fn tokens(family: u32, shared: u32, tail: u32, tail_blocks: u32) -> Vec<u32> {
        let block = |f: u32, k: u32| (0..BLOCK).map(move |j| f * 10_000 + k * BLOCK + j);
        let mut t: Vec<u32> = (0..shared).flat_map(|k| block(family + 1, k)).collect();
        t.extend((0..tail_blocks).flat_map(|k| block(100 + tail, k)));
        t
    }

    /// Compares the two scans for `request` at `now` without routing it; returns how many
    /// stages took the argmin scan.
    fn compare(r: &mut Router, now: Timestamp, request: &RouteRequest<'_>) -> Result<u32, TestCaseError> {
        let prepared = r.prepare(now, request).expect("a consistent prompt");
        let locals = std::mem::take(&mut r.scratch.locals);
        r.compute_overlaps(now, &locals, &prepared.chain);
        r.scratch.locals = locals;
        let view = prepared.view(now, r.config.block_size);
        let mut fast = 0;
        for stage in [Stage::Decode, Stage::Prefill] {
            let Some(params) = r.policy_of(stage).argmin_cost().copied() else {
                continue;
            };
            fast += 1;
            let before = r.rng.clone();
            let pick = r.argmin_scan(stage, &params, &view);
            let after = std::mem::replace(&mut r.rng, before.clone());
            let reference = r.full_scan(stage, &view);
            prop_assert_eq!(pick, reference, "stage {:?}", stage);
            prop_assert_eq!(&after, &r.rng, "stage {:?}: the draws differ", stage);
            r.rng = before;
        }
        Ok(fast)
    }

    fn policy() -> impl Strategy<Value = (PolicyConfig, u32)> {
        let kv = |f: fn(&mut CostPolicyConfig)| {
            let mut c = CostPolicyConfig::KV;
            f(&mut c);
            PolicyConfig::Kv(c)
        };
        let configs = vec![
            PolicyConfig::from_name("kv").unwrap(),
            PolicyConfig::from_name("dynamo").unwrap(),
            kv(|c| c.cost.projection = DecodeProjection::Full),
            kv(|c| c.cost = CostParams::DYNAMO),
            kv(|c| c.cost.decode_active_request_weight = 3.0),
            kv(|c| c.cost.overlap_credit = 0.5),
            kv(|c| c.temperature = 0.5),
            kv(|c| c.spread_tolerance = 0.2),
            PolicyConfig::from_name("sglang-cache-aware").unwrap(),
            PolicyConfig::from_name("round-robin").unwrap(),
            PolicyConfig::from_name("llmd-weighted").unwrap(),
        ];
        (prop::sample::select(configs), 0..3u32)
    }

    fn cache() -> impl Strategy<Value = CacheMode> {
        let recent = RecentConfig {
            ttl: Some(Duration::from_secs(3)),
            max_blocks: 48,
            prune_ratio: 0.5,
        };
        prop_oneof![
            Just(CacheMode::Events),
            Just(CacheMode::EventsWithPrediction(recent)),
            Just(CacheMode::Approximate(recent)),
        ]
    }

    fn busy() -> impl Strategy<Value = BusyThresholds> {
        prop_oneof![
            3 => Just(BusyThresholds::default()),
            1 => Just(BusyThresholds { prefill_tokens: Some(20), ..BusyThresholds::default() }),
            1 => Just(BusyThresholds { decode_blocks_fraction: Some(0.3), ..BusyThresholds::default() }),
            1 => Just(BusyThresholds { requests_fraction: Some(0.01), ..BusyThresholds::default() }),
        ]
    }

    /// A worker: role (mostly aggregated), one of two capacities, draining.
    fn worker() -> impl Strategy<Value = (u8, bool, bool)> {
        (0..8u8, any::<bool>(), prop::bool::weighted(0.1))
    }

    #[derive(Clone, Debug)]
    enum Op {
        Route(u32, u32, u32, u32),
        FirstToken(usize),
        Finish(usize),
        Stored(usize, u32, u32),
        Advance(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..3u32, 0..5u32, 0..40u32, 0..3u32).prop_map(|(f, s, t, n)| Op::Route(f, s, t, n)),
            3 => any::<usize>().prop_map(Op::FirstToken),
            3 => any::<usize>().prop_map(Op::Finish),
            3 => (any::<usize>(), 0..3u32, 1..5u32).prop_map(|(w, f, s)| Op::Stored(w, f, s)),
            1 => (0..2_000u64).prop_map(Op::Advance),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn the_argmin_scan_picks_and_draws_as_the_full_scan(
            (policy, rank) in policy(),
            cache in cache(),
            busy in busy(),
            seed in any::<u64>(),
            decider in prop_oneof![Just(Decider::Always), Just(Decider::Never)],
            fleet in prop::collection::vec(worker(), 1..40),
            ops in prop::collection::vec(op(), 1..120),
        ) {
            let mut r = Router::new(RouterConfig {
                block_size: BLOCK,
                seed,
                policy,
                decider,
                cache,
                busy,
                replica_rank: rank,
                ..RouterConfig::default()
            }).expect("a valid config");
            let mut now = Timestamp::ZERO;
            let mut keys = Vec::new();
            for (i, &(role, big, draining)) in fleet.iter().enumerate() {
                let role = match role {
                    0 => WorkerRole::Prefill,
                    1 => WorkerRole::Decode,
                    _ => WorkerRole::Aggregated,
                };
                let key = WorkerKey::new(WorkerId(i as u64 / 2), DpRank(i as u32 % 2));
                let spec = WorkerSpec::new(key, role, if big { 400 } else { 40 });
                r.handle_worker_added(now, spec).expect("a new worker");
                if draining {
                    r.handle_worker_draining(now, key).expect("a known worker");
                }
                keys.push(key);
            }
            let (mut issued, mut fast) = (0u64, 0u32);
            for op in &ops {
                match *op {
                    Op::Route(family, shared, tail, tail_blocks) => {
                        let t = tokens(family, shared, tail, tail_blocks);
                        let request = RouteRequest::new(RequestId(issued), Prompt::Tokens(&t));
                        issued += 1;
                        fast += compare(&mut r, now, &request)?;
                        r.handle_request(now, &request).expect("a fresh id");
                    }
                    Op::FirstToken(i) => drop(r.handle_first_token(now, RequestId(i as u64 % issued.max(1)))),
                    Op::Finish(i) => drop(r.handle_finished(now, RequestId(i as u64 % issued.max(1)))),
                    Op::Stored(w, family, shared) => {
                        let (mut locals, mut chain) = (Vec::new(), Vec::new());
                        let hasher = BlockHasher::new(BLOCK as usize, &HashSalt::NONE);
                        hasher.hash_prompt(&tokens(family, shared, 0, 0), &mut locals, &mut chain);
                        let blocks = stored_blocks(&locals, &chain);
                        let event = IndexEvent::Stored { parent: None, blocks: &blocks };
                        drop(r.handle_kv_event(now, keys[w % keys.len()], event));
                    }
                    Op::Advance(ms) => now = Timestamp(now.0 + ms * 1_000_000),
                }
            }
            let argmin = r.policy.argmin_cost().is_some();
            prop_assert!(!argmin || issued == 0 || fast > 0);
        }
    }

    /// A fleet of 300 aggregated workers under `kv`, most of them idle: many idle workers with the
    /// same cost (so many tie draws), idle workers at several overlaps, and loaded ones.
    #[test]
    fn a_large_mostly_idle_fleet_decides_alike_under_both_scans() {
        let mut r = Router::new(RouterConfig {
            block_size: BLOCK,
            seed: 5,
            ..RouterConfig::default()
        })
        .expect("a valid config");
        let now = Timestamp::ZERO;
        let keys: Vec<WorkerKey> = (0..300).map(|i| WorkerKey::new(WorkerId(i), DpRank(0))).collect();
        for (i, &key) in keys.iter().enumerate() {
            let capacity = if i % 7 == 0 { 64 } else { 1024 };
            r.handle_worker_added(now, WorkerSpec::new(key, WorkerRole::Aggregated, capacity))
                .expect("a new worker");
        }
        let hasher = BlockHasher::new(BLOCK as usize, &HashSalt::NONE);
        for (i, &key) in keys.iter().enumerate().filter(|(i, _)| i % 5 == 0) {
            let (mut locals, mut chain) = (Vec::new(), Vec::new());
            hasher.hash_prompt(
                &tokens(i as u32 % 3, 1 + i as u32 % 4, 0, 0),
                &mut locals,
                &mut chain,
            );
            let blocks = stored_blocks(&locals, &chain);
            let event = IndexEvent::Stored {
                parent: None,
                blocks: &blocks,
            };
            r.handle_kv_event(now, key, event).expect("a known worker");
        }
        let mut fast = 0;
        for id in 0..400u64 {
            let t = tokens(id as u32 % 3, id as u32 % 5, id as u32, 2);
            let request = RouteRequest::new(RequestId(id), Prompt::Tokens(&t));
            fast += compare(&mut r, now, &request).expect("the scans agree");
            r.handle_request(now, &request).expect("a fresh id");
            if id % 3 == 0 {
                r.handle_finished(now, RequestId(id / 2)).ok();
            }
        }
        assert_eq!(fast, 800);
    }
}
