//! Weighted fair share of tokens among tenants: a virtual token counter per tenant (VTC), read
//! by the wait queue.
//!
//! Every booking, this router's and its peers' alike (they come through the same
//! [`super::Router`] commit), charges its tenant [`served_tokens`] divided by the tenant's
//! weight. Within a priority tier the queue serves the waiting tenant whose counter is smallest
//! (the earliest head among equals), so while workers are saturated each tenant's share of
//! tokens follows its weight, and one tenant's burst waits behind the others instead of
//! starving them. Because peers' bookings are charged too, replicas that see each other's
//! bookings keep one set of counters, and the share holds across them.
//!
//! A tenant that had nothing waiting is lifted, when its next request waits, to the smallest
//! counter of the tenants waiting (to the largest counter of all if none waits): time spent idle
//! banks no credit to spend later in a burst.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

/// A tenant, as the router knows it: a small number the driver assigns from its configuration
/// (`TenantId::OTHER` for requests of no configured tenant). Replicas must assign the same
/// numbers to the same tenants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TenantId(pub u32);

impl TenantId {
    /// Requests of no configured tenant.
    pub const OTHER: TenantId = TenantId(0);
}

/// The fair share's settings: each tenant's weight.
///
/// Every booking (this router's and its peers') charges its tenant [`served_tokens`] divided by
/// the tenant's weight; within a priority tier the queue serves the waiting tenant whose counter
/// is smallest (the earliest head among equals). A tenant that had nothing waiting is lifted,
/// when its next request waits, to the smallest counter of those waiting (to the largest of all
/// if none waits), so idle time banks no credit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FairConfig {
    /// `weights[i]` is the weight of `TenantId(i)`; a tenant past the end weighs 1. Default
    /// empty: every tenant weighs 1.
    pub weights: Vec<NonZeroU32>,
}

impl FairConfig {
    /// Tenant `tenant`'s weight.
    pub fn weight(&self, tenant: TenantId) -> NonZeroU32 {
        self.weights
            .get(tenant.0 as usize)
            .copied()
            .unwrap_or(NonZeroU32::MIN)
    }
}

/// The tokens a booking of `prompt_tokens` with an output hint of `expected_output_tokens`
/// charges its tenant: the one rule, applied to this router's bookings and to its peers'.
pub fn served_tokens(prompt_tokens: u64, expected_output_tokens: Option<u32>) -> u64 {
    prompt_tokens.saturating_add(u64::from(expected_output_tokens.unwrap_or(0)))
}

/// One token of a tenant of weight 1, in counter units (a fixed point, so that division by a
/// weight stays exact enough and integral).
const UNIT: u128 = 1 << 20;

/// The tenants' virtual token counters; see the module docs.
#[derive(Clone, Debug, Default)]
pub(crate) struct FairShare {
    config: FairConfig,
    counters: BTreeMap<TenantId, u128>,
}

impl FairShare {
    pub(crate) fn new(config: FairConfig) -> Self {
        Self {
            config,
            counters: BTreeMap::new(),
        }
    }

    /// Tenant `tenant`'s counter.
    pub(crate) fn counter(&self, tenant: TenantId) -> u128 {
        self.counters.get(&tenant).copied().unwrap_or(0)
    }

    /// Charges `tenant` for `tokens` served.
    pub(crate) fn charge(&mut self, tenant: TenantId, tokens: u64) {
        let weight = u128::from(self.config.weight(tenant).get());
        let add = u128::from(tokens) * UNIT / weight;
        let c = self.counters.entry(tenant).or_insert(0);
        *c = c.saturating_add(add);
    }

    /// Lifts `tenant`, which had nothing waiting, as its next request waits: to the smallest
    /// counter among `waiting` tenants, or, if none waits, to the largest counter of all.
    pub(crate) fn lift(&mut self, tenant: TenantId, waiting: impl Iterator<Item = TenantId>) {
        let floor = waiting
            .map(|t| self.counter(t))
            .min()
            .unwrap_or_else(|| self.counters.values().copied().max().unwrap_or(0));
        let c = self.counters.entry(tenant).or_insert(0);
        *c = (*c).max(floor);
    }

    /// Every counter, in tenant order, in tokens of a weight-1 tenant (for metrics and tests).
    pub(crate) fn snapshot(&self) -> Vec<(TenantId, f64)> {
        self.counters
            .iter()
            .map(|(&t, &c)| (t, c as f64 / UNIT as f64))
            .collect()
    }
}
