//! Aborting a request (its client left): it leaves the engine wherever it is, its blocks are
//! freed, what it cached stays cached, and the engine's invariants hold throughout.

mod common;

use common::{Harness, config, request, with};
use kvroute_core::ids::RequestId;
use kvroute_core::time::Timestamp;
use kvroute_engine::{EngineHost, ImportAdmission, KvTransfer};

#[test]
fn an_aborted_request_leaves_wherever_it_is_and_frees_its_blocks() {
    let mut h = Harness::new(config());
    // A decodes for long; B waits behind it (one sequence at a time).
    let mut h1 = Harness::new(with(|c| c.max_num_seqs = 1));
    for h in [&mut h, &mut h1] {
        h.add(request(1, 0..16, 200)).unwrap();
        h.add(request(2, 100..116, 5)).unwrap();
        h.step().unwrap();
        h.step().unwrap();
    }
    // Waiting (B behind A): it leaves the queue.
    assert_eq!((h1.engine.num_running(), h1.engine.num_waiting()), (1, 1));
    assert!(h1.engine.abort_request(RequestId(2)));
    assert_eq!(h1.engine.num_waiting(), 0);
    h1.engine.check_invariants().unwrap();
    // Running, mid-decode: both leave, every block is freed, and the engine goes idle.
    assert_eq!(h.engine.num_running(), 2);
    let cached_before: Vec<_> = h.engine.cached_blocks().collect();
    assert!(h.engine.abort_request(RequestId(1)));
    assert!(h.engine.abort_request(RequestId(2)));
    h.engine.check_invariants().unwrap();
    assert_eq!(h.engine.kv_blocks().0, 0, "no block in use");
    assert_eq!(h.engine.next_wakeup(), None, "nothing left to run");
    assert!(h.run().is_empty());
    // What they cached stays cached: the router's view needs no event, and a repeat hits.
    assert_eq!(h.engine.cached_blocks().collect::<Vec<_>>(), cached_before);
    h.add(request(3, 0..16, 2)).unwrap();
    let out = h.step().unwrap();
    assert_eq!(
        out.metrics.prefix_cache_hit_tokens, 12,
        "3 of 4 blocks (the last is computed)"
    );
    h.run();
    // Not live any more: finished, aborted, or never there.
    for id in [1, 3, 99] {
        assert!(!h.engine.abort_request(RequestId(id)), "{id}");
    }
}

#[test]
fn an_aborted_import_waits_no_more_and_never_lands() {
    // 10 blocks: the first import (8 blocks) starts, the second must wait for it.
    let mut host = host_of_ten_blocks();
    let now = Timestamp::ZERO;
    let first = host.import(now, request(1, 0..32, 4)).unwrap();
    assert!(matches!(first, ImportAdmission::Started(_)), "{first:?}");
    assert_eq!(
        host.import(now, request(2, 100..132, 4)).unwrap(),
        ImportAdmission::Waiting
    );
    // The waiting one leaves the queue; the one on the link leaves the engine and its transfer.
    assert!(host.abort(RequestId(2)));
    assert_eq!(host.num_waiting_imports(), 0);
    assert!(host.next_landing().is_some());
    assert!(host.abort(RequestId(1)));
    assert_eq!(host.next_landing(), None);
    assert!(host.is_idle());
    host.engine().check_invariants().unwrap();
    assert_eq!(host.engine().kv_blocks().0, 0);
    assert!(!host.abort(RequestId(1)));
}

#[test]
fn a_landing_whose_request_left_the_engine_fails_once_and_is_gone() {
    // The request leaves the engine behind the host's back (`engine_mut`): its transfer still
    // lands, fails, and is consumed, so a driver looping on `next_landing` cannot spin on it.
    let mut host = host_of_ten_blocks();
    let now = Timestamp::ZERO;
    let started = host.import(now, request(1, 0..32, 4)).unwrap();
    assert!(matches!(started, ImportAdmission::Started(_)), "{started:?}");
    assert!(host.engine_mut().abort_request(RequestId(1)));
    let (lands, id) = host.next_landing().expect("the transfer is on the link");
    assert_eq!(id, RequestId(1));
    assert!(host.land(lands, id).is_err());
    assert_eq!(host.next_landing(), None);
    assert!(host.is_idle());
    host.engine().check_invariants().unwrap();
}

/// A host whose engine has 10 blocks, on the default link.
fn host_of_ten_blocks() -> EngineHost {
    EngineHost::new(
        kvroute_engine::Engine::new(with(|c| c.num_blocks = 10)).expect("a valid config"),
        KvTransfer::default(),
    )
}
