//! The worker sets of nodes in a fleet wider than one mask word (more than 64 worker slots).
//!
//! In a fleet of up to 64 slots a node's `mask0` is the bit mask of the workers holding it. A
//! mask over every slot of a wide fleet would cost `slots / 8` bytes per node (128 at 1,000
//! workers) and a read of all of it wherever the index asks whether anybody still holds a node,
//! while most nodes of a large fleet are held by one worker or a few (a prompt's own blocks
//! past the prefix it shares). So in a wide index `mask0` is a set *code*:
//!
//! * `0`: nobody holds the node.
//! * bit 63 clear, not zero: up to three slots inline, each as `slot + 1` in 21 bits, packed
//!   from bit 0 (the first empty field ends the list).
//! * bit 63 set: a row of [`Rows`], its id in the low 32 bits. A row is the holder count, then a
//!   bit mask over every slot.
//!
//! A set is inline while it has at most three holders (all in slots that fit 21 bits); a row is
//! taken when a fourth comes and given back when the count drops to three again (or to zero).
//! So a code is `0` exactly when nobody holds the node, as a narrow index's mask is.

/// Bits per inline slot field.
const FIELD_BITS: u32 = 21;
/// One inline field.
const FIELD: u64 = (1 << FIELD_BITS) - 1;
/// Inline fields in a code.
const INLINE: usize = 3;
/// The code names a row.
const ROW: u64 = 1 << 63;

/// Whether `slot` can be held inline.
#[inline]
fn fits_inline(slot: usize) -> bool {
    (slot as u64) < FIELD
}

/// How many slots an inline code holds.
#[inline]
fn inline_len(code: u64) -> usize {
    debug_assert!(code & ROW == 0);
    if code == 0 {
        0
    } else if code >> (2 * FIELD_BITS) != 0 {
        3
    } else if code >> FIELD_BITS != 0 {
        2
    } else {
        1
    }
}

/// The slots of an inline code, in the order they were added.
#[inline]
fn inline_slots(mut code: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (code != 0).then(|| {
            let slot = (code & FIELD) as usize - 1;
            code >>= FIELD_BITS;
            slot
        })
    })
}

/// The rows of the wide sets with more than three holders, and the set codes' operations.
#[derive(Clone, Debug, Default)]
pub(super) struct Rows {
    /// Mask words per row (a row is one count word, then these); 0 while the index is narrow.
    mask_words: usize,
    /// `1 + mask_words` words per row.
    words: Vec<u64>,
    /// Rows given back, all zero.
    free: Vec<u32>,
}

impl Rows {
    /// Whether the index is wide (its `mask0` fields are set codes).
    #[inline(always)]
    pub(super) fn wide(&self) -> bool {
        self.mask_words != 0
    }

    /// Mask words over every slot.
    #[inline]
    pub(super) fn mask_words(&self) -> usize {
        self.mask_words
    }

    #[inline]
    fn stride(&self) -> usize {
        1 + self.mask_words
    }

    /// Room for slots below `64 * mask_words`; rows are laid out again if they widen.
    pub(super) fn widen(&mut self, mask_words: usize) {
        if mask_words <= self.mask_words {
            return;
        }
        let (old, new) = (self.stride(), 1 + mask_words);
        let rows = if self.mask_words == 0 {
            0
        } else {
            self.words.len() / old
        };
        let mut words = vec![0u64; rows * new];
        for r in 0..rows {
            words[r * new..r * new + old].copy_from_slice(&self.words[r * old..(r + 1) * old]);
        }
        self.words = words;
        self.mask_words = mask_words;
    }

    /// The code of the set whose slots 0..64 are `mask` (a narrow index's node, when the index
    /// widens).
    pub(super) fn code_of_mask(&mut self, mut mask: u64) -> u64 {
        let mut code = 0;
        while mask != 0 {
            self.insert(&mut code, mask.trailing_zeros() as usize);
            mask &= mask - 1;
        }
        code
    }

    /// Mask word `w` of the set `code`.
    #[inline(always)]
    pub(super) fn word(&self, code: u64, w: usize) -> u64 {
        if code & ROW != 0 {
            self.words[self.row_base(code) + 1 + w]
        } else {
            let mut mask = 0;
            for slot in inline_slots(code) {
                if slot >> 6 == w {
                    mask |= 1 << (slot & 63);
                }
            }
            mask
        }
    }

    /// Whether the set `code` holds `slot`.
    #[inline]
    pub(super) fn contains(&self, code: u64, slot: usize) -> bool {
        self.word(code, slot / 64) & (1 << (slot % 64)) != 0
    }

    /// How many slots the set `code` holds.
    pub(super) fn count(&self, code: u64) -> usize {
        if code & ROW != 0 {
            self.words[self.row_base(code)] as usize
        } else {
            inline_len(code)
        }
    }

    /// Adds `slot` to the set `code`, which does not hold it.
    #[inline]
    pub(super) fn insert(&mut self, code: &mut u64, slot: usize) {
        debug_assert!(!self.contains(*code, slot));
        if *code & ROW != 0 {
            let base = self.row_base(*code);
            self.words[base] += 1;
            self.words[base + 1 + slot / 64] |= 1 << (slot % 64);
            return;
        }
        let len = inline_len(*code);
        if len < INLINE && fits_inline(slot) {
            *code |= (slot as u64 + 1) << (FIELD_BITS * len as u32);
            return;
        }
        self.insert_into_new_row(code, slot);
    }

    /// [`Rows::insert`] for an inline set that has no room for `slot`.
    #[inline(never)]
    fn insert_into_new_row(&mut self, code: &mut u64, slot: usize) {
        let row = self.take_row();
        let base = row as usize * self.stride();
        for s in inline_slots(*code).chain([slot]) {
            self.words[base] += 1;
            self.words[base + 1 + s / 64] |= 1 << (s % 64);
        }
        *code = ROW | u64::from(row);
    }

    /// A row in no use, all zero.
    fn take_row(&mut self) -> u32 {
        match self.free.pop() {
            Some(row) => row,
            None => {
                let row = (self.words.len() / self.stride()) as u32;
                self.words.resize(self.words.len() + self.stride(), 0);
                row
            }
        }
    }

    /// Takes `slot` out of the set `code`, if it holds it.
    #[inline]
    pub(super) fn remove(&mut self, code: &mut u64, slot: usize) {
        if *code & ROW != 0 {
            self.remove_from_row(code, slot);
            return;
        }
        let want = slot as u64 + 1;
        for i in 0..INLINE as u32 {
            let field = (*code >> (FIELD_BITS * i)) & FIELD;
            if field == 0 {
                return;
            }
            if field == want {
                let low = *code & ((1 << (FIELD_BITS * i)) - 1);
                let high = *code >> (FIELD_BITS * (i + 1));
                *code = low | high << (FIELD_BITS * i);
                return;
            }
        }
    }

    /// [`Rows::remove`] for a set held in a row: the row goes back when the set fits inline.
    #[inline(never)]
    fn remove_from_row(&mut self, code: &mut u64, slot: usize) {
        let base = self.row_base(*code);
        let word = &mut self.words[base + 1 + slot / 64];
        if *word & (1 << (slot % 64)) == 0 {
            return;
        }
        *word &= !(1 << (slot % 64));
        self.words[base] -= 1;
        let count = self.words[base] as usize;
        if count > INLINE {
            return;
        }
        let stride = self.stride();
        let row = &mut self.words[base..base + stride];
        let mut inline = 0u64;
        let mut n = 0;
        for (w, &mask) in row[1..].iter().enumerate() {
            let mut bits = mask;
            while bits != 0 {
                let s = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if !fits_inline(s) {
                    return;
                }
                inline |= (s as u64 + 1) << (FIELD_BITS * n);
                n += 1;
            }
        }
        row.fill(0);
        self.free.push(*code as u32);
        *code = inline;
    }

    /// Every slot of the set `code`, in increasing order.
    pub(super) fn slots(&self, code: u64) -> Vec<usize> {
        let mut slots: Vec<usize> = if code & ROW != 0 {
            let base = self.row_base(code);
            (0..self.mask_words * 64)
                .filter(|&s| self.words[base + 1 + s / 64] & (1 << (s % 64)) != 0)
                .collect()
        } else {
            inline_slots(code).collect()
        };
        slots.sort_unstable();
        slots
    }

    /// Checks the set `code` is in its canonical form and its row (if any) counts its slots; for
    /// the index's invariant check.
    pub(super) fn check(&self, code: u64) -> Result<(), String> {
        let slots = self.slots(code);
        if slots.windows(2).any(|p| p[0] == p[1]) {
            return Err(format!("set {code:#x} lists a slot twice"));
        }
        if code & ROW == 0 {
            return Ok(());
        }
        let base = self.row_base(code);
        if base + self.stride() > self.words.len() || self.free.contains(&(code as u32)) {
            return Err(format!("set {code:#x} names a row that is not in use"));
        }
        if self.words[base] as usize != slots.len() {
            return Err(format!(
                "row of {code:#x} counts {} slots, holds {}",
                self.words[base],
                slots.len()
            ));
        }
        if slots.len() <= INLINE && slots.iter().all(|&s| fits_inline(s)) {
            return Err(format!(
                "set {code:#x} of {} slots is in a row, not inline",
                slots.len()
            ));
        }
        Ok(())
    }

    // ---- a holder set of either kind: a bit mask while narrow, a code once wide ----

    /// Makes room for worker `slot` in the holder sets `sets` (every node's or run's): past 64
    /// slots the index turns wide and each set becomes its code; a wide index's rows widen as
    /// slots are added.
    pub(super) fn ensure_slot<'a>(&mut self, slot: usize, sets: impl Iterator<Item = &'a mut u64>) {
        let needed = slot / 64 + 1;
        if needed <= self.mask_words.max(1) {
            return;
        }
        let was_wide = self.wide();
        self.widen(needed.max(self.mask_words * 2));
        if !was_wide {
            for set in sets {
                *set = self.code_of_mask(*set);
            }
        }
    }

    /// Mask word `w` of the holder set `set`.
    #[inline]
    pub(super) fn set_word(&self, set: u64, w: usize) -> u64 {
        if self.wide() {
            self.word(set, w)
        } else if w == 0 {
            set
        } else {
            0
        }
    }

    /// Whether the holder set `set` holds `slot`.
    #[inline]
    pub(super) fn set_has(&self, set: u64, slot: usize) -> bool {
        self.set_word(set, slot / 64) & (1 << (slot % 64)) != 0
    }

    /// Adds `slot` to the holder set `set`, which does not hold it.
    #[inline]
    pub(super) fn set_add(&mut self, set: &mut u64, slot: usize) {
        if self.wide() {
            self.insert(set, slot);
        } else {
            *set |= 1 << slot;
        }
    }

    /// Takes `slot` out of the holder set `set`, if it holds it.
    #[inline]
    pub(super) fn set_remove(&mut self, set: &mut u64, slot: usize) {
        if self.wide() {
            self.remove(set, slot);
        } else {
            *set &= !(1 << (slot % 64));
        }
    }

    /// How many slots the holder set `set` holds.
    #[inline]
    pub(super) fn set_len(&self, set: u64) -> usize {
        if self.wide() {
            self.count(set)
        } else {
            set.count_ones() as usize
        }
    }

    /// Whether `slot` alone holds the holder set `set`.
    #[inline]
    pub(super) fn set_is_only(&self, set: u64, slot: usize) -> bool {
        if self.wide() {
            self.count(set) == 1 && self.contains(set, slot)
        } else {
            set == 1 << slot
        }
    }

    /// A second holder set equal to `set`, for a second owner (a run split in two): a row is
    /// copied, since a row has one owner.
    pub(super) fn set_copy(&mut self, set: u64) -> u64 {
        if !self.wide() || set & ROW == 0 {
            return set;
        }
        let row = self.take_row();
        let from = self.row_base(set);
        let stride = self.stride();
        self.words.copy_within(from..from + stride, row as usize * stride);
        ROW | u64::from(row)
    }

    /// Rows in use.
    #[cfg(test)]
    pub(super) fn rows_in_use(&self) -> usize {
        if self.mask_words == 0 {
            0
        } else {
            self.words.len() / self.stride() - self.free.len()
        }
    }

    /// Heap bytes, by capacity.
    pub(super) fn allocation_size(&self) -> usize {
        self.words.capacity() * size_of::<u64>() + self.free.capacity() * size_of::<u32>()
    }

    #[inline(always)]
    fn row_base(&self, code: u64) -> usize {
        (code as u32) as usize * self.stride()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A set taken through every form and back, against a plain list.
    #[test]
    fn sets_move_between_inline_and_a_row_and_keep_their_slots() {
        let mut rows = Rows::default();
        rows.widen(16);
        let mut code = 0u64;
        let mut model: Vec<usize> = Vec::new();
        let order = [5usize, 999, 64, 0, 700, 63, 128, 1];
        for &s in &order {
            rows.insert(&mut code, s);
            model.push(s);
            model.sort_unstable();
            assert_eq!(rows.slots(code), model);
            assert_eq!(rows.count(code), model.len());
            assert_eq!(code & ROW != 0, model.len() > INLINE, "{model:?}");
            rows.check(code).unwrap();
            for w in 0..16 {
                let expect = model
                    .iter()
                    .filter(|&&s| s / 64 == w)
                    .fold(0u64, |m, &s| m | 1 << (s % 64));
                assert_eq!(rows.word(code, w), expect);
            }
        }
        assert_eq!(rows.rows_in_use(), 1);
        rows.remove(&mut code, 12345 % 1000); // not held: nothing changes
        for &s in order.iter().rev() {
            rows.remove(&mut code, s);
            model.retain(|&m| m != s);
            assert_eq!(rows.slots(code), model);
            assert_eq!(code & ROW != 0, model.len() > INLINE, "{model:?}");
            rows.check(code).unwrap();
        }
        assert_eq!(code, 0);
        assert_eq!(rows.rows_in_use(), 0);
        // The row given back is reused, zeroed.
        let mut other = rows.code_of_mask(0b1111_0000);
        assert_eq!(rows.rows_in_use(), 1);
        assert_eq!(rows.slots(other), vec![4, 5, 6, 7]);
        rows.widen(32);
        assert_eq!(rows.slots(other), vec![4, 5, 6, 7]);
        rows.insert(&mut other, 2000);
        assert_eq!(rows.slots(other), vec![4, 5, 6, 7, 2000]);
        rows.check(other).unwrap();
    }

    #[test]
    fn slots_past_the_inline_fields_live_in_rows() {
        let mut rows = Rows::default();
        let big = FIELD as usize;
        rows.widen(big / 64 + 1);
        let mut code = 0;
        rows.insert(&mut code, big);
        assert!(code & ROW != 0);
        rows.insert(&mut code, 3);
        rows.remove(&mut code, big);
        // One slot left, which fits: inline again.
        assert_eq!(code & ROW, 0);
        assert_eq!(rows.slots(code), vec![3]);
        rows.remove(&mut code, 3);
        assert_eq!(code, 0);
    }
}
