//! `kv` and `dynamo`: the lowest [`cost`], by argmin with a random tie-break or, at a positive
//! temperature, by softmax sampling over the normalized costs (Dynamo's default selector).
//!
//! The two names share this implementation and differ in their defaults:
//! [`CostPolicyConfig::KV`] (the staged projection) and Dynamo's (`super::dynamo`).

use super::{Candidate, Policy};
use crate::router::cost::{CostParams, cost};
use crate::router::request::RequestView;
use crate::router::rng::Rng;
use crate::router::select::{argmin, softmax};

/// The parameters of a cost-based policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostPolicyConfig {
    /// The cost's weights and projection.
    pub cost: CostParams,
    /// 0 picks the argmin (random tie-break); above 0 samples with
    /// `p ∝ exp(-normalized_cost / temperature)` (Dynamo `router_temperature`, default 0).
    pub temperature: f64,
}

impl CostPolicyConfig {
    /// `kv`'s defaults: [`CostParams::KV`], temperature 0.
    pub const KV: CostPolicyConfig = CostPolicyConfig {
        cost: CostParams::KV,
        temperature: 0.0,
    };

    pub(crate) fn invalid_field(&self) -> Option<(&'static str, f64)> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Some(("temperature", self.temperature));
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
}

impl CostPolicy {
    pub(super) fn new(name: &'static str, config: CostPolicyConfig) -> Self {
        Self {
            name,
            config,
            costs: Vec::new(),
        }
    }
}

impl Policy for CostPolicy {
    fn name(&self) -> &'static str {
        self.name
    }

    fn select(&mut self, request: &RequestView<'_>, candidates: &[Candidate], rng: &mut Rng) -> usize {
        let params = &self.config.cost;
        let costs = candidates.iter().map(|c| cost(params, request, c));
        if self.config.temperature == 0.0 {
            return argmin(costs, rng);
        }
        self.costs.clear();
        self.costs.extend(costs);
        softmax(&self.costs, self.config.temperature, rng)
    }
}
