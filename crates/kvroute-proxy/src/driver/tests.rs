use super::*;
use crate::config::WorkerConfig;
use crate::worker::{StateName, WorkerEvent};

fn driver() -> (Arc<Driver>, WorkerId) {
    let config = ServeConfig::default();
    let router = Router::new(config.validate().unwrap()).unwrap();
    let driver = Driver::new(router, config, Metrics::new());
    let id = driver
        .add_worker(WorkerConfig::parse_flag("http://127.0.0.1:1").unwrap())
        .unwrap();
    (driver, id)
}

fn state(driver: &Driver) -> StateName {
    driver.worker_statuses()[0].state
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
    let (driver, id) = driver();
    for (step, &(passed, want)) in script.iter().enumerate() {
        driver.worker_event(id, check(passed));
        assert_eq!(driver.any_routable(), want, "after check {step} ({passed})");
        let taking = driver.snapshot().workers.iter().filter(|w| !w.draining).count();
        assert_eq!(taking, usize::from(want), "taking requests in the router");
    }
}

#[test]
fn an_unreachable_worker_leaves_at_once_and_needs_fresh_passes_to_return() {
    let (driver, id) = driver();
    driver.worker_event(id, WorkerEvent::CheckPassed);
    driver.worker_event(id, WorkerEvent::Unreachable);
    assert_eq!(state(&driver), StateName::Unhealthy);
    driver.worker_event(id, WorkerEvent::CheckPassed);
    assert_eq!(
        state(&driver),
        StateName::Unhealthy,
        "a pass before the failure does not count"
    );
    driver.worker_event(id, WorkerEvent::CheckPassed);
    assert_eq!(state(&driver), StateName::Ready);
}

#[tokio::test(start_paused = true)]
async fn a_draining_worker_keeps_its_requests_and_leaves_when_it_has_none() {
    let (driver, id) = driver();
    let (guard, target, _) = driver.route(&[1, 2, 3], None, None).await.unwrap();
    assert_eq!(target.decode.worker, id);
    assert!(driver.drain_worker(id, Announce::ToPeers));
    assert_eq!(state(&driver), StateName::Draining);
    assert_eq!(driver.worker_statuses()[0].active_requests, 1);
    assert_eq!(
        driver.route(&[4], None, None).await.unwrap_err(),
        RouteError::NoWorker
    );
    guard.finish(None, false);
    assert_eq!(state(&driver), StateName::Drained);
    assert!(driver.snapshot().workers.is_empty(), "out of the router");
    assert!(driver.remove_worker(id, Announce::ToPeers));
    assert!(driver.worker_statuses().is_empty());
    assert!(!driver.remove_worker(id, Announce::ToPeers));
    driver.check_invariants().unwrap();
}

/// A worker suspended for failing its health checks keeps the bookings of its requests in
/// flight until they end, and comes back with those still running booked on it (not idle).
/// The health checks are driven as the prober reports them: one event per check.
#[tokio::test(start_paused = true)]
async fn a_suspended_worker_keeps_its_bookings_until_its_requests_end() {
    let (driver, id) = driver();
    let other = driver
        .add_worker(WorkerConfig::parse_flag("http://127.0.0.1:2").unwrap())
        .unwrap();
    // Two requests on `id` (the other worker drained meanwhile, so that they go there).
    assert!(driver.drain_worker(other, Announce::No));
    let (first, target, _) = driver.route(&[1, 2, 3], None, None).await.unwrap();
    assert_eq!(target.decode.worker, id);
    let (second, _, _) = driver.route(&[4, 5, 6], None, None).await.unwrap();
    let booked = |driver: &Driver| {
        let snapshot = driver.snapshot();
        let on = |w: WorkerId| {
            snapshot
                .workers
                .iter()
                .filter(|m| m.spec.key.worker == w)
                .map(|m| m.load.requests)
                .sum::<u32>()
        };
        (on(id), snapshot.active_now)
    };
    assert_eq!(booked(&driver), (2, 2));
    for _ in 0..3 {
        driver.apply_worker_event(id, WorkerEvent::CheckFailed);
    }
    assert_eq!(state(&driver), StateName::Unhealthy);
    // Out of routing, but its requests are still booked there, and listed.
    assert_eq!(booked(&driver), (2, 2));
    assert_eq!(driver.worker_statuses()[0].active_requests, 2);
    assert_eq!(
        driver.route(&[7], None, None).await.unwrap_err(),
        RouteError::NoWorker
    );
    // One ends while it is out: its booking ends then.
    first.finish(None, false);
    assert_eq!(booked(&driver), (1, 1));
    // Back after two passing checks, with the other request still booked on it.
    for _ in 0..2 {
        driver.apply_worker_event(id, WorkerEvent::CheckPassed);
    }
    assert_eq!(state(&driver), StateName::Ready);
    assert_eq!(booked(&driver), (1, 1));
    drop(second);
    assert_eq!(booked(&driver), (0, 0));
    assert_eq!(driver.snapshot().counters.dropped_with_worker, 0);
    driver.check_invariants().unwrap();
}

/// With `when-empty = queue`, a request no worker can take waits, counted by
/// `queued_requests`, and is routed once a worker is routable: added, or back from failing its
/// health checks. With none, the queue timeout answers.
#[tokio::test(start_paused = true)]
async fn with_when_empty_queue_a_request_waits_for_a_routable_worker() {
    let mut config = ServeConfig::default();
    config.routing.when_empty = "queue".into();
    config.routing.queue_timeout_ms = 60_000;
    let router = Router::new(config.validate().unwrap()).unwrap();
    let driver = Driver::new(router, config, Metrics::new());
    // No worker ever comes: the queue timeout, and nothing left waiting.
    assert_eq!(
        driver.route(&[1], None, None).await.unwrap_err(),
        RouteError::QueueTimeout
    );
    assert_eq!(driver.queued_requests(), QueuedRequests::default());
    // A worker is added while a request waits: it goes there.
    let waiting = tokio::spawn({
        let driver = Arc::clone(&driver);
        async move {
            driver
                .route(&[1, 2, 3], None, None)
                .await
                .map(|(_, t, _)| t.decode.worker)
        }
    });
    let queued = QueuedRequests {
        total: 1,
        without_worker: 1,
    };
    assert!(
        driver
            .wait_until(Duration::from_secs(60), |d| d.queued_requests() == queued)
            .await
    );
    assert_eq!(driver.snapshot().queued_without_worker_now, 1);
    let id = driver
        .add_worker(WorkerConfig::parse_flag("http://127.0.0.1:1").unwrap())
        .unwrap();
    assert_eq!(waiting.await.unwrap(), Ok(id));
    assert_eq!(driver.queued_requests(), QueuedRequests::default());
    // Out of routing for failed checks: requests wait again, and go to it when it is back.
    for _ in 0..3 {
        driver.apply_worker_event(id, WorkerEvent::CheckFailed);
    }
    assert_eq!(state(&driver), StateName::Unhealthy);
    let waiting = tokio::spawn({
        let driver = Arc::clone(&driver);
        async move {
            driver
                .route(&[4, 5, 6], None, None)
                .await
                .map(|(_, t, _)| t.decode.worker)
        }
    });
    assert!(
        driver
            .wait_until(Duration::from_secs(60), |d| d.queued_requests() == queued)
            .await
    );
    for _ in 0..2 {
        driver.apply_worker_event(id, WorkerEvent::CheckPassed);
    }
    assert_eq!(waiting.await.unwrap(), Ok(id));
    assert_eq!(driver.snapshot().counters.queued_without_worker, 3);
    driver.check_invariants().unwrap();
}
