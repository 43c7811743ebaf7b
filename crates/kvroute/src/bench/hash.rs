//! `kvroute bench hash`: block hashing throughput next to the machine's memory bandwidth.
//!
//! Hashing a prompt is the one per-request cost the router pays on every token, so it should run
//! near memory speed. The report puts bytes hashed per second beside a large `memcpy`'s bytes per
//! second measured in the same run.

use std::hint::black_box;
use std::time::Instant;

use kvroute_core::hash::{BlockHasher, HashSalt};
use serde::Serialize;

/// One block size's figures.
#[derive(Clone, Debug, Serialize)]
pub struct HashBenchReport {
    /// Always `hash`.
    pub bench: &'static str,
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes of token ids hashed per repetition.
    pub bytes: usize,
    /// Local block hashes: GB (1e9 bytes) of token ids per second, median repetition.
    pub local_gb_per_s: f64,
    /// Local plus sequence (chained) hashes: GB of token ids per second, median repetition.
    pub chained_gb_per_s: f64,
    /// Copying a buffer of the same size: GB per second read (median repetition).
    pub memcpy_gb_per_s: f64,
    /// `chained_gb_per_s / memcpy_gb_per_s`.
    pub fraction_of_memcpy: f64,
    /// A 131,072-token prompt hashed as the router hashes it (`hash_prompt_shared`: local
    /// hashes and the chain in one pass), its token ids in the CPU's caches: median of
    /// `PROMPT_REPS` repetitions, in nanoseconds.
    pub prompt_128k_ns: u64,
    /// `prompt_128k_ns` per full block.
    pub prompt_ns_per_block: f64,
}

/// Tokens of the cache-warm prompt case: 128K, a long-context prompt.
const PROMPT_TOKENS: usize = 128 << 10;
/// Repetitions of the prompt case.
const PROMPT_REPS: usize = 201;

fn median_secs(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut secs: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    secs.sort_by(f64::total_cmp);
    secs[secs.len() / 2]
}

/// Hashes `tokens` token ids (pseudo-random values) at each block size, `reps` times each.
pub fn run(tokens: usize, block_sizes: &[usize], reps: usize) -> Vec<HashBenchReport> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let ids: Vec<u32> = (0..tokens)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 152_064) as u32
        })
        .collect();
    let bytes = tokens * 4;
    let mut dst = vec![0u32; tokens];
    let copy = median_secs(reps, || {
        dst.copy_from_slice(black_box(&ids));
        black_box(&dst);
    });
    block_sizes
        .iter()
        .map(|&block_size| {
            let hasher = BlockHasher::new(block_size, &HashSalt::NONE);
            let local = median_secs(reps, || {
                black_box(hasher.local_hashes(black_box(&ids)));
            });
            let chained = median_secs(reps, || {
                let locals = hasher.local_hashes(black_box(&ids));
                black_box(hasher.sequence_hashes(&locals));
            });
            let prompt = &ids[..PROMPT_TOKENS.min(ids.len())];
            let mut locals = Vec::new();
            let prompt_secs = median_secs(PROMPT_REPS, || {
                black_box(hasher.hash_prompt_shared(black_box(prompt), &mut locals));
            });
            let prompt_blocks = (prompt.len() / block_size).max(1);
            let gbps = |secs: f64| bytes as f64 / secs / 1e9;
            HashBenchReport {
                bench: "hash",
                block_size,
                bytes,
                local_gb_per_s: gbps(local),
                chained_gb_per_s: gbps(chained),
                memcpy_gb_per_s: gbps(copy),
                fraction_of_memcpy: copy / chained,
                prompt_128k_ns: (prompt_secs * 1e9) as u64,
                prompt_ns_per_block: prompt_secs * 1e9 / prompt_blocks as f64,
            }
        })
        .collect()
}
