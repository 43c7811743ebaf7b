//! A fleet scaled to zero ([`WhenEmpty::Queue`]): a request that finds no worker waits in the
//! queue, within its capacity, and the first worker added takes the waiting requests in arrival
//! order; one whose deadline passes first is cancelled by its driver (as the proxy's queue
//! timeout does) and never routed. Checked against a reference model: a list of the waiting
//! requests' arrival times.

use std::time::Duration;

use kvroute_core::ids::{DpRank, RequestId, WorkerId, WorkerKey};
use kvroute_core::router::{
    Output, PolicyConfig, Prompt, QueueConfig, RejectReason, RouteOutcome, RouteRequest, Router,
    RouterConfig, WhenEmpty, WorkerRole, WorkerSpec,
};
use kvroute_core::time::Timestamp;
use proptest::prelude::*;

fn key(w: u64) -> WorkerKey {
    WorkerKey::new(WorkerId(w), DpRank(0))
}

fn config(policy: &str, capacity: usize, when_empty: WhenEmpty) -> RouterConfig {
    RouterConfig {
        block_size: 4,
        policy: PolicyConfig::from_name(policy).expect("a listed name"),
        queue: QueueConfig {
            capacity,
            when_empty,
            ..QueueConfig::default()
        },
        ..RouterConfig::default()
    }
}

/// Routes request `id` with a prompt of its own.
fn route(r: &mut Router, now: Timestamp, id: u64) -> RouteOutcome {
    let tokens: Vec<u32> = (0..9).map(|j| id as u32 * 100 + j).collect();
    r.handle_request(now, &RouteRequest::new(RequestId(id), Prompt::Tokens(&tokens)))
        .expect("a fresh id")
}

/// The reference: the requests waiting, each with its arrival; a driver that cancels each
/// request whose deadline (arrival + `timeout`) has come.
struct Model {
    waiting: Vec<(u64, Timestamp)>,
    timeout: Duration,
}

impl Model {
    /// Cancels, in `r` and here, the requests whose deadline is at or before `now`.
    fn expire(&mut self, r: &mut Router, now: Timestamp) {
        let timeout = self.timeout;
        for &(id, arrived) in &self.waiting {
            if arrived + timeout <= now {
                assert_eq!(r.handle_cancelled(now, RequestId(id)), Ok(Vec::new()));
            }
        }
        self.waiting.retain(|&(_, arrived)| arrived + timeout > now);
    }
}

proptest! {
    #[test]
    fn requests_wait_for_the_first_worker_in_arrival_order_or_expire_at_their_deadline(
        policy in prop::sample::select(PolicyConfig::NAMES),
        capacity in 0usize..6,
        gaps in prop::collection::vec(0u64..50, 0..12),
        timeout_ms in 1u64..200,
        worker_at in prop::option::of(0u64..400),
    ) {
        let mut r = Router::new(config(policy, capacity, WhenEmpty::Queue)).unwrap();
        let mut model = Model { waiting: Vec::new(), timeout: Duration::from_millis(timeout_ms) };
        let mut now = Timestamp::ZERO;
        for (id, gap) in gaps.iter().enumerate() {
            now = now + Duration::from_millis(*gap);
            model.expire(&mut r, now);
            let outcome = route(&mut r, now, id as u64);
            if capacity == 0 {
                // No queue to wait in.
                prop_assert_eq!(outcome, RouteOutcome::Rejected(RejectReason::NoEligibleWorker));
            } else if model.waiting.len() < capacity {
                prop_assert_eq!(outcome, RouteOutcome::Queued);
                model.waiting.push((id as u64, now));
            } else {
                prop_assert_eq!(outcome, RouteOutcome::Rejected(RejectReason::QueueFull));
            }
            let m = r.metrics();
            prop_assert_eq!(m.queued_now, model.waiting.len());
            prop_assert_eq!(m.queued_without_worker_now, model.waiting.len());
            // No timer to run: a tick could release nothing (a driver such as the simulator
            // is not kept ticking by requests no worker can take).
            prop_assert_eq!(r.next_deadline(), None);
            prop_assert!(r.check_invariants().is_ok());
        }
        let Some(at) = worker_at else {
            // No worker ever comes: every request is cancelled at its deadline.
            model.expire(&mut r, now + model.timeout);
            prop_assert!(model.waiting.is_empty());
            let m = r.metrics();
            prop_assert_eq!((m.queued_now, m.counters.routed), (0, 0));
            prop_assert_eq!(m.counters.cancelled_in_queue, m.counters.queued);
            return Ok(());
        };
        now = now + Duration::from_millis(at);
        model.expire(&mut r, now);
        let out = r
            .handle_worker_added(now, WorkerSpec::new(key(1), WorkerRole::Aggregated, 1000))
            .unwrap();
        let expected: Vec<(RequestId, WorkerKey, Duration)> = model
            .waiting
            .iter()
            .map(|&(id, arrived)| (RequestId(id), key(1), now.saturating_since(arrived)))
            .collect();
        let routed: Vec<(RequestId, WorkerKey, Duration)> = out
            .iter()
            .map(|o| match o {
                Output::Routed(d) => (d.request, d.worker, d.waited),
                other => panic!("{other:?}"),
            })
            .collect();
        prop_assert_eq!(routed, expected);
        let m = r.metrics();
        prop_assert_eq!((m.queued_now, m.queued_without_worker_now), (0, 0));
        // A second worker finds no one waiting.
        let out = r
            .handle_worker_added(now, WorkerSpec::new(key(2), WorkerRole::Aggregated, 1000))
            .unwrap();
        prop_assert!(out.is_empty());
        prop_assert!(r.check_invariants().is_ok());
    }

    /// `reject` (the default) turns away at once a request no worker can take, whatever the
    /// queue's capacity, and keeps nothing waiting.
    #[test]
    fn with_reject_a_request_no_worker_can_take_is_turned_away(
        capacity in 0usize..6,
        requests in 1u64..6,
    ) {
        prop_assert_eq!(RouterConfig::default().queue.when_empty, WhenEmpty::Reject);
        let mut r = Router::new(config("kv", capacity, WhenEmpty::Reject)).unwrap();
        for id in 0..requests {
            prop_assert_eq!(
                route(&mut r, Timestamp::ZERO, id),
                RouteOutcome::Rejected(RejectReason::NoEligibleWorker)
            );
        }
        let out = r
            .handle_worker_added(Timestamp::ZERO, WorkerSpec::new(key(1), WorkerRole::Aggregated, 1000))
            .unwrap();
        prop_assert!(out.is_empty());
        prop_assert_eq!(r.metrics().counters.rejected_no_worker, requests);
    }
}
