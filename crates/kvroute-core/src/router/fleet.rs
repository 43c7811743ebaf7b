//! The fleet: every worker with its booked load, and every active request with its booking.
//!
//! This is the write model of the router's load prediction. Each request is booked on the worker
//! that decodes it and, while its prefill is pending, on its prefill worker if it has one. All
//! changes go through [`Fleet::book`], [`Fleet::prefill_done`], [`Fleet::add_output_block`] and
//! [`Fleet::free`]; in debug builds each of them ends by recomputing every worker's totals from
//! the requests and comparing ([`Fleet::check_invariants`]).
//!
//! The fleet also keeps, per spec class, the set of its **idle** workers (nothing booked, not
//! draining) and the set of **loaded** workers (something booked), as vectors with each worker's
//! position ([`Membership`]), so a worker joins or leaves one in O(1) and a uniform pick in a set
//! is one index. A worker moves between them only where a booking comes or goes on it
//! ([`Fleet::book`], [`Fleet::prefill_done`], [`Fleet::free`] and everything built on them: peer
//! bookings, peer loss, expiry, removal) and where it starts draining; adding or removing a
//! worker shifts slots and rebuilds them. The argmin scan (`scan` module) reads them to visit
//! only the loaded workers and the idle ones the prompt overlaps.
//!
//! When a policy of the router weighs the cost, the fleet also keeps, per role, its loaded
//! workers ordered by their **floor** ([`scan::floor`]: the part of the lowest cost a worker can
//! have that no request changes, under the weights of the stage the role belongs to), updated
//! wherever a worker's load changes ([`Fleet::order_by`], [`Fleet::ordered`]). The argmin scan
//! visits them in that order and stops where the floor rules out the rest. It keeps the loaded
//! workers that compute prompts ordered by their load, too, so the fleet's load
//! ([`Fleet::load_of_least_loaded_computing`]) is the first of them, not a pass over the fleet.

use hashbrown::HashMap;
use std::collections::BTreeSet;
use std::sync::Arc;

use super::chain_trie::{NodeId, Touched};
use super::churn::Churn;
use super::cost::CostParams;
use super::load::{ActiveDepth, LoadState, Share, WorkerLoad, staged_len};
use super::lows::{LoadedLows, Lows};
use super::scan;
use super::sync::{Booking, RouterId};
use super::worker::{WorkerRole, WorkerSpec};
use crate::ids::{RequestId, SequenceHash, WorkerKey};
use crate::key_hasher::BuildKeyHasher;
use crate::time::Timestamp;

/// A request as the fleet names it: the router that booked it and that router's id for it.
pub(crate) type RequestKey = (RouterId, RequestId);

/// One worker.
#[derive(Clone, Debug)]
pub(crate) struct FleetWorker {
    pub(crate) spec: WorkerSpec,
    /// Takes no new requests (drained, or suspended).
    pub(crate) draining: bool,
    /// Out of routing for failing its health checks ([`Fleet::suspend`]): its bookings stay
    /// until their requests end, and [`Fleet::resume`] brings it back.
    pub(crate) suspended: bool,
    /// Workers whose specs are equal but for the key share a class (see `Fleet::classes`).
    pub(crate) class: u32,
    load: LoadState,
    member: Membership,
    /// Its recent evictions (see the `churn` module).
    churn: Churn,
}

/// Which of the fleet's sets a worker is in, and where (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Membership {
    /// Nothing booked, not draining: at this position of its class's idle set.
    Idle(u32),
    /// Something booked (draining or not): at this position of the loaded set.
    Loaded(u32),
    /// Nothing booked and draining: in neither set.
    DrainingIdle,
}

impl FleetWorker {
    /// Asks for the cache lines a cost reads (its spec, load and churn) ahead of their use;
    /// changes nothing.
    pub(crate) fn prefetch(&self) {
        kvroute_prefetch::prefetch_read(&self.spec);
        kvroute_prefetch::prefetch_read(&self.churn);
        self.load.prefetch();
    }

    pub(crate) fn load(&self) -> WorkerLoad {
        self.load.snapshot()
    }

    /// The fraction of its cache it evicted lately, at `now` (see the `churn` module); 0 when
    /// nothing is booked here: an idle worker is not hot, and every idle worker of a class then
    /// costs alike (the argmin scan's bulk).
    pub(crate) fn eviction_pressure(&self, now: Timestamp) -> f64 {
        if self.is_idle() {
            return 0.0;
        }
        self.churn.pressure(now, self.spec.capacity_blocks)
    }

    /// Its eviction pressure as a number decay leaves alone (see `Churn::key`).
    fn churn_key(&self) -> f64 {
        self.churn.key(self.spec.capacity_blocks)
    }

    /// See `LoadState::areas_at`.
    pub(crate) fn areas_at(&self, now: Timestamp) -> (u128, u128) {
        self.load.areas_at(now)
    }

    pub(crate) fn depth(&self, chain: &[SequenceHash], hint: u32) -> ActiveDepth {
        self.load.depth(chain, hint)
    }

    /// Whether nothing is booked here (`LoadState::is_idle`): no request is, since every total
    /// is recomputed from the requests (checked after every change in debug builds).
    pub(crate) fn is_idle(&self) -> bool {
        debug_assert_eq!(self.load.requests() == 0, self.load.is_idle());
        self.load.requests() == 0
    }

    /// Which of the fleet's sets it is in.
    pub(crate) fn membership(&self) -> Membership {
        self.member
    }

    /// The membership its state calls for, the position aside (0).
    fn wanted(&self) -> Membership {
        match (self.is_idle(), self.draining) {
            (false, _) => Membership::Loaded(0),
            (true, false) => Membership::Idle(0),
            (true, true) => Membership::DrainingIdle,
        }
    }
}

/// Whether two memberships name the same set, positions aside.
fn same_set(a: Membership, b: Membership) -> bool {
    std::mem::discriminant(&a) == std::mem::discriminant(&b)
}

/// One active request.
#[derive(Clone, Debug)]
struct Active {
    booking: Booking,
    admitted: Timestamp,
    prefill_pending: bool,
    output_blocks: u32,
    /// Its chain's nodes in its decode worker's active set when booked: the hint that spares
    /// their lookups when its prefill ends and when it is freed.
    path: Box<[NodeId]>,
}

/// Why the fleet refused a change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FleetError {
    UnknownWorker(WorkerKey),
    DuplicateRequest,
}

/// See the module docs.
#[derive(Clone, Debug, Default)]
pub(crate) struct Fleet {
    /// Ordered by key.
    workers: Vec<FleetWorker>,
    /// Every distinct spec (its key aside) seen, indexed by class; never shrinks.
    classes: Vec<WorkerSpec>,
    slot_of: HashMap<WorkerKey, usize, BuildKeyHasher>,
    /// Per class, the slots of its idle workers (see the module docs).
    idle: Vec<Vec<u32>>,
    /// Whether some worker is a prefill worker (draining or not).
    prefill_workers: bool,
    /// The slots of the workers with something booked.
    loaded: Vec<u32>,
    requests: HashMap<RequestKey, Active, BuildKeyHasher>,
    by_age: BTreeSet<(Timestamp, RequestKey)>,
    scratch: Touched,
    /// The router's time: load changes are integrated up to it (`LoadState::accrue`).
    clock: Timestamp,
    /// The loaded workers per role, by floor (see the module docs).
    order: LoadedOrder,
    /// The loaded workers that compute prompts and are not draining, by their load as
    /// [`Fleet::load_of_least_loaded_computing`] reads it: `(its bits, slot)`.
    computing: BTreeSet<(u64, u32)>,
    /// Per slot, the bits of the load it is filed under in `computing`, if it is there.
    computing_keys: Vec<Option<u64>>,
    /// What every loaded worker has at least (see the `lows` module).
    lows: LoadedLows,
    /// Per slot, its worker's role and whether it is draining, apart from the workers: the
    /// argmin scan sorts out the workers a prompt overlaps without reading them.
    intake: Vec<Intake>,
}

/// A worker's role and whether it is draining (see [`Fleet::intake_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Intake {
    pub(crate) role: WorkerRole,
    pub(crate) draining: bool,
}

impl Intake {
    fn of(w: &FleetWorker) -> Self {
        Intake {
            role: w.spec.role,
            draining: w.draining,
        }
    }
}

/// The loaded workers of each role ordered by their floor (see the module docs); kept only
/// once [`Fleet::order_by`] names the weights.
#[derive(Clone, Debug, Default)]
struct LoadedOrder {
    /// The weights per role ([`role_index`]), `None` for a role whose stage weighs no cost (its
    /// workers are then ordered by slot alone); `None` altogether: no order is kept.
    params: Option<[Option<CostParams>; 3]>,
    block_size: u32,
    /// Per role, `(floor's bits, slot)` of its loaded workers.
    sets: [BTreeSet<(u64, u32)>; 3],
    /// Per slot, the floor's bits it is filed under, if it is in a set.
    keys: Vec<Option<u64>>,
    /// An empty prompt's chain, for the floors' request.
    empty: Arc<[crate::ids::SequenceHash]>,
}

/// The index of `role` in [`LoadedOrder`]'s arrays.
fn role_index(role: WorkerRole) -> usize {
    match role {
        WorkerRole::Aggregated => 0,
        WorkerRole::Prefill => 1,
        WorkerRole::Decode => 2,
    }
}

impl LoadedOrder {
    /// The key `w` is filed under (`None`: in no set).
    fn key(&self, w: &FleetWorker) -> Option<u64> {
        let params = self.params.as_ref()?;
        if !matches!(w.member, Membership::Loaded(_)) {
            return None;
        }
        let floor = params[role_index(w.spec.role)].map_or(0.0, |p| {
            scan::floor(&p, self.block_size, &self.empty, &w.spec, &w.load())
        });
        // Non-negative (the weights and loads are), so the bits order as the values do; `+ 0.0`
        // turns a -0 into 0.
        Some((floor + 0.0).to_bits())
    }
}

impl Fleet {
    /// Sets the time that load changes from now on happen at (the router's clock, which never
    /// goes back).
    pub(crate) fn set_clock(&mut self, now: Timestamp) {
        self.clock = now;
    }

    // ---- workers ----

    /// Every worker, ordered by key.
    pub(crate) fn workers(&self) -> &[FleetWorker] {
        &self.workers
    }

    /// `worker` evicted `blocks` blocks at `now` (its `Removed` events); false if unknown.
    pub(crate) fn record_evictions(&mut self, worker: WorkerKey, now: Timestamp, blocks: usize) -> bool {
        let Some(&slot) = self.slot_of.get(&worker) else {
            return false;
        };
        self.workers[slot].churn.record(now, blocks);
        self.lows.recorded(now);
        self.lows.rekey(slot, self.workers[slot].churn_key());
        true
    }

    /// What every loaded worker has at least at `now`: requests booked and eviction pressure
    /// (the argmin scan's bound on the workers it has not visited).
    pub(crate) fn lows(&mut self, now: Timestamp) -> Lows {
        let workers = &self.workers;
        let keys = self.loaded.iter().map(|&slot| workers[slot as usize].churn_key());
        self.lows.at(now, keys)
    }

    /// The role of the worker at `slot` and whether it is draining, read without it.
    pub(crate) fn intake_of(&self, slot: usize) -> Intake {
        self.intake[slot]
    }

    /// The requests booked on the worker at `slot` (0 if it is not loaded), read without its
    /// load (see the `lows` module).
    pub(crate) fn booked_of(&self, slot: usize) -> u32 {
        self.lows.requests_of(slot)
    }

    /// At most the eviction pressure of the worker at `slot` at `now`, read without it (see the
    /// `lows` module).
    pub(crate) fn pressure_floor_of(&self, slot: usize, now: Timestamp) -> f64 {
        self.lows.pressure_of(slot, now)
    }

    pub(crate) fn get(&self, key: WorkerKey) -> Option<&FleetWorker> {
        self.slot_of.get(&key).map(|&slot| &self.workers[slot])
    }

    /// Per spec class, the slots of its idle workers (nothing booked, not draining), in no
    /// particular but deterministic order.
    pub(crate) fn idle_sets(&self) -> &[Vec<u32>] {
        &self.idle
    }

    /// Whether some worker (draining or not) is a prefill worker.
    pub(crate) fn has_prefill_workers(&self) -> bool {
        self.prefill_workers
    }

    /// The slots of the workers with something booked, in no particular but deterministic order.
    pub(crate) fn loaded(&self) -> &[u32] {
        &self.loaded
    }

    /// Keeps the loaded workers of each role ordered by their floor under the weights of the
    /// stage it belongs to: `decode` for aggregated and decode workers, `prefill` for prefill
    /// workers (`None`: that stage weighs no cost), with prompts of `block_size`-token blocks.
    pub(crate) fn order_by(
        &mut self,
        decode: Option<CostParams>,
        prefill: Option<CostParams>,
        block_size: u32,
    ) {
        let mut params = [None; 3];
        params[role_index(WorkerRole::Aggregated)] = decode;
        params[role_index(WorkerRole::Decode)] = decode;
        params[role_index(WorkerRole::Prefill)] = prefill;
        self.order = LoadedOrder {
            params: Some(params),
            block_size,
            empty: Arc::from(Vec::new()),
            ..LoadedOrder::default()
        };
        self.reindex();
    }

    /// The loaded workers of `role` in ascending floor, each with its floor, if the fleet keeps
    /// them ordered under `params` (see the module docs); `None` otherwise.
    pub(crate) fn ordered(
        &self,
        role: WorkerRole,
        params: &CostParams,
    ) -> Option<impl Iterator<Item = (f64, usize)> + Clone + '_> {
        let i = role_index(role);
        (self.order.params.as_ref()?[i].as_ref() == Some(params)).then(|| {
            self.order.sets[i]
                .iter()
                .map(|&(bits, slot)| (f64::from_bits(bits), slot as usize))
        })
    }

    /// Per slot, the bits of the floor of each loaded worker, if the fleet keeps every role of
    /// `roles` ordered under `params` (see the module docs).
    pub(crate) fn floors(&self, roles: &[WorkerRole], params: &CostParams) -> Option<&[Option<u64>]> {
        let weights = self.order.params.as_ref()?;
        roles
            .iter()
            .all(|&r| weights[role_index(r)].as_ref() == Some(params))
            .then_some(&self.order.keys[..])
    }

    /// Files the worker at `slot` under its floor and its load as they now stand.
    fn reorder(&mut self, slot: usize) {
        // In [0, 1], so the bits order as the values do.
        let key = self.computing_load(slot).map(f64::to_bits);
        let old = self.computing_keys[slot];
        if key != old {
            if let Some(old) = old {
                self.computing.remove(&(old, slot as u32));
            }
            if let Some(key) = key {
                self.computing.insert((key, slot as u32));
            }
            self.computing_keys[slot] = key;
        }
        let w = &self.workers[slot];
        let loaded = matches!(w.member, Membership::Loaded(_));
        self.lows.refile(slot, if loaded { w.load.requests() } else { 0 });
        let order = &mut self.order;
        if order.params.is_none() {
            return;
        }
        let w = &self.workers[slot];
        let key = order.key(w);
        let old = order.keys[slot];
        if key == old {
            return;
        }
        let set = &mut order.sets[role_index(w.spec.role)];
        if let Some(old) = old {
            set.remove(&(old, slot as u32));
        }
        if let Some(key) = key {
            set.insert((key, slot as u32));
        }
        order.keys[slot] = key;
    }

    /// The load of the least loaded worker that computes prompts (aggregated or prefill, not
    /// draining), in `[0, 1]`: the larger of its booked requests over its `max_requests` and its
    /// booked decode blocks over its capacity; 0 while one of them has nothing booked, or if
    /// there is none (`Router::fleet_load`).
    pub(crate) fn load_of_least_loaded_computing(&self) -> f64 {
        let computes = |slot: u32| {
            let w = &self.workers[slot as usize];
            !w.draining && w.spec.role.tracks_prefill()
        };
        // An idle set's workers share a spec (so a role) and none drains.
        if self
            .idle
            .iter()
            .any(|set| set.first().is_some_and(|&slot| computes(slot)))
        {
            return 0.0;
        }
        self.computing
            .first()
            .map_or(0.0, |&(bits, _)| f64::from_bits(bits))
    }

    /// The load [`Fleet::load_of_least_loaded_computing`] reads of the worker at `slot`, if it
    /// is loaded, not draining and computes prompts.
    fn computing_load(&self, slot: usize) -> Option<f64> {
        let w = &self.workers[slot];
        if w.draining || !w.spec.role.tracks_prefill() || !matches!(w.member, Membership::Loaded(_)) {
            return None;
        }
        let load = w.load();
        let requests = f64::from(load.requests) / w.spec.max_requests.max(1) as f64;
        let blocks = load.decode_blocks as f64 / w.spec.capacity_blocks.max(1) as f64;
        Some(requests.max(blocks).min(1.0))
    }

    /// The position of `key` in [`Fleet::workers`].
    pub(crate) fn slot(&self, key: WorkerKey) -> Option<usize> {
        self.slot_of.get(&key).copied()
    }

    /// Adds a worker; false if it is already there.
    pub(crate) fn add_worker(&mut self, spec: WorkerSpec) -> bool {
        let Err(at) = self.workers.binary_search_by_key(&spec.key, |w| w.spec.key) else {
            return false;
        };
        let class = match self
            .classes
            .iter()
            .position(|c| WorkerSpec { key: c.key, ..spec } == *c)
        {
            Some(class) => class,
            None => {
                self.classes.push(spec);
                self.idle.push(Vec::new());
                self.classes.len() - 1
            }
        };
        self.workers.insert(
            at,
            FleetWorker {
                spec,
                draining: false,
                suspended: false,
                class: class as u32,
                load: LoadState::default(),
                member: Membership::DrainingIdle,
                churn: Churn::default(),
            },
        );
        self.reindex();
        self.debug_check();
        true
    }

    /// Marks a worker as taking no new requests; false if unknown. A drain is for good: a
    /// suspended worker drained is no longer resumed.
    pub(crate) fn drain(&mut self, key: WorkerKey) -> bool {
        self.set_intake(key, true, false)
    }

    /// Takes a worker out of routing until [`Fleet::resume`]: it takes no new requests, and
    /// keeps what is booked on it until those requests end. False if unknown.
    pub(crate) fn suspend(&mut self, key: WorkerKey) -> bool {
        self.set_intake(key, true, true)
    }

    /// Brings a suspended worker back into routing, with whatever is still booked on it. False
    /// if it is unknown or not suspended.
    pub(crate) fn resume(&mut self, key: WorkerKey) -> bool {
        if !self.get(key).is_some_and(|w| w.suspended) {
            return false;
        }
        self.set_intake(key, false, false)
    }

    fn set_intake(&mut self, key: WorkerKey, draining: bool, suspended: bool) -> bool {
        let Some(slot) = self.slot(key) else { return false };
        let w = &mut self.workers[slot];
        (w.draining, w.suspended) = (draining, suspended);
        self.intake[slot] = Intake::of(w);
        self.settle(slot);
        self.debug_check();
        true
    }

    /// Removes a worker, first freeing every request booked on it; returns those requests in key
    /// order, or `None` if the worker is unknown.
    pub(crate) fn remove_worker(&mut self, key: WorkerKey) -> Option<Vec<RequestKey>> {
        let slot = self.slot(key)?;
        let mut dropped: Vec<RequestKey> = self
            .requests
            .iter()
            .filter(|(_, a)| {
                a.booking.worker == key || (a.prefill_pending && a.booking.prefill_worker == Some(key))
            })
            .map(|(&k, _)| k)
            .collect();
        dropped.sort_unstable();
        for &k in &dropped {
            self.free(k);
        }
        self.workers.remove(slot);
        self.reindex();
        self.debug_check();
        Some(dropped)
    }

    /// Rebuilds the slot map and the idle and loaded sets (slots shifted).
    fn reindex(&mut self) {
        self.slot_of = self
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| (w.spec.key, i))
            .collect();
        self.prefill_workers = self.workers.iter().any(|w| w.spec.role == WorkerRole::Prefill);
        self.idle.iter_mut().for_each(Vec::clear);
        self.loaded.clear();
        self.order.sets.iter_mut().for_each(BTreeSet::clear);
        self.order.keys.clear();
        self.order.keys.resize(self.workers.len(), None);
        self.computing.clear();
        self.computing_keys.clear();
        self.computing_keys.resize(self.workers.len(), None);
        self.lows.reset(self.workers.len());
        self.intake = self.workers.iter().map(Intake::of).collect();
        for slot in 0..self.workers.len() {
            self.lows.rekey(slot, self.workers[slot].churn_key());
            self.workers[slot].member = Membership::DrainingIdle;
            self.join(slot);
            self.reorder(slot);
        }
    }

    // ---- the idle and loaded sets ----

    /// Moves the worker at `slot` to the set its state calls for, if it is not there, and files
    /// it under its floor.
    fn settle(&mut self, slot: usize) {
        let w = &self.workers[slot];
        if !same_set(w.member, w.wanted()) {
            self.leave(slot);
            self.join(slot);
        }
        self.reorder(slot);
    }

    /// Takes the worker at `slot` out of its set (swap-remove).
    fn leave(&mut self, slot: usize) {
        let w = &self.workers[slot];
        let (set, pos) = match w.member {
            Membership::Idle(pos) => (&mut self.idle[w.class as usize], pos),
            Membership::Loaded(pos) => (&mut self.loaded, pos),
            Membership::DrainingIdle => return,
        };
        set.swap_remove(pos as usize);
        if let Some(&moved) = set.get(pos as usize) {
            let m = &mut self.workers[moved as usize].member;
            *m = match *m {
                Membership::Idle(_) => Membership::Idle(pos),
                _ => Membership::Loaded(pos),
            };
        }
        self.workers[slot].member = Membership::DrainingIdle;
    }

    /// Puts the worker at `slot`, in no set, into the one its state calls for.
    fn join(&mut self, slot: usize) {
        let w = &mut self.workers[slot];
        let set = match w.wanted() {
            Membership::Idle(_) => &mut self.idle[w.class as usize],
            Membership::Loaded(_) => &mut self.loaded,
            Membership::DrainingIdle => return,
        };
        let pos = set.len() as u32;
        set.push(slot as u32);
        w.member = match w.wanted() {
            Membership::Idle(_) => Membership::Idle(pos),
            _ => Membership::Loaded(pos),
        };
        if matches!(w.member, Membership::Loaded(_)) {
            self.lows.joined(w.churn_key());
        }
    }

    /// Checks the idle and loaded sets against every worker's state.
    fn check_sets(&self) -> Result<(), String> {
        let mut members = 0;
        for (slot, w) in self.workers.iter().enumerate() {
            if !same_set(w.member, w.wanted()) {
                return Err(format!(
                    "worker {} is in {:?}, wants {:?}",
                    w.spec.key,
                    w.member,
                    w.wanted()
                ));
            }
            let at = match w.member {
                Membership::Idle(pos) => self.idle[w.class as usize].get(pos as usize),
                Membership::Loaded(pos) => self.loaded.get(pos as usize),
                Membership::DrainingIdle => continue,
            };
            if at != Some(&(slot as u32)) {
                return Err(format!(
                    "worker {} ({:?}) is not where it says",
                    w.spec.key, w.member
                ));
            }
            members += 1;
        }
        if !self
            .workers
            .iter()
            .map(Intake::of)
            .eq(self.intake.iter().copied())
        {
            return Err("the workers' roles and intake kept per slot are stale".to_owned());
        }
        if self.prefill_workers != self.workers.iter().any(|w| w.spec.role == WorkerRole::Prefill) {
            return Err("the prefill-worker flag is stale".to_owned());
        }
        let sizes = self.loaded.len() + self.idle.iter().map(Vec::len).sum::<usize>();
        if sizes != members {
            return Err(format!("the sets hold {sizes} slots for {members} members"));
        }
        let loaded = self.loaded.iter().map(|&slot| {
            let w = &self.workers[slot as usize];
            (slot as usize, w.load.requests(), w.churn_key())
        });
        self.lows.check(loaded)?;
        self.check_order()
    }

    /// Checks the orders of the loaded workers against a recomputation of every floor and load.
    fn check_order(&self) -> Result<(), String> {
        let computing: BTreeSet<(u64, u32)> = (0..self.workers.len())
            .filter_map(|slot| Some((self.computing_load(slot)?.to_bits(), slot as u32)))
            .collect();
        if computing != self.computing {
            return Err("the computing workers' order is stale".to_owned());
        }
        let order = &self.order;
        if order.params.is_none() {
            return Ok(());
        }
        let mut sets: [BTreeSet<(u64, u32)>; 3] = Default::default();
        for (slot, w) in self.workers.iter().enumerate() {
            let key = order.key(w);
            if order.keys.get(slot) != Some(&key) {
                return Err(format!("worker {} is filed under a stale floor", w.spec.key));
            }
            if let Some(key) = key {
                sets[role_index(w.spec.role)].insert((key, slot as u32));
            }
        }
        if sets != order.sets || order.keys.len() != self.workers.len() {
            return Err("the loaded workers' order is stale".to_owned());
        }
        Ok(())
    }

    // ---- requests ----

    pub(crate) fn contains(&self, key: RequestKey) -> bool {
        self.requests.contains_key(&key)
    }

    pub(crate) fn active_count(&self) -> usize {
        self.requests.len()
    }

    /// Books a request admitted at `now`.
    pub(crate) fn book(
        &mut self,
        now: Timestamp,
        key: RequestKey,
        booking: Booking,
    ) -> Result<(), FleetError> {
        if self.requests.contains_key(&key) {
            return Err(FleetError::DuplicateRequest);
        }
        for worker in std::iter::once(booking.worker).chain(booking.prefill_worker) {
            if !self.slot_of.contains_key(&worker) {
                return Err(FleetError::UnknownWorker(worker));
            }
        }
        let mut active = Active {
            booking,
            admitted: now,
            prefill_pending: true,
            output_blocks: 0,
            path: Box::default(),
        };
        self.apply(&active, LoadState::book);
        active.path = self.scratch.path.as_slice().into();
        self.by_age.insert((now, key));
        self.requests.insert(key, active);
        self.debug_check();
        Ok(())
    }

    /// The request's first token came; false if it is unknown. A second first token is a no-op.
    pub(crate) fn prefill_done(&mut self, key: RequestKey) -> bool {
        let Some(mut active) = self.requests.remove(&key) else {
            return false;
        };
        if active.prefill_pending {
            let (decode, slot) = self.decode_share(&active);
            self.workers[slot].load.accrue(self.clock);
            self.workers[slot].load.finish_prefill(decode, &mut self.scratch);
            self.reorder(slot);
            if let Some((share, slot)) = self.prefill_share(&active) {
                self.workers[slot].load.accrue(self.clock);
                self.workers[slot].load.free(share, &mut self.scratch);
                self.settle(slot);
            }
            active.prefill_pending = false;
        }
        self.requests.insert(key, active);
        self.debug_check();
        true
    }

    /// One more output block for the request; false if it is unknown.
    pub(crate) fn add_output_block(&mut self, key: RequestKey) -> bool {
        let Some(active) = self.requests.get_mut(&key) else {
            return false;
        };
        let slot = self.slot_of[&active.booking.worker];
        let worker = &mut self.workers[slot];
        if worker.spec.role.tracks_decode() {
            worker.load.accrue(self.clock);
            worker.load.add_output_block();
            active.output_blocks += 1;
            self.reorder(slot);
        }
        self.debug_check();
        true
    }

    /// Frees a request; false if it is unknown.
    pub(crate) fn free(&mut self, key: RequestKey) -> bool {
        let Some(active) = self.requests.remove(&key) else {
            return false;
        };
        self.by_age.remove(&(active.admitted, key));
        self.apply(&active, LoadState::free);
        self.debug_check();
        true
    }

    /// Frees every request admitted at or before `cutoff`, oldest first, and returns them.
    pub(crate) fn expire(&mut self, cutoff: Timestamp) -> Vec<RequestKey> {
        let mut expired = Vec::new();
        while let Some(&(admitted, key)) = self.by_age.first()
            && admitted <= cutoff
        {
            self.free(key);
            expired.push(key);
        }
        expired
    }

    /// The requests booked by `router`, in key order.
    pub(crate) fn keys_of(&self, router: RouterId) -> Vec<RequestKey> {
        let mut keys: Vec<RequestKey> = self.requests.keys().filter(|k| k.0 == router).copied().collect();
        keys.sort_unstable();
        keys
    }

    /// The bookings of `router`'s requests in admission order (then by id), each with whether
    /// its prefill is done.
    pub(crate) fn bookings_of(
        &self,
        router: RouterId,
    ) -> impl Iterator<Item = (RequestId, &Booking, bool)> + '_ {
        self.by_age
            .iter()
            .filter(move |(_, key)| key.0 == router)
            .map(|(_, key)| {
                let active = &self.requests[key];
                (key.1, &active.booking, !active.prefill_pending)
            })
    }

    /// The oldest admission time among active requests.
    pub(crate) fn oldest(&self) -> Option<Timestamp> {
        self.by_age.first().map(|&(t, _)| t)
    }

    /// Applies `op` (book or free) to every share of `active`.
    fn apply(&mut self, active: &Active, op: fn(&mut LoadState, Share<'_>, &mut Touched)) {
        let (decode, slot) = self.decode_share(active);
        self.workers[slot].load.accrue(self.clock);
        op(&mut self.workers[slot].load, decode, &mut self.scratch);
        self.settle(slot);
        if let Some((share, slot)) = self.prefill_share(active) {
            self.workers[slot].load.accrue(self.clock);
            // No chain, so nothing in the scratch space: the decode share's stays there.
            op(&mut self.workers[slot].load, share, &mut Touched::default());
            self.settle(slot);
        }
    }

    /// The request's booking on the worker that decodes it, and that worker's slot.
    fn decode_share<'a>(&self, active: &'a Active) -> (Share<'a>, usize) {
        let b = &active.booking;
        let slot = self.slot_of[&b.worker];
        let role = self.workers[slot].spec.role;
        let chain = role.tracks_decode().then_some(&b.chain);
        let local_prefill = role.tracks_prefill() && b.prefill_worker.is_none() && active.prefill_pending;
        let share = Share {
            chain,
            path: &active.path,
            staged_len: staged_len(
                role,
                active.prefill_pending,
                b.overlap_blocks,
                b.chain.len() as u32,
            ),
            prefill_tokens: local_prefill.then_some(b.hint.tokens),
            output_blocks: active.output_blocks,
        };
        (share, slot)
    }

    /// The request's booking on its prefill worker, while its prefill is pending there.
    fn prefill_share<'a>(&self, active: &'a Active) -> Option<(Share<'a>, usize)> {
        let worker = active.booking.prefill_worker.filter(|_| active.prefill_pending)?;
        let slot = self.slot_of[&worker];
        let tokens = self.workers[slot]
            .spec
            .role
            .tracks_prefill()
            .then_some(active.booking.hint.tokens);
        Some((
            Share {
                chain: None,
                path: &[],
                staged_len: 0,
                prefill_tokens: tokens,
                output_blocks: 0,
            },
            slot,
        ))
    }

    // ---- invariants ----

    /// Recomputes every worker's totals from the active requests and compares them with the
    /// running totals; also checks the age index and the idle and loaded sets. Returns the first
    /// difference.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut shares: Vec<Vec<Share<'_>>> = vec![Vec::new(); self.workers.len()];
        let mut keys: Vec<&RequestKey> = self.requests.keys().collect();
        keys.sort_unstable();
        for key in keys {
            let active = &self.requests[key];
            if !self.by_age.contains(&(active.admitted, *key)) {
                return Err(format!("request {key:?} is missing from the age index"));
            }
            let (share, slot) = self.decode_share(active);
            shares[slot].push(share);
            if let Some((share, slot)) = self.prefill_share(active) {
                shares[slot].push(share);
            }
        }
        if self.by_age.len() != self.requests.len() {
            return Err(format!(
                "{} requests but {} in the age index",
                self.requests.len(),
                self.by_age.len()
            ));
        }
        for (worker, shares) in self.workers.iter().zip(&shares) {
            worker
                .load
                .check(shares)
                .map_err(|e| format!("worker {}: {e}", worker.spec.key))?;
        }
        self.check_sets()
    }

    #[inline]
    fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if let Err(e) = self.check_invariants() {
            panic!("router load invariant broken: {e}");
        }
    }
}
