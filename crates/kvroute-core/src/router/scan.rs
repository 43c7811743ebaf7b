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
//!   once per distinct (spec without key, overlap) and every other idle worker with the same pair
//!   reuses that cost; busy workers are scored as in the full scan. The costs then go through the
//!   same [`argmin`] in the same worker order, so the pick and the generator's draws are those of
//!   the full scan; only the winner's candidate is built. In a large fleet most workers are idle,
//!   and the per-worker cost of a decision drops from a candidate (a load snapshot, a trie probe,
//!   a projection and a cost) to a few comparisons.
//!
//! Debug builds run the full scan after every argmin scan and compare the picks and the
//! generator's state.

use super::cost::{CostParams, cost};
use super::fleet::FleetWorker;
use super::load::project;
use super::policy::{Candidate, Policy};
use super::request::RequestView;
use super::select::argmin;
use super::worker::{WorkerRole, WorkerSpec};
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

/// The cost shared by idle workers with this spec (key aside) and overlap; `None` if busy.
#[derive(Clone, Copy, Debug)]
pub(super) struct IdleCost {
    spec: WorkerSpec,
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
        let Scratch {
            overlaps,
            costs,
            slots,
            idle,
            ..
        } = &mut self.scratch;
        costs.clear();
        slots.clear();
        idle.clear();
        let busy = &self.config.busy;
        let chain: &[SequenceHash] = view.chain;
        let blocks = chain.len() as u32;
        let mut eligible = 0;
        for (slot, (w, &overlap)) in self.fleet.workers().iter().zip(overlaps.iter()).enumerate() {
            if w.draining || !stage.admits(w.spec.role) {
                continue;
            }
            eligible += 1;
            let score = |w: &FleetWorker| candidate(w, overlap, chain, busy).map(|c| cost(params, view, &c));
            let value = if w.is_idle() {
                let overlap_blocks = overlap.min(blocks);
                let same = |m: &&IdleCost| {
                    m.overlap_blocks == overlap_blocks && WorkerSpec { key: m.spec.key, ..w.spec } == m.spec
                };
                match idle.iter().find(same) {
                    Some(m) => m.cost,
                    None => {
                        let cost = score(w);
                        if idle.len() < IDLE_MEMO {
                            idle.push(IdleCost {
                                spec: w.spec,
                                overlap_blocks,
                                cost,
                            });
                        }
                        cost
                    }
                }
            } else {
                score(w)
            };
            if let Some(value) = value {
                costs.push(value);
                slots.push(slot as u32);
            }
        }
        if eligible == 0 {
            return Err(Blocked::NoWorker);
        }
        if costs.is_empty() {
            return Err(Blocked::Busy);
        }
        let slot = slots[argmin(costs.iter().copied(), &mut self.rng)] as usize;
        // The same inputs as when it was scored, so not busy.
        candidate(&self.fleet.workers()[slot], overlaps[slot], chain, busy).ok_or(Blocked::Busy)
    }
}
