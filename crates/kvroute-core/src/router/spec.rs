//! The router's vocabulary: the text forms of a policy, a cache view and a decider, and the
//! [`RouterSpec`] of the router options every front end names alike (`kvroute serve`, `kvroute
//! replay`, the demo). One parser and one printer, so that a router tuned offline is the one
//! that serves: what one command accepts the other accepts, into the same [`RouterConfig`], and
//! the flags a replay report prints are generated here from the configuration it simulated.
//!
//! # Grammar
//!
//! A **policy** is a name ([`PolicyConfig::NAMES`]), then, for the cost policies (`kv`,
//! `dynamo`), `:`-separated options over the name's defaults:
//!
//! | option | sets |
//! | --- | --- |
//! | `full`, `staged` | the decode projection ([`DecodeProjection`]) |
//! | `scale=X` | `prefill_load_scale` |
//! | `credit=X` | `overlap_credit` |
//! | `tier=X` | `tier_block_cost`: a block held only on a slower tier (host memory), as a fraction of a block to prefill (1: tier-blind) |
//! | `evict=X` | `evict_weight`: a prompt's uncached blocks on a worker that evicts, times its eviction pressure (0: eviction-blind) |
//! | `fleet=X` | `fleet_weight`: a prompt's uncached blocks anywhere, times the fleet's load (0: load-blind) |
//! | `stall=X` | `stall_weight`: a prompt's uncached blocks on a worker, times its booked requests (0: stall-blind) |
//! | `transfer=X` | `transfer_block_cost`: a prompt block a decode worker lacks, as a fraction of a block to prefill (0: cache-blind decode workers) |
//! | `requests=X` | `decode_active_request_weight`: block-equivalents per request booked on the worker |
//! | `temperature=X` | softmax sampling over the normalized costs instead of the argmin |
//! | `spread=X` | replica spread: costs within the fraction X of the lowest are near-best |
//!
//! For example `kv:full`, `dynamo:staged:scale=2`, `kv:temperature=0.1`.
//!
//! A **cache view** ([`CacheMode`]) is `events`, `predict` (events and the router's record of its
//! own decisions) or `approximate` (that record alone), the last two with `:`-separated options
//! over [`RecentConfig::PREDICT_ON_ROUTE`]: `ttl=S` (seconds, up to nine decimals, or `none`),
//! `max-blocks=N` (per worker), `prune=R` (the fraction a worker is pruned to past
//! `max-blocks`). For example `approximate:ttl=120`.
//!
//! A **decider** ([`Decider`]) is `always`, `never`, or N (uncached prompt tokens).
//!
//! What a request meets **when no worker is eligible** ([`WhenEmpty`]) is `reject` or `queue`.
//!
//! Printing gives the canonical spec: the name, then only the options that differ from its
//! defaults, in the order of the tables above. A printed spec parses back to the same value.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::config::{CacheMode, ConfigError, RouterConfig};
use super::disagg::{Decider, UnknownDecider};
use super::load::DecodeProjection;
use super::policy::{CostPolicyConfig, PolicyConfig, UnknownPolicy};
use super::queue::{QueueConfig, WhenEmpty};
use super::recent::RecentConfig;

/// A spec the vocabulary refuses.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// A policy name no policy has.
    #[error(transparent)]
    UnknownPolicy(#[from] UnknownPolicy),
    /// Options given to a policy or cache view that takes none.
    #[error("{name} takes no options (in {spec:?})")]
    NoOptions {
        /// The policy or cache view.
        name: &'static str,
        /// The whole spec.
        spec: String,
    },
    /// An option the policy or cache view does not have.
    #[error("unknown option {option:?} in {spec:?} ({valid})")]
    UnknownOption {
        /// The option as given.
        option: String,
        /// The whole spec.
        spec: String,
        /// The options there are.
        valid: &'static str,
    },
    /// An option's value is not a number of its kind.
    #[error("{option} in {spec:?}: {value:?} is not {expected}")]
    NotANumber {
        /// The option.
        option: &'static str,
        /// Its value as given.
        value: String,
        /// The whole spec.
        spec: String,
        /// What it must be.
        expected: &'static str,
    },
    /// A parameter out of its range.
    #[error("{field} = {value} is out of range (in {spec:?})")]
    OutOfRange {
        /// The parameter.
        field: &'static str,
        /// Its value.
        value: f64,
        /// The whole spec.
        spec: String,
    },
    /// A cache view that is none of `events`, `predict` or `approximate`.
    #[error("unknown cache view {0:?}: events, predict or approximate")]
    UnknownCache(String),
    /// A decider that is none of `never`, `always` or a token count.
    #[error(transparent)]
    UnknownDecider(#[from] UnknownDecider),
    /// A value out of its range.
    #[error("must be {rule}, not {value}")]
    Invalid {
        /// The rule.
        rule: &'static str,
        /// The value.
        value: String,
    },
    /// The router refused the configuration the options make.
    #[error(transparent)]
    Router(#[from] ConfigError),
    /// A [`RouterConfig`] with a setting no option names, so no spec makes it.
    #[error("{0} has no spec: no option of the router's vocabulary sets it")]
    Inexpressible(&'static str),
}

// ---- when no worker is eligible ----

impl WhenEmpty {
    /// Every value, in the order of its names.
    pub const ALL: [WhenEmpty; 2] = [WhenEmpty::Reject, WhenEmpty::Queue];

    /// The name in flags and files.
    pub fn name(self) -> &'static str {
        match self {
            WhenEmpty::Reject => "reject",
            WhenEmpty::Queue => "queue",
        }
    }
}

impl FromStr for WhenEmpty {
    type Err = SpecError;

    /// `reject` or `queue`.
    fn from_str(s: &str) -> Result<Self, SpecError> {
        Self::ALL
            .into_iter()
            .find(|w| w.name() == s)
            .ok_or_else(|| SpecError::Invalid {
                rule: "reject or queue",
                value: format!("{s:?}"),
            })
    }
}

impl fmt::Display for WhenEmpty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An option of a [`RouterSpec`] that was refused: its key (the flag's long name and the
/// configuration file's key) and why.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{key}: {error}")]
pub struct OptionError {
    /// The option's key, e.g. `policy`.
    pub key: &'static str,
    /// Why it was refused.
    pub error: SpecError,
}

// ---- policies ----

const COST_OPTIONS: &str = "full, staged, scale=X, credit=X, tier=X, evict=X, fleet=X, stall=X, transfer=X, requests=X, temperature=X, spread=X";

impl FromStr for PolicyConfig {
    type Err = SpecError;

    /// A policy spec (see the module docs), validated.
    fn from_str(spec: &str) -> Result<Self, SpecError> {
        let mut parts = spec.split(':');
        let name = parts.next().unwrap_or_default();
        let mut policy = PolicyConfig::from_name(name)?;
        let policy_name = policy.name();
        for part in parts {
            let (PolicyConfig::Kv(config) | PolicyConfig::Dynamo(config)) = &mut policy else {
                return Err(SpecError::NoOptions {
                    name: policy_name,
                    spec: spec.to_owned(),
                });
            };
            let CostPolicyConfig {
                cost,
                temperature,
                spread_tolerance,
            } = config;
            let number = |option: &'static str, value: &str| {
                value.parse::<f64>().map_err(|_| SpecError::NotANumber {
                    option,
                    value: value.to_owned(),
                    spec: spec.to_owned(),
                    expected: "a number",
                })
            };
            match part.split_once('=') {
                None if part == "full" => cost.projection = DecodeProjection::Full,
                None if part == "staged" => cost.projection = DecodeProjection::Staged,
                Some(("scale", v)) => cost.prefill_load_scale = number("scale", v)?,
                Some(("credit", v)) => cost.overlap_credit = number("credit", v)?,
                Some(("tier", v)) => cost.tier_block_cost = number("tier", v)?,
                Some(("evict", v)) => cost.evict_weight = number("evict", v)?,
                Some(("fleet", v)) => cost.fleet_weight = number("fleet", v)?,
                Some(("stall", v)) => cost.stall_weight = number("stall", v)?,
                Some(("transfer", v)) => cost.transfer_block_cost = number("transfer", v)?,
                Some(("requests", v)) => cost.decode_active_request_weight = number("requests", v)?,
                Some(("temperature", v)) => *temperature = number("temperature", v)?,
                Some(("spread", v)) => *spread_tolerance = number("spread", v)?,
                _ => {
                    return Err(SpecError::UnknownOption {
                        option: part.to_owned(),
                        spec: spec.to_owned(),
                        valid: COST_OPTIONS,
                    });
                }
            }
        }
        if let Some((field, value)) = policy.invalid_field() {
            return Err(SpecError::OutOfRange {
                field,
                value,
                spec: spec.to_owned(),
            });
        }
        Ok(policy)
    }
}

impl fmt::Display for PolicyConfig {
    /// The canonical spec: the name, then the options that differ from the name's defaults.
    /// Parameters no option sets (`sglang-cache-aware`'s, `llmd-weighted`'s, the cost's
    /// per-request weight) are not printed; [`RouterSpec::from_config`] refuses a configuration
    /// that has them away from their defaults.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())?;
        let (PolicyConfig::Kv(c) | PolicyConfig::Dynamo(c)) = self else {
            return Ok(());
        };
        let Ok(PolicyConfig::Kv(d) | PolicyConfig::Dynamo(d)) = PolicyConfig::from_name(self.name()) else {
            return Ok(());
        };
        if c.cost.projection != d.cost.projection {
            f.write_str(match c.cost.projection {
                DecodeProjection::Full => ":full",
                DecodeProjection::Staged => ":staged",
            })?;
        }
        for (option, value, default) in [
            ("scale", c.cost.prefill_load_scale, d.cost.prefill_load_scale),
            ("credit", c.cost.overlap_credit, d.cost.overlap_credit),
            ("tier", c.cost.tier_block_cost, d.cost.tier_block_cost),
            ("evict", c.cost.evict_weight, d.cost.evict_weight),
            ("fleet", c.cost.fleet_weight, d.cost.fleet_weight),
            ("stall", c.cost.stall_weight, d.cost.stall_weight),
            ("transfer", c.cost.transfer_block_cost, d.cost.transfer_block_cost),
            (
                "requests",
                c.cost.decode_active_request_weight,
                d.cost.decode_active_request_weight,
            ),
            ("temperature", c.temperature, d.temperature),
            ("spread", c.spread_tolerance, d.spread_tolerance),
        ] {
            if value.to_bits() != default.to_bits() {
                write!(f, ":{option}={value}")?;
            }
        }
        Ok(())
    }
}

// ---- cache views ----

const RECENT_OPTIONS: &str = "ttl=S, ttl=none, max-blocks=N, prune=R";

impl FromStr for CacheMode {
    type Err = SpecError;

    /// A cache-view spec (see the module docs), validated.
    fn from_str(spec: &str) -> Result<Self, SpecError> {
        let mut parts = spec.split(':');
        let name = parts.next().unwrap_or_default();
        let mut recent = RecentConfig::PREDICT_ON_ROUTE;
        let wrap: fn(RecentConfig) -> CacheMode = match name {
            "events" => {
                if parts.next().is_some() {
                    return Err(SpecError::NoOptions {
                        name: "events",
                        spec: spec.to_owned(),
                    });
                }
                return Ok(CacheMode::Events);
            }
            "predict" => CacheMode::EventsWithPrediction,
            "approximate" => CacheMode::Approximate,
            _ => return Err(SpecError::UnknownCache(spec.to_owned())),
        };
        let bad = |option: &'static str, value: &str, expected: &'static str| SpecError::NotANumber {
            option,
            value: value.to_owned(),
            spec: spec.to_owned(),
            expected,
        };
        for part in parts {
            match part.split_once('=') {
                Some(("ttl", "none")) => recent.ttl = None,
                Some(("ttl", v)) => {
                    recent.ttl = Some(
                        parse_seconds(v)
                            .ok_or_else(|| bad("ttl", v, "seconds (up to 9 decimals) or none"))?,
                    )
                }
                Some(("max-blocks", v)) => {
                    recent.max_blocks = v.parse().map_err(|_| bad("max-blocks", v, "a whole number"))?
                }
                Some(("prune", v)) => {
                    recent.prune_ratio = v.parse().map_err(|_| bad("prune", v, "a number"))?
                }
                _ => {
                    return Err(SpecError::UnknownOption {
                        option: part.to_owned(),
                        spec: spec.to_owned(),
                        valid: RECENT_OPTIONS,
                    });
                }
            }
        }
        let out_of_range = |field, value| SpecError::OutOfRange {
            field,
            value,
            spec: spec.to_owned(),
        };
        if recent.ttl.is_some_and(|t| t.is_zero()) {
            return Err(out_of_range("ttl", 0.0));
        }
        if recent.max_blocks == 0 {
            return Err(out_of_range("max-blocks", 0.0));
        }
        if !(recent.prune_ratio > 0.0 && recent.prune_ratio <= 1.0) {
            return Err(out_of_range("prune", recent.prune_ratio));
        }
        Ok(wrap(recent))
    }
}

impl fmt::Display for CacheMode {
    /// The canonical spec: the view, then the options that differ from
    /// [`RecentConfig::PREDICT_ON_ROUTE`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, recent) = match self {
            CacheMode::Events => return f.write_str("events"),
            CacheMode::EventsWithPrediction(r) => ("predict", r),
            CacheMode::Approximate(r) => ("approximate", r),
        };
        f.write_str(name)?;
        let d = RecentConfig::PREDICT_ON_ROUTE;
        if recent.ttl != d.ttl {
            match recent.ttl {
                None => f.write_str(":ttl=none")?,
                Some(t) => write!(f, ":ttl={}", Seconds(t))?,
            }
        }
        if recent.max_blocks != d.max_blocks {
            write!(f, ":max-blocks={}", recent.max_blocks)?;
        }
        if recent.prune_ratio.to_bits() != d.prune_ratio.to_bits() {
            write!(f, ":prune={}", recent.prune_ratio)?;
        }
        Ok(())
    }
}

/// `S` or `S.F` (at most nine decimals) seconds, exactly.
fn parse_seconds(s: &str) -> Option<Duration> {
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(frac) || frac.len() > 9 {
        return None;
    }
    let nanos = if frac.is_empty() {
        0
    } else {
        frac.parse::<u32>().ok()? * 10u32.pow(9 - frac.len() as u32)
    };
    Some(Duration::new(whole.parse().ok()?, nanos))
}

/// A duration printed as seconds, exactly, as [`parse_seconds`] reads them.
struct Seconds(Duration);

impl fmt::Display for Seconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.as_secs())?;
        let nanos = self.0.subsec_nanos();
        if nanos > 0 {
            let frac = format!("{nanos:09}");
            write!(f, ".{}", frac.trim_end_matches('0'))?;
        }
        Ok(())
    }
}

// ---- deciders ----

impl FromStr for Decider {
    type Err = SpecError;

    /// [`Decider::from_name`].
    fn from_str(s: &str) -> Result<Self, SpecError> {
        Ok(Decider::from_name(s)?)
    }
}

impl fmt::Display for Decider {
    /// `never`, `always` or the threshold, as [`Decider::from_name`] reads them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decider::Never => f.write_str("never"),
            Decider::Always => f.write_str("always"),
            Decider::PrefixThreshold { uncached_tokens } => write!(f, "{uncached_tokens}"),
        }
    }
}

// ---- the router's options ----

/// The router options every front end names alike, under the same keys (the long flags of
/// `kvroute serve` and `kvroute replay`, the keys of their files). [`RouterSpec::router_config`]
/// is the one place they become a [`RouterConfig`]; its `Display` is the flags that make it
/// again.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterSpec {
    /// `policy`.
    pub policy: PolicyConfig,
    /// `cache`.
    pub cache: CacheMode,
    /// `decider`.
    pub decider: Decider,
    /// `block-size`: tokens per KV block.
    pub block_size: u32,
    /// `seed`.
    pub seed: u64,
    /// `queue-capacity`: requests that may wait when every worker is busy.
    pub queue_capacity: usize,
    /// `busy-requests-fraction`: a worker is busy past this fraction of its max requests.
    pub busy_requests_fraction: Option<f64>,
    /// `when-empty`: whether a request for which no worker is eligible waits in the queue.
    pub when_empty: WhenEmpty,
}

/// The options of a [`RouterSpec`] as a front end reads them: the specs as text, the numbers as
/// numbers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterOptions<'a> {
    /// `policy`: a policy spec.
    pub policy: &'a str,
    /// `cache`: a cache-view spec.
    pub cache: &'a str,
    /// `decider`: a decider spec.
    pub decider: &'a str,
    /// `block-size`.
    pub block_size: u32,
    /// `seed`.
    pub seed: u64,
    /// `queue-capacity`.
    pub queue_capacity: usize,
    /// `busy-requests-fraction`.
    pub busy_requests_fraction: Option<f64>,
    /// `when-empty`: `reject` or `queue`.
    pub when_empty: &'a str,
}

impl Default for RouterSpec {
    /// The options of [`RouterConfig::default`].
    fn default() -> Self {
        let c = RouterConfig::default();
        Self {
            policy: c.policy,
            cache: c.cache,
            decider: c.decider,
            block_size: c.block_size,
            seed: c.seed,
            queue_capacity: c.queue.capacity,
            busy_requests_fraction: c.busy.requests_fraction,
            when_empty: c.queue.when_empty,
        }
    }
}

impl RouterSpec {
    /// Parses and checks the options; the error names the first option refused.
    pub fn parse(options: &RouterOptions<'_>) -> Result<Self, OptionError> {
        let key = |key: &'static str| move |error: SpecError| OptionError { key, error };
        let spec = Self {
            policy: options.policy.parse().map_err(key("policy"))?,
            cache: options.cache.parse().map_err(key("cache"))?,
            decider: options.decider.parse().map_err(key("decider"))?,
            block_size: options.block_size,
            seed: options.seed,
            queue_capacity: options.queue_capacity,
            busy_requests_fraction: options.busy_requests_fraction,
            when_empty: options.when_empty.parse().map_err(key("when-empty"))?,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// Checks every option, naming the first refused.
    pub fn validate(&self) -> Result<(), OptionError> {
        let refuse = |key, rule, value: String| {
            Err(OptionError {
                key,
                error: SpecError::Invalid { rule, value },
            })
        };
        if self.block_size == 0 {
            return refuse("block-size", "at least 1", "0".to_owned());
        }
        if let Some(f) = self.busy_requests_fraction
            && !(f.is_finite() && f >= 0.0)
        {
            return refuse("busy-requests-fraction", "a number 0 or above", f.to_string());
        }
        if let Some((field, value)) = self.policy.invalid_field() {
            return Err(OptionError {
                key: "policy",
                error: SpecError::OutOfRange {
                    field,
                    value,
                    spec: self.policy.to_string(),
                },
            });
        }
        // The cache view's own checks are its parser's.
        let cache = self.cache.to_string();
        cache
            .parse::<CacheMode>()
            .map_err(|error| OptionError { key: "cache", error })?;
        self.router_config().validate().map_err(|e| OptionError {
            key: "router",
            error: e.into(),
        })
    }

    /// The router configuration: [`RouterConfig::default`] with these options.
    pub fn router_config(&self) -> RouterConfig {
        let mut config = RouterConfig {
            policy: self.policy,
            cache: self.cache,
            decider: self.decider,
            block_size: self.block_size,
            seed: self.seed,
            queue: QueueConfig {
                capacity: self.queue_capacity,
                when_empty: self.when_empty,
                ..QueueConfig::default()
            },
            ..RouterConfig::default()
        };
        config.busy.requests_fraction = self.busy_requests_fraction;
        config
    }

    /// The options that make `config`, up to what a front end sets beside them for its own
    /// driver (`router_id`, `replica_rank`, `sync`, `max_blocks_per_worker`); an error names a
    /// setting no option makes (a prefill policy of its own, another busy threshold, a policy
    /// parameter the policy spec has no option for, ...).
    pub fn from_config(config: &RouterConfig) -> Result<Self, SpecError> {
        let spec = Self {
            policy: config.policy,
            cache: config.cache,
            decider: config.decider,
            block_size: config.block_size,
            seed: config.seed,
            queue_capacity: config.queue.capacity,
            busy_requests_fraction: config.busy.requests_fraction,
            when_empty: config.queue.when_empty,
        };
        if spec.policy.to_string().parse::<PolicyConfig>().ok() != Some(spec.policy) {
            return Err(SpecError::Inexpressible("policy"));
        }
        if spec.cache.to_string().parse::<CacheMode>().ok() != Some(spec.cache) {
            return Err(SpecError::Inexpressible("cache"));
        }
        let made = RouterConfig {
            router_id: config.router_id,
            replica_rank: config.replica_rank,
            sync: config.sync,
            max_blocks_per_worker: config.max_blocks_per_worker,
            ..spec.router_config()
        };
        let differs = |a: bool, field| {
            if a {
                Err(SpecError::Inexpressible(field))
            } else {
                Ok(())
            }
        };
        differs(made.prefill_policy != config.prefill_policy, "prefill_policy")?;
        differs(made.busy != config.busy, "busy")?;
        differs(made.queue != config.queue, "queue")?;
        differs(made.request_ttl != config.request_ttl, "request_ttl")?;
        differs(
            made.track_output_blocks != config.track_output_blocks,
            "track_output_blocks",
        )?;
        differs(made.prefill_model != config.prefill_model, "prefill_model")?;
        differs(made != *config, "router")?;
        Ok(spec)
    }
}

impl fmt::Display for RouterSpec {
    /// The flags that make this router, e.g. `--policy kv:full --cache approximate --decider
    /// always --block-size 64 --seed 0 --queue-capacity 1024 --when-empty reject`: every
    /// option, so that the defaults of the command they are given to do not matter.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "--policy {} --cache {} --decider {} --block-size {} --seed {} --queue-capacity {} \
             --when-empty {}",
            self.policy,
            self.cache,
            self.decider,
            self.block_size,
            self.seed,
            self.queue_capacity,
            self.when_empty
        )?;
        if let Some(fraction) = self.busy_requests_fraction {
            write!(f, " --busy-requests-fraction {fraction}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_specs_replay_took_parse_as_before() {
        let kv = |f: &dyn Fn(&mut CostPolicyConfig)| {
            let mut c = CostPolicyConfig::KV;
            f(&mut c);
            PolicyConfig::Kv(c)
        };
        let cases: &[(&str, PolicyConfig, &str)] = &[
            ("kv", kv(&|_| {}), "kv"),
            ("kv:staged", kv(&|_| {}), "kv"),
            (
                "kv:full",
                kv(&|c| c.cost.projection = DecodeProjection::Full),
                "kv:full",
            ),
            (
                "kv:staged:scale=2",
                kv(&|c| c.cost.prefill_load_scale = 2.0),
                "kv:scale=2",
            ),
            (
                "kv:temperature=0.1:spread=0.05",
                kv(&|c| {
                    c.temperature = 0.1;
                    c.spread_tolerance = 0.05;
                }),
                "kv:temperature=0.1:spread=0.05",
            ),
            (
                "kv:credit=0.5",
                kv(&|c| c.cost.overlap_credit = 0.5),
                "kv:credit=0.5",
            ),
            ("round-robin", PolicyConfig::RoundRobin, "round-robin"),
        ];
        for (spec, config, canonical) in cases {
            let parsed: PolicyConfig = spec.parse().unwrap();
            assert_eq!(parsed, *config, "{spec}");
            assert_eq!(parsed.to_string(), *canonical, "{spec}");
        }
        let dynamo: PolicyConfig = "dynamo:staged:scale=2".parse().unwrap();
        assert_eq!(dynamo.to_string(), "dynamo:staged:scale=2");
        assert_eq!(
            "dynamo:full".parse::<PolicyConfig>().unwrap().to_string(),
            "dynamo"
        );
    }

    #[test]
    fn bad_specs_name_what_is_wrong() {
        let err = |s: &str| s.parse::<PolicyConfig>().unwrap_err().to_string();
        assert!(err("nosuch").contains("valid names"), "{}", err("nosuch"));
        assert!(err("kv:bogus").contains("\"bogus\""), "{}", err("kv:bogus"));
        assert!(err("kv:scale=x").contains("scale"), "{}", err("kv:scale=x"));
        assert!(
            err("kv:spread=-1").contains("spread_tolerance"),
            "{}",
            err("kv:spread=-1")
        );
        assert!(
            err("kv:scale=inf").contains("prefill_load_scale"),
            "{}",
            err("kv:scale=inf")
        );
        assert!(
            err("random:full").contains("takes no options"),
            "{}",
            err("random:full")
        );
        let cache = |s: &str| s.parse::<CacheMode>().unwrap_err().to_string();
        assert!(cache("approx").contains("events, predict or approximate"));
        assert!(cache("events:ttl=1").contains("takes no options"));
        assert!(cache("predict:ttl=0").contains("ttl"));
        assert!(cache("predict:ttl=1e3").contains("seconds"));
        assert!(cache("predict:ttl=0.0000000001").contains("seconds"));
        assert!(cache("approximate:prune=0").contains("prune"));
        assert!(cache("approximate:max-blocks=0").contains("max-blocks"));
        assert!(cache("approximate:size=3").contains("unknown option"));
        assert!("sometimes".parse::<Decider>().is_err());
    }

    #[test]
    fn cache_views_parse_over_the_predict_on_route_defaults() {
        let d = RecentConfig::PREDICT_ON_ROUTE;
        assert_eq!("events".parse(), Ok(CacheMode::Events));
        assert_eq!("predict".parse(), Ok(CacheMode::EventsWithPrediction(d)));
        assert_eq!("approximate".parse(), Ok(CacheMode::Approximate(d)));
        let c: CacheMode = "approximate:ttl=120.5:max-blocks=4096:prune=0.5".parse().unwrap();
        assert_eq!(
            c,
            CacheMode::Approximate(RecentConfig {
                ttl: Some(Duration::from_millis(120_500)),
                max_blocks: 4096,
                prune_ratio: 0.5,
            })
        );
        assert_eq!(c.to_string(), "approximate:ttl=120.5:max-blocks=4096:prune=0.5");
        assert_eq!(
            "predict:ttl=5".parse::<CacheMode>().unwrap().to_string(),
            "predict"
        );
        assert_eq!(
            "predict:ttl=none".parse::<CacheMode>().unwrap().to_string(),
            "predict:ttl=none"
        );
    }

    #[test]
    fn the_flags_name_every_option() {
        let spec = RouterSpec::parse(&RouterOptions {
            policy: "kv:staged:scale=2",
            cache: "approximate",
            decider: "512",
            block_size: 64,
            seed: 7,
            queue_capacity: 0,
            busy_requests_fraction: Some(0.9),
            when_empty: "queue",
        })
        .unwrap();
        assert_eq!(
            spec.to_string(),
            "--policy kv:scale=2 --cache approximate --decider 512 --block-size 64 --seed 7 \
             --queue-capacity 0 --when-empty queue --busy-requests-fraction 0.9"
        );
        assert_eq!(spec.router_config().queue.when_empty, WhenEmpty::Queue);
        assert_eq!(RouterSpec::from_config(&spec.router_config()), Ok(spec.clone()));
        let mut config = spec.router_config();
        config.busy.prefill_tokens = Some(1);
        assert_eq!(
            RouterSpec::from_config(&config),
            Err(SpecError::Inexpressible("busy"))
        );
        let bad = RouterOptions {
            busy_requests_fraction: Some(f64::NAN),
            ..RouterOptions {
                policy: "kv",
                cache: "events",
                decider: "always",
                block_size: 16,
                seed: 0,
                queue_capacity: 1,
                busy_requests_fraction: None,
                when_empty: "reject",
            }
        };
        let err = RouterSpec::parse(&bad).unwrap_err();
        assert_eq!(err.key, "busy-requests-fraction");
        assert_eq!(
            err.to_string(),
            "busy-requests-fraction: must be a number 0 or above, not NaN"
        );
        let err = RouterSpec::parse(&RouterOptions {
            when_empty: "wait",
            busy_requests_fraction: None,
            ..bad
        })
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "when-empty: must be reject or queue, not \"wait\""
        );
        for w in WhenEmpty::ALL {
            assert_eq!(w.to_string().parse(), Ok(w));
        }
    }

    fn number() -> impl Strategy<Value = f64> {
        prop_oneof![
            (0u32..1000).prop_map(f64::from),
            (0.0f64..1.0),
            (0.0f64..1e6),
            Just(f64::MIN_POSITIVE),
        ]
    }

    fn policy_spec() -> impl Strategy<Value = String> {
        let option = prop_oneof![
            Just("full".to_owned()),
            Just("staged".to_owned()),
            number().prop_map(|v| format!("scale={v}")),
            (0.0f64..=1.0).prop_map(|v| format!("credit={v}")),
            (0.0f64..=1.0).prop_map(|v| format!("tier={v}")),
            number().prop_map(|v| format!("evict={v}")),
            number().prop_map(|v| format!("fleet={v}")),
            number().prop_map(|v| format!("stall={v}")),
            (0.0f64..=1.0).prop_map(|v| format!("transfer={v}")),
            number().prop_map(|v| format!("requests={v}")),
            number().prop_map(|v| format!("temperature={v}")),
            number().prop_map(|v| format!("spread={v}")),
        ];
        let cost = (
            prop_oneof![Just("kv"), Just("dynamo")],
            prop::collection::vec(option, 0..5),
        )
            .prop_map(|(name, options)| {
                std::iter::once(name.to_owned())
                    .chain(options)
                    .collect::<Vec<_>>()
                    .join(":")
            });
        prop_oneof![
            prop::sample::select(PolicyConfig::NAMES).prop_map(str::to_owned),
            cost
        ]
    }

    fn cache_spec() -> impl Strategy<Value = String> {
        let option = prop_oneof![
            (0u64..100_000, 1u32..1_000_000_000)
                .prop_map(|(s, n)| format!("ttl={}", Seconds(Duration::new(s, n)))),
            (1u64..10_000).prop_map(|s| format!("ttl={s}")),
            Just("ttl=none".to_owned()),
            (1u64..u64::MAX).prop_map(|n| format!("max-blocks={n}")),
            (0.001f64..=1.0).prop_map(|r| format!("prune={r}")),
        ];
        let recent = (
            prop_oneof![Just("predict"), Just("approximate")],
            prop::collection::vec(option, 0..4),
        )
            .prop_map(|(name, options)| {
                std::iter::once(name.to_owned())
                    .chain(options)
                    .collect::<Vec<_>>()
                    .join(":")
            });
        prop_oneof![Just("events".to_owned()), recent]
    }

    proptest! {
        #[test]
        fn a_printed_spec_parses_back_to_the_same(
            policy in policy_spec(),
            cache in cache_spec(),
            threshold in any::<u64>(),
            when_empty in prop::sample::select(WhenEmpty::ALL.to_vec()),
        ) {
            let p: PolicyConfig = policy.parse().unwrap();
            prop_assert_eq!(p.to_string().parse::<PolicyConfig>(), Ok(p));
            let c: CacheMode = cache.parse().unwrap();
            prop_assert_eq!(c.to_string().parse::<CacheMode>(), Ok(c));
            let d = Decider::PrefixThreshold { uncached_tokens: threshold };
            prop_assert_eq!(d.to_string().parse::<Decider>(), Ok(d));
            prop_assert_eq!(when_empty.to_string().parse::<WhenEmpty>(), Ok(when_empty));
            let spec = RouterSpec { policy: p, cache: c, decider: d, when_empty, ..RouterSpec::default() };
            prop_assert_eq!(RouterSpec::from_config(&spec.router_config()), Ok(spec));
        }

        #[test]
        fn any_text_parses_or_is_refused_without_panicking(s in "\\PC{0,40}") {
            let _ = s.parse::<PolicyConfig>();
            let _ = s.parse::<CacheMode>();
            let _ = s.parse::<Decider>();
            let _ = s.parse::<WhenEmpty>();
        }
    }
}
