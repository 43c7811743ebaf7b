use super::*;
use crate::config::WorkerConfig;
use crate::worker::{StateName, WorkerEvent};

fn shared() -> (Arc<Shared>, WorkerId) {
    let config = ServeConfig::default();
    let router = Router::new(config.validate().unwrap()).unwrap();
    let shared = Shared::new(router, config, Metrics::new());
    let id = shared
        .add_worker(WorkerConfig::parse_flag("http://127.0.0.1:1").unwrap())
        .unwrap();
    (shared, id)
}

fn state(shared: &Shared) -> StateName {
    shared.worker_statuses()[0].state
}

fn check(passed: bool) -> WorkerEvent {
    if passed {
        WorkerEvent::CheckPassed
    } else {
        WorkerEvent::CheckFailed
    }
}

#[test]
fn health_checks_flip_a_worker_only_after_enough_in_a_row() {
    // Defaults: out after 3 failed checks in a row, back after 2 passing ones in a row.
    // (check passed, routable after it)
    let script: &[(bool, bool)] = &[
        (false, true),
        (false, true),
        (true, true), // the streak of failures is broken
        (false, true),
        (false, true),
        (false, false), // third in a row: out
        (true, false),
        (false, false), // the streak of passes is broken
        (true, false),
        (true, true), // second in a row: back
        (true, true),
    ];
    let (shared, id) = shared();
    for (step, &(passed, want)) in script.iter().enumerate() {
        shared.worker_event(id, check(passed));
        assert_eq!(shared.any_routable(), want, "after check {step} ({passed})");
        assert_eq!(
            shared.snapshot().workers.len(),
            usize::from(want),
            "in the router"
        );
    }
}

#[test]
fn an_unreachable_worker_leaves_at_once_and_needs_fresh_passes_to_return() {
    let (shared, id) = shared();
    shared.worker_event(id, WorkerEvent::CheckPassed);
    shared.worker_event(id, WorkerEvent::Unreachable);
    assert_eq!(state(&shared), StateName::Unhealthy);
    shared.worker_event(id, WorkerEvent::CheckPassed);
    assert_eq!(
        state(&shared),
        StateName::Unhealthy,
        "a pass before the failure does not count"
    );
    shared.worker_event(id, WorkerEvent::CheckPassed);
    assert_eq!(state(&shared), StateName::Ready);
}

#[tokio::test(start_paused = true)]
async fn a_draining_worker_keeps_its_requests_and_leaves_when_it_has_none() {
    let (shared, id) = shared();
    let (guard, target, _) = shared.route(&[1, 2, 3], None).await.unwrap();
    assert_eq!(target.decode.worker, id);
    assert!(shared.drain_worker(id));
    assert_eq!(state(&shared), StateName::Draining);
    assert_eq!(shared.worker_statuses()[0].active_requests, 1);
    assert_eq!(shared.route(&[4], None).await.unwrap_err(), RouteError::NoWorker);
    guard.finish();
    assert_eq!(state(&shared), StateName::Drained);
    assert!(shared.snapshot().workers.is_empty(), "out of the router");
    assert!(shared.remove_worker(id));
    assert!(shared.worker_statuses().is_empty());
    assert!(!shared.remove_worker(id));
    shared.check_invariants().unwrap();
}
