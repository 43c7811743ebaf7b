//! The removal order: which worker to take out first when the fleet shrinks. The cheapest to
//! remove comes first: the fewest cached blocks that no other worker holds (the cache value
//! the fleet loses with it), then the fewest requests in flight, then the newest. The same
//! order is served by `GET /admin/planner/removal-order` and exported as
//! `kvroute_worker_removal_rank{worker}` and `kvroute_worker_removal_cost{worker}` (for
//! Kubernetes' `controller.kubernetes.io/pod-deletion-cost`, where a lower cost is removed
//! first and a higher one later: the cost is the rank).

use crate::driver::{Driver, RemovalFigures};

/// The driver's workers with their figures, in the planner's removal order (cheapest first:
/// `kvroute_planner::removal_rank`, the rule its scale-down uses).
pub fn ranked(driver: &Driver) -> Vec<RemovalFigures> {
    let mut figures = driver.removal_figures();
    figures.sort_by_key(|f| kvroute_planner::removal_rank(f.cached_unique_blocks, f.in_flight, f.id.0));
    figures
}

/// Sets `kvroute_worker_removal_rank` and `kvroute_worker_removal_cost` from the order now
/// (every worker's series; those of workers gone are dropped). Called when `/metrics` is
/// scraped.
pub fn refresh_gauges(driver: &Driver) {
    let ranked = ranked(driver);
    let metrics = &driver.metrics;
    metrics.worker_removal_rank.reset();
    metrics.worker_removal_cost.reset();
    for (rank, w) in ranked.iter().enumerate() {
        let label = w.id.0.to_string();
        let rank = rank as i64;
        metrics
            .worker_removal_rank
            .with_label_values(&[label.as_str()])
            .set(rank);
        metrics
            .worker_removal_cost
            .with_label_values(&[label.as_str()])
            .set(rank);
    }
}
