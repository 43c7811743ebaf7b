//! `kvroute bench route`: the latency of one routing decision, hashing included.
//!
//! For each fleet size and prompt length, a router (the default `kv` policy, KV events, block
//! size 16 as vLLM's default) is given realistic state before the clock starts:
//!
//! * **Cache.** Every worker holds conversations the KV events told it about: each one of four
//!   shared system prompts (`min(2,048, prompt/4)` tokens) followed by a private history of
//!   half to all of the prompt length, until the worker holds about 16K blocks (at least two
//!   conversations, at most 64).
//! * **Load.** Four requests per worker are routed through the router itself, half of them past
//!   their first token.
//!
//! Then each sample builds a prompt (untimed): half continue one of the cached conversations
//! (a deep hit on one worker), half start a new one on a shared system prompt (a shallow hit on a
//! quarter of the fleet). The timed region is `Router::handle_request` on the token ids: hashing,
//! the index lookup, the load projection of every worker, the policy, the booking. The request is
//! then finished (untimed), so the load stays as set up. `hash_p50_ns` times the router's hashing
//! alone on the same prompts. Fresh prompts and follow-ups are also reported apart.
//!
//! **A follow-up's earlier hashes** ([`EarlierHashes`]). A driver that keeps a conversation's
//! hashes routes the next turn as [`Prompt::Continues`], so the router hashes only the blocks
//! past the previous turn's; the default [`EarlierHashes::Kept`] models that, the previous turn's
//! hashes made untimed. The proxy does so for a chat whose previous turn its conversation cache
//! holds (`kvroute_http::prefix_cache::Turn`: the turn's hashes kept beside the cache's entries);
//! it hashes the new blocks just before the decision, outside the router's lock, and hands the
//! router the whole chain. [`EarlierHashes::Rehashed`] routes every prompt as token ids, hashed
//! whole: a proxied prompt that is not a chat, or whose previous turn the cache no longer holds
//! or hashed under another salt.
//!
//! **Where the prompt is.** In the proxy a prompt is routed right after it was tokenized, so its
//! token ids (512 KiB at 128K tokens) are in the CPU's caches; [`PromptCache::Warm`] (the
//! default) models that: each prompt is generated, hashed alone (timed as `hash_p50_ns`), then
//! routed. [`PromptCache::Cold`] routes each prompt after 64 MiB of other prompts were written
//! since it was made (twice the last-level cache), so its token ids come from memory; its
//! `hash_p50_ns` is timed after the decision, on the then-warm prompt.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvroute_core::hash::{BlockHasher, HashSalt, PromptHasher, PromptHashes};
use kvroute_core::ids::{DpRank, RequestId, WorkerId, WorkerKey};
use kvroute_core::router::{
    IndexEvent, Prompt, RouteOutcome, RouteRequest, Router, RouterConfig, WorkerRole, WorkerSpec,
    stored_blocks,
};
use kvroute_core::time::Timestamp;
use serde::Serialize;

use super::{mean, percentile};

/// Tokens per block: vLLM's default.
pub const BLOCK_SIZE: u32 = 16;
/// Shared system prompts in the fleet.
const SYSTEM_PROMPTS: u64 = 4;
/// Blocks each worker's cache is filled to, roughly.
const CACHED_BLOCKS_PER_WORKER: usize = 16 << 10;
/// Requests booked per worker before timing.
const ACTIVE_PER_WORKER: usize = 4;

/// Whether a timed prompt's token ids are in the CPU's caches when it is routed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PromptCache {
    /// Just generated and read, as a prompt the proxy just tokenized.
    #[default]
    Warm,
    /// Generated 64 MiB of prompts earlier: read from memory.
    Cold,
}

/// How a follow-up turn's earlier blocks reach the router.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum EarlierHashes {
    /// The previous turn's hashes, kept as a driver may keep them: only the new blocks
    /// are hashed ([`Prompt::Continues`]).
    #[default]
    Kept,
    /// None: the whole prompt is hashed ([`Prompt::Tokens`]).
    Rehashed,
}

/// Bytes of prompts written between a cold prompt's making and its routing.
const COLD_DISTANCE_BYTES: usize = 64 << 20;

/// One case's figures.
#[derive(Clone, Debug, Serialize)]
pub struct RouteBenchReport {
    /// Always `route`.
    pub bench: &'static str,
    /// Workers in the fleet.
    pub workers: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub block_size: u32,
    /// Decisions timed.
    pub samples: usize,
    /// Where the timed prompts' token ids were.
    pub prompt_cache: PromptCache,
    /// How follow-ups' earlier blocks reached the router.
    pub earlier_hashes: EarlierHashes,
    /// Median decision latency, hashing included, in nanoseconds.
    pub p50_ns: u64,
    /// 99th percentile decision latency, in nanoseconds.
    pub p99_ns: u64,
    /// Slowest decision, in nanoseconds.
    pub max_ns: u64,
    /// Mean decision latency, in nanoseconds.
    pub mean_ns: f64,
    /// Median time to hash the prompt alone (local and sequence hashes, as the router does:
    /// a follow-up's new blocks alone with [`EarlierHashes::Kept`]), in nanoseconds.
    pub hash_p50_ns: u64,
    /// Fresh prompts (on a shared system prompt): decisions timed; p50 and p99 in nanoseconds.
    pub fresh: KindFigures,
    /// Follow-ups (continuing a cached conversation): decisions timed; p50 and p99.
    pub follow_up: KindFigures,
    /// (worker, block) entries in the KV index.
    pub cached_entries: u64,
    /// Requests booked while timing.
    pub active_requests: usize,
}

/// One kind of prompt's decisions.
#[derive(Clone, Debug, Serialize)]
pub struct KindFigures {
    /// Decisions timed.
    pub samples: usize,
    /// Median decision latency, in nanoseconds.
    pub p50_ns: u64,
    /// 99th percentile decision latency, in nanoseconds.
    pub p99_ns: u64,
}

impl KindFigures {
    fn of(mut ns: Vec<u64>) -> Self {
        ns.sort_unstable();
        Self {
            samples: ns.len(),
            p50_ns: percentile(&ns, 50.0),
            p99_ns: percentile(&ns, 99.0),
        }
    }
}

/// A xorshift64 generator for token ids: fast, seeded, good enough for content.
#[derive(Clone, Debug)]
struct Tokens(u64);

impl Tokens {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Appends `n` token ids (a 152K vocabulary, like Qwen's).
    fn extend(&mut self, out: &mut Vec<u32>, n: usize) {
        out.extend((0..n).map(|_| (self.next() % 152_064) as u32));
    }
}

/// The fleet's content, regenerated from seeds on demand instead of stored.
struct Corpus {
    seed: u64,
    prompt_tokens: usize,
    system_tokens: usize,
    conversations: usize,
}

impl Corpus {
    fn new(seed: u64, prompt_tokens: usize) -> Self {
        let system_tokens = (prompt_tokens / 4).min(2048) / BLOCK_SIZE as usize * BLOCK_SIZE as usize;
        let conversation_blocks = (prompt_tokens * 3 / 4 / BLOCK_SIZE as usize).max(1);
        let conversations = (CACHED_BLOCKS_PER_WORKER / conversation_blocks).clamp(2, 64);
        Self {
            seed,
            prompt_tokens,
            system_tokens,
            conversations,
        }
    }

    fn system(&self, which: u64, out: &mut Vec<u32>) {
        Tokens::new(self.seed ^ (which + 1) << 48).extend(out, self.system_tokens);
    }

    /// Conversation `k` of worker `w`: its system prompt and history.
    fn conversation(&self, w: usize, k: usize, out: &mut Vec<u32>) {
        out.clear();
        self.system(w as u64 % SYSTEM_PROMPTS, out);
        let mut rng = Tokens::new(self.seed ^ ((w as u64) << 20 | k as u64) << 8);
        let len = self.prompt_tokens / 2 + (rng.next() as usize % (self.prompt_tokens / 2 + 1));
        rng.extend(out, len.saturating_sub(self.system_tokens));
    }
}

fn worker(w: usize) -> WorkerKey {
    WorkerKey::new(WorkerId(w as u64), DpRank(0))
}

/// A router with `workers` workers, their caches and their load; see the module docs.
fn setup(workers: usize, corpus: &Corpus, rng: &mut Tokens) -> anyhow::Result<(Router, u64)> {
    let config = RouterConfig {
        seed: corpus.seed,
        block_size: BLOCK_SIZE,
        ..RouterConfig::default()
    };
    let mut router = Router::new(config)?;
    let hasher = BlockHasher::new(BLOCK_SIZE as usize, &HashSalt::NONE);
    let (mut tokens, mut locals, mut chain) = (Vec::new(), Vec::new(), Vec::new());
    for w in 0..workers {
        router.handle_worker_added(
            Timestamp::ZERO,
            WorkerSpec::new(worker(w), WorkerRole::Aggregated, 1 << 16),
        )?;
        for k in 0..corpus.conversations {
            corpus.conversation(w, k, &mut tokens);
            hasher.hash_prompt(&tokens, &mut locals, &mut chain);
            let blocks = stored_blocks(&locals, &chain);
            router.handle_kv_event(
                Timestamp::ZERO,
                worker(w),
                IndexEvent::Stored {
                    parent: None,
                    blocks: &blocks,
                },
            )?;
        }
    }
    let mut next_id = 0;
    for i in 0..workers * ACTIVE_PER_WORKER {
        sample_prompt(corpus, workers, rng, &mut tokens);
        let id = RequestId(next_id);
        next_id += 1;
        router.handle_request(Timestamp::ZERO, &RouteRequest::new(id, Prompt::Tokens(&tokens)))?;
        if i % 2 == 0 {
            router.handle_first_token(Timestamp::ZERO, id)?;
        }
    }
    Ok((router, next_id))
}

/// A prompt of `corpus.prompt_tokens`: half continue a cached conversation, half start anew.
/// Returns the length of the conversation a follow-up continues (its first tokens), `None` for
/// a fresh prompt.
fn sample_prompt(corpus: &Corpus, workers: usize, rng: &mut Tokens, out: &mut Vec<u32>) -> Option<usize> {
    let earlier = if rng.next().is_multiple_of(2) {
        let w = rng.next() as usize % workers;
        let k = rng.next() as usize % corpus.conversations;
        corpus.conversation(w, k, out);
        Some(out.len())
    } else {
        out.clear();
        corpus.system(rng.next() % SYSTEM_PROMPTS, out);
        None
    };
    let missing = corpus.prompt_tokens.saturating_sub(out.len());
    rng.extend(out, missing);
    out.truncate(corpus.prompt_tokens);
    earlier.map(|len| len.min(out.len()))
}

/// A timed prompt: its token ids and, for a follow-up with [`EarlierHashes::Kept`], the hashes
/// its conversation's previous turn left.
#[derive(Default)]
struct Sample {
    tokens: Vec<u32>,
    follow_up: bool,
    earlier: Option<PromptHashes>,
}

impl Sample {
    fn make(&mut self, corpus: &Corpus, workers: usize, rng: &mut Tokens, earlier: EarlierHashes) {
        let len = sample_prompt(corpus, workers, rng, &mut self.tokens);
        self.follow_up = len.is_some();
        self.earlier = match (len, earlier) {
            (Some(len), EarlierHashes::Kept) => {
                let hasher = PromptHasher::new(BLOCK_SIZE as usize, &HashSalt::NONE);
                Some(PromptHashes::new(&hasher, &self.tokens[..len]))
            }
            _ => None,
        };
    }

    fn prompt(&self) -> Prompt<'_> {
        match &self.earlier {
            Some(earlier) => Prompt::Continues {
                tokens: &self.tokens,
                earlier,
            },
            None => Prompt::Tokens(&self.tokens),
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Times `samples` decisions for one fleet size and prompt length.
pub fn run_case(
    workers: usize,
    prompt_tokens: usize,
    samples: usize,
    seed: u64,
    prompt_cache: PromptCache,
    earlier_hashes: EarlierHashes,
) -> anyhow::Result<RouteBenchReport> {
    let corpus = Corpus::new(seed, prompt_tokens);
    let mut rng = Tokens::new(seed ^ 0xB0B);
    let (mut router, mut next_id) = setup(workers, &corpus, &mut rng)?;
    // The hashing the router does: local hashes and the chain in one shared allocation, only
    // past the earlier hashes where a follow-up has them.
    let hasher = PromptHasher::new(BLOCK_SIZE as usize, &HashSalt::NONE);
    let mut locals = Vec::new();
    let mut time_hashing = |sample: &Sample| {
        let t0 = Instant::now();
        let chain = match &sample.earlier {
            Some(earlier) => hasher.hash_prompt_after(black_box(&sample.tokens), earlier, &mut locals),
            None => Some(hasher.hash_prompt_shared(black_box(&sample.tokens), &mut locals)),
        };
        let ns = nanos(t0.elapsed());
        black_box(chain);
        ns
    };
    // Warm: one prompt, made just before it is routed. Cold: a ring of prompts, each routed
    // `ring.len()` samples after it was made.
    let ring_len = match prompt_cache {
        PromptCache::Warm => 1,
        PromptCache::Cold => COLD_DISTANCE_BYTES.div_ceil(prompt_tokens.max(1) * 4).max(2),
    };
    let mut ring: Vec<Sample> = std::iter::repeat_with(Sample::default).take(ring_len).collect();
    if prompt_cache == PromptCache::Cold {
        for sample in &mut ring {
            sample.make(&corpus, workers, &mut rng, earlier_hashes);
        }
    }
    let mut route_ns = Vec::with_capacity(samples);
    let (mut fresh_ns, mut follow_up_ns) = (Vec::new(), Vec::new());
    let mut hash_ns = Vec::with_capacity(samples);
    let now = Timestamp::from_millis(1);
    for i in 0..samples {
        let sample = &mut ring[i % ring_len];
        if prompt_cache == PromptCache::Warm {
            sample.make(&corpus, workers, &mut rng, earlier_hashes);
            hash_ns.push(time_hashing(sample));
        }
        let id = RequestId(next_id);
        next_id += 1;
        let request = RouteRequest::new(id, sample.prompt());
        let t0 = Instant::now();
        let outcome = router.handle_request(now, black_box(&request))?;
        let ns = nanos(t0.elapsed());
        route_ns.push(ns);
        if sample.follow_up {
            follow_up_ns.push(ns);
        } else {
            fresh_ns.push(ns);
        }
        if !matches!(outcome, RouteOutcome::Routed(_)) {
            anyhow::bail!("request {id:?} was not routed: {outcome:?}");
        }
        router.handle_finished(now, id)?;
        if prompt_cache == PromptCache::Cold {
            hash_ns.push(time_hashing(sample));
            sample.make(&corpus, workers, &mut rng, earlier_hashes);
        }
    }
    router.check_invariants().map_err(anyhow::Error::msg)?;
    let metrics = router.metrics();
    route_ns.sort_unstable();
    hash_ns.sort_unstable();
    Ok(RouteBenchReport {
        bench: "route",
        workers,
        prompt_tokens,
        block_size: BLOCK_SIZE,
        samples,
        prompt_cache,
        earlier_hashes,
        p50_ns: percentile(&route_ns, 50.0),
        p99_ns: percentile(&route_ns, 99.0),
        max_ns: route_ns.last().copied().unwrap_or(0),
        mean_ns: mean(&route_ns),
        hash_p50_ns: percentile(&hash_ns, 50.0),
        fresh: KindFigures::of(fresh_ns),
        follow_up: KindFigures::of(follow_up_ns),
        cached_entries: metrics.workers.iter().map(|w| w.cached_blocks).sum(),
        active_requests: metrics.active_now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_and_rehashed_follow_ups_time_the_same_decisions() {
        let run = |earlier| run_case(4, 512, 60, 3, PromptCache::Warm, earlier).expect("a small case runs");
        let (kept, rehashed) = (run(EarlierHashes::Kept), run(EarlierHashes::Rehashed));
        for report in [&kept, &rehashed] {
            assert_eq!(report.fresh.samples + report.follow_up.samples, 60);
            assert!(report.fresh.samples > 0 && report.follow_up.samples > 0);
        }
        // The same prompts, the same fleet: only how follow-ups are hashed differs.
        assert_eq!(kept.follow_up.samples, rehashed.follow_up.samples);
        assert_eq!(kept.cached_entries, rehashed.cached_entries);
        assert_eq!(kept.active_requests, rehashed.active_requests);
    }
}
