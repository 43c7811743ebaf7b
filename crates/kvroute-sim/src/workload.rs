//! The workload: every request a run will offer, with its arrival rule, its prompt as local
//! block hashes at the engines' block size, and its true output length.
//!
//! A workload is built once (from a trace or a generator) and run under any number of router
//! configurations: each policy of a comparison sees the identical requests.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::LocalBlockHash;
use kvroute_core::router::Rng;
use kvroute_core::time::Timestamp;
use kvroute_engine::Dispersion;
use kvroute_engine::noise::mix;

use crate::error::SimError;
use crate::trace::fill_unique_tokens;

/// When a request arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// At a fixed time (open loop: trace timestamps, generated arrival processes).
    At(Timestamp),
    /// `delay` after an earlier request of the same session finishes (or is turned away): the
    /// next turn of a conversation, with the user's think time.
    After {
        /// Index of the earlier request in [`Workload::requests`].
        request: usize,
        /// Think time.
        delay: Duration,
    },
}

/// `n` times `f`, rounded, at least 1.
fn scale_tokens(n: u32, f: f64) -> u32 {
    (f64::from(n) * f).round().clamp(1.0, f64::from(u32::MAX)) as u32
}

/// A prompt's local block hashes, kept as shared segments: requests that share a prefix (a
/// prefix group's system prompt, a session's earlier turns) share its memory, so a million
/// requests cost their new blocks only. Every hash is XORed with `salt` when read (the trace
/// multiplier's copies share their original's segments). Equality is on the hashes read.
#[derive(Clone, Debug)]
pub struct PromptBlocks {
    segments: Box<[Arc<[LocalBlockHash]>]>,
    salt: u64,
}

impl PromptBlocks {
    /// The blocks of `segments`, in order.
    pub fn from_segments(segments: Vec<Arc<[LocalBlockHash]>>) -> Self {
        Self {
            segments: segments.into_boxed_slice(),
            salt: 0,
        }
    }

    /// The same blocks with every hash XORed with `salt` as well.
    pub(crate) fn salted(&self, salt: u64) -> Self {
        Self {
            segments: self.segments.clone(),
            salt: self.salt ^ salt,
        }
    }

    /// Blocks in the prompt.
    pub fn len(&self) -> usize {
        self.segments.iter().map(|s| s.len()).sum()
    }

    /// Whether the prompt has no full block.
    pub fn is_empty(&self) -> bool {
        self.segments.iter().all(|s| s.is_empty())
    }

    /// The hashes, in order.
    pub fn iter(&self) -> impl Iterator<Item = LocalBlockHash> + '_ {
        let salt = self.salt;
        self.segments
            .iter()
            .flat_map(|s| s.iter())
            .map(move |h| LocalBlockHash(h.0 ^ salt))
    }

    /// Block `i`'s hash.
    pub fn get(&self, i: usize) -> Option<LocalBlockHash> {
        self.iter().nth(i)
    }

    /// Writes the hashes into `out` (cleared first).
    pub fn write_to(&self, out: &mut Vec<LocalBlockHash>) {
        out.clear();
        out.reserve(self.len());
        out.extend(self.iter());
    }

    /// The hashes as one vector.
    pub fn to_vec(&self) -> Vec<LocalBlockHash> {
        let mut out = Vec::new();
        self.write_to(&mut out);
        out
    }
}

impl From<Arc<[LocalBlockHash]>> for PromptBlocks {
    fn from(blocks: Arc<[LocalBlockHash]>) -> Self {
        Self::from_segments(vec![blocks])
    }
}

impl From<Vec<LocalBlockHash>> for PromptBlocks {
    fn from(blocks: Vec<LocalBlockHash>) -> Self {
        Self::from(Arc::<[LocalBlockHash]>::from(blocks))
    }
}

impl PartialEq for PromptBlocks {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for PromptBlocks {}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    /// When it arrives (ignored in closed-loop mode, where a request arrives when a slot frees).
    pub arrival: Arrival,
    /// Local hashes of the prompt's full blocks, at [`Workload::block_size`].
    pub locals: PromptBlocks,
    /// Prompt length in tokens: `locals.len()` full blocks plus fewer than a block.
    pub prompt_tokens: u32,
    /// Tokens the request generates. Only the engine reads it; the router never sees it.
    pub output_tokens: u32,
}

/// Where a run takes its requests from, one at a time, in the order of their ids (request `i`
/// is `RequestId(i)`): a [`Workload`] held whole, or a stream that makes each request when the
/// run needs it ([`crate::synthetic::SyntheticStream`]), so that the run's memory follows what
/// is in flight, not the workload's length.
pub trait RequestSource<'w> {
    /// Tokens per block of every request's `locals`.
    fn block_size(&self) -> u32;

    /// Requests in all.
    fn len(&self) -> usize;

    /// Whether it has no request.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The next request, `None` after the last; an error says why it cannot be made.
    fn next_request(&mut self) -> Result<Option<Cow<'w, SimRequest>>, SimError>;

    /// Whether the run may take the requests as it needs them: the fixed arrival times never
    /// decrease from one request to the next, and every request of a session (an open arrival
    /// and the requests that follow it, directly or not) comes before the first fixed arrival
    /// later than the session's first request. A source that does not promise it is taken
    /// whole when the run starts (a trace's rows need not be in time order). A promise broken
    /// is an error of the run, never a different run.
    fn in_arrival_order(&self) -> bool;
}

/// A [`Workload`] as a [`RequestSource`]: its requests lent, taken whole at the run's start.
#[derive(Clone, Copy, Debug)]
pub struct WorkloadSource<'w> {
    workload: &'w Workload,
    next: usize,
}

impl<'w> WorkloadSource<'w> {
    /// The requests of `workload`, from the first.
    pub fn new(workload: &'w Workload) -> Self {
        Self { workload, next: 0 }
    }
}

impl<'w> RequestSource<'w> for WorkloadSource<'w> {
    fn block_size(&self) -> u32 {
        self.workload.block_size
    }

    fn len(&self) -> usize {
        self.workload.requests.len()
    }

    fn next_request(&mut self) -> Result<Option<Cow<'w, SimRequest>>, SimError> {
        let r = self.workload.requests.get(self.next).map(Cow::Borrowed);
        self.next += usize::from(r.is_some());
        Ok(r)
    }

    fn in_arrival_order(&self) -> bool {
        false
    }
}

/// Prompt- and output-length spread, applied to a built workload
/// ([`Workload::spread_lengths`]) before any run, so the router sees the spread prompts.
/// Default: none.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LengthSpread {
    /// Each prompt's tail (the tokens after its earlier segments: a generated request's own new
    /// tokens; a trace row's whole prompt) times a factor drawn per request, at least 1 token.
    /// A shortened tail keeps its first blocks; a longer one gains blocks of its own, shared with
    /// no other request; so what requests share stays shared.
    pub prompt: Option<Dispersion>,
    /// Each output length times a factor drawn per request, at least 1 token.
    pub output: Option<Dispersion>,
}

impl LengthSpread {
    /// Whether both amounts are in range; an error names the one that is not.
    pub fn validate(&self) -> Result<(), String> {
        for (d, what) in [(&self.prompt, "prompt"), (&self.output, "output")] {
            if let Some(d) = d {
                d.validate().map_err(|e| format!("{what} length spread: {e}"))?;
            }
        }
        Ok(())
    }

    /// Spreads request `i`'s lengths, its factors drawn from `seed` and `i` alone, its blocks
    /// of `bs` tokens.
    fn apply(&self, r: &mut SimRequest, i: usize, seed: u64, bs: u32) {
        let bs = u64::from(bs.max(1));
        if let Some(d) = &self.output {
            let f = d.draw_at(seed ^ OUTPUT_SALT, i as u64);
            r.output_tokens = scale_tokens(r.output_tokens, f);
        }
        let Some(d) = &self.prompt else {
            return;
        };
        let f = d.draw_at(seed ^ PROMPT_SALT, i as u64);
        let segments = &r.locals.segments;
        let tail_blocks = segments.last().map_or(0, |s| s.len()) as u64;
        let head_blocks = r.locals.len() as u64 - tail_blocks;
        let head_tokens = head_blocks * bs;
        let tail_tokens = u64::from(r.prompt_tokens).saturating_sub(head_tokens);
        let new_tail = u64::from(scale_tokens(u32::try_from(tail_tokens).unwrap_or(u32::MAX), f));
        let tokens = (head_tokens + new_tail).min(u64::from(u32::MAX));
        let full = tokens / bs;
        let mut kept: Vec<Arc<[LocalBlockHash]>> = segments[..segments.len().saturating_sub(1)].to_vec();
        if let Some(last) = segments.last() {
            let keep = (full.saturating_sub(head_blocks) as usize).min(last.len());
            if keep == last.len() {
                kept.push(Arc::clone(last));
            } else if keep > 0 {
                kept.push(Arc::from(&last[..keep]));
            }
        }
        let have = head_blocks + tail_blocks.min(full.saturating_sub(head_blocks));
        if full > have {
            let mut rng = Rng::new(mix(seed ^ BLOCK_SALT, i as u64));
            let extra: Vec<LocalBlockHash> = (have..full).map(|_| LocalBlockHash(rng.next_u64())).collect();
            kept.push(Arc::from(extra));
        }
        r.locals = PromptBlocks {
            segments: kept.into_boxed_slice(),
            salt: r.locals.salt,
        };
        r.prompt_tokens = tokens as u32;
    }
}

/// Salts of the length-spread streams.
const PROMPT_SALT: u64 = 0x5EED_0000_0000_0006;
const OUTPUT_SALT: u64 = 0x5EED_0000_0000_0007;
const BLOCK_SALT: u64 = 0x5EED_0000_0000_0008;

/// Requests, in the order of their ids (request `i` is `RequestId(i)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Tokens per block of every request's `locals`; runs need engines and a router of this
    /// block size.
    pub block_size: u32,
    /// The requests.
    pub requests: Vec<SimRequest>,
}

impl Workload {
    /// An empty workload at `block_size` tokens per block.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            requests: Vec::new(),
        }
    }

    /// Spreads every request's prompt and output length (see [`LengthSpread`]), request `i`'s
    /// factors drawn from `seed` and `i` alone; an error names an amount out of range.
    pub fn spread_lengths(&mut self, spread: &LengthSpread, seed: u64) -> Result<(), String> {
        spread.validate()?;
        let bs = self.block_size;
        for (i, r) in self.requests.iter_mut().enumerate() {
            spread.apply(r, i, seed, bs);
        }
        Ok(())
    }

    /// Prompt tokens over all requests.
    pub fn total_input_tokens(&self) -> u64 {
        self.requests.iter().map(|r| u64::from(r.prompt_tokens)).sum()
    }

    /// Divides every fixed arrival time and think time by `speedup` (2.0 arrives twice as fast).
    /// Values that are not finite and positive leave the workload unchanged.
    pub fn speed_up(&mut self, speedup: f64) {
        for r in &mut self.requests {
            r.arrival = sped_up(r.arrival, speedup);
        }
    }

    /// Re-times fixed arrivals so that the arrival rate at (new) time `τ` is the original rate
    /// times `m(τ)`, with `m` the piecewise-linear profile through `points` (seconds,
    /// multiplier), constant before the first point and after the last. A request at original
    /// time `t` arrives at the `τ` where `∫₀^τ m = t`, so a stationary trace becomes a ramp or a
    /// daily cycle while its requests, lengths and order stay. Think times are kept. Points must
    /// have increasing times and positive, finite multipliers; otherwise an error says why.
    pub fn warp_rate(&mut self, points: &[(f64, f64)]) -> Result<(), String> {
        let Some(warp) = RateWarp::new(points)? else {
            return Ok(());
        };
        for r in &mut self.requests {
            r.arrival = warp.arrival(r.arrival);
        }
        Ok(())
    }

    /// The workload played by `copies` independent populations at once: the trace multiplier
    /// that turns a real trace into a fleet-sized one. Each request `i` becomes requests
    /// `i * copies + c` for `c` in `0..copies`, at the same arrival rule (so the arrival rate
    /// is `copies` times the original, and a session's turns follow their own copy's earlier
    /// turn). Copy 0 is the original; copy `c`'s prompts are its own: every local hash is mixed
    /// with a constant of `c`, so blocks shared within a copy (a system prompt, a conversation's
    /// history) stay shared and no block is shared across copies. `copies` of 0 or 1 leaves the
    /// workload unchanged; a result beyond `u32::MAX` requests is an error.
    pub fn multiply(&self, copies: usize) -> Result<Workload, String> {
        let copies = copies.max(1);
        let n = multiplied_len(self.requests.len(), copies)?;
        let mut requests = Vec::with_capacity(n);
        for r in &self.requests {
            requests.extend((0..copies).map(|c| copy_of(r, copies, c)));
        }
        Ok(Workload {
            block_size: self.block_size,
            requests,
        })
    }

    /// The workload `shape` makes of this one, held whole: the requests a [`Reshaped`] source
    /// gives, one rule for a workload made whole and one made as the run goes; the same as
    /// [`Workload::multiply`], then [`Workload::spread_lengths`], [`Workload::speed_up`] and the
    /// warp. A shape that changes nothing gives the workload back as it is.
    pub fn reshaped(self, shape: Reshape) -> Result<Workload, String> {
        if shape.changes_nothing() {
            return Ok(self);
        }
        let mut source = Reshaped::new(WorkloadSource::new(&self), shape)?;
        let mut requests = Vec::with_capacity(source.len());
        while let Some(r) = source.next_request().map_err(|e| e.to_string())? {
            requests.push(r.into_owned());
        }
        Ok(Workload {
            block_size: self.block_size,
            requests,
        })
    }

    /// Keeps the first `n` requests, dropping any session link to a dropped request.
    pub fn truncate(&mut self, n: usize) {
        self.requests.truncate(n);
    }
}

/// The constant copy `c` of [`Workload::multiply`] mixes into its local hashes (a SplitMix64
/// finalizer: distinct copies get unrelated constants; copy 0 gets 0).
fn copy_salt(c: u64) -> u64 {
    if c == 0 {
        return 0;
    }
    let mut z = c.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` requests times `copies` ([`Workload::multiply`]), or why that is too many.
pub fn multiplied_len(n: usize, copies: usize) -> Result<usize, String> {
    match n.checked_mul(copies) {
        Some(total) if total <= u32::MAX as usize => Ok(total),
        _ => Err(format!(
            "{n} requests times {copies} copies is over 2^32 requests"
        )),
    }
}

/// Copy `c` of `copies` of request `r` ([`Workload::multiply`]).
fn copy_of(r: &SimRequest, copies: usize, c: usize) -> SimRequest {
    let arrival = match r.arrival {
        Arrival::At(t) => Arrival::At(t),
        Arrival::After { request, delay } => Arrival::After {
            request: request * copies + c,
            delay,
        },
    };
    SimRequest {
        arrival,
        locals: r.locals.salted(copy_salt(c as u64)),
        prompt_tokens: r.prompt_tokens,
        output_tokens: r.output_tokens,
    }
}

/// `arrival` `speedup` times as fast ([`Workload::speed_up`]).
fn sped_up(arrival: Arrival, speedup: f64) -> Arrival {
    if !(speedup.is_finite() && speedup > 0.0) || speedup == 1.0 {
        return arrival;
    }
    match arrival {
        Arrival::At(t) => Arrival::At(Timestamp((t.as_nanos() as f64 / speedup).round() as u64)),
        Arrival::After { request, delay } => Arrival::After {
            request,
            delay: delay.div_f64(speedup),
        },
    }
}

/// A rate profile's time warp ([`Workload::warp_rate`]): segments (start, end, multiplier at
/// start, at end), the first from 0, the last open.
#[derive(Clone, Debug, PartialEq)]
pub struct RateWarp {
    segments: Vec<(f64, f64, f64, f64)>,
}

impl RateWarp {
    /// The warp of the profile through `points`, `None` for no points, or why the points are
    /// unusable.
    pub fn new(points: &[(f64, f64)]) -> Result<Option<Self>, String> {
        if points.is_empty() {
            return Ok(None);
        }
        for (i, &(t, m)) in points.iter().enumerate() {
            if !(t.is_finite() && t >= 0.0 && m.is_finite() && m > 0.0) {
                return Err(format!(
                    "rate profile point ({t}, {m}): time >= 0 and multiplier > 0"
                ));
            }
            if i > 0 && t <= points[i - 1].0 {
                return Err(format!(
                    "rate profile times must increase ({t} after {})",
                    points[i - 1].0
                ));
            }
        }
        let mut segments = Vec::with_capacity(points.len() + 1);
        let (t0, m0) = points[0];
        if t0 > 0.0 {
            segments.push((0.0, t0, m0, m0));
        }
        for pair in points.windows(2) {
            segments.push((pair[0].0, pair[1].0, pair[0].1, pair[1].1));
        }
        let (tl, ml) = points[points.len() - 1];
        segments.push((tl, f64::INFINITY, ml, ml));
        Ok(Some(Self { segments }))
    }

    /// The new time of original time `target`, seconds.
    fn invert(&self, target: f64) -> f64 {
        let mut area = 0.0;
        for &(a, b, ma, mb) in &self.segments {
            let slope = if b.is_finite() { (mb - ma) / (b - a) } else { 0.0 };
            let seg_area = if b.is_finite() {
                (ma + mb) / 2.0 * (b - a)
            } else {
                f64::INFINITY
            };
            if area + seg_area >= target {
                // Solve ma·x + slope·x²/2 = target - area for x in [0, b - a].
                let need = target - area;
                let x = if slope.abs() < 1e-15 {
                    need / ma
                } else {
                    (-ma + (ma * ma + 2.0 * slope * need).max(0.0).sqrt()) / slope
                };
                return a + x.max(0.0);
            }
            area += seg_area;
        }
        target
    }

    /// `arrival` warped: a fixed time moves, a think time stays.
    pub fn arrival(&self, arrival: Arrival) -> Arrival {
        match arrival {
            Arrival::At(t) => Arrival::At(Timestamp((self.invert(t.as_secs_f64()) * 1e9).round() as u64)),
            after => after,
        }
    }
}

/// How a workload is reshaped before it runs, in this order: [`Workload::multiply`],
/// [`Workload::spread_lengths`], [`Workload::speed_up`], [`Workload::warp_rate`]. Applied to
/// a [`RequestSource`] by [`Reshaped`], request by request.
#[derive(Clone, Debug, PartialEq)]
pub struct Reshape {
    /// Copies of each request (0 or 1: none).
    pub copies: usize,
    /// The length spread, and the seed of its draws.
    pub spread: LengthSpread,
    /// The seed of the length spread's draws.
    pub seed: u64,
    /// Arrival speed-up (1: none).
    pub speedup: f64,
    /// The rate profile's warp, if any.
    pub warp: Option<RateWarp>,
}

impl Reshape {
    /// Whether it leaves every request as it is: one copy, no spread, no speed-up, no warp.
    pub fn changes_nothing(&self) -> bool {
        self.copies <= 1
            && self.spread == LengthSpread::default()
            && self.speedup == 1.0
            && self.warp.is_none()
    }
}

impl Default for Reshape {
    fn default() -> Self {
        Self {
            copies: 1,
            spread: LengthSpread::default(),
            seed: 0,
            speedup: 1.0,
            warp: None,
        }
    }
}

/// A [`RequestSource`] reshaped ([`Reshape`]): the requests the whole workload, reshaped by the
/// [`Workload`] methods, would have, made one at a time.
pub struct Reshaped<'w, S> {
    inner: S,
    shape: Reshape,
    len: usize,
    /// The request being copied and its next copy.
    copying: Option<(Cow<'w, SimRequest>, usize)>,
    next_id: usize,
}

impl<'w, S: RequestSource<'w>> Reshaped<'w, S> {
    /// `inner` reshaped by `shape`, or why it cannot be (a spread out of range, too many
    /// requests).
    pub fn new(inner: S, mut shape: Reshape) -> Result<Self, String> {
        shape.copies = shape.copies.max(1);
        shape.spread.validate()?;
        let len = multiplied_len(inner.len(), shape.copies)?;
        Ok(Self {
            inner,
            shape,
            len,
            copying: None,
            next_id: 0,
        })
    }
}

impl<'w, S: RequestSource<'w>> RequestSource<'w> for Reshaped<'w, S> {
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn next_request(&mut self) -> Result<Option<Cow<'w, SimRequest>>, SimError> {
        if self.copying.is_none() {
            self.copying = self.inner.next_request()?.map(|r| (r, 0));
        }
        let shape = &self.shape;
        let mut r = if shape.copies == 1 {
            // The one copy is the original.
            match self.copying.take() {
                Some((original, _)) => original.into_owned(),
                None => return Ok(None),
            }
        } else {
            let Some((original, c)) = &mut self.copying else {
                return Ok(None);
            };
            let r = copy_of(original, shape.copies, *c);
            *c += 1;
            if *c == shape.copies {
                self.copying = None;
            }
            r
        };
        shape
            .spread
            .apply(&mut r, self.next_id, shape.seed, self.inner.block_size());
        self.next_id += 1;
        r.arrival = sped_up(r.arrival, shape.speedup);
        if let Some(warp) = &shape.warp {
            r.arrival = warp.arrival(r.arrival);
        }
        Ok(Some(Cow::Owned(r)))
    }

    /// Copies, spread and warp keep the order: copies arrive with their original, and speed-up
    /// and warp never swap two times.
    fn in_arrival_order(&self) -> bool {
        self.inner.in_arrival_order()
    }
}

/// Hashes synthesized prompts into a workload's blocks, reusing one token buffer.
#[derive(Debug)]
pub(crate) struct PromptHasher {
    hasher: BlockHasher,
    tokens: Vec<u32>,
}

impl PromptHasher {
    pub(crate) fn new(block_size: u32) -> Self {
        Self {
            hasher: BlockHasher::new(block_size as usize, &HashSalt::NONE),
            tokens: Vec::new(),
        }
    }

    /// The buffer to fill with a prompt's tokens (cleared).
    pub(crate) fn buffer(&mut self) -> &mut Vec<u32> {
        self.tokens.clear();
        &mut self.tokens
    }

    /// The local hashes of the full blocks of the buffer's tokens.
    ///
    /// A block equal to the one before it reuses its hash: synthesized trace prompts repeat one
    /// token per trace block, so most blocks do, and comparing is cheaper than hashing.
    pub(crate) fn locals(&self) -> PromptBlocks {
        let mut prev: Option<(&[u32], LocalBlockHash)> = None;
        self.tokens
            .chunks_exact(self.hasher.block_size())
            .map(|block| match prev {
                Some((tokens, hash)) if tokens == block => hash,
                _ => {
                    let hash = self.hasher.local_hash(block);
                    prev = Some((block, hash));
                    hash
                }
            })
            .collect::<Vec<_>>()
            .into()
    }

    /// The local hashes of the full blocks of a prompt made of `runs` (each a token repeated
    /// `count` times), and the prompt's length, without writing the prompt out: a block inside
    /// one run is hashed once per run, only blocks across a run boundary are assembled. The
    /// hashes are those [`PromptHasher::locals`] gives for the same tokens.
    pub(crate) fn run_locals(&mut self, runs: impl IntoIterator<Item = (u32, usize)>) -> (PromptBlocks, u32) {
        let bs = self.hasher.block_size();
        let mut locals = Vec::new();
        let mut len = 0usize;
        let mut uniform: Option<(u32, LocalBlockHash)> = None;
        self.tokens.clear();
        for (token, mut count) in runs {
            len += count;
            while count > 0 {
                if self.tokens.is_empty() && count >= bs {
                    let hash = match uniform {
                        Some((t, hash)) if t == token => hash,
                        _ => {
                            self.tokens.resize(bs, token);
                            let hash = self.hasher.local_hash(&self.tokens);
                            self.tokens.clear();
                            uniform = Some((token, hash));
                            hash
                        }
                    };
                    let whole = count / bs;
                    locals.extend(std::iter::repeat_n(hash, whole));
                    count -= whole * bs;
                } else {
                    let take = (bs - self.tokens.len()).min(count);
                    self.tokens.extend(std::iter::repeat_n(token, take));
                    count -= take;
                    if self.tokens.len() == bs {
                        locals.push(self.hasher.local_hash(&self.tokens));
                        self.tokens.clear();
                    }
                }
            }
        }
        self.tokens.clear();
        (locals.into(), u32::try_from(len).unwrap_or(u32::MAX))
    }

    /// Appends the tokens `unique_token(id, j)`, `j` in `0..count`, to a prompt whose partial
    /// block is `tail`: the blocks they complete go into `locals` as their local hashes, and the
    /// tokens after the last full block stay in `tail`. A growing prompt (a session's next turn
    /// after a shared prefix) hashes only its new tokens, and a block of new tokens only is made
    /// in the hasher's buffer and hashed there, never written to `tail`. For the prompt `locals`'
    /// blocks, then `tail`, then the new tokens, the hashes are those [`PromptHasher::locals`]
    /// gives for its tokens.
    pub(crate) fn push_unique_tokens(
        &mut self,
        tail: &mut Vec<u32>,
        id: u64,
        count: u32,
        locals: &mut Vec<LocalBlockHash>,
    ) {
        let head = if tail.is_empty() {
            0
        } else {
            (self.hasher.block_size() - tail.len()).min(count as usize) as u32
        };
        let middle = self.unique_blocks(id, head, count - head);
        locals.extend(self.push_unique_tokens_around(tail, id, count, middle));
    }

    /// [`PromptHasher::push_unique_tokens`] given `middle`, the hashes
    /// [`PromptHasher::unique_blocks`] gives for the new tokens after those completing `tail`'s
    /// block: returns every block the new tokens complete (`middle` with the completed block
    /// first, if any).
    pub(crate) fn push_unique_tokens_around(
        &mut self,
        tail: &mut Vec<u32>,
        id: u64,
        count: u32,
        mut middle: Vec<LocalBlockHash>,
    ) -> Vec<LocalBlockHash> {
        let bs = self.hasher.block_size();
        let passed = middle.len();
        let mut j = 0u32;
        if !tail.is_empty() {
            let take = (bs - tail.len()).min(count as usize) as u32;
            let at = tail.len();
            tail.resize(at + take as usize, 0);
            fill_unique_tokens(&mut tail[at..], id, 0);
            j = take;
            if tail.len() == bs {
                middle.insert(0, self.hasher.local_hash(tail));
                tail.clear();
            }
        }
        j += (passed * bs) as u32;
        assert!(
            j <= count && (count - j) as usize / bs == 0,
            "{passed} blocks given for {count} new tokens"
        );
        let at = tail.len();
        tail.resize(at + (count - j) as usize, 0);
        fill_unique_tokens(&mut tail[at..], id, j);
        middle
    }

    /// The local hashes of the full blocks of the tokens `unique_token(id, j)` for `j` from
    /// `first` on, `count` of them (a trailing partial block is left out): each block made in
    /// the hasher's buffer and hashed there.
    pub(crate) fn unique_blocks(&mut self, id: u64, first: u32, count: u32) -> Vec<LocalBlockHash> {
        let bs = self.hasher.block_size();
        let whole = count as usize / bs;
        // One more for the block completing the prompt's partial block, put first.
        let mut locals = Vec::with_capacity(whole + 1);
        self.tokens.clear();
        self.tokens.resize(bs, 0);
        let mut j = first;
        for _ in 0..whole {
            fill_unique_tokens(&mut self.tokens, id, j);
            locals.push(self.hasher.local_hash(&self.tokens));
            j += bs as u32;
        }
        self.tokens.clear();
        locals
    }

    /// Tokens in the buffer.
    #[cfg(test)]
    pub(crate) fn len(&self) -> u32 {
        u32::try_from(self.tokens.len()).unwrap_or(u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::PromptHasher;

    use std::collections::HashSet;

    use super::{Arrival, Workload};
    use crate::synthetic::{Lengths, SyntheticConfig, generate};

    #[test]
    fn multiply_gives_the_requested_count_of_independent_copies_deterministically() {
        let base = generate(
            &SyntheticConfig {
                requests: 60,
                turns_per_session: 3,
                prefix_groups: 2,
                shared_prefix_tokens: 64,
                isl: Lengths::Uniform { min: 16, max: 80 },
                ..SyntheticConfig::default()
            },
            16,
        );
        assert_eq!(base.multiply(1).unwrap(), base);
        assert_eq!(base.multiply(0).unwrap(), base);
        let copies = 7;
        let big = base.multiply(copies).unwrap();
        assert_eq!(big.requests.len(), base.requests.len() * copies);
        assert_eq!(base.multiply(copies).unwrap(), big, "deterministic");
        assert_eq!(big.block_size, base.block_size);
        let blocks = |c: usize| -> HashSet<_> {
            big.requests[c..]
                .iter()
                .step_by(copies)
                .flat_map(|r| r.locals.iter())
                .collect()
        };
        for c in 0..copies {
            for (i, orig) in base.requests.iter().enumerate() {
                let r = &big.requests[i * copies + c];
                assert_eq!(
                    (r.prompt_tokens, r.output_tokens),
                    (orig.prompt_tokens, orig.output_tokens)
                );
                assert_eq!(r.locals.len(), orig.locals.len());
                match (r.arrival, orig.arrival) {
                    (Arrival::At(a), Arrival::At(b)) => assert_eq!(a, b),
                    (Arrival::After { request, delay }, Arrival::After { request: o, delay: d }) => {
                        assert_eq!((request, delay), (o * copies + c, d))
                    }
                    other => panic!("arrival kind changed: {other:?}"),
                }
                // Sharing within a copy is the original's: equal blocks stay equal.
                for (j, other) in base.requests[..i].iter().enumerate() {
                    let shared = orig
                        .locals
                        .iter()
                        .zip(other.locals.iter())
                        .take_while(|(a, b)| a == b)
                        .count();
                    let r2 = &big.requests[j * copies + c];
                    let shared_copy = r
                        .locals
                        .iter()
                        .zip(r2.locals.iter())
                        .take_while(|(a, b)| a == b)
                        .count();
                    assert_eq!(shared, shared_copy);
                }
            }
            if c == 0 {
                assert!(big.requests[0].locals == base.requests[0].locals);
            }
            for d in 0..c {
                assert!(
                    blocks(c).is_disjoint(&blocks(d)),
                    "copies {c} and {d} share a block"
                );
            }
        }
        let huge = Workload {
            block_size: 16,
            requests: vec![base.requests[0].clone(); 2],
        };
        assert!(huge.multiply(1 << 31).is_err());
    }

    proptest! {
        /// Appending unique tokens (a prompt growing turn by turn) gives the hashes of the whole
        /// written-out prompt, and leaves its partial block's tokens in the tail.
        #[test]
        fn pushed_unique_tokens_hash_as_the_written_out_prompt(
            block_size in prop_oneof![Just(64u32), Just(16u32), 1u32..80],
            turns in prop::collection::vec((0u64..5, 0u32..300), 1..6),
        ) {
            let mut hasher = PromptHasher::new(block_size);
            let (mut tail, mut locals) = (Vec::new(), Vec::new());
            let mut written = Vec::new();
            for &(id, count) in &turns {
                hasher.push_unique_tokens(&mut tail, id, count, &mut locals);
                written.extend((0..count).map(|j| crate::trace::unique_token(id, j)));
                prop_assert_eq!(tail.len(), written.len() % block_size as usize);
                prop_assert_eq!(&tail[..], &written[written.len() - tail.len()..]);
            }
            hasher.buffer().extend_from_slice(&written);
            prop_assert_eq!(super::PromptBlocks::from(locals), hasher.locals());
        }

        /// Hashing runs gives what hashing the written-out prompt gives, partial tail included.
        #[test]
        fn run_locals_equal_locals_of_the_tokens(
            block_size in 1u32..40,
            runs in prop::collection::vec((0u32..4, 0usize..100), 0..12),
        ) {
            let mut hasher = PromptHasher::new(block_size);
            let (from_runs, len) = hasher.run_locals(runs.iter().copied());
            let tokens = hasher.buffer();
            for &(token, count) in &runs {
                tokens.extend(std::iter::repeat_n(token, count));
            }
            prop_assert_eq!(len, hasher.len());
            prop_assert_eq!(from_runs, hasher.locals());
        }
    }
}
