//! Lookups along long chains (hundreds of blocks, as with 16- to 64-token blocks) in a fleet
//! spread over several worker mask words, against a direct reference: a worker's depth for the
//! first `q` blocks of the chain is the length of the run of blocks it holds from block 0.
//!
//! The lookup hands the walk over to a one-word loop once every worker still matching lives in
//! one mask word; these cases put the last workers standing in word 0, in a higher word, and in
//! several words at once, with holes that stop one worker while others go on.

use std::collections::BTreeMap;

use kvroute_core::hash::sequence_hashes_into;
use kvroute_core::ids::{DpRank, LocalBlockHash, WorkerId, WorkerKey};
use kvroute_core::index::{IndexConfig, PrefixIndex, StoredBlock, stored_blocks};
use proptest::prelude::*;

/// Worker slots: four mask words.
const WORKERS: u64 = 200;
/// The longest chain.
const CHAIN: usize = 600;

fn key(w: u64) -> WorkerKey {
    WorkerKey::new(WorkerId(w), DpRank(0))
}

/// One worker's holding: the first `len` blocks of the chain, less the blocks at `holes`.
#[derive(Clone, Debug)]
struct Holding {
    worker: u64,
    len: usize,
    holes: Vec<usize>,
}

fn holding() -> impl Strategy<Value = Holding> {
    (
        prop_oneof![0..4u64, 60..70u64, 120..130u64, 190..WORKERS],
        1..=CHAIN,
        proptest::collection::vec(0..CHAIN, 0..3),
    )
        .prop_map(|(worker, len, holes)| Holding { worker, len, holes })
}

fn chain() -> (Vec<LocalBlockHash>, Vec<StoredBlock>) {
    let locals: Vec<LocalBlockHash> = (0..CHAIN as u64)
        .map(|i| LocalBlockHash(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xABCD))
        .collect();
    let mut seq = Vec::new();
    sequence_hashes_into(&locals, &mut seq);
    let blocks = stored_blocks(&locals, &seq);
    (locals, blocks)
}

proptest! {
    #[test]
    fn depths_along_long_chains_match_the_reference(
        holdings in proptest::collection::vec(holding(), 1..10),
        query_len in 1..=CHAIN,
        // A branch off the chain that some workers also hold, so a walk passes branching nodes.
        branch_at in 1..CHAIN,
    ) {
        let (locals, blocks) = chain();
        let mut index = PrefixIndex::new(IndexConfig::default());
        for w in 0..WORKERS {
            index.add_worker(key(w));
        }
        // The reference: per worker, which positions of the chain it holds.
        let mut held: BTreeMap<u64, Vec<bool>> = BTreeMap::new();
        for h in &holdings {
            let w = key(h.worker);
            index.apply_stored(w, None, &blocks[..h.len]).unwrap();
            let mine = held.entry(h.worker).or_insert_with(|| vec![false; CHAIN]);
            mine[..h.len].iter_mut().for_each(|b| *b = true);
            // A branch: a different block at `branch_at`, under the chain's block before it.
            if branch_at <= h.len && h.worker % 2 == 0 {
                let other = StoredBlock {
                    local: LocalBlockHash(!locals[branch_at].0),
                    external: kvroute_core::ids::ExternalBlockHash(!blocks[branch_at].external.0),
                };
                index
                    .apply_stored(w, Some(blocks[branch_at - 1].external), &[other])
                    .unwrap();
            }
            let holes: Vec<_> = h.holes.iter().map(|&p| blocks[p].external).collect();
            index.apply_removed(w, &holes).unwrap();
            for &p in &h.holes {
                mine[p] = false;
            }
        }
        index.check_invariants().map_err(TestCaseError::fail)?;
        let expected: BTreeMap<u64, u32> = held
            .iter()
            .map(|(&w, mine)| (w, mine[..query_len].iter().take_while(|&&b| b).count() as u32))
            .filter(|&(_, d)| d > 0)
            .collect();
        let got: BTreeMap<u64, u32> = index
            .find_matches(&locals[..query_len], false)
            .iter()
            .map(|(w, d)| (w.worker.0, d))
            .collect();
        prop_assert_eq!(&got, &expected);
        // With early exit, the last worker standing scores at least its true depth's lower
        // bound and never more; every other worker's depth is exact.
        let early: BTreeMap<u64, u32> = index
            .find_matches(&locals[..query_len], true)
            .iter()
            .map(|(w, d)| (w.worker.0, d))
            .collect();
        prop_assert_eq!(early.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>());
        for (w, d) in &early {
            prop_assert!(*d <= expected[w], "worker {w}: early exit scored {d} > {}", expected[w]);
        }
    }
}
