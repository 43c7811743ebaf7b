//! A cache-line prefetch hint behind a safe function.
//!
//! A batch of hash-table updates whose keys land on random cache lines is bound by waiting on
//! those lines. A plain load of a line ahead of its use does start the miss early, but the load
//! must complete before the instructions after it can retire, so a few loads in flight fill the
//! processor's reorder window and the batch waits anyway. A prefetch instruction retires at once:
//! issued a few keys ahead of the update that needs the line, its miss overlaps with the work on
//! the keys in between (BENCHMARKS.md, "Index: prefetch distance").
//!
//! Stable Rust has no safe prefetch (`std::hint::prefetch_read` is unstable), and even baseline
//! SSE intrinsics must be called from `unsafe` code outside a `#[target_feature]` function. This
//! crate is the workspace's one `unsafe` block: a prefetch is a hint that never faults, whatever
//! the address, reads and writes no memory and changes no register or flag; here the address is
//! also that of a live reference. On targets other than x86-64 the function does nothing.

/// Hints that the cache line holding `value` will be read soon (into every cache level).
///
/// Never changes what any load returns; at worst it costs the memory traffic of one line.
#[inline(always)]
pub fn prefetch_read<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let address: *const T = value;
        #[expect(unsafe_code, reason = "the workspace's one exception: see the crate docs")]
        // SAFETY: `prefetcht0` is a hint. It never faults, whatever the address, and it has no
        // architectural effect; `address` comes from a live reference besides. SSE is part of
        // the x86-64 baseline, so the instruction exists on every x86-64 processor.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(address.cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = value;
    }
}

#[cfg(test)]
mod tests {
    use super::prefetch_read;

    #[test]
    fn a_prefetch_changes_nothing_it_is_pointed_at() {
        let lines = vec![[7u64; 8]; 64];
        for line in &lines {
            prefetch_read(line);
        }
        prefetch_read(&lines[63][7]);
        assert!(lines.iter().flatten().all(|&v| v == 7));
    }
}
