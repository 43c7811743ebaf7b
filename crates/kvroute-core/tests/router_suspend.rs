//! A worker out of the fleet for failing health checks keeps its cache view: its events still
//! apply, it comes back with the view, and only its removal forgets it.

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
        r.metrics().workers.iter().all(|w| w.spec.key != key(1)),
        "out of the fleet"
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
