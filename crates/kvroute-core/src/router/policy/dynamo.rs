//! `dynamo`: NVIDIA Dynamo's KV router with its default settings, for comparison.
//!
//! The cost is the shared [`crate::router::cost::cost`] with [`CostParams::DYNAMO`]:
//! `prefill_load_scale = 1`, `overlap_score_credit = 1`, `decode_active_request_weight = 0`,
//! the full decode projection (a pending request's uncached blocks count in both terms), and
//! `router_temperature = 0` (argmin, ties broken uniformly at random). Load is the router's own
//! bookkeeping, as in Dynamo: prefill tokens until the first token, active blocks deduplicated
//! by sequence hash.
//!
//! Left out because kvroute does not model them: the host and disk cache tiers and the shared
//! cache multiplier, credit decay, preferred-taint factors, and the `lmetric` selection policy.
//! Busy thresholds, queueing, approximate mode and predict-on-route are router settings that
//! apply to every policy and default to Dynamo's (off, off, events on, off).

use super::kv::CostPolicyConfig;
use crate::router::cost::CostParams;

/// Dynamo's defaults.
pub(super) const DEFAULTS: CostPolicyConfig = CostPolicyConfig {
    cost: CostParams::DYNAMO,
    temperature: 0.0,
    spread_tolerance: 0.0,
};
