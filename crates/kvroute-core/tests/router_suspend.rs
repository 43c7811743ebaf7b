//! A worker out of routing for failing health checks keeps its cache view (its events still
//! apply, it comes back with the view, and only its removal forgets it) and the requests booked
//! on it, which end when they end.

use kvroute_core::ids::{DpRank, ExternalBlockHash, LocalBlockHash, RequestId, WorkerId, WorkerKey};
use kvroute_core::index::StoredBlock;
use kvroute_core::router::{
    IndexEvent, Prompt, RouteOutcome, RouteRequest, Router, RouterConfig, RouterError, WorkerRole, WorkerSpec,
};
use kvroute_core::time::Timestamp;

fn key(w: u64) -> WorkerKey {
    WorkerKey::new(WorkerId(w), DpRank(0))
}

fn blocks(range: std::ops::Range<u64>) -> Vec<StoredBlock> {
    range
        .map(|i| StoredBlock {
            local: LocalBlockHash(1000 + i),
            external: ExternalBlockHash(i),
        })
        .collect()
}

#[test]
fn a_suspended_worker_keeps_its_view_and_its_events_apply() {
    let mut r = Router::new(RouterConfig::default()).unwrap();
    let t = Timestamp(0);
    for w in 0..2 {
        r.handle_worker_added(t, WorkerSpec::new(key(w), WorkerRole::Aggregated, 1024))
            .unwrap();
    }
    let stored = blocks(0..3);
    r.handle_kv_event(
        t,
        key(1),
        IndexEvent::Stored {
            parent: None,
            blocks: &stored,
        },
    )
    .unwrap();
    r.handle_worker_suspended(t, key(1)).unwrap();
    assert!(
        r.metrics()
            .workers
            .iter()
            .filter(|w| w.spec.key == key(1))
            .all(|w| w.draining),
        "out of routing"
    );
    assert_eq!(r.index().block_count(key(1)), 3, "view kept");
    // Its events still apply while it is out.
    let more = blocks(3..5);
    r.handle_kv_event(
        t,
        key(1),
        IndexEvent::Stored {
            parent: Some(ExternalBlockHash(2)),
            blocks: &more,
        },
    )
    .unwrap();
    // A request for its prefix cannot go to it meanwhile.
    let locals: Vec<LocalBlockHash> = (0..5).map(|i| LocalBlockHash(1000 + i)).collect();
    let prompt = Prompt::Blocks {
        locals: &locals,
        prompt_tokens: 5 * 16,
    };
    match r
        .handle_request(t, &RouteRequest::new(RequestId(1), prompt))
        .unwrap()
    {
        RouteOutcome::Routed(d) => assert_eq!(d.worker, key(0)),
        other => panic!("{other:?}"),
    }
    r.handle_finished(t, RequestId(1)).unwrap();
    // Back with the whole view: the prefix goes to it.
    r.handle_worker_added(t, WorkerSpec::new(key(1), WorkerRole::Aggregated, 1024))
        .unwrap();
    assert_eq!(r.index().block_count(key(1)), 5);
    match r
        .handle_request(t, &RouteRequest::new(RequestId(2), prompt))
        .unwrap()
    {
        RouteOutcome::Routed(d) => assert_eq!((d.worker, d.overlap_blocks), (key(1), 5)),
        other => panic!("{other:?}"),
    }
    r.handle_finished(t, RequestId(2)).unwrap();
    // Removal, suspended or not, forgets the view; a second removal is refused.
    r.handle_worker_suspended(t, key(1)).unwrap();
    r.handle_worker_removed(t, key(1)).unwrap();
    assert_eq!(r.index().block_count(key(1)), 0);
    assert_eq!(
        r.handle_worker_removed(t, key(1)),
        Err(RouterError::UnknownWorker(key(1)))
    );
    assert!(r.handle_worker_suspended(t, key(1)).is_err());
    r.check_invariants().unwrap();
    r.index().check_invariants().unwrap();
}

fn routed_to(r: &mut Router, t: Timestamp, id: u64) -> WorkerKey {
    let locals = [LocalBlockHash(7000 + id)];
    let prompt = Prompt::Blocks {
        locals: &locals,
        prompt_tokens: 16,
    };
    match r
        .handle_request(t, &RouteRequest::new(RequestId(id), prompt))
        .expect("a valid request")
    {
        RouteOutcome::Routed(d) => d.worker,
        other => panic!("{other:?}"),
    }
}

/// The load booked on worker `w` (`None`: not in the fleet).
fn booked(r: &Router, w: u64) -> Option<u32> {
    r.metrics()
        .workers
        .iter()
        .find(|m| m.spec.key == key(w))
        .map(|m| m.load.requests)
}

#[test]
fn a_suspended_worker_keeps_its_bookings_until_their_requests_end() {
    let mut r = Router::new(RouterConfig::default()).unwrap();
    let t = Timestamp(0);
    let spec = |w| WorkerSpec::new(key(w), WorkerRole::Aggregated, 1024);
    r.handle_worker_added(t, spec(0)).unwrap();
    // Two requests on worker 0 (the only one), then worker 1 joins.
    assert_eq!(routed_to(&mut r, t, 1), key(0));
    assert_eq!(routed_to(&mut r, t, 2), key(0));
    r.handle_worker_added(t, spec(1)).unwrap();
    assert!(r.handle_worker_suspended(t, key(0)).unwrap().is_empty());
    // Still booked, and said to take no new requests.
    assert_eq!(booked(&r, 0), Some(2));
    assert_eq!(r.metrics().active_now, 2);
    assert!(
        r.metrics()
            .workers
            .iter()
            .any(|m| m.spec.key == key(0) && m.draining)
    );
    assert_eq!(r.metrics().counters.dropped_with_worker, 0);
    // New requests go elsewhere meanwhile.
    for id in 3..6 {
        assert_eq!(routed_to(&mut r, t, id), key(1));
        r.handle_finished(t, RequestId(id)).unwrap();
    }
    // Suspending again changes nothing.
    r.handle_worker_suspended(t, key(0)).unwrap();
    assert_eq!(booked(&r, 0), Some(2));
    // A request ending while it is out frees its booking then, not before.
    r.handle_finished(t, RequestId(1)).unwrap();
    assert_eq!(booked(&r, 0), Some(1));
    r.check_invariants().unwrap();
    // Back: with the request still running, it is booked as loaded, not idle.
    r.handle_worker_added(t, spec(0)).unwrap();
    assert_eq!(booked(&r, 0), Some(1));
    assert!(r.metrics().workers.iter().all(|m| !m.draining));
    r.handle_finished(t, RequestId(2)).unwrap();
    assert_eq!(booked(&r, 0), Some(0));
    assert_eq!(r.metrics().counters.dropped_with_worker, 0);
    // Removal while suspended drops what is booked, as removal does (worker 1 drained, so
    // that the request goes to worker 0).
    r.handle_worker_draining(t, key(1)).unwrap();
    assert_eq!(routed_to(&mut r, t, 6), key(0));
    r.handle_worker_suspended(t, key(0)).unwrap();
    r.handle_worker_removed(t, key(0)).unwrap();
    assert_eq!(booked(&r, 0), None);
    assert_eq!(r.metrics().counters.dropped_with_worker, 1);
    assert_eq!(r.metrics().active_now, 0);
    // A drained worker is not brought back by a re-add.
    assert_eq!(
        r.handle_worker_added(t, spec(1)),
        Err(RouterError::DuplicateWorker(key(1)))
    );
    r.check_invariants().unwrap();
}
