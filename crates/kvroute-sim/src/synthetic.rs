//! A seeded workload generator: Poisson or gamma arrivals, length distributions, shared-prefix
//! groups and multi-turn sessions with think time.
//!
//! A session's turn `k + 1` arrives `think_time` after turn `k` finishes, and its prompt is turn
//! `k`'s prompt followed by `isl` new tokens (the previous answer and the user's next message), so
//! a router that keeps a session on one worker finds the whole earlier prompt cached.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::ids::LocalBlockHash;
use kvroute_core::router::Rng;
use kvroute_core::time::Timestamp;

use crate::error::SimError;
#[cfg(test)]
use crate::trace::unique_token;
use crate::workload::{Arrival, PromptBlocks, PromptHasher, RequestSource, SimRequest, Workload};

/// How session starts are spaced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ArrivalProcess {
    /// Exponential gaps (coefficient of variation 1).
    Poisson,
    /// Gamma-distributed gaps with this coefficient of variation (above 1: bursty).
    Gamma {
        /// Coefficient of variation of the gaps.
        cv: f64,
    },
}

/// A length distribution in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lengths {
    /// Always this many.
    Fixed(u32),
    /// Uniform over `min..=max`.
    Uniform {
        /// Smallest.
        min: u32,
        /// Largest.
        max: u32,
    },
}

impl Lengths {
    fn sample(&self, rng: &mut Rng) -> u32 {
        match *self {
            Self::Fixed(n) => n,
            Self::Uniform { min, max } => {
                let (lo, hi) = (min.min(max), min.max(max));
                lo + rng.below((hi - lo) as usize + 1) as u32
            }
        }
    }
}

/// What to generate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyntheticConfig {
    /// Requests in all (turns included).
    pub requests: usize,
    /// Session starts per second.
    pub rate_rps: f64,
    /// Gap distribution between session starts.
    pub arrival: ArrivalProcess,
    /// New prompt tokens per turn (after the shared prefix on a first turn).
    pub isl: Lengths,
    /// Output tokens per request.
    pub osl: Lengths,
    /// Shared-prefix groups; 0 for none. Each session starts with its group's prefix.
    pub prefix_groups: u32,
    /// Tokens of each group's prefix.
    pub shared_prefix_tokens: u32,
    /// Turns per session (1: independent requests).
    pub turns_per_session: u32,
    /// Think time between a turn's end and the next turn.
    pub think_time: Duration,
    /// Seed of every random draw.
    pub seed: u64,
}

impl Default for SyntheticConfig {
    /// 2,000 single-turn requests at 10 per second (Poisson), ISL 1,024–4,096, OSL 64–512,
    /// 16 prefix groups of 2,048 tokens, seed 1.
    fn default() -> Self {
        Self {
            requests: 2000,
            rate_rps: 10.0,
            arrival: ArrivalProcess::Poisson,
            isl: Lengths::Uniform { min: 1024, max: 4096 },
            osl: Lengths::Uniform { min: 64, max: 512 },
            prefix_groups: 16,
            shared_prefix_tokens: 2048,
            turns_per_session: 1,
            think_time: Duration::from_secs(5),
            seed: 1,
        }
    }
}

/// A prefix group's prefix: its full blocks' hashes and the tokens after them.
type GroupPrefix = (Arc<[LocalBlockHash]>, Vec<u32>);

/// Generates the workload `config` describes at `block_size` tokens per block.
///
/// Each token is hashed once: a group's prefix blocks are hashed once for the run, and a
/// session's next turn hashes only the blocks its new tokens complete. Prompts share their
/// memory the same way ([`PromptBlocks`]: the group's prefix and each earlier turn are segments
/// every later request of the group or session points to), so a million requests generate in
/// time and memory linear in their new tokens. [`SyntheticStream`] makes the same requests one
/// at a time.
pub fn generate(config: &SyntheticConfig, block_size: u32) -> Workload {
    let plan = WorkloadPlan::new(config, block_size);
    let own = plan.hash(plan.requests());
    plan.build(own.blocks)
}

/// The synthetic workload as a [`RequestSource`]: each request made when the run needs it (the
/// requests [`generate`] makes, in order), so that a run's memory does not grow with the
/// workload's length. Requests are drawn and hashed a chunk at a time; the hashing of a chunk
/// ([`WorkloadPlan::hash`] over ranges of it) may be handed to any number of threads
/// ([`SyntheticStream::with_hasher`]; this crate starts none).
pub struct SyntheticStream<'h> {
    draws: Draws,
    assembler: Assembler,
    chunk: usize,
    hash: HashPlan<'h>,
    /// The requests of the chunk drawn and hashed, not yet made, with their own blocks.
    pending: std::collections::VecDeque<(PlannedTurn, Vec<LocalBlockHash>)>,
    next_id: usize,
}

/// Hashes a chunk of a [`SyntheticStream`]: [`WorkloadPlan::hash`] over ranges that cover the
/// chunk's requests ([`WorkloadPlan::requests`]) in order.
pub type HashPlan<'h> = Box<dyn FnMut(&WorkloadPlan) -> Vec<OwnBlocks> + 'h>;

impl std::fmt::Debug for SyntheticStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyntheticStream")
            .field("config", &self.draws.config)
            .field("next_id", &self.next_id)
            .finish_non_exhaustive()
    }
}

impl<'h> SyntheticStream<'h> {
    /// Requests drawn and hashed at a time by [`SyntheticStream::new`].
    pub const CHUNK: usize = 1 << 13;

    /// The workload `config` describes at `block_size` tokens per block, hashed here.
    pub fn new(config: &SyntheticConfig, block_size: u32) -> Self {
        Self::with_hasher(
            config,
            block_size,
            Self::CHUNK,
            Box::new(|plan: &WorkloadPlan| vec![plan.hash(plan.requests())]),
        )
    }

    /// The same requests, drawn `chunk` at a time, each chunk hashed by `hash`.
    pub fn with_hasher(config: &SyntheticConfig, block_size: u32, chunk: usize, hash: HashPlan<'h>) -> Self {
        Self {
            draws: Draws::new(config, block_size.max(1) as usize),
            assembler: Assembler::new(config, block_size),
            chunk: chunk.max(1),
            hash,
            pending: std::collections::VecDeque::new(),
            next_id: 0,
        }
    }

    /// The next request, from the chunk in hand or a new one.
    fn next_request_checked(&mut self) -> Result<Option<SimRequest>, SimError> {
        if self.pending.is_empty() {
            let first = self.next_id;
            let plan = WorkloadPlan {
                config: self.draws.config,
                block_size: self.assembler.block_size,
                first,
                turns: self.draws.by_ref().take(self.chunk).collect(),
            };
            if plan.is_empty() {
                return Ok(None);
            }
            let parts = (self.hash)(&plan);
            let own = plan.own_blocks(parts)?;
            self.pending = plan.turns.into_iter().zip(own).collect();
        }
        Ok(self.pending.pop_front().map(|(turn, middle)| {
            let id = self.next_id;
            self.next_id += 1;
            self.assembler.request(id, &turn, middle)
        }))
    }
}

impl<'w> RequestSource<'w> for SyntheticStream<'_> {
    fn block_size(&self) -> u32 {
        self.assembler.block_size
    }

    fn len(&self) -> usize {
        self.draws.config.requests
    }

    fn next_request(&mut self) -> Result<Option<Cow<'w, SimRequest>>, SimError> {
        Ok(self.next_request_checked()?.map(Cow::Owned))
    }

    /// Session starts never go back, and a session's turns are made before the next session's.
    fn in_arrival_order(&self) -> bool {
        true
    }
}

/// [`generate`] in three steps, so that a caller can hash on several threads (this crate starts
/// none): [`WorkloadPlan::new`] makes every draw; [`WorkloadPlan::hash`] hashes the blocks made of a range of
/// requests' own tokens (all of a turn's blocks but the one that completes the session's
/// partial block), each range independently; [`WorkloadPlan::assemble`] builds the workload from the
/// ranges: [`generate`]'s, whatever the ranges. A [`SyntheticStream`] hands its chunks out as
/// plans of a range of the workload's requests.
#[derive(Clone, Debug)]
pub struct WorkloadPlan {
    config: SyntheticConfig,
    block_size: u32,
    /// The id of the first request planned.
    first: usize,
    turns: Vec<PlannedTurn>,
}

/// The blocks made of the own tokens of a range of a [`WorkloadPlan`]'s requests, from [`WorkloadPlan::hash`].
#[derive(Clone, Debug)]
pub struct OwnBlocks {
    first: usize,
    blocks: Vec<Vec<LocalBlockHash>>,
}

impl WorkloadPlan {
    /// Every draw of the workload `config` describes at `block_size` tokens per block, in order.
    pub fn new(config: &SyntheticConfig, block_size: u32) -> Self {
        Self {
            config: *config,
            block_size,
            first: 0,
            turns: Draws::new(config, block_size.max(1) as usize).collect(),
        }
    }

    /// Requests planned.
    pub fn len(&self) -> usize {
        self.turns.len()
    }

    /// Whether no request is planned.
    pub fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }

    /// The ids of the requests planned.
    pub fn requests(&self) -> Range<usize> {
        self.first..self.first + self.turns.len()
    }

    /// The local hashes of the blocks made of the own tokens of requests `range` (clamped to
    /// the plan's).
    pub fn hash(&self, range: Range<usize>) -> OwnBlocks {
        let all = self.requests();
        let end = range.end.clamp(all.start, all.end);
        let first = range.start.clamp(all.start, end);
        let mut hasher = PromptHasher::new(self.block_size.max(1));
        let blocks = self.turns[first - all.start..end - all.start]
            .iter()
            .enumerate()
            .map(|(k, t)| hasher.unique_blocks((first + k) as u64, t.head, t.new - t.head))
            .collect();
        OwnBlocks { first, blocks }
    }

    /// Every planned request's own blocks, in order, from `parts` that cover the requests in
    /// order; an error says where a request is missing.
    fn own_blocks(
        &self,
        parts: Vec<OwnBlocks>,
    ) -> Result<impl Iterator<Item = Vec<LocalBlockHash>> + use<>, SimError> {
        let all = self.requests();
        let mut next = all.start;
        for part in &parts {
            if part.first != next {
                return Err(SimError::Workload(format!(
                    "the hashed blocks start at request {} where request {next} is next",
                    part.first
                )));
            }
            next += part.blocks.len();
        }
        if next != all.end {
            return Err(SimError::Workload(format!(
                "the hashed blocks end at request {next}, not at {}",
                all.end
            )));
        }
        Ok(parts.into_iter().flat_map(|p| p.blocks))
    }

    /// The workload, from `parts` that cover the requests in order (ranges `0..a`, `a..b`, ...,
    /// up to [`WorkloadPlan::len`]); an error says where a request is missing.
    pub fn assemble(&self, parts: Vec<OwnBlocks>) -> Result<Workload, SimError> {
        Ok(self.build(self.own_blocks(parts)?))
    }

    /// The workload, given every request's own blocks in order.
    fn build(&self, own: impl IntoIterator<Item = Vec<LocalBlockHash>>) -> Workload {
        let mut workload = Workload::new(self.block_size);
        workload.requests.reserve_exact(self.turns.len());
        let mut assembler = Assembler::new(&self.config, self.block_size);
        for ((k, turn), middle) in self.turns.iter().enumerate().zip(own) {
            workload
                .requests
                .push(assembler.request(self.first + k, turn, middle));
        }
        workload
    }
}

/// Makes the requests from their draws and own blocks, in order: it keeps each group's prefix
/// and the prompt of the session so far.
#[derive(Debug)]
struct Assembler {
    config: SyntheticConfig,
    block_size: u32,
    hasher: PromptHasher,
    /// Per prefix group: its prefix's full blocks and the tokens after them.
    prefixes: Vec<Option<GroupPrefix>>,
    /// The session's prompt so far: segments of full blocks (`blocks` of them), then the
    /// tokens of its partial block.
    segments: Vec<Arc<[LocalBlockHash]>>,
    blocks: u64,
    tail: Vec<u32>,
}

impl Assembler {
    fn new(config: &SyntheticConfig, block_size: u32) -> Self {
        Self {
            config: *config,
            block_size,
            hasher: PromptHasher::new(block_size.max(1)),
            prefixes: vec![None; config.prefix_groups as usize],
            segments: Vec::new(),
            blocks: 0,
            tail: Vec::new(),
        }
    }

    /// Request `id`, drawn as `turn`, with `middle` its own blocks ([`WorkloadPlan::hash`]'s).
    fn request(&mut self, id: usize, turn: &PlannedTurn, middle: Vec<LocalBlockHash>) -> SimRequest {
        let (config, hasher) = (&self.config, &mut self.hasher);
        let bs = self.block_size.max(1) as usize;
        if turn.turn == 0 {
            self.segments.clear();
            self.blocks = 0;
            self.tail.clear();
            if let Some(group) = turn.group {
                let (prefix, rest) = self.prefixes[group].get_or_insert_with(|| {
                    let (mut full, mut rest) = (Vec::new(), Vec::new());
                    hasher.push_unique_tokens(
                        &mut rest,
                        u64::MAX - group as u64,
                        config.shared_prefix_tokens,
                        &mut full,
                    );
                    (full.into(), rest)
                });
                if !prefix.is_empty() {
                    self.blocks += prefix.len() as u64;
                    self.segments.push(Arc::clone(prefix));
                }
                self.tail.extend_from_slice(rest);
            }
        }
        let new_blocks = hasher.push_unique_tokens_around(&mut self.tail, id as u64, turn.new, middle);
        if !new_blocks.is_empty() {
            self.blocks += new_blocks.len() as u64;
            self.segments.push(Arc::from(new_blocks));
        }
        let tokens = self.blocks * bs as u64 + self.tail.len() as u64;
        SimRequest {
            arrival: turn_arrival(turn.turn, turn.start, id, config),
            locals: PromptBlocks::from_segments(self.segments.clone()),
            prompt_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
            output_tokens: turn.output_tokens,
        }
    }
}

/// One request's draws, and where its own full blocks start.
#[derive(Clone, Copy, Debug)]
struct PlannedTurn {
    /// The session's start, seconds.
    start: f64,
    /// Turn of its session.
    turn: usize,
    /// The session's prefix group, on its first turn.
    group: Option<usize>,
    /// New tokens.
    new: u32,
    output_tokens: u32,
    /// New tokens that complete the session's partial block (0 if it has none).
    head: u32,
}

/// Every draw of [`generate`], one request at a time, in its order, with the length of each
/// session's partial block.
#[derive(Clone, Debug)]
struct Draws {
    config: SyntheticConfig,
    bs: usize,
    rng: Rng,
    made: usize,
    /// The session's start, seconds.
    start: f64,
    /// The session's next turn (`turns_per_session` or more: a new session is next).
    turn: usize,
    group: Option<usize>,
    /// Tokens in the session's partial block.
    partial: usize,
}

impl Draws {
    fn new(config: &SyntheticConfig, bs: usize) -> Self {
        Self {
            config: *config,
            bs,
            rng: Rng::new(config.seed),
            made: 0,
            start: 0.0,
            turn: usize::MAX,
            group: None,
            partial: 0,
        }
    }
}

impl Iterator for Draws {
    type Item = PlannedTurn;

    fn next(&mut self) -> Option<PlannedTurn> {
        let config = &self.config;
        if self.made >= config.requests {
            return None;
        }
        if self.turn >= config.turns_per_session.max(1) as usize {
            self.start += gap_secs(config, &mut self.rng);
            self.partial = 0;
            self.group = None;
            if config.prefix_groups > 0 {
                self.group = Some(self.rng.below(config.prefix_groups as usize));
                self.partial = config.shared_prefix_tokens as usize % self.bs;
            }
            self.turn = 0;
        }
        let new = config.isl.sample(&mut self.rng).max(1);
        let head = if self.partial == 0 {
            0
        } else {
            (self.bs - self.partial).min(new as usize) as u32
        };
        let planned = PlannedTurn {
            start: self.start,
            turn: self.turn,
            group: if self.turn == 0 { self.group } else { None },
            new,
            output_tokens: config.osl.sample(&mut self.rng),
            head,
        };
        self.partial = (self.partial + new as usize) % self.bs;
        self.turn += 1;
        self.made += 1;
        Some(planned)
    }
}

/// One gap between session starts, in seconds.
/// When turn `turn` of a session arrives: the session's start for its first turn, else
/// the think time after the answer to request `id - 1` (the session's previous turn).
fn turn_arrival(turn: usize, start: f64, id: usize, config: &SyntheticConfig) -> Arrival {
    if turn == 0 {
        Arrival::At(Timestamp((start * 1e9).round() as u64))
    } else {
        Arrival::After {
            request: id - 1,
            delay: config.think_time,
        }
    }
}

/// An exponential draw of mean `mean`: a Poisson process's gap.
pub(crate) fn exponential_secs(mean: f64, rng: &mut Rng) -> f64 {
    -mean * (1.0 - rng.next_f64()).ln()
}

fn gap_secs(config: &SyntheticConfig, rng: &mut Rng) -> f64 {
    let mean = 1.0 / config.rate_rps.max(1e-9);
    match config.arrival {
        ArrivalProcess::Poisson => exponential_secs(mean, rng),
        ArrivalProcess::Gamma { cv } => {
            let shape = 1.0 / (cv * cv).max(1e-6);
            gamma(shape, rng) * mean / shape
        }
    }
}

/// A Gamma(`shape`, 1) draw (Marsaglia and Tsang; shapes below 1 by the `U^(1/k)` boost).
fn gamma(shape: f64, rng: &mut Rng) -> f64 {
    if shape < 1.0 {
        let u = 1.0 - rng.next_f64();
        return gamma(shape + 1.0, rng) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = 1.0 - rng.next_f64();
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut Rng) -> f64 {
    let u1 = 1.0 - rng.next_f64();
    let u2 = rng.next_f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_extend_their_previous_prompt_and_follow_it() {
        let config = SyntheticConfig {
            requests: 6,
            turns_per_session: 3,
            isl: Lengths::Fixed(32),
            prefix_groups: 1,
            shared_prefix_tokens: 16,
            ..SyntheticConfig::default()
        };
        let w = generate(&config, 16);
        assert_eq!(w.requests.len(), 6);
        assert!(matches!(w.requests[0].arrival, Arrival::At(_)));
        assert_eq!(
            w.requests[1].arrival,
            Arrival::After {
                request: 0,
                delay: config.think_time
            }
        );
        assert_eq!(w.requests[2].prompt_tokens, 16 + 3 * 32);
        assert!(
            w.requests[2]
                .locals
                .to_vec()
                .starts_with(&w.requests[1].locals.to_vec())
        );
        // Both sessions share the group prefix block.
        assert_eq!(w.requests[0].locals.get(0), w.requests[3].locals.get(0));
        assert_eq!(generate(&config, 16), w);
    }

    /// The generator as it was before it hashed incrementally: every turn writes out the
    /// session's whole prompt and hashes all of it. The oracle for the incremental one.
    fn generate_by_full_rehash(config: &SyntheticConfig, block_size: u32) -> Workload {
        let mut rng = Rng::new(config.seed);
        let mut workload = Workload::new(block_size);
        let mut hasher = PromptHasher::new(block_size.max(1));
        let turns = config.turns_per_session.max(1) as usize;
        let mut start = 0.0_f64;
        let mut session: Vec<u32> = Vec::new();
        while workload.requests.len() < config.requests {
            start += gap_secs(config, &mut rng);
            session.clear();
            if config.prefix_groups > 0 {
                let group = rng.below(config.prefix_groups as usize) as u64;
                session.extend((0..config.shared_prefix_tokens).map(|j| unique_token(u64::MAX - group, j)));
            }
            for turn in 0..turns {
                if workload.requests.len() >= config.requests {
                    break;
                }
                let id = workload.requests.len();
                let new = config.isl.sample(&mut rng).max(1);
                session.extend((0..new).map(|j| unique_token(id as u64, j)));
                hasher.buffer().extend_from_slice(&session);
                let arrival = turn_arrival(turn, start, id, config);
                workload.requests.push(SimRequest {
                    arrival,
                    locals: hasher.locals(),
                    prompt_tokens: hasher.len(),
                    output_tokens: config.osl.sample(&mut rng),
                });
            }
        }
        workload
    }

    #[test]
    fn generates_the_requested_count_deterministically_as_a_full_rehash_would() {
        let cases = [
            // (requests, turns, prefix groups, prefix tokens, block size)
            (1, 1, 0, 0, 16),
            (1_000, 1, 16, 2048, 64),
            (999, 4, 3, 100, 16),
            (500, 7, 2, 37, 5),
            (300, 2, 0, 0, 1),
        ];
        for (requests, turns, groups, prefix, bs) in cases {
            let config = SyntheticConfig {
                requests,
                turns_per_session: turns,
                prefix_groups: groups,
                shared_prefix_tokens: prefix,
                isl: Lengths::Uniform { min: 1, max: 300 },
                seed: requests as u64,
                ..SyntheticConfig::default()
            };
            let w = generate(&config, bs);
            assert_eq!(w.requests.len(), requests, "{config:?}");
            assert_eq!(generate(&config, bs), w, "not deterministic: {config:?}");
            // Hashed in ranges (as threads would), the same workload.
            let plan = WorkloadPlan::new(&config, bs);
            for cuts in [
                vec![],
                vec![0, 1],
                vec![requests / 3, requests / 2],
                vec![requests],
            ] {
                let mut parts = Vec::new();
                let mut from = 0;
                for cut in cuts.into_iter().chain([requests]) {
                    parts.push(plan.hash(from..cut));
                    from = cut;
                }
                assert_eq!(plan.assemble(parts).unwrap(), w, "{config:?}");
            }
            // Parts that leave a request out are an error.
            assert!(plan.assemble(vec![plan.hash(0..requests - 1)]).is_err());
            if requests > 2 {
                let gap = vec![plan.hash(0..1), plan.hash(2..requests)];
                assert!(plan.assemble(gap).is_err());
            }
            assert_eq!(
                generate_by_full_rehash(&config, bs),
                w,
                "{config:?} at block size {bs}"
            );
            let other = generate(
                &SyntheticConfig {
                    seed: config.seed + 1,
                    ..config
                },
                bs,
            );
            assert_ne!(other, w, "the seed changes the workload");
        }
    }

    #[test]
    fn gamma_gaps_have_the_requested_mean() {
        let mut rng = Rng::new(3);
        let config = SyntheticConfig {
            rate_rps: 4.0,
            arrival: ArrivalProcess::Gamma { cv: 2.0 },
            ..SyntheticConfig::default()
        };
        let n = 20_000;
        let mean = (0..n).map(|_| gap_secs(&config, &mut rng)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.02, "{mean}");
    }
}
