//! Choosing a worker: the scan over the fleet that feeds the policy.
//!
//! Two scans, one decision rule:
//!
//! * **The full scan** ([`Router::fill_candidates`], then [`Policy::select`]): a [`Candidate`] per
//!   eligible worker (its load snapshot, the depth of the prompt in its active set, its
//!   projection), for any policy.
//! * **The argmin scan**, for policies whose pick is the argmin of the cost
//!   ([`Policy::argmin_cost`]: `kv` and `dynamo` at temperature 0 without replica spread), costs
//!   a decision in the loaded workers and the idle workers the prompt overlaps, not in the fleet.
//!   A worker with nothing booked has a candidate that depends only on its spec (its key aside)
//!   and its overlap with the prompt, and [`cost()`] reads nothing else. So the scan scores one
//!   by one only the workers of the fleet's loaded set and the idle workers with an overlap
//!   above 0 (`Scratch::overlapping`; an idle worker's cost is computed once per distinct (spec
//!   class, overlap)); every other idle worker of a class (the fleet keeps each class's idle
//!   set, see the `fleet` module) costs what an idle worker of that class with no overlap does,
//!   so each class's bulk is one cost and a count. The pick is uniform among all the workers
//!   tied at the minimum cost, as the full scan's reservoir argmin gives, with one draw among
//!   the `k` tied (none if `k = 1`), mapped to a worker scored one by one, or to a position of a
//!   class's idle set skipping the positions scored one by one. Busy workers are never tied
//!   (busy is decided on the same candidate), draining ones are in no idle set, and a stage
//!   counts only the roles it admits. The full scan draws differently (one draw per tie as it
//!   goes): the two scans' picks follow the same distribution, not the same draws.
//!
//! The loaded workers are visited without costing them all. A loaded worker's depth walk (a
//! read of its active set) is spared when its lowest possible cost ([`bound`], the cost at the
//! deepest depth) is above the lowest cost so far: it cannot be tied at the minimum. The loaded
//! workers the prompt overlaps are visited first, each spared unread while its floor plus the
//! request's part plus the cross terms at its own requests booked and eviction pressure (which
//! the fleet keeps per slot, apart from the workers) is above the lowest cost so far; on a
//! loaded fleet a prompt's prefix is on dozens of workers, and this reads the load of about
//! one a decision. The others, whose bound is at least their
//! [`floor`] (the part no request changes) plus the request's plus the cross terms at their
//! lowest over the loaded workers ([`cross_floor`]: the fewest requests booked on one and the
//! least eviction pressure, which the fleet keeps: the `lows` module), in the fleet's order of
//! ascending floor per role (`Fleet::ordered`), until that sum is above the lowest cost so far:
//! every later worker's bound is too. On a fleet whose workers all evict, the cross terms are
//! what sets apart a worker that lacks the prompt from one that holds its prefix; without them
//! the scan would visit every loaded worker. The ties found are then put in the
//! loaded set's order, the order of a scan of every loaded worker, so the pick and the draw
//! are the ones that scan makes (checked against it in the tests).
//!
//! Debug builds run the full scan after every argmin scan and check that the argmin scan's
//! pick is one of the workers the full scan finds at the minimum cost (`check_argmin_pick`).

use std::sync::Arc;

use super::cost::{CostParams, cached_blocks, cost, uncached_blocks};
use super::fleet::{FleetWorker, Membership};
use super::load::{ActiveDepth, WorkerLoad, project};
use super::lows::Lows;
use super::policy::{Candidate, Policy};
use super::request::RequestView;
use super::worker::{WorkerRole, WorkerSpec};
use super::{Blocked, Router, Scratch};
use crate::ids::{RequestId, SequenceHash};
use crate::time::Timestamp;

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

    /// The roles it admits.
    fn roles(self) -> &'static [WorkerRole] {
        match self {
            Stage::Decode => &[WorkerRole::Aggregated, WorkerRole::Decode],
            Stage::Prefill => &[WorkerRole::Prefill],
        }
    }
}

/// How many loaded workers ahead of the one it visits the scan prefetches.
const PREFETCH_AHEAD: usize = 8;

/// The most distinct (spec, overlap) pairs of idle workers remembered per decision; further
/// ones are scored one by one.
const IDLE_MEMO: usize = 16;

/// The cost shared by idle workers of this spec class (their specs equal but for the key) and
/// overlap; `None` if busy.
#[derive(Clone, Copy, Debug)]
struct IdleCost {
    class: u32,
    overlap: Overlap,
    cost: Option<f64>,
}

/// A worker's match of the prompt: blocks on its GPU, then blocks past them held only on a
/// slower tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Overlap {
    pub gpu: u32,
    pub tier: u32,
}

impl Overlap {
    /// Clamped to a prompt of `blocks` blocks.
    fn within(self, blocks: u32) -> Overlap {
        let gpu = self.gpu.min(blocks);
        Overlap {
            gpu,
            tier: self.tier.min(blocks - gpu),
        }
    }

    fn is_none(self) -> bool {
        self.gpu == 0 && self.tier == 0
    }
}

/// The argmin scan's buffers, reused across decisions.
#[derive(Clone, Debug, Default)]
pub(super) struct ArgminScratch {
    memo: Vec<IdleCost>,
    /// The idle workers scored one by one: (class, position in its idle set).
    singled: Vec<(u32, u32)>,
    /// How many of them per class.
    singled_in: Vec<u32>,
    /// Workers scored one by one at the lowest cost so far, by slot.
    tied: Vec<usize>,
    /// Classes whose bulk is at the lowest cost so far, with the bulk's size.
    tied_bulk: Vec<(u32, usize)>,
    /// Positions of one class's idle set scored one by one, ascending.
    skip: Vec<u32>,
    /// The loaded workers the prompt overlaps, each with the lowest cost it can have by its
    /// floor (see [`floor`]).
    lower: Vec<(f64, usize)>,
    /// The request's parts of the bound ([`request_floor`]) by role and overlap (clamped).
    parts: Vec<(WorkerRole, Overlap, Option<f64>)>,
    /// Scores every loaded worker, the bounds unused (the tests' reference).
    #[cfg(test)]
    unbounded: bool,
}

impl ArgminScratch {
    /// The cost of an idle worker `w` at `overlap` (clamped), from the memo or `score`.
    fn idle_cost(
        &mut self,
        w: &FleetWorker,
        overlap: Overlap,
        score: impl FnOnce() -> Option<f64>,
    ) -> Option<f64> {
        let same = |m: &&IdleCost| m.overlap == overlap && m.class == w.class;
        if let Some(m) = self.memo.iter().find(same) {
            return m.cost;
        }
        let cost = score();
        if self.memo.len() < IDLE_MEMO {
            self.memo.push(IdleCost {
                class: w.class,
                overlap,
                cost,
            });
        }
        cost
    }

    /// The request's part of the bound of a worker of `role` at `overlap` (clamped), from the
    /// memo or [`request_floor`] of its spec (read only then).
    fn request_part(
        &mut self,
        role: WorkerRole,
        spec: impl FnOnce() -> WorkerSpec,
        overlap: Overlap,
        params: &CostParams,
        view: &RequestView<'_>,
    ) -> Option<f64> {
        if let Some(&(_, _, part)) = self.parts.iter().find(|p| p.0 == role && p.1 == overlap) {
            return part;
        }
        let part = request_floor(&spec(), overlap, params, view);
        if self.parts.len() < IDLE_MEMO {
            self.parts.push((role, overlap, part));
        }
        part
    }

    /// The slot of the `draw`-th of the tied workers: those scored one by one first, then each
    /// tied class's bulk in turn, the bulk being its idle set without the positions scored one
    /// by one.
    fn tied_worker(&mut self, draw: usize, idle_sets: &[Vec<u32>]) -> Option<usize> {
        if let Some(&slot) = self.tied.get(draw) {
            return Some(slot);
        }
        let mut draw = draw - self.tied.len();
        let &(class, _) = self.tied_bulk.iter().find(|&&(_, n)| {
            let here = draw < n;
            if !here {
                draw -= n;
            }
            here
        })?;
        self.skip.clear();
        let singled = self.singled.iter().filter(|&&(c, _)| c == class);
        self.skip.extend(singled.map(|&(_, p)| p));
        self.skip.sort_unstable();
        // The `draw`-th position not skipped: step over each skipped one at or before it.
        let mut pos = draw;
        for &p in &self.skip {
            if p as usize > pos {
                break;
            }
            pos += 1;
        }
        idle_sets.get(class as usize)?.get(pos).map(|&slot| slot as usize)
    }
}

/// The lowest cost offered so far; ties are collected in the scratch's `tied` lists.
#[derive(Clone, Copy, Debug, Default)]
struct Lowest(Option<f64>);

impl Lowest {
    /// Whether `value` joins the ties at the lowest cost: it equals the lowest, or is below it
    /// (then it becomes the lowest and the ties so far are dropped from `s`).
    fn offer(&mut self, value: f64, s: &mut ArgminScratch) -> bool {
        match self.0 {
            _ if value.is_nan() => false,
            Some(low) if value > low => false,
            Some(low) if value == low => true,
            _ => {
                self.0 = Some(value);
                s.tied.clear();
                s.tied_bulk.clear();
                true
            }
        }
    }
}

/// `w`'s candidate for a prompt of `chain` of which it caches `overlap` leading blocks, or `None`
/// if it is busy. The one place a candidate is built.
pub(super) fn candidate(
    w: &FleetWorker,
    overlap: Overlap,
    chain: &[SequenceHash],
    busy: &super::BusyThresholds,
    now: Timestamp,
) -> Option<Candidate> {
    let load = w.load();
    if busy.is_busy(&w.spec, &load) {
        return None;
    }
    let blocks = chain.len() as u32;
    let Overlap {
        gpu: overlap_blocks,
        tier: tier_blocks,
    } = overlap.within(blocks);
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
        tier_blocks,
        load,
        projection: project(w.spec.role, &load, blocks, overlap_blocks, depth),
        eviction_pressure: w.eviction_pressure(now),
    })
}

/// The lowest cost `w` can have for a prompt of `chain` of which it caches `overlap` leading
/// blocks, whatever the prompt's depth in its active set: the cost at the deepest depth, the
/// whole chain (a deeper chain only takes blocks off the decode projection, and the cost only
/// grows with it). `None` if it is busy. Reads no active set, so it spares the depth walk.
fn bound(
    w: &FleetWorker,
    overlap: Overlap,
    busy: &super::BusyThresholds,
    params: &CostParams,
    view: &RequestView<'_>,
) -> Option<f64> {
    let load = w.load();
    if busy.is_busy(&w.spec, &load) {
        return None;
    }
    let pressure = w.eviction_pressure(view.now);
    Some(deepest_cost(&w.spec, &load, overlap, pressure, params, view))
}

/// The cost of a worker of `spec` with `load`, caching `overlap` leading blocks of the prompt
/// and at eviction pressure `pressure`, at the prompt's deepest depth in its active set (the
/// whole chain: [`bound`]).
fn deepest_cost(
    spec: &WorkerSpec,
    load: &WorkerLoad,
    overlap: Overlap,
    pressure: f64,
    params: &CostParams,
    view: &RequestView<'_>,
) -> f64 {
    let blocks = view.chain.len() as u32;
    let Overlap {
        gpu: overlap_blocks,
        tier: tier_blocks,
    } = overlap.within(blocks);
    let deepest = ActiveDepth {
        all: blocks,
        staged: blocks,
    };
    let c = Candidate {
        spec: *spec,
        overlap_blocks,
        tier_blocks,
        load: *load,
        projection: project(spec.role, load, blocks, overlap_blocks, deepest),
        eviction_pressure: pressure,
    };
    cost(params, view, &c)
}

/// A loaded worker's **floor**: the part of its [`bound`] that no request changes, its bound
/// for an empty prompt at no eviction pressure (under `params`, at `block_size` tokens a block;
/// `empty` is an empty chain). A request's bound on it is at least its floor plus the
/// request's part ([`request_floor`]), the bound of a worker of its role with nothing booked
/// and the same overlap: the cost is a sum of load terms and request terms, the prefill term
/// is linear in the tokens of both (and what the overlap takes off is at most the prompt's
/// full blocks, so it never reaches the worker's own tokens), and the eviction pressure and
/// the stall term (booked requests times the prompt's uncached blocks) only add (checked over random weights, loads, overlaps and requests in the tests). The fleet
/// keeps the loaded workers ordered by it.
pub(super) fn floor(
    params: &CostParams,
    block_size: u32,
    empty: &Arc<[SequenceHash]>,
    spec: &WorkerSpec,
    load: &WorkerLoad,
) -> f64 {
    let view = RequestView {
        now: Timestamp::ZERO,
        id: RequestId(0),
        prompt_tokens: 0,
        block_size,
        chain: empty,
        fleet_load: 0.0,
    };
    deepest_cost(spec, load, Overlap::default(), 0.0, params, &view)
}

/// The request's part of the bound of a worker of `spec`'s role that caches `overlap` of it:
/// the bound of such a worker with nothing booked (see [`floor`]). `None` if the prompt has
/// fewer tokens than its full blocks hold (the router refuses such a prompt), where the
/// overlap's credit could reach the worker's own tokens.
fn request_floor(
    spec: &WorkerSpec,
    overlap: Overlap,
    params: &CostParams,
    view: &RequestView<'_>,
) -> Option<f64> {
    let full = view.chain.len() as u64 * u64::from(view.block_size);
    (view.prompt_tokens >= full)
        .then(|| deepest_cost(spec, &WorkerLoad::default(), overlap, 0.0, params, view))
}

/// The part of a loaded worker's bound that its floor and the request's part at `overlap`
/// leave out, at most: the eviction pressure's and the stall term's (the cross terms of
/// [`floor`]: the prompt's uncached blocks times the worker's pressure or booked requests) at
/// `lows`, which the worker has at least (the fleet's lows, or its own), on a worker of `role`
/// that prefills; 0 on others.
fn cross_floor(
    role: WorkerRole,
    overlap: Overlap,
    lows: Lows,
    params: &CostParams,
    view: &RequestView<'_>,
) -> f64 {
    if !role.tracks_prefill() {
        return 0.0;
    }
    let (cached, _) = cached_blocks(params, overlap.gpu, overlap.tier);
    let per_block = params.evict_weight * lows.pressure + params.stall_weight * f64::from(lows.requests);
    params.prefill_load_scale * per_block * uncached_blocks(view, cached)
}

/// How far below a worker's floor plus a request's its bound may come out in floating point (a
/// relative margin, far above the few roundings' error): the scan stops only past it.
const FLOOR_SLACK: f64 = 1e-9;

impl Router {
    fn policy_of(&self, stage: Stage) -> &dyn Policy {
        match stage {
            Stage::Decode => self.policy.as_ref(),
            Stage::Prefill => self.prefill_policy.as_ref(),
        }
    }

    /// Chooses a worker of `stage`'s pool for `view` with `stage`'s policy, the overlaps being
    /// in `scratch.overlaps`, among the workers serving `adapter` if one is named. Errs if no
    /// worker is eligible, or if every eligible one is busy.
    ///
    /// A request naming an adapter takes the full scan: the argmin scan's idle classes know
    /// nothing of adapters.
    pub(super) fn choose(
        &mut self,
        stage: Stage,
        view: &RequestView<'_>,
        adapter: Option<&str>,
    ) -> Result<Candidate, Blocked> {
        let params = match self.policy_of(stage).argmin_cost() {
            Some(params) if adapter.is_none() => *params,
            _ => return self.full_scan(stage, view, adapter),
        };
        let pick = self.argmin_scan(stage, &params, view);
        #[cfg(debug_assertions)]
        if let Err(e) = self.check_argmin_pick(stage, &params, view, &pick) {
            panic!("the argmin scan and the full scan disagree: {e}");
        }
        pick
    }

    /// Checks `pick`, the argmin scan's, against the full scan: both err alike, or `pick` is
    /// one of the full scan's candidates at the lowest cost and so is the full scan's own pick.
    /// Leaves the generator as it found it.
    #[cfg(any(debug_assertions, test))]
    pub(super) fn check_argmin_pick(
        &mut self,
        stage: Stage,
        params: &CostParams,
        view: &RequestView<'_>,
        pick: &Result<Candidate, Blocked>,
    ) -> Result<(), String> {
        let rng = self.rng.clone();
        let full = self.full_scan(stage, view, None);
        self.rng = rng;
        let (pick, full) = match (pick, full) {
            (Err(a), Err(b)) if *a == b => return Ok(()),
            (Ok(pick), Ok(full)) => (pick, full),
            (pick, full) => return Err(format!("{pick:?} against the full scan's {full:?}")),
        };
        let candidates = &self.scratch.candidates;
        let lowest = candidates
            .iter()
            .map(|c| cost(params, view, c))
            .fold(f64::INFINITY, f64::min);
        let (cost_pick, cost_full) = (cost(params, view, pick), cost(params, view, &full));
        if cost_pick != lowest || cost_full != lowest {
            return Err(format!(
                "costs {cost_pick} (argmin scan) and {cost_full} (full scan), lowest {lowest}"
            ));
        }
        if !candidates.contains(pick) {
            return Err(format!("{pick:?} is not a candidate of the full scan"));
        }
        Ok(())
    }

    /// The full scan: every candidate (serving `adapter`, if one is named), then the policy.
    pub(super) fn full_scan(
        &mut self,
        stage: Stage,
        view: &RequestView<'_>,
        adapter: Option<&str>,
    ) -> Result<Candidate, Blocked> {
        self.fill_candidates(stage, view.chain, adapter, view.now)?;
        let policy = match stage {
            Stage::Decode => &mut self.policy,
            Stage::Prefill => &mut self.prefill_policy,
        };
        let candidates = &self.scratch.candidates;
        let pick = policy.select(view, candidates, &mut self.rng);
        Ok(candidates[pick.min(candidates.len() - 1)])
    }

    /// Fills `scratch.candidates` with the workers of `stage`'s pool, not draining, not busy,
    /// and serving `adapter` if one is named. Errs if no worker is eligible, or if every
    /// eligible one is busy.
    pub(super) fn fill_candidates(
        &mut self,
        stage: Stage,
        chain: &[SequenceHash],
        adapter: Option<&str>,
        now: Timestamp,
    ) -> Result<(), Blocked> {
        let Scratch {
            overlaps,
            tier_overlaps,
            candidates,
            ..
        } = &mut self.scratch;
        candidates.clear();
        let mut eligible = 0;
        for ((w, &gpu), &tier) in self
            .fleet
            .workers()
            .iter()
            .zip(overlaps.iter())
            .zip(tier_overlaps.iter())
        {
            let overlap = Overlap { gpu, tier };
            if w.draining || !stage.admits(w.spec.role) || !self.adapters.serves(adapter, w.spec.key) {
                continue;
            }
            eligible += 1;
            candidates.extend(candidate(w, overlap, chain, &self.config.busy, now));
        }
        match (eligible, candidates.is_empty()) {
            (0, _) => Err(Blocked::NoWorker),
            (_, true) => Err(Blocked::Busy),
            _ => Ok(()),
        }
    }

    /// The argmin scan (see the module docs).
    pub(super) fn argmin_scan(
        &mut self,
        stage: Stage,
        params: &CostParams,
        view: &RequestView<'_>,
    ) -> Result<Candidate, Blocked> {
        let lows = self.fleet.lows(view.now);
        let Scratch {
            overlaps,
            tier_overlaps,
            overlapping,
            argmin: s,
            ..
        } = &mut self.scratch;
        let overlap_of = |slot: usize| Overlap {
            gpu: overlaps[slot],
            tier: tier_overlaps[slot],
        };
        s.memo.clear();
        s.singled.clear();
        s.tied.clear();
        s.tied_bulk.clear();
        s.singled_in.clear();
        s.singled_in.resize(self.fleet.idle_sets().len(), 0);
        let busy = &self.config.busy;
        let chain: &[SequenceHash] = view.chain;
        let blocks = chain.len() as u32;
        let workers = self.fleet.workers();
        let score = |w: &FleetWorker, overlap: Overlap| {
            candidate(w, overlap, chain, busy, view.now).map(|c| cost(params, view, &c))
        };
        let mut lowest = Lowest::default();
        let mut eligible = 0;
        #[cfg(test)]
        let unbounded = s.unbounded;
        #[cfg(not(test))]
        let unbounded = false;
        // A loaded worker, one by one: its depth walk reads its active set, a cache miss or more,
        // so it is spared when the worker's lowest possible cost ([`bound`]) is above the lowest
        // cost so far (it cannot be tied at the minimum). The ties are kept by position in the
        // loaded set, put in that order below.
        let loaded = self.fleet.loaded();
        let visit = |w: &FleetWorker, overlap: Overlap, lowest: &mut Lowest, s: &mut ArgminScratch| {
            let Membership::Loaded(pos) = w.membership() else {
                return;
            };
            let Some(b) = bound(w, overlap, busy, params, view) else {
                return; // busy
            };
            if !unbounded && lowest.0.is_some_and(|low| b > low) {
                return;
            }
            if let Some(value) = score(w, overlap)
                && lowest.offer(value, s)
            {
                s.tied.push(pos as usize);
            }
        };
        // The loaded workers the prompt overlaps: each one's floor plus the request's part at
        // its overlap (see [`floor`]; the parts are few, one per distinct role and overlap) plus
        // the stall term at its own requests booked, then the lowest of them visited first, and
        // every other whose is not above the lowest cost by then, nor with the eviction term at
        // its own pressure added (both kept per slot by the fleet: read without the worker's
        // load, the pressure only where the rest does not spare the worker).
        let floors = self.fleet.floors(stage.roles(), params);
        let fleet = &self.fleet;
        let mut lower = std::mem::take(&mut s.lower);
        lower.clear();
        s.parts.clear();
        for &slot in overlapping.iter() {
            // A loaded worker has requests booked; none else has.
            let (booked, intake) = (fleet.booked_of(slot), fleet.intake_of(slot));
            let overlap = overlap_of(slot);
            if booked == 0 || overlap.is_none() || intake.draining || !stage.admits(intake.role) {
                continue;
            }
            eligible += 1;
            let floor = floors.and_then(|f| f[slot]).map(f64::from_bits);
            let overlap = overlap.within(blocks);
            let part = s.request_part(intake.role, || workers[slot].spec, overlap, params, view);
            let lb = floor.zip(part).map_or(f64::NEG_INFINITY, |(f, r)| {
                let booked = Lows {
                    requests: booked,
                    pressure: 0.0,
                };
                f + r + cross_floor(intake.role, overlap, booked, params, view)
            });
            lower.push((lb, slot));
        }
        let first = (0..lower.len()).min_by(|&i, &j| lower[i].0.total_cmp(&lower[j].0));
        if let Some(i) = first {
            lower.swap(0, i);
        }
        let spared = |lb: f64, lowest: &Lowest| {
            !unbounded && lowest.0.is_some_and(|low| lb * (1.0 - FLOOR_SLACK) > low)
        };
        for &(lb, slot) in &lower {
            let overlap = overlap_of(slot);
            if spared(lb, &lowest) {
                continue;
            }
            let pressed = Lows {
                requests: 0,
                pressure: fleet.pressure_floor_of(slot, view.now),
            };
            let role = fleet.intake_of(slot).role;
            if spared(
                lb + cross_floor(role, overlap.within(blocks), pressed, params, view),
                &lowest,
            ) {
                continue;
            }
            visit(&workers[slot], overlap, &mut lowest, s);
        }
        s.lower = lower;
        // The others, of each role the stage admits, by ascending floor (see [`floor`]): once a
        // worker's floor plus the request's is above the lowest cost so far, so is every later
        // worker's bound, and the scan of the role stops.
        for &role in stage.roles() {
            let Some(order) = self.fleet.ordered(role, params) else {
                debug_assert!(false, "the fleet keeps no order of its {role} workers");
                continue;
            };
            let mut request = None;
            // The workers are visited scattered over the fleet: each one's fields a cache miss,
            // unless asked for a few workers ahead.
            let mut ahead = order.clone().skip(PREFETCH_AHEAD);
            for (floor, slot) in order {
                if let Some((_, next)) = ahead.next() {
                    workers[next].prefetch();
                }
                let w = &workers[slot];
                let request = *request.get_or_insert_with(|| {
                    let cross = cross_floor(role, Overlap::default(), lows, params, view);
                    request_floor(&w.spec, Overlap::default(), params, view).map(|r| r + cross)
                });
                if !unbounded
                    && let (Some(low), Some(request)) = (lowest.0, request)
                    && (floor + request) * (1.0 - FLOOR_SLACK) > low
                {
                    break;
                }
                let overlap = overlap_of(slot);
                if w.draining || !overlap.is_none() {
                    continue;
                }
                eligible += 1;
                visit(w, overlap, &mut lowest, s);
            }
        }
        // The ties in the loaded set's order, as a scan of it in order offers them.
        s.tied.sort_unstable();
        for t in &mut s.tied {
            *t = loaded[*t] as usize;
        }
        // The idle workers the prompt overlaps, one by one (the loaded ones are done).
        for &slot in overlapping.iter() {
            let (w, overlap) = (&workers[slot], overlap_of(slot));
            let Membership::Idle(pos) = w.membership() else {
                continue;
            };
            if overlap.is_none() || !stage.admits(w.spec.role) {
                continue;
            }
            s.singled.push((w.class, pos));
            s.singled_in[w.class as usize] += 1;
            if let Some(value) = s.idle_cost(w, overlap.within(blocks), || score(w, overlap))
                && lowest.offer(value, s)
            {
                s.tied.push(slot);
            }
        }
        // Every other idle worker of a class: one cost, a count.
        for (class, set) in self.fleet.idle_sets().iter().enumerate() {
            let Some(&first) = set.first() else { continue };
            let w = &workers[first as usize];
            if !stage.admits(w.spec.role) {
                continue;
            }
            eligible += set.len();
            let bulk = set.len() - s.singled_in[class] as usize;
            if bulk > 0
                && let Some(value) = s.idle_cost(w, Overlap::default(), || score(w, Overlap::default()))
                && lowest.offer(value, s)
            {
                s.tied_bulk.push((class as u32, bulk));
            }
        }
        if lowest.0.is_none() {
            return Err(if eligible == 0 {
                Blocked::NoWorker
            } else {
                Blocked::Busy
            });
        }
        let ties = s.tied.len() + s.tied_bulk.iter().map(|&(_, n)| n).sum::<usize>();
        let draw = if ties > 1 { self.rng.below(ties) } else { 0 };
        let Some(slot) = s.tied_worker(draw, self.fleet.idle_sets()) else {
            debug_assert!(false, "draw {draw} of {ties} ties names no worker");
            return Err(Blocked::Busy);
        };
        // The same inputs as when it was scored, so not busy.
        candidate(&workers[slot], overlap_of(slot), chain, busy, view.now).ok_or(Blocked::Busy)
    }
}

#[cfg(test)]
mod tests {
    //! The argmin scan against the full scan (the reference): over random fleets (roles, specs,
    //! draining), loads (routed requests in every phase, a peer's bookings), overlaps (KV
    //! events, the recent record), busy thresholds and policies, every decision's pick is one of
    //! the workers the full scan finds at the lowest cost (never a busy, draining or ineligible
    //! one), and both scans err alike, at both stages. The fleet's idle and loaded sets are
    //! compared with a recomputation after every input, and the ties are drawn evenly.

    use std::sync::Arc;
    use std::time::Duration;

    use proptest::prelude::*;

    use super::{FLOOR_SLACK, Overlap, Stage, cross_floor, deepest_cost, floor, request_floor};
    use crate::hash::{BlockHasher, HashSalt};
    use crate::ids::{DpRank, RequestId, SequenceHash, WorkerId, WorkerKey};
    use crate::router::load::WorkerLoad;
    use crate::router::lows::Lows;
    use crate::router::policy::CostPolicyConfig;
    use crate::router::request::RequestView;
    use crate::router::{
        Booking, BusyThresholds, CacheMode, CostParams, Decider, DecodeProjection, IndexEvent, LoadChange,
        PolicyConfig, PrefillLoadHint, Prompt, RecentConfig, RouteRequest, Router, RouterConfig, RouterId,
        SyncEvent, WorkerRole, WorkerSpec, stored_blocks,
    };
    use crate::time::Timestamp;

    const BLOCK: u32 = 4;
    const PEER: RouterId = RouterId(7);

    fn tokens(family: u32, shared: u32, tail: u32, tail_blocks: u32) -> Vec<u32> {
        let block = |f: u32, k: u32| (0..BLOCK).map(move |j| f * 10_000 + k * BLOCK + j);
        let mut t: Vec<u32> = (0..shared).flat_map(|k| block(family + 1, k)).collect();
        t.extend((0..tail_blocks).flat_map(|k| block(100 + tail, k)));
        t
    }

    /// Runs the argmin scan for `request` at `now` without routing it and checks its pick
    /// against the full scan ([`Router::check_argmin_pick`]); the generator is left as it was.
    /// Returns the stages that took the argmin scan, with their picks' keys.
    fn compare(
        r: &mut Router,
        now: Timestamp,
        request: &RouteRequest<'_>,
    ) -> Result<Vec<Option<WorkerKey>>, TestCaseError> {
        let prepared = r.prepare(now, request).expect("a consistent prompt");
        let locals = std::mem::take(&mut r.scratch.locals);
        r.compute_overlaps(now, &locals, &prepared.chain);
        r.scratch.locals = locals;
        let view = prepared.view(now, r.config.block_size);
        let mut picks = Vec::new();
        for stage in [Stage::Decode, Stage::Prefill] {
            let Some(params) = r.policy_of(stage).argmin_cost().copied() else {
                continue;
            };
            let before = r.rng.clone();
            let pick = r.argmin_scan(stage, &params, &view);
            // The bounds spare work only: without them the scan makes the same pick with the
            // same draws.
            let after = r.rng.clone();
            r.rng = before.clone();
            r.scratch.argmin.unbounded = true;
            let reference = r.argmin_scan(stage, &params, &view);
            r.scratch.argmin.unbounded = false;
            prop_assert_eq!(
                &pick,
                &reference,
                "stage {:?}: with and without the bounds",
                stage
            );
            prop_assert_eq!(&r.rng, &after, "the draws");
            r.check_argmin_pick(stage, &params, &view, &pick)
                .map_err(|e| TestCaseError::fail(format!("stage {stage:?}: {e}")))?;
            r.rng = before;
            picks.push(pick.ok().map(|c| c.worker()));
        }
        Ok(picks)
    }

    /// The fleet's idle and loaded sets against a recomputation from each worker's state.
    fn check_sets(r: &Router) -> Result<(), TestCaseError> {
        let workers = r.fleet.workers();
        let sorted = |set: &[u32]| {
            let mut v = set.to_vec();
            v.sort_unstable();
            v
        };
        for (class, set) in r.fleet.idle_sets().iter().enumerate() {
            let expect: Vec<u32> = (0..workers.len() as u32)
                .filter(|&i| {
                    let w = &workers[i as usize];
                    w.class as usize == class && w.load().is_idle() && !w.draining
                })
                .collect();
            prop_assert_eq!(sorted(set), expect, "idle set of class {}", class);
        }
        let loaded: Vec<u32> = (0..workers.len() as u32)
            .filter(|&i| !workers[i as usize].load().is_idle())
            .collect();
        prop_assert_eq!(sorted(r.fleet.loaded()), loaded, "loaded set");
        r.fleet.check_invariants().map_err(TestCaseError::fail)
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
            kv(|c| c.cost.overlap_credit = 0.0),
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
        /// A peer books a request on a worker (and maybe a prefill worker).
        PeerAdded(usize, usize, u32),
        PeerPrefillDone(usize),
        PeerFreed(usize),
        PeerLost,
        Drain(usize),
        /// Suspends a worker (its requests dropped) and adds it back.
        SuspendAndReturn(usize),
        /// Removes a worker for good.
        Remove(usize),
        Tick,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..3u32, 0..5u32, 0..40u32, 0..3u32).prop_map(|(f, s, t, n)| Op::Route(f, s, t, n)),
            3 => any::<usize>().prop_map(Op::FirstToken),
            3 => any::<usize>().prop_map(Op::Finish),
            3 => (any::<usize>(), 0..3u32, 1..5u32).prop_map(|(w, f, s)| Op::Stored(w, f, s)),
            1 => (0..2_000u64).prop_map(Op::Advance),
            2 => (any::<usize>(), any::<usize>(), 0..4u32).prop_map(|(w, p, f)| Op::PeerAdded(w, p, f)),
            1 => any::<usize>().prop_map(Op::PeerPrefillDone),
            1 => any::<usize>().prop_map(Op::PeerFreed),
            1 => Just(Op::PeerLost),
            1 => any::<usize>().prop_map(Op::Drain),
            1 => any::<usize>().prop_map(Op::SuspendAndReturn),
            1 => any::<usize>().prop_map(Op::Remove),
            1 => Just(Op::Tick),
        ]
    }

    /// A router with `fleet` and the test's inputs, driven op by op.
    struct Harness {
        r: Router,
        now: Timestamp,
        specs: Vec<WorkerSpec>,
        issued: u64,
        peer_issued: u64,
    }

    impl Harness {
        fn new(config: RouterConfig, fleet: &[(u8, bool, bool)]) -> Self {
            let mut r = Router::new(RouterConfig {
                request_ttl: Duration::from_secs(5),
                ..config
            })
            .expect("a valid config");
            let now = Timestamp::ZERO;
            let mut specs = Vec::new();
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
                specs.push(spec);
            }
            Self {
                r,
                now,
                specs,
                issued: 0,
                peer_issued: 0,
            }
        }

        /// Applies `op`; for a route, first checks the argmin scan against the full scan and
        /// returns how many stages took it.
        fn apply(&mut self, op: &Op) -> Result<u32, TestCaseError> {
            let (r, now) = (&mut self.r, self.now);
            let peer = |request: u64, change: LoadChange| SyncEvent {
                router: PEER,
                request: RequestId(request),
                change,
            };
            match *op {
                Op::Route(family, shared, tail, tail_blocks) => {
                    let t = tokens(family, shared, tail, tail_blocks);
                    let request = RouteRequest::new(RequestId(self.issued), Prompt::Tokens(&t));
                    self.issued += 1;
                    let fast = compare(r, now, &request)?.len() as u32;
                    r.handle_request(now, &request).expect("a fresh id");
                    return Ok(fast);
                }
                Op::FirstToken(i) => {
                    drop(r.handle_first_token(now, RequestId(i as u64 % self.issued.max(1))))
                }
                Op::Finish(i) => drop(r.handle_finished(now, RequestId(i as u64 % self.issued.max(1)))),
                Op::Stored(w, family, shared) => {
                    let (mut locals, mut chain) = (Vec::new(), Vec::new());
                    let hasher = BlockHasher::new(BLOCK as usize, &HashSalt::NONE);
                    hasher.hash_prompt(&tokens(family, shared, 0, 0), &mut locals, &mut chain);
                    let blocks = stored_blocks(&locals, &chain);
                    let event = IndexEvent::Stored {
                        parent: None,
                        blocks: &blocks,
                    };
                    let key = self.specs[w % self.specs.len()].key;
                    drop(r.handle_kv_event(now, key, event));
                }
                Op::Advance(ms) => self.now = Timestamp(now.0 + ms * 1_000_000),
                Op::PeerAdded(w, p, family) => {
                    let (mut locals, mut chain) = (Vec::new(), Vec::new());
                    let hasher = BlockHasher::new(BLOCK as usize, &HashSalt::NONE);
                    hasher.hash_prompt(&tokens(family, 2, 0, 0), &mut locals, &mut chain);
                    let (worker, prefill) = (
                        self.specs[w % self.specs.len()].key,
                        self.specs[p % self.specs.len()].key,
                    );
                    let booking = Booking {
                        worker,
                        overlap_blocks: 1,
                        prefill_worker: (prefill != worker && p % 2 == 0).then_some(prefill),
                        prompt_tokens: u64::from(BLOCK) * 2,
                        chain: Arc::from(chain),
                        hint: PrefillLoadHint::new(u64::from(BLOCK) * 2, 1, BLOCK, None),
                        expected_output_tokens: None,
                        session: None,
                        tenant: crate::router::TenantId::OTHER,
                    };
                    self.peer_issued += 1;
                    drop(r.handle_sync_event(now, &peer(self.peer_issued, LoadChange::Added(booking))));
                }
                Op::PeerPrefillDone(i) => {
                    let id = i as u64 % (self.peer_issued + 1);
                    drop(r.handle_sync_event(now, &peer(id, LoadChange::PrefillDone)));
                }
                Op::PeerFreed(i) => {
                    let id = i as u64 % (self.peer_issued + 1);
                    drop(r.handle_sync_event(now, &peer(id, LoadChange::Freed)));
                }
                Op::PeerLost => drop(r.handle_peer_lost(now, PEER)),
                Op::Drain(w) => drop(r.handle_worker_draining(now, self.specs[w % self.specs.len()].key)),
                Op::SuspendAndReturn(w) => {
                    let spec = self.specs[w % self.specs.len()];
                    if r.handle_worker_suspended(now, spec.key).is_ok() {
                        r.handle_worker_added(now, spec).expect("back in the fleet");
                    }
                }
                Op::Remove(w) => {
                    // Keep one worker, so keys stay valid.
                    if self.specs.len() > 1 {
                        let spec = self.specs.remove(w % self.specs.len());
                        r.handle_worker_removed(now, spec.key).expect("a known worker");
                    }
                }
                Op::Tick => drop(r.handle_tick(now)),
            }
            Ok(0)
        }
    }

    /// Cost weights over their ranges (the validated ones), either projection.
    fn weights() -> impl Strategy<Value = CostParams> {
        (
            (0.0..64.0f64, 0.0..=1.0f64, 0.0..8.0f64, any::<bool>()),
            (
                0.0..=1.0f64,
                0.0..64.0f64,
                0.0..256.0f64,
                0.0..=1.0f64,
                0.0..2.0f64,
            ),
        )
            .prop_map(
                |((scale, credit, per_request, full), (tier, evict, fleet, transfer, stall))| CostParams {
                    prefill_load_scale: scale,
                    overlap_credit: credit,
                    decode_active_request_weight: per_request,
                    projection: if full {
                        DecodeProjection::Full
                    } else {
                        DecodeProjection::Staged
                    },
                    tier_block_cost: tier,
                    evict_weight: evict,
                    fleet_weight: fleet,
                    stall_weight: stall,
                    transfer_block_cost: transfer,
                },
            )
    }

    fn load() -> impl Strategy<Value = WorkerLoad> {
        (
            0..200u32,
            0..2_000_000u64,
            0..1_000_000u64,
            0..1_000_000u64,
            0..100_000u64,
        )
            .prop_map(
                |(requests, prefill_tokens, decode_blocks, staged, output_blocks)| WorkerLoad {
                    requests,
                    prefill_requests: requests / 2,
                    prefill_tokens,
                    decode_blocks,
                    staged_decode_blocks: staged.min(decode_blocks),
                    output_blocks: output_blocks.min(decode_blocks),
                },
            )
    }

    proptest! {
        /// The floor the argmin scan orders loaded workers by: a worker's bound for a request
        /// is at least its floor plus the request's part at the worker's overlap, within the
        /// slack the scan allows; at no eviction pressure and no stall term the two are equal but
        /// for rounding.
        #[test]
        fn a_bound_is_at_least_the_workers_floor_plus_the_requests(
            params in weights(),
            role in prop::sample::select(vec![WorkerRole::Aggregated, WorkerRole::Prefill, WorkerRole::Decode]),
            capacity in 1..100_000u64,
            load in load(),
            pressure in prop_oneof![Just(0.0), 0.0..=1.0f64],
            block_size in 1..256u32,
            (prompt_tokens, gpu, tier) in (0..500_000u64, 0.0..1.2f64, 0.0..1.2f64),
            overlapped in any::<bool>(),
            fleet_load in prop_oneof![Just(0.0), 0.0..=1.0f64],
            lows in (0..64u32, prop_oneof![Just(1.0), 0.0..=1.0f64]),
        ) {
            let spec = WorkerSpec::new(WorkerKey::new(WorkerId(0), DpRank(0)), role, capacity);
            let blocks = prompt_tokens / u64::from(block_size);
            let chain: Arc<[SequenceHash]> = (0..blocks).map(SequenceHash).collect();
            let view = RequestView {
                now: Timestamp::ZERO,
                id: RequestId(1),
                prompt_tokens,
                block_size,
                chain: &chain,
                fleet_load,
            };
            // Up to a little past the prompt's blocks (the scan clamps).
            let overlap = if overlapped {
                Overlap { gpu: (gpu * blocks as f64) as u32, tier: (tier * blocks as f64) as u32 }
            } else {
                Overlap::default()
            };
            let empty: Arc<[SequenceHash]> = Arc::from(Vec::new());
            let bound = deepest_cost(&spec, &load, overlap, pressure, &params, &view);
            let floor = floor(&params, block_size, &empty, &spec, &load);
            let request = request_floor(&spec, overlap, &params, &view).expect("a consistent prompt");
            let sum = floor + request;
            prop_assert!(floor >= 0.0 && request >= 0.0, "{floor} {request}");
            prop_assert!(bound >= sum * (1.0 - FLOOR_SLACK), "bound {bound} below {floor} + {request}");
            // With the cross terms at lows no higher than the worker's own.
            let lows = Lows { requests: lows.0.min(load.requests), pressure: pressure * lows.1 };
            let cross = cross_floor(role, overlap.within(blocks as u32), lows, &params, &view);
            prop_assert!(
                bound >= (sum + cross) * (1.0 - FLOOR_SLACK),
                "bound {bound} below {floor} + {request} + {cross}"
            );
            // And summed in two steps, the stall term then the eviction term, as the scan does
            // for a worker the prompt overlaps.
            let overlap = overlap.within(blocks as u32);
            let stall = cross_floor(role, overlap, Lows { pressure: 0.0, ..lows }, &params, &view);
            let evict = cross_floor(role, overlap, Lows { requests: 0, ..lows }, &params, &view);
            prop_assert!(
                bound >= (sum + stall + evict) * (1.0 - FLOOR_SLACK),
                "bound {bound} below {floor} + {request} + {stall} + {evict}"
            );
            // The eviction pressure and the stall term (booked requests times the prompt's
            // uncached blocks) are the cross terms; without them the bound is the sum.
            if pressure == 0.0 && (params.stall_weight == 0.0 || load.requests == 0) {
                prop_assert!((bound - sum).abs() <= sum * 1e-12, "bound {bound} against {floor} + {request}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Every pick of the argmin scan is one the full scan could make (see the module docs).
        #[test]
        fn the_argmin_scan_picks_among_the_full_scans_lowest_cost(
            (policy, rank) in policy(),
            cache in cache(),
            busy in busy(),
            seed in any::<u64>(),
            decider in prop_oneof![Just(Decider::Always), Just(Decider::Never)],
            fleet in prop::collection::vec(worker(), 1..40),
            ops in prop::collection::vec(op(), 1..120),
        ) {
            let mut h = Harness::new(RouterConfig {
                block_size: BLOCK,
                seed,
                policy,
                decider,
                cache,
                busy,
                replica_rank: rank,
                ..RouterConfig::default()
            }, &fleet);
            let (mut routes, mut fast) = (0u32, 0u32);
            for op in &ops {
                routes += u32::from(matches!(op, Op::Route(..)));
                fast += h.apply(op)?;
            }
            let argmin = h.r.policy.argmin_cost().is_some();
            prop_assert!(!argmin || routes == 0 || fast > 0);
        }

        /// After every input, each class's idle set holds exactly its workers with nothing
        /// booked that are not draining, and the loaded set every worker with something booked.
        #[test]
        fn the_idle_and_loaded_sets_follow_every_input(
            seed in any::<u64>(),
            cache in cache(),
            decider in prop_oneof![Just(Decider::Always), Just(Decider::Never)],
            fleet in prop::collection::vec(worker(), 1..24),
            ops in prop::collection::vec(op(), 1..160),
        ) {
            let mut h = Harness::new(RouterConfig {
                block_size: BLOCK,
                seed,
                decider,
                cache,
                ..RouterConfig::default()
            }, &fleet);
            check_sets(&h.r)?;
            for op in &ops {
                h.apply(op)?;
                check_sets(&h.r)?;
            }
        }
    }

    /// A fleet of 300 aggregated workers under `kv`, most of them idle: many idle workers with the
    /// same cost (so many ties), idle workers at several overlaps, and loaded ones.
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
            fast += compare(&mut r, now, &request).expect("the scans agree").len();
            r.handle_request(now, &request).expect("a fresh id");
            if id % 3 == 0 {
                r.handle_finished(now, RequestId(id / 2)).ok();
            }
        }
        assert_eq!(fast, 800);
    }

    /// Ties are drawn evenly: 12 aggregated workers of two classes, three of them caching the
    /// prompt (scored one by one) but at `overlap_credit = 0` costing what the others do, two
    /// draining and one loaded (neither ever picked). Each of the nine tied workers gets about a
    /// ninth of 18,000 dry-run picks (a fixed seed; the bound is ±20 %, about 9 standard
    /// deviations).
    #[test]
    fn ties_are_drawn_evenly_over_singled_and_bulk_workers() {
        // No credit for cached blocks, and the full projection (the staged one counts them in
        // the decode term): the overlap changes no cost.
        let mut cost = CostPolicyConfig::KV;
        cost.cost.overlap_credit = 0.0;
        cost.cost.projection = DecodeProjection::Full;
        let mut r = Router::new(RouterConfig {
            block_size: BLOCK,
            seed: 11,
            policy: PolicyConfig::Kv(cost),
            ..RouterConfig::default()
        })
        .expect("a valid config");
        let now = Timestamp::ZERO;
        let keys: Vec<WorkerKey> = (0..12).map(|i| WorkerKey::new(WorkerId(i), DpRank(0))).collect();
        for (i, &key) in keys.iter().enumerate() {
            let capacity = if i % 2 == 0 { 64 } else { 1024 };
            r.handle_worker_added(now, WorkerSpec::new(key, WorkerRole::Aggregated, capacity))
                .expect("a new worker");
        }
        let hasher = BlockHasher::new(BLOCK as usize, &HashSalt::NONE);
        let prompt = tokens(0, 3, 0, 0);
        let (mut locals, mut chain) = (Vec::new(), Vec::new());
        hasher.hash_prompt(&prompt, &mut locals, &mut chain);
        let blocks = stored_blocks(&locals, &chain);
        for &i in &[1, 4, 9] {
            let event = IndexEvent::Stored {
                parent: None,
                blocks: &blocks,
            };
            r.handle_kv_event(now, keys[i], event).expect("a known worker");
        }
        for &i in &[3, 6] {
            r.handle_worker_draining(now, keys[i]).expect("a known worker");
        }
        let other = tokens(2, 4, 0, 0);
        let loaded = match r
            .handle_request(now, &RouteRequest::new(RequestId(0), Prompt::Tokens(&other)))
            .expect("a fresh id")
        {
            crate::router::RouteOutcome::Routed(d) => d.worker,
            outcome => panic!("not routed: {outcome:?}"),
        };
        let request = RouteRequest::new(RequestId(1), Prompt::Tokens(&prompt));
        let mut counts = std::collections::BTreeMap::new();
        const ROUNDS: usize = 18_000;
        for _ in 0..ROUNDS {
            let picks = compare(&mut r, now, &request).expect("the scans agree");
            let pick = picks[0].expect("a pick");
            *counts.entry(pick).or_insert(0usize) += 1;
            // compare() leaves the generator as it was: move it on.
            r.rng.next_u64();
        }
        let tied: Vec<WorkerKey> = keys
            .iter()
            .enumerate()
            .filter(|&(i, &k)| i != 3 && i != 6 && k != loaded)
            .map(|(_, &k)| k)
            .collect();
        assert_eq!(tied.len(), 9, "the loaded worker is one of the ten not draining");
        assert_eq!(counts.keys().copied().collect::<Vec<_>>(), tied, "{counts:?}");
        let expect = ROUNDS / tied.len();
        for (k, &n) in &counts {
            assert!(
                n.abs_diff(expect) < expect / 5,
                "{k}: {n} picks, expected about {expect}: {counts:?}"
            );
        }
    }
}
