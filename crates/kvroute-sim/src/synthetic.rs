//! A seeded workload generator: Poisson or gamma arrivals, length distributions, shared-prefix
//! groups and multi-turn sessions with think time.
//!
//! A session's turn `k + 1` arrives `think_time` after turn `k` finishes, and its prompt is turn
//! `k`'s prompt followed by `isl` new tokens (the previous answer and the user's next message), so
//! a router that keeps a session on one worker finds the whole earlier prompt cached.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::ids::LocalBlockHash;
use kvroute_core::router::Rng;
use kvroute_core::time::Timestamp;

use crate::error::SimError;
#[cfg(test)]
use crate::trace::unique_token;
use crate::workload::{Arrival, PromptBlocks, PromptHasher, SimRequest, Workload};

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
/// time and memory linear in their new tokens.
pub fn generate(config: &SyntheticConfig, block_size: u32) -> Workload {
    let plan = WorkloadPlan::new(config, block_size);
    let own = plan.hash(0..plan.len());
    plan.build(own.blocks)
}

/// [`generate`] in three steps, so that a caller can hash on several threads (this crate starts
/// none): [`WorkloadPlan::new`] makes every draw; [`WorkloadPlan::hash`] hashes the blocks made of a range of
/// requests' own tokens (all of a turn's blocks but the one that completes the session's
/// partial block), each range independently; [`WorkloadPlan::assemble`] builds the workload from the
/// ranges: [`generate`]'s, whatever the ranges.
#[derive(Clone, Debug)]
pub struct WorkloadPlan {
    config: SyntheticConfig,
    block_size: u32,
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
            turns: plan(config, block_size.max(1) as usize),
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

    /// The local hashes of the blocks made of the own tokens of requests `range` (clamped to
    /// the plan).
    pub fn hash(&self, range: Range<usize>) -> OwnBlocks {
        let end = range.end.min(self.turns.len());
        let first = range.start.min(end);
        let mut hasher = PromptHasher::new(self.block_size.max(1));
        let blocks = self.turns[first..end]
            .iter()
            .enumerate()
            .map(|(k, t)| hasher.unique_blocks((first + k) as u64, t.head, t.new - t.head))
            .collect();
        OwnBlocks { first, blocks }
    }

    /// The workload, from `parts` that cover the requests in order (ranges `0..a`, `a..b`, ...,
    /// up to [`WorkloadPlan::len`]); an error says where a request is missing.
    pub fn assemble(&self, parts: Vec<OwnBlocks>) -> Result<Workload, SimError> {
        let mut next = 0;
        for part in &parts {
            if part.first != next {
                return Err(SimError::Workload(format!(
                    "the hashed blocks start at request {} where request {next} is next",
                    part.first
                )));
            }
            next += part.blocks.len();
        }
        if next != self.turns.len() {
            return Err(SimError::Workload(format!(
                "the hashed blocks end at request {next}, not at {}",
                self.turns.len()
            )));
        }
        Ok(self.build(parts.into_iter().flat_map(|p| p.blocks)))
    }

    /// The workload, given every request's own blocks in order.
    fn build(&self, own: impl IntoIterator<Item = Vec<LocalBlockHash>>) -> Workload {
        let (config, block_size) = (&self.config, self.block_size);
        let bs = block_size.max(1) as usize;
        let mut workload = Workload::new(block_size);
        workload.requests.reserve_exact(self.turns.len());
        let mut hasher = PromptHasher::new(block_size.max(1));
        // Per prefix group: its prefix's full blocks and the tokens after them.
        let mut prefixes: Vec<Option<GroupPrefix>> = vec![None; config.prefix_groups as usize];
        // The session's prompt so far: segments of full blocks, then the tokens of its partial
        // block.
        let mut segments: Vec<Arc<[LocalBlockHash]>> = Vec::new();
        let mut tail: Vec<u32> = Vec::new();
        let mut blocks = 0u64;
        for ((id, turn), middle) in self.turns.iter().enumerate().zip(own) {
            if turn.turn == 0 {
                segments.clear();
                blocks = 0;
                tail.clear();
                if let Some(group) = turn.group {
                    let (prefix, rest) = prefixes[group].get_or_insert_with(|| {
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
                        blocks += prefix.len() as u64;
                        segments.push(Arc::clone(prefix));
                    }
                    tail.extend_from_slice(rest);
                }
            }
            let new_blocks = hasher.push_unique_tokens_around(&mut tail, id as u64, turn.new, middle);
            if !new_blocks.is_empty() {
                blocks += new_blocks.len() as u64;
                segments.push(Arc::from(new_blocks));
            }
            let tokens = blocks * bs as u64 + tail.len() as u64;
            workload.requests.push(SimRequest {
                arrival: turn_arrival(turn.turn, turn.start, id, config),
                locals: PromptBlocks::from_segments(segments.clone()),
                prompt_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
                output_tokens: turn.output_tokens,
            });
        }
        workload
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

/// Every draw of [`generate`], in its order, with the length of each session's partial block.
fn plan(config: &SyntheticConfig, bs: usize) -> Vec<PlannedTurn> {
    let mut rng = Rng::new(config.seed);
    let mut turns = Vec::with_capacity(config.requests);
    let per_session = config.turns_per_session.max(1) as usize;
    let mut start = 0.0_f64;
    while turns.len() < config.requests {
        start += gap_secs(config, &mut rng);
        let mut partial = 0usize;
        let mut group = None;
        if config.prefix_groups > 0 {
            group = Some(rng.below(config.prefix_groups as usize));
            partial = config.shared_prefix_tokens as usize % bs;
        }
        for turn in 0..per_session {
            if turns.len() >= config.requests {
                break;
            }
            let new = config.isl.sample(&mut rng).max(1);
            let head = if partial == 0 {
                0
            } else {
                (bs - partial).min(new as usize) as u32
            };
            turns.push(PlannedTurn {
                start,
                turn,
                group: if turn == 0 { group } else { None },
                new,
                output_tokens: config.osl.sample(&mut rng),
                head,
            });
            partial = (partial + new as usize) % bs;
        }
    }
    turns
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
