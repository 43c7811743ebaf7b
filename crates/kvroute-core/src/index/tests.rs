//! Unit tests of the prefix index's internals: fleets past 64 slots, and chains laid in consecutive nodes.

use super::*;
use crate::ids::{DpRank, LocalBlockHash, WorkerId};

fn chain(seed: u64, len: u64) -> Vec<StoredBlock> {
    (0..len)
        .map(|i| StoredBlock {
            local: LocalBlockHash(seed << 32 | i),
            external: ExternalBlockHash(seed << 32 | i),
        })
        .collect()
}

/// The nodes of `blocks`' prefixes, from the root.
fn nodes_of(index: &PrefixIndex, blocks: &[StoredBlock]) -> Vec<NodeId> {
    let mut at = ROOT;
    blocks
        .iter()
        .map(|b| {
            at = index
                .child(at, b.local.0)
                .unwrap_or_else(|| panic!("no node for {b:?}"));
            at
        })
        .collect()
}

fn key(i: u64) -> WorkerKey {
    WorkerKey::new(WorkerId(i), DpRank(0))
}

/// Every worker's depth for `locals`, in slot order (the scores' own order aside).
fn depths(index: &PrefixIndex, locals: &[LocalBlockHash], workers: u64) -> Vec<u32> {
    let scores = index.find_matches(locals, false);
    (0..workers).map(|i| scores.depth(key(i))).collect()
}

#[test]
fn a_fleet_past_64_slots_keeps_what_its_nodes_hold() {
    let mut index = PrefixIndex::new(IndexConfig::default());
    let shared = chain(7, 8);
    let locals: Vec<LocalBlockHash> = shared.iter().map(|b| b.local).collect();
    // 64 workers: every one holds the shared chain to a depth of its own, some deeper.
    for i in 0..64 {
        index.add_worker(key(i));
        index
            .apply_stored(key(i), None, &shared[..1 + (i as usize % 8)])
            .unwrap();
    }
    let before = depths(&index, &locals, 64);
    // The 65th worker turns the index wide: the same depths, the same order of scores.
    let scores = index.find_matches(&locals, false);
    index.add_worker(key(64));
    index.check_invariants().unwrap();
    assert_eq!(depths(&index, &locals, 64), before);
    assert_eq!(index.find_matches(&locals, false), scores);
    // Workers up to slot 999: sets grow past three holders into rows and back.
    for i in 65..1000 {
        index.add_worker(key(i));
    }
    for i in (0..1000).step_by(37) {
        index.apply_stored(key(i), None, &shared).unwrap();
    }
    index.check_invariants().unwrap();
    for i in (0..64).step_by(2) {
        index.clear_worker(key(i)).unwrap();
    }
    index.check_invariants().unwrap();
    let scores = index.find_matches(&locals, false);
    for i in 0..1000 {
        let expect = if i % 37 == 0 && (i >= 64 || i % 2 == 1) {
            8
        } else if i < 64 && i % 2 == 1 {
            1 + (i as u32 % 8)
        } else {
            0
        };
        assert_eq!(scores.depth(key(i)), expect, "worker {i}");
    }
    for i in 0..1000 {
        index.clear_worker(key(i)).unwrap();
    }
    index.check_invariants().unwrap();
    assert_eq!(index.footprint().nodes, 0);
    assert_eq!(index.rows.rows_in_use(), 0);
}

#[test]
fn a_wide_fleet_pays_no_full_worker_mask_per_node() {
    // 1,000 workers, each holding chains of its own: one holder per node. A mask over every
    // slot would be 128 bytes a node more than the narrow index's node.
    let mut index = PrefixIndex::new(IndexConfig::default());
    for i in 0..1000 {
        index.add_worker(key(i));
    }
    for i in 0..1000 {
        index.apply_stored(key(i), None, &chain(100 + i, 64)).unwrap();
    }
    index.check_invariants().unwrap();
    let footprint = index.footprint();
    assert_eq!(footprint.entries, 64_000);
    assert!(
        footprint.bytes_per_entry() < 100.0,
        "{:.1} bytes per entry",
        footprint.bytes_per_entry()
    );
}

#[test]
fn a_new_chain_takes_consecutive_nodes_when_the_free_ids_are_scattered() {
    let w = WorkerKey::new(WorkerId(1), DpRank(0));
    let mut index = PrefixIndex::new(IndexConfig {
        expected_blocks: 1024,
        ..IndexConfig::default()
    });
    index.add_worker(w);
    let (a, b) = (chain(1, 100), chain(2, 100));
    index.apply_stored(w, None, &a).unwrap();
    index.apply_stored(w, None, &b).unwrap();
    // The last block of each chain goes: two free ids, far apart.
    index.apply_removed(w, &[a[99].external, b[99].external]).unwrap();
    let c = chain(3, 10);
    index.apply_stored(w, None, &c).unwrap();
    let ids = nodes_of(&index, &c);
    assert!(ids.windows(2).all(|p| p[1] == p[0] + 1), "{ids:?}");
    index.check_invariants().unwrap();
    // A chain freed as a whole is taken back in order by the next chain.
    index
        .apply_removed(w, &b.iter().map(|b| b.external).collect::<Vec<_>>())
        .unwrap();
    let d = chain(4, 99);
    index.apply_stored(w, None, &d).unwrap();
    let ids = nodes_of(&index, &d);
    assert!(ids.windows(2).all(|p| p[1] == p[0] + 1), "{ids:?}");
    index.check_invariants().unwrap();
    assert_eq!(index.find_matches(&[d[0].local, d[1].local], false).depth(w), 2);
}

/// `sole_blocks` against the brute-force answer (a worker's blocks that no other worker's
/// `holds` names), narrow and past 64 slots.
#[test]
fn sole_blocks_are_those_no_other_worker_holds() {
    for workers in [3u64, 70] {
        let mut index = PrefixIndex::new(IndexConfig::default());
        for i in 0..workers {
            index.add_worker(key(i));
            // Worker i holds a chain shared with every worker to depth 1 + i % 5, and a chain of
            // its own of i % 4 blocks.
            index.apply_stored(key(i), None, &chain(1, 1 + i % 5)).unwrap();
            index.apply_stored(key(i), None, &chain(100 + i, i % 4)).unwrap();
        }
        for i in 0..workers {
            let brute = index
                .held_blocks(key(i))
                .filter(|&b| (0..workers).filter(|&j| j != i).all(|j| !index.holds(key(j), b)))
                .count();
            assert_eq!(index.sole_blocks(key(i)), brute, "{workers} workers, worker {i}");
        }
        let own: usize = (0..workers).map(|i| (i % 4) as usize).sum();
        let total: usize = (0..workers).map(|i| index.sole_blocks(key(i))).sum();
        assert!(
            total >= own,
            "every worker's own chain is its alone: {total} < {own}"
        );
        assert_eq!(
            index.sole_blocks(key(workers + 5)),
            0,
            "an unknown worker holds nothing"
        );
    }
}

#[test]
fn maps_sized_ahead_answer_as_maps_grown_from_empty() {
    // The same stores and removals on an index whose workers' maps start sized for 300 blocks
    // and on one whose maps grow: the same depths and entries; the sized maps never grow.
    let mut grown = PrefixIndex::new(IndexConfig::default());
    let mut sized = PrefixIndex::new(IndexConfig {
        expected_blocks_per_worker: 300,
        ..IndexConfig::default()
    });
    let size_of_map =
        |index: &PrefixIndex, i: u64| index.slots.get(key(i)).map(|s| s.blocks.allocation_size());
    for index in [&mut grown, &mut sized] {
        for i in 0..3 {
            index.add_worker(key(i));
        }
    }
    let sized_at_start: Vec<_> = (0..3).map(|i| size_of_map(&sized, i)).collect();
    let chains: Vec<Vec<StoredBlock>> = (0..6).map(|s| chain(s, 40 + 7 * s)).collect();
    for (n, blocks) in chains.iter().enumerate() {
        let w = key(n as u64 % 3);
        for index in [&mut grown, &mut sized] {
            index.apply_stored(w, None, blocks).unwrap();
            let gone: Vec<ExternalBlockHash> = blocks[5..9].iter().map(|b| b.external).collect();
            index.apply_removed(w, &gone).unwrap();
            index.check_invariants().unwrap();
        }
        let locals: Vec<LocalBlockHash> = blocks.iter().map(|b| b.local).collect();
        assert_eq!(depths(&sized, &locals, 3), depths(&grown, &locals, 3));
    }
    assert_eq!(sized.footprint().entries, grown.footprint().entries);
    let sized_at_end: Vec<_> = (0..3).map(|i| size_of_map(&sized, i)).collect();
    assert_eq!(
        sized_at_end, sized_at_start,
        "a map sized for 300 blocks grew below 300"
    );
    assert!(sized_at_start.iter().all(|s| s.is_some_and(|b| b > 0)));
}
