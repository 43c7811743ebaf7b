//! Importing a request whose prompt another engine prefilled (the decode side of prefill/decode
//! disaggregation): blocks reserved at transfer start, the prompt's KV present at completion,
//! cache hits honoured, and the engine's invariants and the router's agreement kept throughout.

mod common;

use common::{Harness, config, request, with};
use kvroute_core::events::KvEvent;
use kvroute_core::ids::RequestId;
use kvroute_engine::{Engine, RequestError};

/// Applies events returned outside a step to the harness's index and checks everything.
fn apply(h: &mut Harness, events: &[KvEvent]) {
    for event in events {
        h.index
            .apply_event(h.worker, event.as_index_event())
            .unwrap_or_else(|e| panic!("{event:?}: {e}"));
    }
    h.engine.check_invariants().expect("engine invariants");
    let engine: std::collections::BTreeSet<_> = h.engine.cached_blocks().collect();
    assert_eq!(
        common::held(&h.index, h.worker),
        engine,
        "router and engine disagree"
    );
}

fn stored_blocks(events: &[KvEvent]) -> usize {
    events
        .iter()
        .map(|e| match e {
            KvEvent::Stored(s) => s.blocks.len(),
            _ => 0,
        })
        .sum()
}

#[test]
fn an_import_holds_its_prompt_blocks_then_decodes_without_recomputing_the_prompt() {
    let mut h = Harness::new(config());
    // 10 tokens in blocks of 4: two full blocks and a partial one.
    let import = h
        .engine
        .import_request(h.now, request(1, 0..10, 4))
        .expect("fits");
    assert_eq!((import.hit_blocks, import.transfer_blocks), (0, 3));
    apply(&mut h, &import.events);
    assert_eq!(h.engine.num_importing(), 1);
    assert_eq!(
        h.engine.next_wakeup(),
        None,
        "nothing to compute while the KV is in transfer"
    );
    assert_eq!(h.engine.step(h.now), None);
    assert_eq!(
        h.engine.cached_blocks().count(),
        0,
        "blocks in transfer are not cached yet"
    );

    let events = h.engine.complete_import(h.now, RequestId(1)).expect("importing");
    assert_eq!(
        stored_blocks(&events),
        2,
        "the full prompt blocks are cached when the KV lands"
    );
    apply(&mut h, &events);
    assert_eq!(h.engine.num_importing(), 0);

    let outs = h.run();
    // The first token came from the prefill engine: 3 more here, one per pass, each a decode.
    assert_eq!(outs.len(), 3);
    for out in &outs {
        assert!(out.first_token.is_empty());
        assert_eq!(out.metrics.pass.prefill_seqs, 0, "{:?}", out.metrics.pass);
        assert_eq!(out.emitted.len(), 1);
    }
    let finished = &outs.last().unwrap().finished;
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].output_tokens, 4);
}

#[test]
fn an_imported_request_ends_with_the_cache_an_aggregated_run_leaves() {
    // The same request, prefilled locally on one engine and imported into another with the same
    // hash seed: the output tokens are the same, so the cached blocks are too.
    let mut local = Harness::new(config());
    local.add(request(7, 0..13, 9)).unwrap();
    local.run();
    let mut imported = Harness::new(config());
    let import = imported
        .engine
        .import_request(imported.now, request(7, 0..13, 9))
        .unwrap();
    apply(&mut imported, &import.events);
    let events = imported
        .engine
        .complete_import(imported.now, RequestId(7))
        .unwrap();
    apply(&mut imported, &events);
    let outs = imported.run();
    let tokens: u32 = outs.iter().flat_map(|o| &o.emitted).map(|e| e.tokens).sum();
    assert_eq!(tokens, 8);
    let a: Vec<_> = local.engine.cached_blocks().collect();
    let b: Vec<_> = imported.engine.cached_blocks().collect();
    assert_eq!(a, b);
}

#[test]
fn cached_prompt_blocks_are_hit_and_not_transferred() {
    let mut h = Harness::new(config());
    h.add(request(1, 0..12, 1)).unwrap();
    h.run();
    assert_eq!(h.engine.cached_blocks().count(), 3);
    // 14 tokens: blocks 0..2 cached, block 3 partial.
    let import = h.engine.import_request(h.now, request(2, 0..14, 3)).unwrap();
    assert_eq!((import.hit_blocks, import.transfer_blocks), (3, 1));
    apply(&mut h, &import.events);
    let events = h.engine.complete_import(h.now, RequestId(2)).unwrap();
    assert_eq!(stored_blocks(&events), 0, "no full block is new");
    apply(&mut h, &events);
    h.run();
    // A fully cached prompt of whole blocks needs no transfer at all (no `len - 1` cap).
    let import = h.engine.import_request(h.now, request(3, 0..12, 2)).unwrap();
    assert_eq!((import.hit_blocks, import.transfer_blocks), (3, 0));
    apply(&mut h, &import.events);
    let events = h.engine.complete_import(h.now, RequestId(3)).unwrap();
    apply(&mut h, &events);
    h.run();
    assert_eq!(h.engine.num_running() + h.engine.num_waiting(), 0);
}

#[test]
fn two_imports_of_one_prompt_keep_one_cached_copy() {
    let mut h = Harness::new(config());
    let a = h.engine.import_request(h.now, request(1, 0..8, 2)).unwrap();
    let b = h.engine.import_request(h.now, request(2, 0..8, 2)).unwrap();
    assert_eq!(
        (a.transfer_blocks, b.transfer_blocks),
        (2, 2),
        "neither is cached yet"
    );
    apply(&mut h, &a.events);
    apply(&mut h, &b.events);
    let events = h.engine.complete_import(h.now, RequestId(1)).unwrap();
    assert_eq!(stored_blocks(&events), 2);
    apply(&mut h, &events);
    let events = h.engine.complete_import(h.now, RequestId(2)).unwrap();
    assert_eq!(
        stored_blocks(&events),
        0,
        "the second copy is swapped for the cached one"
    );
    apply(&mut h, &events);
    h.run();
    assert_eq!(h.engine.cached_blocks().count(), 2);
}

#[test]
fn imports_are_refused_without_changing_the_engine() {
    // 8 blocks of 4 tokens.
    let mut engine = Engine::new(with(|c| c.num_blocks = 8)).unwrap();
    let now = kvroute_core::time::Timestamp::ZERO;
    assert_eq!(
        engine.import_request(now, request(1, 0..10, 1)),
        Err(RequestError::NothingToDecode(RequestId(1)))
    );
    engine.import_request(now, request(2, 0..20, 2)).unwrap();
    assert_eq!(
        engine.import_request(now, request(2, 0..4, 2)),
        Err(RequestError::DuplicateId(RequestId(2)))
    );
    assert_eq!(
        engine.import_request(now, request(3, 100..116, 2)),
        Err(RequestError::NoBlocksForImport {
            id: RequestId(3),
            blocks_needed: 4,
            blocks_free: 3
        })
    );
    assert_eq!(engine.num_importing(), 1);
    assert_eq!(
        engine.complete_import(now, RequestId(3)),
        Err(RequestError::NotImporting(RequestId(3)))
    );
    engine.check_invariants().unwrap();
    // A prefix cache reset is refused while a transfer holds blocks.
    assert!(engine.reset_prefix_cache().is_err());
}

#[test]
fn landed_imports_wait_for_a_running_slot_and_waiting_requests_that_fit_still_run() {
    let mut h = Harness::new(with(|c| {
        c.max_num_seqs = 2;
        c.num_blocks = 16;
    }));
    h.add(request(1, 100..108, 6)).unwrap();
    h.add(request(2, 200..208, 6)).unwrap();
    h.step();
    // Both slots are taken; a landed import waits for one.
    let import = h.engine.import_request(h.now, request(3, 0..8, 3)).unwrap();
    apply(&mut h, &import.events);
    let events = h.engine.complete_import(h.now, RequestId(3)).unwrap();
    apply(&mut h, &events);
    assert_eq!(h.engine.num_running(), 2);
    assert_eq!(h.engine.num_waiting(), 1);
    // A waiting request that fits is admitted while another transfer holds blocks.
    let import = h.engine.import_request(h.now, request(4, 300..312, 2)).unwrap();
    apply(&mut h, &import.events);
    h.add(request(5, 400..404, 1)).unwrap();
    let outs = h.run();
    let finished: Vec<u64> = outs
        .iter()
        .flat_map(|o| &o.finished)
        .map(|f| f.request.0)
        .collect();
    assert_eq!(finished.len(), 4, "{finished:?}");
    assert!(!finished.contains(&4), "request 4 is still in transfer");
    assert_eq!(h.engine.num_importing(), 1);
    assert_eq!(h.engine.next_wakeup(), None);
    let events = h.engine.complete_import(h.now, RequestId(4)).unwrap();
    apply(&mut h, &events);
    let outs = h.run();
    assert_eq!(outs.last().unwrap().finished[0].request, RequestId(4));
}
