//! A worker's map from the engine's external block hashes to tree nodes.
//!
//! This is the index's hottest table: every stored and every removed block probes it once, and
//! with thousands of blocks per worker and dozens of workers it does not fit in cache, so its cost
//! is counted in cache lines. A general Swiss table reads a control group and then a bucket: two
//! lines per probe. Here a cache line holds five keys, their five node ids, one counter and the
//! bits of the slots in use, and a key lives in its home line unless that line was full when it
//! was inserted.
//!
//! The counter (as in folly's F14) is the line's *overflow*: how many keys stored in later lines
//! passed over this one while looking for room. A lookup that misses in a line whose overflow is
//! zero is over: the key is absent. A removal empties its slot and decrements the overflow of the
//! lines the key had passed over; nothing moves and no tombstone is left. So a removal touches
//! only the lines its own key's probe touched, almost always the home line alone, where linear
//! probing with backward-shift deletion had to read on past the hole, often into the next line.

use super::NodeId;
use crate::key_hasher::mix;

/// Slots per cache line: five 8-byte keys and five 4-byte node ids, with 4 bytes left for the
/// overflow counter and the bits of the slots in use.
const LINE_SLOTS: usize = 5;

/// A line's `used` bits when every slot is in use.
const ALL_USED: u16 = (1 << LINE_SLOTS) - 1;

/// A slot's position as `line * SLOT_STRIDE + slot` (a shift, not a multiply by five).
const SLOT_STRIDE: usize = 8;

/// The table grows before more than this fraction of its slots (numerator, denominator) is full.
const MAX_LOAD: (usize, usize) = (5, 8);

/// Five slots and an overflow counter on one 64-byte cache line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Line {
    keys: [u64; LINE_SLOTS],
    nodes: [NodeId; LINE_SLOTS],
    /// Keys stored in a later line whose probe passed over this one. It sticks at `u16::MAX`
    /// (lookups then always go on past this line: slower, never wrong) until the table is
    /// rebuilt.
    overflow: u16,
    /// Bit `s`: slot `s` holds a key. A free slot's key and node are stale.
    used: u16,
}

/// A line with no key. The node ids of its free slots are never read; they are not zero
/// because a table of all-zero lines compiles to a `memset` call per line when it is filled.
const VACANT_LINE: Line = Line {
    keys: [0; LINE_SLOTS],
    nodes: [NodeId::MAX; LINE_SLOTS],
    overflow: 0,
    used: 0,
};

/// The slots whose bits are set in `used`, in order.
#[inline]
fn in_use(used: u16) -> impl Iterator<Item = usize> {
    (0..LINE_SLOTS).filter(move |&s| used & (1 << s) != 0)
}

impl Line {
    /// In one pass over the line: the slots holding `key` (bit `s` for slot `s`) and the empty
    /// slots.
    ///
    /// The slots are compared into bit masks without a branch per slot: where a key sits in
    /// its line is random, so a branch per slot would be mispredicted about once per probe. One
    /// pass serves both questions a store asks of a line (is the key here, where is room).
    #[inline]
    fn scan(&self, key: u64) -> (u32, u32) {
        let mut same = 0u32;
        for s in 0..LINE_SLOTS {
            same |= u32::from(self.keys[s] == key) << s;
        }
        let used = u32::from(self.used);
        (same & used, !used & u32::from(ALL_USED))
    }

    /// The slot holding `key`, if any (a removal's question).
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let (hits, _) = self.scan(key);
        (hits != 0).then(|| hits.trailing_zeros() as usize)
    }

    /// The first empty slot, if any.
    #[inline]
    fn vacant(&self) -> Option<usize> {
        let empty = !self.used & ALL_USED;
        (empty != 0).then(|| empty.trailing_zeros() as usize)
    }

    /// One more key passed over this line.
    #[inline]
    fn pass(&mut self) {
        self.overflow = self.overflow.saturating_add(1);
    }

    /// A key that had passed over this line is gone (a stuck counter stays stuck).
    #[inline]
    fn unpass(&mut self) {
        if self.overflow != u16::MAX {
            self.overflow -= 1;
        }
    }
}

/// Open-addressing map `u64 -> NodeId` over cache lines, probing line by line from a key's home
/// line, with per-line overflow counters instead of tombstones or backward shifts.
#[derive(Clone, Debug, Default)]
pub struct ExtMap {
    lines: Box<[Line]>,
    /// Entries held: fewer than 2^32, as node ids are `u32` and no two entries share a node.
    len: u32,
    /// Set with the table's size (`grow`): `64 - log2(lines)`, the shift that takes a hash's
    /// high bits to a home line.
    shift: u32,
    /// Set with the table's size: the most entries it takes before it grows, so that no more
    /// than MAX_LOAD of its slots are full (zero while unallocated). With the two above, one
    /// word more than a length: the map is no bigger than a `Vec` and a `usize` length.
    max_len: u32,
}

/// Where a key is, or where it would go.
enum Probe {
    /// The key is present, mapped to this node.
    Found(NodeId),
    /// The key is absent: the slot to insert it into, and the key's home line.
    Vacant(Vacancy),
}

/// Where an absent key goes: handed from [`ExtMap::probe`] to [`ExtMap::insert_at`].
#[derive(Clone, Copy, Debug)]
struct Vacancy {
    /// The empty slot (`line * SLOT_STRIDE + slot`), or `usize::MAX` when the table must grow.
    at: usize,
    /// The key's home line.
    home: usize,
}

impl Vacancy {
    const NONE: Vacancy = Vacancy {
        at: usize::MAX,
        home: 0,
    };
}

impl ExtMap {
    const MIN_LINES: usize = 4;

    /// The line after `line`, wrapping around.
    #[inline]
    fn next(&self, line: usize) -> usize {
        (line + 1) & (self.lines.len() - 1)
    }

    /// `key`'s home line; past the end of an unallocated table (whose shift is zero).
    #[inline]
    fn home(&self, key: u64) -> usize {
        // High bits of the multiplicative hash are the best mixed; shift them down.
        (mix(key, 0) >> self.shift) as usize
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Heap bytes, by capacity.
    pub fn allocation_size(&self) -> usize {
        self.lines.len() * size_of::<Line>()
    }

    /// Starts loading `key`'s home line without waiting for it, so that a probe for `key` a few
    /// keys later finds it in cache (a prefetch, which unlike a load holds up none of the work
    /// that follows: see `kvroute-prefetch`).
    #[inline(always)]
    pub fn prefetch(&self, key: u64) {
        // An unallocated table has shift 0: every home is past its (empty) end.
        if let Some(line) = self.lines.get(self.home(key)) {
            kvroute_prefetch::prefetch_read(line);
        }
    }

    /// Maps `key` to `node` if `key` is absent; otherwise changes nothing and returns the node
    /// `key` maps to.
    ///
    /// The common case is one line: the key is not in its home line, no key passed over that
    /// line (so the key is absent), and the line has room; it goes there. Anything else (a full
    /// home line, an overflowed one, a table due to grow or unallocated) takes the general probe,
    /// out of line.
    #[inline(always)]
    pub fn insert_new(&mut self, key: u64, node: NodeId) -> Result<(), NodeId> {
        let home = self.home(key);
        if let Some(l) = self.lines.get_mut(home) {
            let (hits, empty) = l.scan(key);
            if hits != 0 {
                return Err(l.nodes[hits.trailing_zeros() as usize]);
            }
            if l.overflow == 0 && empty != 0 && self.len < self.max_len {
                let s = empty.trailing_zeros() as usize;
                l.keys[s] = key;
                l.nodes[s] = node;
                l.used |= 1 << s;
                self.len += 1;
                return Ok(());
            }
        }
        self.insert_probed(key, node)
    }

    /// [`ExtMap::insert_new`] through the general probe.
    #[inline(never)]
    fn insert_probed(&mut self, key: u64, node: NodeId) -> Result<(), NodeId> {
        match self.probe(key) {
            Probe::Found(held) => Err(held),
            Probe::Vacant(vacancy) => {
                self.insert_at(vacancy, key, node);
                Ok(())
            }
        }
    }

    /// Looks `key` up, reporting the node or the slot to insert it into.
    #[inline(always)]
    fn probe(&self, key: u64) -> Probe {
        if self.lines.is_empty() {
            return Probe::Vacant(Vacancy::NONE);
        }
        let home = self.home(key);
        let mut line = home;
        let mut vacant = usize::MAX;
        // Every line is visited at most once: a table whose every line has overflowed could
        // otherwise be probed forever for an absent key.
        for _ in 0..self.lines.len() {
            let l = &self.lines[line];
            let (hits, empty) = l.scan(key);
            if hits != 0 {
                return Probe::Found(l.nodes[hits.trailing_zeros() as usize]);
            }
            if vacant == usize::MAX && empty != 0 {
                vacant = line * SLOT_STRIDE + empty.trailing_zeros() as usize;
            }
            if l.overflow == 0 {
                break;
            }
            line = self.next(line);
        }
        if vacant == usize::MAX {
            // The key is absent, but the lines probed were full: room is further on.
            vacant = self.first_vacant(self.next(line));
        }
        Probe::Vacant(Vacancy { at: vacant, home })
    }

    /// The first empty slot at or after `line`, or `usize::MAX` if the table is full.
    fn first_vacant(&self, mut line: usize) -> usize {
        for _ in 0..self.lines.len() {
            if let Some(s) = self.lines[line].vacant() {
                return line * SLOT_STRIDE + s;
            }
            line = self.next(line);
        }
        usize::MAX
    }

    /// The node `key` maps to.
    #[inline]
    pub fn get(&self, key: u64) -> Option<NodeId> {
        self.locate(key).map(|(_, line, s)| self.lines[line].nodes[s])
    }

    /// Where `key` is: its home line, its line and its slot.
    #[inline(always)]
    fn locate(&self, key: u64) -> Option<(usize, usize, usize)> {
        let home = self.home(key);
        let mut line = home;
        // At most every line once (see `probe`); none when unallocated.
        for _ in 0..self.lines.len() {
            let l = &self.lines[line];
            if let Some(s) = l.find(key) {
                return Some((home, line, s));
            }
            if l.overflow == 0 {
                return None;
            }
            line = self.next(line);
        }
        None
    }

    /// Inserts `key` where a [`Probe::Vacant`] for it said, with no other insert or removal in
    /// between.
    #[inline(always)]
    fn insert_at(&mut self, vacancy: Vacancy, key: u64, node: NodeId) {
        if vacancy.at == usize::MAX || self.len >= self.max_len {
            // Too full (or unallocated): grow, then place the key afresh.
            self.grow_to((self.lines.len() * 2).max(Self::MIN_LINES));
            self.reinsert(key, node);
        } else {
            self.place(vacancy.at, vacancy.home, key, node);
        }
        self.len += 1;
    }

    /// Makes room for `additional` more entries, so that inserting them grows the table at most
    /// once, here: to the size inserting them one by one would reach, in one rehash instead of
    /// one per doubling on the way (a long chain's store into a small table).
    pub fn reserve(&mut self, additional: usize) {
        // The table holds at most as many entries as node ids (see `len`).
        let needed = (self.len as usize)
            .saturating_add(additional)
            .min(u32::MAX as usize);
        if needed <= self.max_len as usize {
            return;
        }
        let mut lines = self.lines.len().max(Self::MIN_LINES);
        while Self::max_len_of(lines) < needed {
            lines *= 2;
        }
        self.grow_to(lines);
    }

    /// The most entries a table of `lines` lines takes before it grows (see `max_len`).
    fn max_len_of(lines: usize) -> usize {
        lines.saturating_mul(LINE_SLOTS * MAX_LOAD.0) / MAX_LOAD.1
    }

    /// Puts `key`, which is absent, into the first empty slot from its home line on: a
    /// rehash's insert, with no probe for the key.
    #[inline(always)]
    fn reinsert(&mut self, key: u64, node: NodeId) {
        let home = self.home(key);
        let l = &mut self.lines[home];
        let empty = !l.used & ALL_USED;
        if empty != 0 {
            // The home line has room (at most 5/8 of the slots are full): no line is passed.
            let s = empty.trailing_zeros() as usize;
            l.keys[s] = key;
            l.nodes[s] = node;
            l.used |= 1 << s;
        } else {
            let at = self.first_vacant(self.next(home));
            self.place(at, home, key, node);
        }
    }

    /// Writes `key`, whose home line is `home`, into the empty slot `at` and counts it on the
    /// lines its probe passed over.
    #[inline]
    fn place(&mut self, at: usize, home: usize, key: u64, node: NodeId) {
        let (line, s) = (at / SLOT_STRIDE, at % SLOT_STRIDE);
        let l = &mut self.lines[line];
        l.keys[s] = key;
        l.nodes[s] = node;
        l.used |= 1 << s;
        let mut passed = home;
        while passed != line {
            self.lines[passed].pass();
            passed = self.next(passed);
        }
    }

    /// Removes `key`, returning its node.
    #[inline(always)]
    pub fn remove(&mut self, key: u64) -> Option<NodeId> {
        let (home, line, s) = self.locate(key)?;
        let l = &mut self.lines[line];
        let removed = l.nodes[s];
        l.used &= !(1 << s);
        let mut passed = home;
        while passed != line {
            self.lines[passed].unpass();
            passed = self.next(passed);
        }
        self.len -= 1;
        Some(removed)
    }

    /// Removes every entry, keeping the allocation, and yields the nodes that were mapped.
    pub fn drain_nodes(&mut self) -> impl Iterator<Item = NodeId> + '_ {
        self.len = 0;
        self.lines.iter_mut().flat_map(|line| {
            let used = std::mem::take(&mut line.used);
            line.overflow = 0;
            let nodes = line.nodes;
            in_use(used).map(move |s| nodes[s])
        })
    }

    /// Every key and its node, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, NodeId)> + '_ {
        self.lines
            .iter()
            .flat_map(|line| in_use(line.used).map(|s| (line.keys[s], line.nodes[s])))
    }

    /// Maps `key`, which is present, to `node` instead; returns false (and changes nothing)
    /// if `key` is absent.
    pub fn replace(&mut self, key: u64, node: NodeId) -> bool {
        let Some((_, line, s)) = self.locate(key) else {
            return false;
        };
        self.lines[line].nodes[s] = node;
        true
    }

    /// Keeps only the entries for which `keep(key, node)` holds (the table keeps its size).
    pub fn retain(&mut self, mut keep: impl FnMut(u64, NodeId) -> bool) {
        let kept: Vec<(u64, NodeId)> = self.iter().filter(|&(k, n)| keep(k, n)).collect();
        self.clear();
        for (key, node) in kept {
            self.reinsert(key, node);
            self.len += 1;
        }
    }

    /// Removes every entry, keeping the allocation.
    pub fn clear(&mut self) {
        self.lines.fill(VACANT_LINE);
        self.len = 0;
    }

    /// Checks the overflow counters against the keys' positions, for tests.
    #[cfg(test)]
    fn check_overflow(&self) -> Result<(), String> {
        let mut expected = vec![0u32; self.lines.len()];
        for (line, l) in self.lines.iter().enumerate() {
            for s in in_use(l.used) {
                let mut passed = self.home(l.keys[s]);
                while passed != line {
                    expected[passed] += 1;
                    passed = self.next(passed);
                }
            }
        }
        for (line, l) in self.lines.iter().enumerate() {
            if u32::from(l.overflow) != expected[line] {
                return Err(format!(
                    "line {line} counts overflow {}, expected {}",
                    l.overflow, expected[line]
                ));
            }
        }
        Ok(())
    }

    /// Rehashes into a table of `lines` lines (a power of two, more than today's).
    fn grow_to(&mut self, lines: usize) {
        let old = std::mem::replace(&mut self.lines, vec![VACANT_LINE; lines].into());
        self.shift = 64 - lines.trailing_zeros();
        // The table holds at most as many entries as node ids (see `len`).
        self.max_len = u32::try_from(Self::max_len_of(lines)).unwrap_or(u32::MAX);
        // Old line `i`'s keys go to new lines from `i * lines / old.len()` on, so the writes
        // move forward in order; the slots in use are read from the in-use bits, one at a time.
        for line in &old {
            let mut used = line.used;
            while used != 0 {
                let s = used.trailing_zeros() as usize;
                used &= used - 1;
                self.reinsert(line.keys[s], line.nodes[s]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum MapOp {
        Insert(u64, NodeId),
        Remove(u64),
        Drain,
        Replace(u64, NodeId),
        /// Keeps the entries whose node is below this.
        Retain(NodeId),
        Clear,
    }

    fn op() -> impl Strategy<Value = MapOp> {
        // Few distinct keys, so inserts and removes collide; some share a home slot.
        let key = prop_oneof![0u64..48, any::<u64>()];
        prop_oneof![
            6 => (key.clone(), 0u32..1000).prop_map(|(k, v)| MapOp::Insert(k, v)),
            4 => key.clone().prop_map(MapOp::Remove),
            1 => Just(MapOp::Drain),
            2 => (key, 0u32..1000).prop_map(|(k, v)| MapOp::Replace(k, v)),
            1 => (0u32..1000).prop_map(MapOp::Retain),
            1 => Just(MapOp::Clear),
        ]
    }

    proptest! {
        #[test]
        fn behaves_like_a_hash_map(ops in proptest::collection::vec(op(), 1..400)) {
            let mut map = ExtMap::default();
            let mut model: HashMap<u64, NodeId> = HashMap::new();
            for op in ops {
                match op {
                    MapOp::Insert(k, v) => match map.insert_new(k, v) {
                        Err(node) => prop_assert_eq!(model.get(&k), Some(&node)),
                        Ok(()) => {
                            prop_assert!(!model.contains_key(&k));
                            model.insert(k, v);
                        }
                    },
                    MapOp::Remove(k) => prop_assert_eq!(map.remove(k), model.remove(&k)),
                    MapOp::Drain => {
                        let mut drained: Vec<NodeId> = map.drain_nodes().collect();
                        let mut expected: Vec<NodeId> = model.drain().map(|(_, v)| v).collect();
                        drained.sort_unstable();
                        expected.sort_unstable();
                        prop_assert_eq!(drained, expected);
                    }
                    MapOp::Replace(k, v) => {
                        let present = model.contains_key(&k);
                        prop_assert_eq!(map.replace(k, v), present);
                        if present {
                            model.insert(k, v);
                        }
                    }
                    MapOp::Retain(below) => {
                        map.retain(|_, v| v < below);
                        model.retain(|_, v| *v < below);
                    }
                    MapOp::Clear => {
                        map.clear();
                        model.clear();
                    }
                }
                prop_assert_eq!(map.len(), model.len());
                if let Err(e) = map.check_overflow() {
                    return Err(TestCaseError::fail(e));
                }
                for (k, v) in &model {
                    prop_assert_eq!(map.get(*k), Some(*v));
                }
            }
        }
    }

    #[test]
    fn grows_exactly_when_more_than_the_load_limit_would_be_full() {
        // The limit is an entry count (`max_len`); it must say what MAX_LOAD says, at the first
        // size and after a growth: an insert that would fill more than 5/8 of the slots grows.
        let mut map = ExtMap::default();
        for k in 0u64..200 {
            let lines_before = map.lines.len();
            assert_eq!(
                map.insert_new(k, k as NodeId),
                Ok(()),
                "key {k} found before insert"
            );
            let slots_before = lines_before * LINE_SLOTS;
            let must_grow = (k as usize + 1) * MAX_LOAD.1 > slots_before * MAX_LOAD.0;
            assert_eq!(map.lines.len() > lines_before, must_grow, "insert of key {k}");
            assert_eq!(map.check_overflow(), Ok(()));
        }
        assert!((0u64..200).all(|k| map.get(k) == Some(k as NodeId)));
    }

    fn insert_new(map: &mut ExtMap, key: u64, node: NodeId) {
        assert_eq!(map.insert_new(key, node), Ok(()), "key {key} found before insert");
    }

    proptest! {
        #[test]
        fn a_reserve_reaches_the_size_of_inserting_one_by_one_and_needs_no_growth_after(
            before in 0u64..300,
            batch in 0usize..700,
        ) {
            // Keys `0..before` are held; `batch` more are reserved, then inserted.
            let mut one_by_one = ExtMap::default();
            let mut reserved = ExtMap::default();
            for k in 0..before {
                insert_new(&mut one_by_one, k, k as NodeId);
                insert_new(&mut reserved, k, k as NodeId);
            }
            reserved.reserve(batch);
            let lines = reserved.lines.len();
            prop_assert_eq!(reserved.check_overflow(), Ok(()));
            for k in before..before + batch as u64 {
                insert_new(&mut one_by_one, k, k as NodeId);
                insert_new(&mut reserved, k, k as NodeId);
                prop_assert_eq!(reserved.lines.len(), lines, "grew after the reserve");
            }
            prop_assert_eq!(reserved.lines.len(), one_by_one.lines.len());
            prop_assert_eq!(reserved.check_overflow(), Ok(()));
            let held = before + batch as u64;
            prop_assert!((0..held).all(|k| reserved.get(k) == Some(k as NodeId)));
            prop_assert_eq!(reserved.len(), held as usize);
        }
    }

    #[test]
    fn keys_sharing_a_home_line_overflow_and_come_back() {
        // Twelve keys with one home line in the smallest table: they fill it and spill over
        // into the next lines; removing them in any order must keep the rest reachable.
        let mut map = ExtMap::default();
        insert_new(&mut map, 0, 0);
        let home = map.home(0);
        let keys: Vec<u64> = (0u64..)
            .filter(|&k| map.home(k) == home)
            .take(ExtMap::MIN_LINES * LINE_SLOTS * MAX_LOAD.0 / MAX_LOAD.1)
            .collect();
        map.remove(0);
        for (i, &k) in keys.iter().enumerate() {
            insert_new(&mut map, k, i as NodeId);
            assert_eq!(map.lines.len(), ExtMap::MIN_LINES, "the table must not grow");
            assert_eq!(map.check_overflow(), Ok(()));
        }
        assert!(map.lines[home].overflow > 0);
        for order in [[0usize, 6, 11, 3, 9, 1, 7, 4, 10, 2, 8, 5]] {
            let mut map = map.clone();
            for (n, &i) in order.iter().enumerate() {
                assert_eq!(map.remove(keys[i]), Some(i as NodeId));
                assert_eq!(map.remove(keys[i]), None);
                assert_eq!(map.check_overflow(), Ok(()));
                for &j in &order[n + 1..] {
                    assert_eq!(map.get(keys[j]), Some(j as NodeId));
                }
            }
            assert_eq!(map.len(), 0);
            assert!(map.lines.iter().all(|l| l.overflow == 0));
        }
    }
}
