//! Lookups: how deep each worker holds a query's prefix, walked along the tree.

use super::{LocalBlockHash, Node, NodeId, OverlapScores, PrefixIndex, ROOT};

impl PrefixIndex {
    /// `find_matches`, writing into `out` (cleared first) to reuse its allocation.
    pub fn find_matches_into(&self, locals: &[LocalBlockHash], early_exit: bool, out: &mut OverlapScores) {
        out.clear();
        let Some((first, rest)) = locals.split_first() else {
            return;
        };
        let Some(mut node) = self.child(ROOT, first.0) else {
            return;
        };
        if !self.rows.wide() {
            let active = self.nodes[node as usize].mask0;
            self.walk_one_word(node, rest, 0, active, 1, early_exit, out);
            return;
        }
        let words = self.rows.mask_words();
        // Fleets of up to 1,024 worker slots keep the walk's worker set on the stack.
        let mut stack = [0u64; 16];
        let mut heap = Vec::new();
        let active: &mut [u64] = if words <= stack.len() {
            &mut stack[..words]
        } else {
            heap.resize(words, 0);
            &mut heap
        };
        for (w, word) in active.iter_mut().enumerate() {
            *word = self.mask_word(node, w);
        }
        let mut depth = 1u32;
        for (i, local) in rest.iter().enumerate() {
            let mut live = active.iter().enumerate().filter(|&(_, &w)| w != 0);
            let Some((first, &word)) = live.next() else {
                break;
            };
            if live.next().is_none() {
                // One word of workers left (a long prompt past its shared prefix, the common
                // case): the walk reads only that word from here on.
                self.walk_one_word(node, &rest[i..], first, word, depth, early_exit, out);
                return;
            }
            if early_exit && active.iter().map(|w| w.count_ones()).sum::<u32>() <= 1 {
                break;
            }
            let Some(next) = self.child(node, local.0) else {
                break;
            };
            for (w, word) in active.iter_mut().enumerate() {
                if *word == 0 {
                    continue;
                }
                let kept = *word & self.mask_word(next, w);
                self.emit(w, *word & !kept, depth, out);
                *word = kept;
            }
            depth += 1;
            node = next;
        }
        for (w, &word) in active.iter().enumerate() {
            self.emit(w, word, depth, out);
        }
    }

    /// The walk once every worker still matching is in mask word `word`: `active` are those
    /// workers, matched `depth` blocks deep at `node`; `rest` are the query's blocks after it.
    // Out of line: the walk's loop gets the registers to itself (inlined into
    // `find_matches_into`, its state was spilled to the stack on every block).
    #[inline(never)]
    #[allow(clippy::too_many_arguments, reason = "the walk's state, handed over mid-walk")]
    fn walk_one_word(
        &self,
        node: NodeId,
        rest: &[LocalBlockHash],
        word: usize,
        active: u64,
        depth: u32,
        early_exit: bool,
        out: &mut OverlapScores,
    ) {
        // One loop per kind of index, so the loop reads its word without a branch on which.
        if !self.rows.wide() {
            self.walk_word(node, rest, word, active, depth, early_exit, out, |n| n.mask0);
        } else {
            let rows = &self.rows;
            self.walk_word(node, rest, word, active, depth, early_exit, out, |n| {
                rows.word(n.mask0, word)
            });
        }
    }

    /// [`PrefixIndex::walk_one_word`] with `mask` reading a node's word `word`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments, reason = "the walk's state, handed over mid-walk")]
    fn walk_word(
        &self,
        mut node: NodeId,
        rest: &[LocalBlockHash],
        word: usize,
        mut active: u64,
        depth: u32,
        early_exit: bool,
        out: &mut OverlapScores,
        mask: impl Fn(&Node) -> u64,
    ) {
        if active == 0 {
            return;
        }
        // `active` is never empty here; one bit left is `active & (active - 1) == 0`. The test
        // is made where `active` changes, not per block: along a chain where nobody drops out,
        // a block costs the child lookup and the mask test alone.
        if early_exit && active & (active - 1) == 0 {
            self.emit(word, active, depth, out);
            return;
        }
        let nodes = self.nodes.as_slice();
        // Blocks of `rest` matched so far: `node` is `depth + i` blocks deep.
        let mut i = 0usize;
        loop {
            // Along a chain laid out in consecutive nodes (see `free_runs`) where every active
            // worker holds on, a block is a compare of the next node's own fields: its address
            // does not wait on the current node. The two slices are walked in step, so the loop
            // has no bounds check and keeps its few values in registers.
            let ahead = nodes.get(node as usize + 1..).unwrap_or_default();
            let run = ahead
                .iter()
                .zip(rest.get(i..).unwrap_or_default())
                .zip(node..)
                .take_while(|&((n, q), before)| {
                    n.parent == before && n.local == q.0 && mask(n) & active == active
                })
                .count();
            node += run as NodeId;
            i += run;
            let Some(local) = rest.get(i) else {
                break;
            };
            let Some(next) = self.child(node, local.0) else {
                break;
            };
            node = next;
            i += 1;
            let kept = active & mask(&nodes[next as usize]);
            if kept != active {
                self.emit(word, active & !kept, depth + i as u32 - 1, out);
                if kept == 0 {
                    return;
                }
                active = kept;
                if early_exit && active & (active - 1) == 0 {
                    break;
                }
            }
        }
        self.emit(word, active, depth + i as u32, out);
    }

    /// Records `depth` for every worker whose bit is set in `bits`, mask word `word`.
    #[inline]
    fn emit(&self, word: usize, mut bits: u64, depth: u32, out: &mut OverlapScores) {
        while bits != 0 {
            let slot = word * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if let Some(s) = self.slots.at(slot) {
                out.push(s.key, depth);
            }
        }
    }
}
