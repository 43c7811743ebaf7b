//! A state-machine property test of [`PrefixIndex`] against the literal reference of
//! `shared/bench/OPSTREAM.md`.
//!
//! The reference keeps, per worker, a set `held` of ext hashes and a map
//! `child[(parent ext or ROOT, local)] = ext` that every store fills and nothing shrinks. A match
//! walks `child` from ROOT along the query and stops at the first missing entry or the first ext
//! that is not held. Ext hashes are the router chain of the locals (`next_sequence_hash`), so
//! the producer guarantee "ext identifies a prefix" holds; under it, never shrinking `child`
//! (OPSTREAM.md) and dropping it on a clear (`check_opstream.py`) give the same answers.
//!
//! Local hashes come from a four-letter alphabet, so chains of different workers and of one
//! worker share prefixes and branch. The alphabet holds 0 and `u64::MAX` on purpose: a root
//! block's ext is its local hash, so ext 0 and ext `u64::MAX` are exercised too.
//!
//! Two shapes run, each on both layouts: up to six workers (one mask word), and 70 workers added
//! up front with most operations aimed at the ones in slots 64 and up (the index keeps those in
//! wide holder sets, with their own lookup walk).
//!
//! After every transition the test checks the index's own invariants, the worker set, every
//! worker's held blocks (`block_count`, `held_blocks`, `holds`), the counters of `stats`, the
//! footprint's entries and node count (distinct held prefixes plus their ancestors), and the
//! answer to a lookup of every chain stored so far. Stores may be made to fail on purpose (a
//! parent that is not held, an ext already held at another place, a second ext for a held
//! prefix); the error and the number of blocks applied before it must match the reference.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::marker::PhantomData;

use kvroute_core::hash::next_sequence_hash;
use kvroute_core::ids::{DpRank, ExternalBlockHash, LocalBlockHash, SequenceHash, WorkerId, WorkerKey};
use kvroute_core::index::{
    IndexConfig, IndexError, IndexLayout, IndexStats, OverlapScores, PrefixIndex, RunIndex, StoredBlock,
};
use proptest::prelude::*;
use proptest::sample::{Index, select};
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

/// Local hashes of every block in this test. Small, so prefixes collide and branch.
const ALPHABET: [u64; 4] = [0, 1, 0x9e37_79b9_7f4a_7c15, u64::MAX];

/// An ext hash no store ever produces (a chain hash equal to it is vanishingly unlikely).
const STRANGER: u64 = 0x5eed_0000_dead_beef;

/// What turns an ext hash into one that is not the chain hash of its place.
const GARBLE: u64 = 0x5555_5555_5555_5555;

/// The index key of test worker `id`. Two ids share a `WorkerId` and differ in `DpRank`, so the
/// rank must count as part of the key.
fn key(id: u64) -> WorkerKey {
    WorkerKey::new(WorkerId(id / 2), DpRank((id % 2) as u32))
}

fn id_of(key: WorkerKey) -> u64 {
    key.worker.0 * 2 + u64::from(key.dp_rank.0)
}

/// The shape of one test: how many workers exist up front and which ids transitions pick.
trait Shape: Clone + Debug + 'static {
    /// Workers `0..PRE_ADDED` are added before the first transition.
    const PRE_ADDED: u64;
    /// Transitions name workers `0..IDS`; ids not added yet test `UnknownWorker`.
    const IDS: u64;
    /// Ids `HOT_FROM..IDS` are picked about half of the time.
    const HOT_FROM: u64;
    /// Stored chains looked up after every transition (the most recent ones first).
    const CHECKED_CHAINS: usize;
}

#[derive(Clone, Debug)]
struct Few;
impl Shape for Few {
    const PRE_ADDED: u64 = 0;
    const IDS: u64 = 6;
    const HOT_FROM: u64 = 0;
    const CHECKED_CHAINS: usize = 64;
}

#[derive(Clone, Debug)]
struct Many;
impl Shape for Many {
    const PRE_ADDED: u64 = 70;
    const IDS: u64 = 72;
    const HOT_FROM: u64 = 60;
    const CHECKED_CHAINS: usize = 16;
}

/// One worker in the literal reference.
#[derive(Clone, Debug, Default)]
struct WorkerModel {
    held: BTreeSet<u64>,
    /// `(parent ext or None for ROOT, local) -> ext`; filled by stores, never shrunk.
    child: BTreeMap<(Option<u64>, u64), u64>,
    /// Where each ext was stored: `(parent ext or None, local)`; never shrunk.
    place: BTreeMap<u64, (Option<u64>, u64)>,
}

impl WorkerModel {
    fn depth(&self, query: &[u64]) -> u32 {
        let mut prev = None;
        let mut depth = 0;
        for &local in query {
            match self.child.get(&(prev, local)) {
                Some(&ext) if self.held.contains(&ext) => {
                    depth += 1;
                    prev = Some(ext);
                }
                _ => break,
            }
        }
        depth
    }
}

/// What the reference says the last transition must return.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Expect {
    Nothing,
    Unit(Result<(), IndexError>),
    Count(Result<usize, IndexError>),
}

#[derive(Clone, Debug)]
struct Model<S> {
    workers: BTreeMap<u64, WorkerModel>,
    /// Every chain ext any store has produced, with its local-hash path. For generating
    /// transitions and for the node count.
    paths: BTreeMap<u64, Vec<u64>>,
    /// Chains in the order they were first stored (for the lookups after every transition).
    recent: Vec<u64>,
    stats: IndexStats,
    expect: Expect,
    _shape: PhantomData<S>,
}

#[derive(Clone, Debug)]
enum Transition {
    AddWorker(u64),
    RemoveWorker(u64),
    /// Stores `locals` under `parent`, each block's ext the chain hash of its place, except that
    /// `corrupt = Some((i, ext))` replaces the ext of block `i`.
    Store {
        w: u64,
        parent: Option<u64>,
        locals: Vec<u64>,
        corrupt: Option<(usize, u64)>,
    },
    Remove {
        w: u64,
        exts: Vec<u64>,
    },
    Clear(u64),
    Match {
        query: Vec<u64>,
        early_exit: bool,
    },
}

/// The blocks of a store: chain hashes from `parent`, with the optional corruption.
fn store_blocks(parent: Option<u64>, locals: &[u64], corrupt: Option<(usize, u64)>) -> Vec<StoredBlock> {
    let mut prev = parent.map(SequenceHash);
    let mut out = Vec::with_capacity(locals.len());
    for (i, &local) in locals.iter().enumerate() {
        let seq = next_sequence_hash(prev, LocalBlockHash(local));
        prev = Some(seq);
        let external = match corrupt {
            Some((at, ext)) if at == i => ExternalBlockHash(ext),
            _ => seq.into(),
        };
        out.push(StoredBlock {
            local: LocalBlockHash(local),
            external,
        });
    }
    out
}

/// What a store does to the reference: the result, and the blocks it newly holds
/// (`(parent, local, ext)`), in order.
struct StoreOutcome {
    result: Result<(), IndexError>,
    newly_held: Vec<(Option<u64>, u64, u64)>,
    /// `(parent, local, ext)` of every block applied, newly held or held already.
    applied: Vec<(Option<u64>, u64, u64)>,
}

impl<S: Shape> Model<S> {
    fn initial() -> Self {
        Model {
            workers: (0..S::PRE_ADDED).map(|w| (w, WorkerModel::default())).collect(),
            paths: BTreeMap::new(),
            recent: Vec::new(),
            stats: IndexStats::default(),
            expect: Expect::Nothing,
            _shape: PhantomData,
        }
    }

    fn simulate_store(&self, w: u64, parent: Option<u64>, blocks: &[StoredBlock]) -> StoreOutcome {
        let mut out = StoreOutcome {
            result: Ok(()),
            newly_held: Vec::new(),
            applied: Vec::new(),
        };
        let Some(m) = self.workers.get(&w) else {
            out.result = Err(IndexError::UnknownWorker(key(w)));
            return out;
        };
        if let Some(p) = parent
            && !m.held.contains(&p)
        {
            out.result = Err(IndexError::UnknownParent {
                worker: key(w),
                parent: ExternalBlockHash(p),
            });
            return out;
        }
        let mut held = m.held.clone();
        let mut place = m.place.clone();
        let mut child = m.child.clone();
        let mut prev = parent;
        for (applied, b) in blocks.iter().enumerate() {
            let (local, ext) = (b.local.0, b.external.0);
            if held.contains(&ext) {
                if place.get(&ext) != Some(&(prev, local)) {
                    out.result = Err(IndexError::ConflictingBlock {
                        worker: key(w),
                        external: b.external,
                        applied,
                    });
                    return out;
                }
            } else if child.get(&(prev, local)).is_some_and(|e| held.contains(e)) {
                out.result = Err(IndexError::DuplicatePrefix {
                    worker: key(w),
                    external: b.external,
                    applied,
                });
                return out;
            } else {
                held.insert(ext);
                place.insert(ext, (prev, local));
                child.insert((prev, local), ext);
                out.newly_held.push((prev, local, ext));
            }
            out.applied.push((prev, local, ext));
            prev = Some(ext);
        }
        out
    }

    /// Whether the reference can take the transition: a corrupted ext must never end up held,
    /// since the reference relies on ext hashes naming prefixes.
    fn admits(&self, t: &Transition) -> bool {
        match t {
            &Transition::Store {
                w,
                parent,
                ref locals,
                corrupt: Some((at, bad)),
            } => {
                if at >= locals.len() {
                    return false;
                }
                let genuine = store_blocks(parent, locals, None)[at].external.0;
                let outcome = self.simulate_store(w, parent, &store_blocks(parent, locals, Some((at, bad))));
                genuine == bad || !outcome.newly_held.iter().any(|&(_, _, e)| e == bad)
            }
            _ => true,
        }
    }

    /// Depths of every worker for `query`, depth 0 left out.
    fn depths(&self, query: &[u64]) -> BTreeMap<u64, u32> {
        self.workers
            .iter()
            .map(|(&w, m)| (w, m.depth(query)))
            .filter(|&(_, d)| d > 0)
            .collect()
    }

    /// The number of tree nodes the index must keep: every held prefix and its ancestors.
    fn live_prefixes(&self) -> usize {
        let mut prefixes: BTreeSet<&[u64]> = BTreeSet::new();
        for m in self.workers.values() {
            for ext in &m.held {
                let path = &self.paths[ext];
                for len in 1..=path.len() {
                    prefixes.insert(&path[..len]);
                }
            }
        }
        prefixes.len()
    }

    fn record_paths(&mut self, parent: Option<u64>, locals: &[u64]) {
        let mut path = parent.map(|p| self.paths[&p].clone()).unwrap_or_default();
        for block in store_blocks(parent, locals, None) {
            path.push(block.local.0);
            let ext = block.external.0;
            if let std::collections::btree_map::Entry::Vacant(slot) = self.paths.entry(ext) {
                slot.insert(path.clone());
                self.recent.push(ext);
            }
        }
    }
}

fn pick(values: &[u64], at: &Index) -> Option<u64> {
    (!values.is_empty()).then(|| values[at.index(values.len())])
}

/// Worker ids for an operation: mostly workers that exist (hot ones first), sometimes any id.
fn worker_ids<S: Shape>(existing: &BTreeMap<u64, WorkerModel>) -> BoxedStrategy<u64> {
    let all: Vec<u64> = existing.keys().copied().collect();
    let hot: Vec<u64> = all.iter().copied().filter(|&w| w >= S::HOT_FROM).collect();
    match (all.is_empty(), hot.is_empty()) {
        (true, _) => (0..S::IDS).boxed(),
        (false, true) => prop_oneof![4 => select(all), 1 => 0..S::IDS].boxed(),
        (false, false) => prop_oneof![2 => select(hot), 2 => select(all), 1 => 0..S::IDS].boxed(),
    }
}

fn locals_strategy(len: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Vec<u64>> + Clone {
    prop::collection::vec(select(&ALPHABET[..]), len)
}

impl<S: Shape> ReferenceStateMachine for Model<S> {
    type State = Self;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Self> {
        Just(Self::initial()).boxed()
    }

    fn transitions(state: &Self) -> BoxedStrategy<Transition> {
        let held: BTreeMap<u64, Vec<u64>> = state
            .workers
            .iter()
            .map(|(&w, m)| (w, m.held.iter().copied().collect()))
            .collect();
        let universe: Vec<u64> = state.paths.keys().copied().collect();
        let paths = state.paths.clone();
        let ids = worker_ids::<S>(&state.workers);

        let (h1, h2, h3, h4) = (held.clone(), held.clone(), held.clone(), held);
        let (u1, u2, u3) = (universe.clone(), universe.clone(), universe.clone());
        let (p1, p2, p3) = (paths.clone(), paths.clone(), paths);
        let u4 = universe;

        // A store under the root or a held parent; now and then under a block not held.
        let store = (ids.clone(), any::<Index>(), 0..10u8, locals_strategy(1..=4)).prop_map(
            move |(w, at, kind, locals)| {
                let mine = h1.get(&w).map(Vec::as_slice).unwrap_or_default();
                let parent = match kind {
                    0..=2 => None,
                    9 => Some(pick(&u1, &at).filter(|e| !mine.contains(e)).unwrap_or(STRANGER)),
                    _ => pick(mine, &at),
                };
                Transition::Store {
                    w,
                    parent,
                    locals,
                    corrupt: None,
                }
            },
        );
        // A store whose block `i` carries an ext the worker holds at another place.
        let conflicting = (
            ids.clone(),
            any::<Index>(),
            any::<Index>(),
            any::<Index>(),
            locals_strategy(1..=4),
        )
            .prop_map(move |(w, at_parent, at_bad, at_pos, locals)| {
                let mine = h2.get(&w).map(Vec::as_slice).unwrap_or_default();
                let parent = pick(mine, &at_parent).filter(|_| at_parent.index(3) > 0);
                let corrupt = pick(mine, &at_bad).map(|bad| (at_pos.index(locals.len()), bad));
                Transition::Store {
                    w,
                    parent,
                    locals,
                    corrupt,
                }
            });
        // A store that repeats a held chain from one of its held ancestors (or the root), with
        // a new ext for its last block: a second ext for a held prefix.
        let duplicate = (
            ids.clone(),
            any::<Index>(),
            any::<Index>(),
            locals_strategy(0..=1),
        )
            .prop_map(move |(w, at_block, at_cut, extra)| {
                let mine = h3.get(&w).map(Vec::as_slice).unwrap_or_default();
                let Some(target) = pick(mine, &at_block) else {
                    return Transition::Store {
                        w,
                        parent: None,
                        locals: extra,
                        corrupt: None,
                    };
                };
                let path = &p1[&target];
                // Held proper ancestors of the target (and the root) can be its parent.
                let chain: Vec<u64> = store_blocks(None, path, None)
                    .iter()
                    .map(|b| b.external.0)
                    .collect();
                let cuts: Vec<usize> = (0..path.len())
                    .filter(|&cut| cut == 0 || mine.contains(&chain[cut - 1]))
                    .collect();
                let cut = cuts[at_cut.index(cuts.len())];
                let parent = cut.checked_sub(1).map(|i| chain[i]);
                let mut locals = path[cut..].to_vec();
                let at = locals.len() - 1;
                locals.extend(extra);
                Transition::Store {
                    w,
                    parent,
                    locals,
                    corrupt: Some((at, target ^ GARBLE)),
                }
            });
        let remove = (
            ids.clone(),
            prop::collection::vec((any::<Index>(), 0..5u8), 0..=4),
        )
            .prop_map(move |(w, picks)| {
                let mine = h4.get(&w).map(Vec::as_slice).unwrap_or_default();
                let exts = picks
                    .into_iter()
                    .map(|(at, kind)| match kind {
                        0..=2 => pick(mine, &at).or_else(|| pick(&u2, &at)).unwrap_or(STRANGER),
                        3 => pick(&u2, &at).unwrap_or(STRANGER),
                        _ => STRANGER,
                    })
                    .collect();
                Transition::Remove { w, exts }
            });
        // Lookups: mostly a stored chain, cut or extended; sometimes anything.
        let query = (
            any::<Index>(),
            any::<Index>(),
            locals_strategy(0..=2),
            locals_strategy(0..=6),
            0..4u8,
            any::<bool>(),
        )
            .prop_map(move |(at, cut, extra, random, kind, early_exit)| {
                let query = match pick(&u3, &at) {
                    Some(ext) if kind > 0 => {
                        let path = &p2[&ext];
                        let mut q = path[..=cut.index(path.len())].to_vec();
                        if kind == 3 {
                            q.extend(extra);
                        }
                        q
                    }
                    _ => random,
                };
                Transition::Match { query, early_exit }
            });

        // The whole of a chain stored before, again from the root: heals any holes in it, and
        // is idempotent for the blocks still held.
        let restore = (ids.clone(), any::<Index>()).prop_map(move |(w, at)| {
            let Some(ext) = pick(&u4, &at) else {
                return Transition::Store {
                    w,
                    parent: None,
                    locals: vec![ALPHABET[0]],
                    corrupt: None,
                };
            };
            Transition::Store {
                w,
                parent: None,
                locals: p3[&ext].clone(),
                corrupt: None,
            }
        });
        // Adding workers matters most while there are few.
        let add_weight = if state.workers.len() < 2 { 12 } else { 2 };

        prop_oneof![
            add_weight => (0..S::IDS).prop_map(Transition::AddWorker),
            1 => ids.clone().prop_map(Transition::RemoveWorker),
            10 => store,
            3 => restore,
            2 => conflicting,
            2 => duplicate,
            5 => remove,
            1 => ids.prop_map(Transition::Clear),
            5 => query,
        ]
        .boxed()
    }

    fn preconditions(state: &Self, t: &Transition) -> bool {
        state.admits(t)
    }

    fn apply(mut state: Self, t: &Transition) -> Self {
        state.expect = Expect::Nothing;
        match t {
            Transition::AddWorker(w) => {
                state.workers.entry(*w).or_default();
            }
            Transition::RemoveWorker(w) => {
                let result = if state.workers.remove(w).is_some() {
                    state.stats.clears += 1;
                    Ok(())
                } else {
                    state.stats.unknown_worker += 1;
                    Err(IndexError::UnknownWorker(key(*w)))
                };
                state.expect = Expect::Unit(result);
            }
            Transition::Clear(w) => {
                let result = match state.workers.get_mut(w) {
                    Some(m) => {
                        m.held.clear();
                        state.stats.clears += 1;
                        Ok(())
                    }
                    None => {
                        state.stats.unknown_worker += 1;
                        Err(IndexError::UnknownWorker(key(*w)))
                    }
                };
                state.expect = Expect::Unit(result);
            }
            Transition::Store {
                w,
                parent,
                locals,
                corrupt,
            } => {
                let blocks = store_blocks(*parent, locals, *corrupt);
                let outcome = state.simulate_store(*w, *parent, &blocks);
                match &outcome.result {
                    Ok(()) => {}
                    Err(IndexError::UnknownWorker(_)) => state.stats.unknown_worker += 1,
                    Err(IndexError::UnknownParent { .. }) => state.stats.unknown_parent += 1,
                    Err(IndexError::ConflictingBlock { .. }) => state.stats.conflicting_block += 1,
                    Err(IndexError::DuplicatePrefix { .. }) => state.stats.duplicate_prefix += 1,
                    Err(other) => panic!("the reference does not produce {other:?}"),
                }
                if !outcome.applied.is_empty() {
                    // Applied blocks are all genuine (the corrupted one is never applied).
                    state.record_paths(*parent, &locals[..outcome.applied.len()]);
                }
                if let Some(m) = state.workers.get_mut(w) {
                    for &(prev, local, ext) in &outcome.newly_held {
                        m.held.insert(ext);
                        m.child.insert((prev, local), ext);
                        m.place.insert(ext, (prev, local));
                    }
                }
                state.stats.blocks_stored += outcome.newly_held.len() as u64;
                state.expect = Expect::Unit(outcome.result);
            }
            Transition::Remove { w, exts } => {
                let result = match state.workers.get_mut(w) {
                    Some(m) => {
                        let dropped = exts.iter().filter(|e| m.held.remove(e)).count();
                        state.stats.blocks_removed += dropped as u64;
                        state.stats.removed_not_held += (exts.len() - dropped) as u64;
                        Ok(dropped)
                    }
                    None => {
                        state.stats.unknown_worker += 1;
                        Err(IndexError::UnknownWorker(key(*w)))
                    }
                };
                state.expect = Expect::Count(result);
            }
            Transition::Match { .. } => {}
        }
        state
    }
}

/// Checks one lookup against the reference. With early exit, the walk may stop once a single
/// worker is left: that one worker's depth is then a lower bound, above every other depth.
fn check_match<L: Layout>(index: &L, model: &BTreeMap<u64, u32>, query: &[u64], early_exit: bool) {
    let locals: Vec<LocalBlockHash> = query.iter().map(|&l| LocalBlockHash(l)).collect();
    let mut scores = OverlapScores::default();
    index.find_into(&locals, early_exit, &mut scores);
    let got: BTreeMap<u64, u32> = scores
        .iter()
        .filter(|&(_, d)| d > 0)
        .map(|(w, d)| (id_of(w), d))
        .collect();
    assert_eq!(
        got.len(),
        scores.iter().filter(|&(_, d)| d > 0).count(),
        "a worker reported twice"
    );

    let mut reused = OverlapScores::default();
    index.find_into(&[LocalBlockHash(ALPHABET[0])], false, &mut reused);
    index.find_into(&locals, early_exit, &mut reused);
    assert_eq!(reused, scores, "a reused result disagrees with a fresh one");

    if !early_exit {
        assert_eq!(&got, model, "query {query:x?}");
        for (&w, &d) in model {
            assert_eq!(scores.depth(key(w)), d);
        }
        assert_eq!(scores.max_depth(), model.values().copied().max().unwrap_or(0));
        return;
    }
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        model.keys().collect::<Vec<_>>(),
        "early exit, query {query:x?}"
    );
    let inexact: Vec<u64> = got
        .iter()
        .filter(|&(w, d)| model[w] != *d)
        .map(|(&w, _)| w)
        .collect();
    assert!(
        inexact.len() <= 1,
        "early exit: several inexact depths {got:?} vs {model:?}"
    );
    if let Some(&w) = inexact.first() {
        let d = got[&w];
        assert!(
            d < model[&w],
            "early exit: depth {d} of worker {w} above the true {}",
            model[&w]
        );
        assert!(
            got.iter().all(|(&other, &od)| other == w || od < d),
            "early exit stopped with worker {w} at {d}, not alone in front: {got:?}"
        );
    }
}

/// What the test needs of an index layout beyond [`IndexLayout`]: [`PrefixIndex`] and
/// [`RunIndex`] answer alike.
trait Layout: IndexLayout + Sized {
    /// [`IndexLayout::find_matches_into`], checked against the layout's other lookups.
    fn find_into(&self, query: &[LocalBlockHash], early_exit: bool, out: &mut OverlapScores) {
        self.find_matches_into(query, early_exit, out);
    }
}

impl Layout for PrefixIndex {
    fn find_into(&self, query: &[LocalBlockHash], early_exit: bool, out: &mut OverlapScores) {
        let fresh = self.find_matches(query, early_exit);
        self.find_matches_into(query, early_exit, out);
        assert_eq!(&fresh, out, "find_matches_into disagrees with find_matches");
    }
}

impl Layout for RunIndex {}

/// The worker set, the counters and every worker's held blocks against the model.
fn check_workers<S: Shape, L: Layout>(index: &L, model: &Model<S>) {
    let workers: BTreeSet<u64> = index.workers().map(id_of).collect();
    assert_eq!(workers, model.workers.keys().copied().collect(), "worker set");
    assert_eq!(
        index.workers().count(),
        model.workers.len(),
        "a worker listed twice"
    );
    assert_eq!(index.stats(), model.stats, "stats");
    for w in 0..S::IDS {
        let empty = WorkerModel::default();
        let m = model.workers.get(&w).unwrap_or(&empty);
        let held: BTreeSet<u64> = index.held_blocks(key(w)).map(|e| e.0).collect();
        assert_eq!(held, m.held, "held_blocks of worker {w}");
    }
}

struct IndexTest<S, L = PrefixIndex>(PhantomData<(S, L)>);

impl<S: Shape, L: Layout> StateMachineTest for IndexTest<S, L> {
    type SystemUnderTest = L;
    type Reference = Model<S>;

    fn init_test(ref_state: &Model<S>) -> L {
        let mut index = L::with_config(IndexConfig::default());
        for &w in ref_state.workers.keys() {
            index.add_worker(key(w));
        }
        index
    }

    fn apply(mut index: L, ref_state: &Model<S>, t: Transition) -> L {
        let got = match t {
            Transition::AddWorker(w) => {
                index.add_worker(key(w));
                Expect::Nothing
            }
            Transition::RemoveWorker(w) => Expect::Unit(index.remove_worker(key(w))),
            Transition::Clear(w) => Expect::Unit(index.clear_worker(key(w))),
            Transition::Store {
                w,
                parent,
                locals,
                corrupt,
            } => {
                let before = index.footprint();
                let blocks = store_blocks(parent, &locals, corrupt);
                let result = index.apply_stored(key(w), parent.map(ExternalBlockHash), &blocks);
                if let Err(IndexError::UnknownWorker(_) | IndexError::UnknownParent { .. }) = result {
                    assert_eq!(index.footprint(), before, "a refused store changed the index");
                }
                Expect::Unit(result)
            }
            Transition::Remove { w, exts } => {
                let exts: Vec<ExternalBlockHash> = exts.into_iter().map(ExternalBlockHash).collect();
                Expect::Count(index.apply_removed(key(w), &exts))
            }
            Transition::Match { query, early_exit } => {
                check_match(&index, &ref_state.depths(&query), &query, early_exit);
                Expect::Nothing
            }
        };
        assert_eq!(got, ref_state.expect);
        index
    }

    fn check_invariants(index: &L, model: &Model<S>) {
        if let Err(e) = index.check_invariants() {
            panic!("index invariant broken: {e}");
        }
        check_workers(index, model);

        let footprint = index.footprint();
        let entries: usize = model.workers.values().map(|m| m.held.len()).sum();
        assert_eq!(footprint.entries, entries as u64, "footprint entries");
        assert_eq!(footprint.nodes, model.live_prefixes() as u64, "footprint nodes");

        for w in 0..S::IDS {
            let empty = WorkerModel::default();
            let m = model.workers.get(&w).unwrap_or(&empty);
            assert_eq!(
                index.block_count(key(w)),
                m.held.len(),
                "block_count of worker {w}"
            );
            if w >= S::HOT_FROM || model.paths.len() < 32 {
                for &ext in model.paths.keys().chain([&STRANGER]) {
                    assert_eq!(
                        index.holds(key(w), ExternalBlockHash(ext)),
                        m.held.contains(&ext),
                        "holds"
                    );
                }
            }
        }

        // Every chain stored lately, looked up whole.
        for ext in model.recent.iter().rev().take(S::CHECKED_CHAINS) {
            let path = &model.paths[ext];
            check_match(index, &model.depths(path), path, false);
        }
        let mut none = OverlapScores::default();
        index.find_into(&[], false, &mut none);
        assert!(none.is_empty());
    }

    fn teardown(mut index: L, model: Model<S>) {
        // Once every worker is gone, no node may be left behind.
        for &w in model.workers.keys() {
            index
                .remove_worker(key(w))
                .expect("removing a worker the model has");
        }
        assert_eq!(
            index.footprint().nodes,
            0,
            "nodes left after every worker was removed"
        );
        assert_eq!(index.footprint().entries, 0);
        if let Err(e) = index.check_invariants() {
            panic!("index invariant broken after removing every worker: {e}");
        }
    }
}

prop_state_machine! {
    #![proptest_config(Config { cases: 192, max_shrink_iters: 4096, ..Config::default() })]

    #[test]
    fn few_workers_agree_with_the_reference(sequential 1..100 => IndexTest<Few>);
}

prop_state_machine! {
    #![proptest_config(Config { cases: 40, max_shrink_iters: 4096, ..Config::default() })]

    #[test]
    fn seventy_workers_agree_with_the_reference(sequential 1..80 => IndexTest<Many>);
}

prop_state_machine! {
    #![proptest_config(Config { cases: 192, max_shrink_iters: 4096, ..Config::default() })]

    #[test]
    fn the_run_layout_agrees_with_the_reference(sequential 1..100 => IndexTest<Few, RunIndex>);
}

prop_state_machine! {
    #![proptest_config(Config { cases: 40, max_shrink_iters: 4096, ..Config::default() })]

    #[test]
    fn the_run_layout_of_seventy_workers_agrees_with_the_reference(sequential 1..80 => IndexTest<Many, RunIndex>);
}

/// The reference itself, on the A B C D example of OPSTREAM.md, so a bug in it cannot hide one in
/// the index.
#[test]
fn the_reference_follows_opstream_md() {
    let mut model = Model::<Few>::initial();
    let [a, b, c, d] = ALPHABET;
    let chain: Vec<u64> = store_blocks(None, &[a, b, c, d], None)
        .iter()
        .map(|s| s.external.0)
        .collect();
    model = Model::apply(model, &Transition::AddWorker(0));
    let store = |parent: Option<u64>, locals: Vec<u64>| Transition::Store {
        w: 0,
        parent,
        locals,
        corrupt: None,
    };
    let remove = |ext: u64| Transition::Remove {
        w: 0,
        exts: vec![ext],
    };
    // Each step, then the depth worker 0 matches of A B C D after it.
    let steps = [
        (store(None, vec![a, b, c, d]), Some(4)),
        (remove(chain[1]), Some(1)),
        (store(Some(chain[0]), vec![b]), Some(4)),
        (remove(chain[0]), None),
    ];
    for (i, (step, depth)) in steps.iter().enumerate() {
        model = Model::apply(model, step);
        let expected: BTreeMap<u64, u32> = depth.map(|depth| (0, depth)).into_iter().collect();
        assert_eq!(model.depths(&[a, b, c, d]), expected, "after step {i}: {step:?}");
    }
    assert_eq!(model.stats.blocks_stored, 5);
    assert_eq!(model.stats.blocks_removed, 2);
    // A second ext for the held prefix A B is refused after applying the first block.
    model = Model::apply(model, &store(None, vec![a]));
    assert_eq!(model.depths(&[a, b, c, d]), BTreeMap::from([(0, 4)]));
    let dup = Transition::Store {
        w: 0,
        parent: None,
        locals: vec![a, b],
        corrupt: Some((1, chain[1] ^ GARBLE)),
    };
    assert!(model.admits(&dup));
    model = Model::apply(model, &dup);
    assert_eq!(
        model.expect,
        Expect::Unit(Err(IndexError::DuplicatePrefix {
            worker: key(0),
            external: ExternalBlockHash(chain[1] ^ GARBLE),
            applied: 1,
        }))
    );
    // A corrupted ext that would end up held is not a transition the reference takes.
    let fresh = Transition::Store {
        w: 0,
        parent: None,
        locals: vec![d],
        corrupt: Some((0, STRANGER)),
    };
    assert!(!model.admits(&fresh));
}
