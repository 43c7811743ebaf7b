//! Skipping pure-decode passes: an engine that skips every run of passes its horizon promises
//! pure ends every real pass exactly as one that steps through them all, with its invariants
//! holding after every skip and pass, a request aborted between skipped passes and the next
//! real one included.

mod common;

use common::{request, with};
use kvroute_core::ids::RequestId;
use kvroute_core::time::Timestamp;
use kvroute_engine::Engine;

/// Runs two engines on the same requests, one stepping every pass, the other skipping what its
/// horizon promises; with `abort`, aborts the middle running request in both right after the
/// first run of skipped passes with two or more running. Returns the passes
/// skipped.
fn skip_against_step(abort: bool) -> u64 {
    // Blocks of 16 tokens: several requests decode between block boundaries.
    let config = with(|c| c.block_size = 16);
    let mut stepped = Engine::new(config.clone()).expect("valid config");
    let mut skipping = Engine::new(config).expect("valid config");
    for engine in [&mut stepped, &mut skipping] {
        for i in 0..6u32 {
            let prompt = i * 100..i * 100 + 5 + 3 * i;
            engine
                .add_request(Timestamp::ZERO, request(u64::from(i), prompt, 20 + 7 * i))
                .expect("the request fits");
        }
    }
    let (mut skipped, mut aborted, mut ends) = (0, false, Vec::new());
    while let Some(at) = skipping.next_wakeup() {
        let k = skipping.decode_horizon();
        if k == 0 {
            let out = skipping.step(at).expect("an engine with work steps");
            skipping.check_invariants().expect("engine invariants");
            assert_eq!(stepped.next_wakeup(), Some(at), "both engines wake together");
            let expected = stepped.step(at).expect("the stepped engine keeps up");
            assert_eq!(out, expected, "a real pass after skipped ones differs");
            continue;
        }
        ends.clear();
        skipping.decode_pass_ends(at, k, &mut ends);
        let last_start = if k >= 2 { ends[ends.len() - 2] } else { at };
        skipping.skip_decode_passes(k, last_start, ends[ends.len() - 1]);
        skipping.check_invariants().expect("engine invariants");
        skipped += u64::from(k);
        let running = skipping.running_requests().to_vec();
        for &end in &ends {
            let next = stepped.next_wakeup().expect("the stepped engine has work");
            let out = stepped.step(next).expect("the stepped engine keeps up");
            assert_eq!(out.end, end, "a skipped pass ends when the stepped one does");
            let emitted: Vec<RequestId> = out.emitted.iter().map(|e| e.request).collect();
            assert_eq!(emitted, running, "a skipped pass decodes every running request");
            assert!(out.events.is_empty() && out.finished.is_empty() && out.first_token.is_empty());
        }
        if abort && !aborted && running.len() >= 2 {
            let id = running[running.len() / 2];
            assert!(skipping.abort_request(id) && stepped.abort_request(id));
            skipping.check_invariants().expect("engine invariants");
            aborted = true;
        }
    }
    assert_eq!(stepped.next_wakeup(), None, "both engines finish together");
    assert_eq!(
        skipping.cached_blocks().collect::<Vec<_>>(),
        stepped.cached_blocks().collect::<Vec<_>>()
    );
    assert_eq!(aborted, abort, "the abort happened");
    skipped
}

#[test]
fn skipping_pure_decode_passes_matches_stepping_them() {
    assert!(skip_against_step(false) > 0, "some passes were skipped");
}

#[test]
fn a_request_aborted_after_skipped_passes_leaves_the_others_exact() {
    assert!(skip_against_step(true) > 0);
}
