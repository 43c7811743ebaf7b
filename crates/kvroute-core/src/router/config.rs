//! The router's configuration, validated once in [`super::Router::new`].

use std::time::Duration;

use super::busy::BusyThresholds;
use super::disagg::Decider;
use super::load::PrefillModel;
use super::policy::{CostPolicyConfig, PolicyConfig};
use super::queue::QueueConfig;
use super::recent::RecentConfig;
use super::session::SessionConfig;
use super::sync::{RouterId, SyncConfig};

/// Where the router's view of the workers' caches comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum CacheMode {
    /// The engines' KV events feed the index (Dynamo's default).
    #[default]
    Events,
    /// KV events, plus a short-lived record of the router's own decisions ("predict-on-route"):
    /// a worker's overlap is the larger of the two.
    EventsWithPrediction(RecentConfig),
    /// No KV events: the router's record of its own decisions is its only view (approximate
    /// mode). KV events are refused.
    Approximate(RecentConfig),
}

/// The router's settings. [`RouterConfig::default`] documents every default.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// This replica's id, carried in the replica events it exports. Default 0.
    pub router_id: RouterId,
    /// Tokens per KV block, as the engines use (vLLM's default is 16). Default 16.
    pub block_size: u32,
    /// Seed of the router's random numbers (tie-breaks, sampling). Default 0.
    pub seed: u64,
    /// The policy for workers that decode (aggregated and decode workers). Default `kv`.
    pub policy: PolicyConfig,
    /// The policy for the prefill pool; `None` uses `policy`'s kind and parameters. Default `None`.
    pub prefill_policy: Option<PolicyConfig>,
    /// Whether a request on a decode worker has its prefill on a prefill worker. Default
    /// [`Decider::Always`].
    pub decider: Decider,
    /// Where the cache view comes from. Default [`CacheMode::Events`].
    pub cache: CacheMode,
    /// When a worker is too busy for new requests. Default: never.
    pub busy: BusyThresholds,
    /// The queue for requests that find every eligible worker busy. Default
    /// [`QueueConfig::default`].
    pub queue: QueueConfig,
    /// Age at which an active request is dropped as lost (a "finished" that never came).
    /// Default 3,600 s (Dynamo's current value).
    pub request_ttl: Duration,
    /// Whether output blocks are booked as generation crosses block boundaries. Default off.
    pub track_output_blocks: bool,
    /// A model of prefill time, for the expected duration in load hints. Default none.
    pub prefill_model: Option<PrefillModel>,
    /// Replica sync: whether load changes are exported as replica events
    /// ([`super::Router::poll_sync_event`]), and the tombstone cap. Default off.
    pub sync: SyncConfig,
    /// This router's rank among its replicas (0: alone, or the first), read by policies that
    /// spread concurrent replicas' decisions ([`super::policy::CostPolicyConfig::spread_tolerance`]);
    /// [`super::Router::set_replica_rank`] changes it as peers come and go. Default 0.
    pub replica_rank: u32,
    /// The most blocks the index keeps per worker, evicting the oldest past it
    /// ([`crate::index::IndexConfig::max_blocks_per_worker`]). Default unbounded.
    pub max_blocks_per_worker: Option<std::num::NonZeroUsize>,
    /// Session affinity for requests that carry a session: size, idle time, overload.
    /// Default [`SessionConfig::default`].
    pub sessions: SessionConfig,
    /// Tenants' weights in the queue's fair share ([`super::FairConfig`]). Default: every tenant
    /// weighs 1.
    pub fair: super::FairConfig,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            router_id: RouterId(0),
            block_size: 16,
            seed: 0,
            policy: PolicyConfig::Kv(CostPolicyConfig::KV),
            prefill_policy: None,
            decider: Decider::Always,
            cache: CacheMode::Events,
            busy: BusyThresholds::default(),
            queue: QueueConfig::default(),
            request_ttl: Duration::from_secs(3600),
            track_output_blocks: false,
            prefill_model: None,
            sync: SyncConfig::default(),
            replica_rank: 0,
            max_blocks_per_worker: None,
            sessions: SessionConfig::default(),
            fair: super::FairConfig::default(),
        }
    }
}

/// A configuration the router refuses.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `block_size` is 0.
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
    /// A numeric parameter is out of its range.
    #[error("{field} = {value} is out of range ({policy})")]
    OutOfRange {
        /// Where the parameter is: a policy name, or `router`.
        policy: &'static str,
        /// The parameter.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// A TTL or a duration that must be positive is zero.
    #[error("{0} must be positive")]
    ZeroDuration(&'static str),
}

impl RouterConfig {
    /// Checks every parameter; [`super::Router::new`] calls it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        for policy in std::iter::once(&self.policy).chain(&self.prefill_policy) {
            if let Some((field, value)) = policy.invalid_field() {
                return Err(ConfigError::OutOfRange {
                    policy: policy.name(),
                    field,
                    value,
                });
            }
        }
        let router = |field: &'static str, value: f64| ConfigError::OutOfRange {
            policy: "router",
            field,
            value,
        };
        if let Some((field, value)) = self.busy.invalid_field() {
            return Err(router(field, value));
        }
        if let CacheMode::EventsWithPrediction(r) | CacheMode::Approximate(r) = &self.cache {
            if r.ttl.is_some_and(|t| t.is_zero()) {
                return Err(ConfigError::ZeroDuration("cache TTL"));
            }
            if !(r.prune_ratio > 0.0 && r.prune_ratio <= 1.0) {
                return Err(router("prune_ratio", r.prune_ratio));
            }
            if r.max_blocks == 0 {
                return Err(router("max_blocks", 0.0));
            }
        }
        if self.sync.max_tombstones == 0 {
            return Err(router("sync.max_tombstones", 0.0));
        }
        if let Some((field, value)) = self.sessions.overloaded.invalid_field() {
            return Err(ConfigError::OutOfRange {
                policy: "sessions.overloaded",
                field,
                value,
            });
        }
        if self.sessions.max_sessions == 0 {
            return Err(router("sessions.max_sessions", 0.0));
        }
        if self.sessions.idle_ttl.is_zero() {
            return Err(ConfigError::ZeroDuration("sessions.idle_ttl"));
        }
        if self.request_ttl.is_zero() {
            return Err(ConfigError::ZeroDuration("request_ttl"));
        }
        if self.queue.recheck_interval.is_zero() {
            return Err(ConfigError::ZeroDuration("queue recheck_interval"));
        }
        if let Some(m) = &self.prefill_model
            && !(m.tokens_per_second.is_finite() && m.tokens_per_second > 0.0)
        {
            return Err(router("prefill_model.tokens_per_second", m.tokens_per_second));
        }
        Ok(())
    }
}
