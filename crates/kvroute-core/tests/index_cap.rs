//! The per-worker cap of both index layouts, [`PrefixIndex`] and [`RunIndex`]
//! (`IndexConfig::max_blocks_per_worker`), against a small
//! reference: per worker, the set of blocks held and the queue of blocks in first-store order
//! (compacted by the same rule as the index). A store past the cap evicts from the front of
//! the queue; engines' removals and clears apply as usual; re-announcing a held chain (as vLLM
//! does with `kv_cache_report_mode: full`) changes nothing.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::num::NonZeroUsize;

use kvroute_core::ids::{DpRank, ExternalBlockHash, LocalBlockHash, WorkerId, WorkerKey};
use kvroute_core::index::{
    IndexConfig, IndexEvent, IndexLayout, OverlapScores, PrefixIndex, RunIndex, StoredBlock,
};
use proptest::prelude::*;

const WORKERS: u64 = 3;

fn key(w: u64) -> WorkerKey {
    WorkerKey::new(WorkerId(w), DpRank(0))
}

#[derive(Clone, Debug)]
enum Op {
    /// A chain of `len` fresh blocks under the `parent`-th held block of worker `w` (in store
    /// order), or at the root.
    Store {
        w: u64,
        parent: Option<prop::sample::Index>,
        len: usize,
    },
    /// Stores again the chain of the `which`-th store, if all its blocks are still held.
    Reannounce {
        which: prop::sample::Index,
    },
    /// Removes the `which`-th held block of worker `w`.
    Remove {
        w: u64,
        which: prop::sample::Index,
    },
    Clear {
        w: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..WORKERS, proptest::option::of(any::<prop::sample::Index>()), 1..5usize)
            .prop_map(|(w, parent, len)| Op::Store { w, parent, len }),
        2 => any::<prop::sample::Index>().prop_map(|which| Op::Reannounce { which }),
        2 => (0..WORKERS, any::<prop::sample::Index>()).prop_map(|(w, which)| Op::Remove { w, which }),
        1 => (0..WORKERS).prop_map(|w| Op::Clear { w }),
    ]
}

#[derive(Default)]
struct Reference {
    held: BTreeSet<u64>,
    order: VecDeque<u64>,
    evicted: u64,
}

impl Reference {
    fn store(&mut self, blocks: &[u64], cap: usize) {
        for &b in blocks {
            if self.held.insert(b) {
                self.order.push_back(b);
            }
        }
        while self.held.len() > cap {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if self.held.remove(&oldest) {
                self.evicted += 1;
            }
        }
        if self.order.len() > 2 * self.held.len() + 64 {
            let mut seen = HashSet::new();
            let held = &self.held;
            self.order.retain(|e| held.contains(e) && seen.insert(*e));
        }
    }
}

/// One stored chain: the worker, its parent, its blocks.
type Chain = (u64, Option<u64>, Vec<StoredBlock>);

fn run<L: IndexLayout>(cap: usize, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut index = L::with_config(IndexConfig {
        max_blocks_per_worker: NonZeroUsize::new(cap),
        ..IndexConfig::default()
    });
    let mut refs: Vec<Reference> = (0..WORKERS).map(|_| Reference::default()).collect();
    // Every held block in store order, per worker (the reference's view, for picking).
    let mut chains: Vec<Chain> = Vec::new();
    for w in 0..WORKERS {
        index.add_worker(key(w));
    }
    let mut next = 1u64;
    for op in ops {
        match op {
            Op::Store { w, parent, len } => {
                let r = &mut refs[*w as usize];
                let held: Vec<u64> = r.order.iter().copied().filter(|b| r.held.contains(b)).collect();
                let parent = parent
                    .as_ref()
                    .and_then(|i| (!held.is_empty()).then(|| held[i.index(held.len())]));
                let blocks: Vec<StoredBlock> = (0..*len)
                    .map(|_| {
                        next += 1;
                        StoredBlock {
                            local: LocalBlockHash(next * 7),
                            external: ExternalBlockHash(next),
                        }
                    })
                    .collect();
                let event = IndexEvent::Stored {
                    parent: parent.map(ExternalBlockHash),
                    blocks: &blocks,
                };
                prop_assert_eq!(index.apply_event(key(*w), event), Ok(()));
                r.store(&blocks.iter().map(|b| b.external.0).collect::<Vec<_>>(), cap);
                chains.push((*w, parent, blocks));
            }
            Op::Reannounce { which } => {
                if chains.is_empty() {
                    continue;
                }
                let (w, parent, blocks) = &chains[which.index(chains.len())];
                let r = &refs[*w as usize];
                let all_held = parent.is_none_or(|p| r.held.contains(&p))
                    && blocks.iter().all(|b| r.held.contains(&b.external.0));
                if !all_held {
                    continue;
                }
                let before = index.stats();
                let event = IndexEvent::Stored {
                    parent: parent.map(ExternalBlockHash),
                    blocks,
                };
                prop_assert_eq!(
                    index.apply_event(key(*w), event),
                    Ok(()),
                    "a re-announcement is idempotent"
                );
                prop_assert_eq!(index.stats(), before, "a re-announcement changes nothing");
            }
            Op::Remove { w, which } => {
                let r = &mut refs[*w as usize];
                if r.held.is_empty() {
                    continue;
                }
                let held: Vec<u64> = r.held.iter().copied().collect();
                let b = held[which.index(held.len())];
                index
                    .apply_event(
                        key(*w),
                        IndexEvent::Removed {
                            blocks: &[ExternalBlockHash(b)],
                        },
                    )
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                r.held.remove(&b);
            }
            Op::Clear { w } => {
                index
                    .apply_event(key(*w), IndexEvent::Cleared)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let r = &mut refs[*w as usize];
                r.held.clear();
                r.order.clear();
            }
        }
        index.check_invariants().map_err(TestCaseError::fail)?;
        for w in 0..WORKERS {
            let r = &refs[w as usize];
            prop_assert!(index.block_count(key(w)) <= cap);
            let held: BTreeSet<u64> = index.held_blocks(key(w)).map(|e| e.0).collect();
            prop_assert_eq!(&held, &r.held, "worker {}", w);
        }
        prop_assert_eq!(
            index.stats().blocks_evicted,
            refs.iter().map(|r| r.evicted).sum::<u64>()
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn a_capped_index_evicts_oldest_first_like_the_reference(
        cap in 1usize..12,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        run::<PrefixIndex>(cap, &ops)?;
        run::<RunIndex>(cap, &ops)?;
    }
}

#[test]
fn without_a_cap_nothing_is_evicted_and_with_one_the_oldest_chain_goes_first() {
    oldest_chain_first::<PrefixIndex>();
    oldest_chain_first::<RunIndex>();
}

fn oldest_chain_first<L: IndexLayout>() {
    let stores: Vec<Vec<StoredBlock>> = (0..3u64)
        .map(|c| {
            (0..4u64)
                .map(|i| StoredBlock {
                    local: LocalBlockHash(100 * c + i + 1),
                    external: ExternalBlockHash(100 * c + i + 1),
                })
                .collect()
        })
        .collect();
    for (cap, held) in [(None, 12), (NonZeroUsize::new(8), 8)] {
        let mut index = L::with_config(IndexConfig {
            max_blocks_per_worker: cap,
            ..IndexConfig::default()
        });
        index.add_worker(key(0));
        for blocks in &stores {
            index
                .apply_event(key(0), IndexEvent::Stored { parent: None, blocks })
                .expect("the test's own input");
        }
        assert_eq!(index.block_count(key(0)), held);
        assert_eq!(index.stats().blocks_evicted, 12 - held as u64);
        if cap.is_some() {
            // The first chain (stored first) went; the last two are whole.
            assert!((1..=4).all(|e| !index.holds(key(0), ExternalBlockHash(e))));
            let locals: Vec<LocalBlockHash> = (201..=204).map(LocalBlockHash).collect();
            let mut scores = OverlapScores::default();
            index.find_matches_into(&locals, false, &mut scores);
            assert_eq!(scores.iter().collect::<Vec<_>>(), vec![(key(0), 4)]);
        }
        index.check_invariants().expect("invariants hold");
    }
}
