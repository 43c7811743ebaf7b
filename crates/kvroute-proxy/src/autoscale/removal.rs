//! The removal order: which worker to take out first when the fleet shrinks. The cheapest to
//! remove comes first: the fewest cached blocks that no other worker holds (the cache value
//! the fleet loses with it), then the fewest requests in flight, then the newest. The same
//! order is served by `GET /admin/planner/removal-order` and exported as
//! `kvroute_worker_removal_rank{worker}` and `kvroute_worker_removal_cost{worker}` (for
//! Kubernetes' `controller.kubernetes.io/pod-deletion-cost`, where a lower cost is removed
//! first and a higher one later: the cost is the rank).

use std::cmp::Reverse;

use crate::driver::{Driver, RemovalFigures};

/// One worker as the removal order sees it (the fields of the planner's `WorkerObservation`
/// the order reads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerObservation {
    /// The fleet's id of the worker.
    pub id: u64,
    /// Requests in flight on it.
    pub in_flight: u32,
    /// Cached blocks no other worker holds.
    pub cached_unique_blocks: u64,
}

// replaced by kvroute_planner::removal_order on merge
/// The workers' ids, cheapest to remove first: sorted by `(cached_unique_blocks, in_flight,
/// Reverse(id))` (ids grow with age, so the newest goes first among equals).
pub fn removal_order(workers: &[WorkerObservation]) -> Vec<u64> {
    let mut sorted: Vec<&WorkerObservation> = workers.iter().collect();
    sorted.sort_by_key(|w| (w.cached_unique_blocks, w.in_flight, Reverse(w.id)));
    sorted.into_iter().map(|w| w.id).collect()
}

/// The driver's workers with their figures, in removal order (cheapest first).
pub fn ranked(driver: &Driver) -> Vec<RemovalFigures> {
    let mut figures = driver.removal_figures();
    let observed: Vec<WorkerObservation> = figures
        .iter()
        .map(|f| WorkerObservation {
            id: f.id.0,
            in_flight: f.in_flight,
            cached_unique_blocks: f.cached_unique_blocks,
        })
        .collect();
    let order = removal_order(&observed);
    figures.sort_by_key(|f| order.iter().position(|&id| id == f.id.0));
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn w(id: u64, cached_unique_blocks: u64, in_flight: u32) -> WorkerObservation {
        WorkerObservation {
            id,
            in_flight,
            cached_unique_blocks,
        }
    }

    #[test]
    fn cache_value_first_then_load_then_newest() {
        // (workers, order)
        let cases: &[(&[WorkerObservation], &[u64])] = &[
            (&[], &[]),
            (&[w(0, 5, 0)], &[0]),
            // Fewest unique blocks first, whatever the load.
            (&[w(0, 10, 0), w(1, 2, 9), w(2, 5, 0)], &[1, 2, 0]),
            // Equal cache value: fewest in flight first.
            (&[w(0, 3, 2), w(1, 3, 1), w(2, 3, 4)], &[1, 0, 2]),
            // Equal in both: the newest (highest id) first.
            (&[w(0, 0, 0), w(1, 0, 0), w(2, 0, 0)], &[2, 1, 0]),
            (&[w(4, 1, 1), w(7, 1, 1), w(5, 0, 3)], &[5, 7, 4]),
        ];
        for &(workers, want) in cases {
            assert_eq!(removal_order(workers), want, "{workers:?}");
        }
    }

    proptest! {
        /// Against a reference: the order is a permutation of the ids, and each worker comes no
        /// later than any other it beats on the rule compared field by field.
        #[test]
        fn the_order_is_the_rule(raw in prop::collection::btree_map(0u64..50, (0u64..4, 0u32..3), 0..12)) {
            let workers: Vec<WorkerObservation> =
                raw.iter().map(|(&id, &(c, f))| w(id, c, f)).collect();
            let order = removal_order(&workers);
            let mut ids: Vec<u64> = workers.iter().map(|w| w.id).collect();
            let mut got = order.clone();
            ids.sort_unstable();
            got.sort_unstable();
            prop_assert_eq!(got, ids);
            let beats = |a: &WorkerObservation, b: &WorkerObservation| {
                a.cached_unique_blocks < b.cached_unique_blocks
                    || (a.cached_unique_blocks == b.cached_unique_blocks
                        && (a.in_flight < b.in_flight
                            || (a.in_flight == b.in_flight && a.id > b.id)))
            };
            let at = |id: u64| order.iter().position(|&x| x == id).unwrap_or(usize::MAX);
            for a in &workers {
                for b in &workers {
                    if beats(a, b) {
                        prop_assert!(at(a.id) < at(b.id), "{:?} before {:?}: {:?}", a, b, order);
                    }
                }
            }
        }
    }
}
