//! Routing policies: given a snapshot of the eligible workers, pick one.
//!
//! A policy sees a [`Candidate`] per eligible worker (its overlap with the prompt, its booked
//! load, its projected decode blocks, its limits), the request, and the router's seeded [`Rng`].
//! It returns the index of its pick and touches nothing else: booking happens in one place, in
//! the router, after selection. A policy may keep state of its own (a round-robin cursor,
//! SGLang's tree of routed prompts), updated in [`Policy::select`] or when told where a request
//! went ([`Policy::routed`]).
//!
//! Policies are chosen by name ([`PolicyConfig::from_name`]). Each lives in its own file, which
//! documents which peer it renders and how; adding one is that file plus its line in
//! [`PolicyConfig`] (variant, name, build).
//!
//! | name | what it does |
//! | --- | --- |
//! | `round-robin` | the next worker in turn |
//! | `random` | a uniformly random worker |
//! | `least-loaded` | fewest booked requests, random tie-break |
//! | `power-of-two` | the less loaded of two random workers |
//! | `kv` | kvroute's cost ([`super::cost`]), staged projection |
//! | `dynamo` | Dynamo's default cost and defaults (full projection) |
//! | `sglang-cache-aware` | SGLang gateway's cache-aware policy over routed prompts |
//! | `llmd-weighted` | llm-d's prefix-cache, queue and KV-utilization scorers, 2:1:1 |

mod dynamo;
mod kv;
mod least_loaded;
mod llmd;
mod power_of_two;
mod random;
mod round_robin;
mod sglang;

use std::fmt;

pub use kv::CostPolicyConfig;
pub use llmd::LlmdConfig;
pub use sglang::SglangConfig;

use super::cost::CostParams;
use super::load::{Projection, WorkerLoad};
use super::request::RequestView;
use super::rng::Rng;
use super::worker::WorkerSpec;
use crate::ids::{SequenceHash, WorkerKey};
use crate::time::Timestamp;

/// One eligible worker as a policy sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The worker, its role and its limits.
    pub spec: WorkerSpec,
    /// Leading prompt blocks cached on the worker (the KV index, or the router's record of
    /// recent decisions, whichever is deeper).
    pub overlap_blocks: u32,
    /// The prompt blocks right after `overlap_blocks` that the worker holds only on a slower
    /// tier (from the KV index's tier events), which its engine loads instead of computing.
    pub tier_blocks: u32,
    /// The worker's booked load, without this request.
    pub load: WorkerLoad,
    /// The worker's decode blocks with this request added.
    pub projection: Projection,
    /// The fraction of the worker's cache it evicted lately (decayed `Removed` events over its
    /// capacity, in `[0, 1]`; 0 on a worker with nothing booked): how hot it runs.
    pub eviction_pressure: f64,
}

impl Candidate {
    /// The worker.
    pub fn worker(&self) -> WorkerKey {
        self.spec.key
    }
}

/// A routing policy; see the module docs.
pub trait Policy: fmt::Debug + Send {
    /// The policy's name, as [`PolicyConfig::from_name`] takes it.
    fn name(&self) -> &'static str;

    /// Picks one of `candidates` (never empty, ordered by worker) and returns its index.
    fn select(&mut self, request: &RequestView<'_>, candidates: &[Candidate], rng: &mut Rng) -> usize;

    /// The cost weights, if this policy's pick is always the argmin of [`super::cost()`] under
    /// them over the candidates in order, ties broken by [`super::select::argmin`], and its
    /// [`Policy::select`] has no other effect. The router then scores the workers without
    /// building every candidate (scoring the idle ones once per distinct worker spec and
    /// overlap) and skips [`Policy::select`]; the pick and the generator's draws are the same.
    fn argmin_cost(&self) -> Option<&CostParams> {
        None
    }

    /// `request` was booked on `worker`. Policies with a view of their own update it here.
    fn routed(&mut self, request: &RequestView<'_>, worker: WorkerKey) {
        let _ = (request, worker);
    }

    /// How many leading blocks of `chain` the policy's own view holds for `worker` at `now`, for
    /// policies that keep one (`None` for the others). For diagnostics and tests: replicas that
    /// saw the same bookings answer alike.
    fn view_depth(&self, worker: WorkerKey, chain: &[SequenceHash], now: Timestamp) -> Option<u32> {
        let _ = (worker, chain, now);
        None
    }

    /// This router is replica `rank` among its live peers (0: alone, or the first). Policies
    /// that spread concurrent replicas' decisions read it (`kv`'s spread tolerance).
    fn set_replica_rank(&mut self, rank: u32) {
        let _ = rank;
    }

    /// `worker` left the fleet.
    fn worker_removed(&mut self, worker: WorkerKey) {
        let _ = worker;
    }
}

/// A policy and its parameters. [`PolicyConfig::from_name`] gives each policy with its
/// documented defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum PolicyConfig {
    /// `round-robin`.
    RoundRobin,
    /// `random`.
    Random,
    /// `least-loaded`.
    LeastLoaded,
    /// `power-of-two`.
    PowerOfTwo,
    /// `kv`: the cost with [`super::cost::CostParams::KV`] by default.
    Kv(CostPolicyConfig),
    /// `dynamo`: the cost with [`super::cost::CostParams::DYNAMO`] by default.
    Dynamo(CostPolicyConfig),
    /// `sglang-cache-aware`.
    SglangCacheAware(SglangConfig),
    /// `llmd-weighted`.
    LlmdWeighted(LlmdConfig),
}

/// A policy name that [`PolicyConfig::from_name`] does not know.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy {0:?}; valid names: {names}", names = PolicyConfig::NAMES.join(", "))]
pub struct UnknownPolicy(pub String);

impl PolicyConfig {
    /// Every policy name, in the order of the module table.
    pub const NAMES: &'static [&'static str] = &[
        "round-robin",
        "random",
        "least-loaded",
        "power-of-two",
        "kv",
        "dynamo",
        "sglang-cache-aware",
        "llmd-weighted",
    ];

    /// The policy called `name`, with its defaults.
    pub fn from_name(name: &str) -> Result<Self, UnknownPolicy> {
        Ok(match name {
            "round-robin" => Self::RoundRobin,
            "random" => Self::Random,
            "least-loaded" => Self::LeastLoaded,
            "power-of-two" => Self::PowerOfTwo,
            "kv" => Self::Kv(CostPolicyConfig::KV),
            "dynamo" => Self::Dynamo(dynamo::DEFAULTS),
            "sglang-cache-aware" => Self::SglangCacheAware(SglangConfig::default()),
            "llmd-weighted" => Self::LlmdWeighted(LlmdConfig::default()),
            other => return Err(UnknownPolicy(other.to_owned())),
        })
    }

    /// The policy's name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
            Self::LeastLoaded => "least-loaded",
            Self::PowerOfTwo => "power-of-two",
            Self::Kv(_) => "kv",
            Self::Dynamo(_) => "dynamo",
            Self::SglangCacheAware(_) => "sglang-cache-aware",
            Self::LlmdWeighted(_) => "llmd-weighted",
        }
    }

    /// The first out-of-range parameter, by name and value.
    pub(crate) fn invalid_field(&self) -> Option<(&'static str, f64)> {
        match self {
            Self::Kv(c) | Self::Dynamo(c) => c.invalid_field(),
            Self::SglangCacheAware(c) => c.invalid_field(),
            Self::LlmdWeighted(c) => c.invalid_field(),
            Self::RoundRobin | Self::Random | Self::LeastLoaded | Self::PowerOfTwo => None,
        }
    }

    /// A fresh policy.
    pub(crate) fn build(&self) -> Box<dyn Policy> {
        let name = self.name();
        match *self {
            Self::RoundRobin => Box::new(round_robin::RoundRobin::default()),
            Self::Random => Box::new(random::Random),
            Self::LeastLoaded => Box::new(least_loaded::LeastLoaded),
            Self::PowerOfTwo => Box::new(power_of_two::PowerOfTwo),
            Self::Kv(config) | Self::Dynamo(config) => Box::new(kv::CostPolicy::new(name, config)),
            Self::SglangCacheAware(config) => Box::new(sglang::SglangCacheAware::new(config)),
            Self::LlmdWeighted(config) => Box::new(llmd::LlmdWeighted::new(config)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips_and_unknown_names_list_the_valid_ones() {
        for name in PolicyConfig::NAMES {
            let config = PolicyConfig::from_name(name).unwrap();
            assert_eq!(config.name(), *name);
            assert_eq!(config.build().name(), *name);
            assert_eq!(config.invalid_field(), None);
        }
        let err = PolicyConfig::from_name("kv-aware").unwrap_err().to_string();
        assert!(
            err.contains("\"kv-aware\"") && err.contains("round-robin, random"),
            "{err}"
        );
    }
}
