//! `kv` and `dynamo`: the lowest [`cost`], by argmin with a random tie-break or, at a positive
//! temperature, by softmax sampling over the normalized costs (Dynamo's default selector).
//!
//! The two names share this implementation and differ in their defaults:
//! [`CostPolicyConfig::KV`] (the staged projection) and Dynamo's (`super::dynamo`).
//!
//! **Replica spread** ([`CostPolicyConfig::spread_tolerance`]): router replicas that see the same
//! view at the same moment (a burst of requests spread over them, faster than their sync) would
//! all take the same argmin and herd onto one worker. With a tolerance above 0, the candidates
//! whose cost is within that fraction of the lowest count as near-best, ranked by cost then
//! worker order, and the replica of rank `r` ([`super::Policy::set_replica_rank`]) takes the
//! `r`-th of them (modulo their number): concurrent replicas spread over the near-best workers
//! the way one router's successive bookings would. Rank 0, one router, takes the argmin as
//! without it.

use super::{Candidate, Policy};
use crate::router::cost::{CostParams, cost};
use crate::router::request::RequestView;
use crate::router::rng::Rng;
use crate::router::select::{argmin, nth_near_best, softmax};

/// The parameters of a cost-based policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostPolicyConfig {
    /// The cost's weights and projection.
    pub cost: CostParams,
    /// 0 picks the argmin (random tie-break); above 0 samples with
    /// `p ∝ exp(-normalized_cost / temperature)` (Dynamo `router_temperature`, default 0).
    pub temperature: f64,
    /// Replica spread at temperature 0 (see the module docs): costs within this fraction of the
    /// lowest are near-best, and replica rank `r` takes the `r`-th. Default 0 (off).
    pub spread_tolerance: f64,
}

impl CostPolicyConfig {
    /// `kv`'s defaults: [`CostParams::KV`], temperature 0.
    pub const KV: CostPolicyConfig = CostPolicyConfig {
        cost: CostParams::KV,
        temperature: 0.0,
        spread_tolerance: 0.0,
    };

    pub(crate) fn invalid_field(&self) -> Option<(&'static str, f64)> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Some(("temperature", self.temperature));
        }
        if !(self.spread_tolerance.is_finite() && self.spread_tolerance >= 0.0) {
            return Some(("spread_tolerance", self.spread_tolerance));
        }
        self.cost.invalid_field()
    }
}

/// See the module docs.
#[derive(Clone, Debug)]
pub(super) struct CostPolicy {
    name: &'static str,
    config: CostPolicyConfig,
    costs: Vec<f64>,
    rank: u32,
    near: Vec<usize>,
}

impl CostPolicy {
    pub(super) fn new(name: &'static str, config: CostPolicyConfig) -> Self {
        Self {
            name,
            config,
            costs: Vec::new(),
            rank: 0,
            near: Vec::new(),
        }
    }
}

impl CostPolicy {
    /// Whether this policy takes the plain argmin: temperature 0 and no replica spread.
    fn takes_argmin(&self) -> bool {
        self.config.temperature == 0.0 && (self.rank == 0 || self.config.spread_tolerance == 0.0)
    }
}

impl Policy for CostPolicy {
    fn name(&self) -> &'static str {
        self.name
    }

    fn select(&mut self, request: &RequestView<'_>, candidates: &[Candidate], rng: &mut Rng) -> usize {
        let params = &self.config.cost;
        let costs = candidates.iter().map(|c| cost(params, request, c));
        if self.takes_argmin() {
            return argmin(costs, rng);
        }
        if self.config.temperature == 0.0 {
            self.costs.clear();
            self.costs.extend(costs);
            return nth_near_best(
                &self.costs,
                self.config.spread_tolerance,
                self.rank,
                &mut self.near,
            );
        }
        self.costs.clear();
        self.costs.extend(costs);
        softmax(&self.costs, self.config.temperature, rng)
    }

    fn argmin_cost(&self) -> Option<&CostParams> {
        self.takes_argmin().then_some(&self.config.cost)
    }

    fn set_replica_rank(&mut self, rank: u32) {
        self.rank = rank;
    }
}
