//! Step-by-step snapshots of small scenarios: one line per step with its timing, batch, results
//! and KV events, so a change in behaviour shows up as a readable diff. `UPDATE_EXPECT=1`
//! refreshes them. The harness checks the invariants and the router's agreement at every step,
//! so a snapshot never freezes a broken state.

mod common;

use std::collections::BTreeMap;
use std::fmt::Write;

use common::{Harness, request, with};
use expect_test::{Expect, expect};
use kvroute_core::events::KvEvent;
use kvroute_core::ids::{ExternalBlockHash, RequestId};
use kvroute_engine::{EngineConfig, EngineRequest, StepOutput};

/// Short names for external hashes, in order of first appearance.
#[derive(Default)]
struct Names(BTreeMap<ExternalBlockHash, usize>);

impl Names {
    fn of(&mut self, h: ExternalBlockHash) -> String {
        let next = self.0.len();
        format!("b{}", self.0.entry(h).or_insert(next))
    }

    fn list(&mut self, hashes: &[ExternalBlockHash]) -> String {
        hashes.iter().map(|&h| self.of(h)).collect::<Vec<_>>().join(",")
    }
}

fn ids(ids: impl IntoIterator<Item = RequestId>) -> String {
    let v: Vec<String> = ids.into_iter().map(|r| r.0.to_string()).collect();
    if v.is_empty() { "-".to_owned() } else { v.join(",") }
}

/// `ns` nanoseconds in milliseconds, as the snapshots print times.
fn millis(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// One line per step.
fn render(log: &[StepOutput]) -> String {
    let mut names = Names::default();
    let mut text = String::new();
    for (i, out) in log.iter().enumerate() {
        let m = &out.metrics;
        let p = &m.pass;
        let events: Vec<String> = out
            .events
            .iter()
            .map(|e| match e {
                KvEvent::Stored(s) => {
                    let parent = s.parent_block_hash.map_or("-".to_owned(), |h| names.of(h));
                    format!("stored {parent}>{}", names.list(&s.block_hashes()))
                }
                KvEvent::Removed(r) => format!("removed {}", names.list(&r.block_hashes)),
                KvEvent::AllCleared => "cleared".to_owned(),
                KvEvent::TierStored(t) => format!("offloaded {}", names.list(&t.block_hashes)),
                KvEvent::TierRemoved(t) => format!("removed from CPU {}", names.list(&t.block_hashes)),
            })
            .collect();
        writeln!(
            text,
            "#{i:<2} {:>8.3}ms +{:>6.3} | prefill {}/{} decode {} | blocks {}/{} run {} wait {} | emit {} first {} done {} preempt {} | {}",
            millis(out.start.as_nanos()),
            millis(u64::try_from(m.duration.as_nanos()).expect("a step shorter than 584 years")),
            p.prefill_seqs,
            p.prefill_tokens,
            p.decode_seqs,
            m.active_blocks,
            m.total_blocks,
            m.running,
            m.waiting,
            ids(out.emitted.iter().map(|e| e.request)),
            ids(out.first_token.iter().copied()),
            ids(out.finished.iter().map(|f| f.request)),
            ids(out.preempted.iter().copied()),
            if events.is_empty() { "-".to_owned() } else { events.join("; ") },
        )
        .expect("writing to a string");
    }
    text
}

fn check(config: EngineConfig, requests: Vec<EngineRequest>, expect: Expect) {
    let mut h = Harness::new(config);
    for r in requests {
        h.add(r).expect("accepted");
    }
    h.run();
    expect.assert_eq(&render(&h.log));
}

#[test]
fn preemption_and_recompute_with_six_blocks() {
    check(
        with(|c| c.num_blocks = 6),
        vec![request(1, 0..8, 6), request(2, 100..108, 6)],
        expect![[r#"
            #0     0.000ms +16.744 | prefill 2/16 decode 0 | blocks 4/6 run 2 wait 0 | emit 1,2 first 1,2 done - preempt - | stored ->b0,b1; stored ->b2,b3
            #1    16.744ms +34.010 | prefill 0/0 decode 2 | blocks 6/6 run 2 wait 0 | emit 1,2 first - done - preempt - | -
            #2    50.754ms +34.010 | prefill 0/0 decode 2 | blocks 6/6 run 2 wait 0 | emit 1,2 first - done - preempt - | -
            #3    84.764ms +34.010 | prefill 0/0 decode 2 | blocks 6/6 run 2 wait 0 | emit 1,2 first - done - preempt - | -
            #4   118.774ms +34.010 | prefill 0/0 decode 2 | blocks 6/6 run 2 wait 0 | emit 1,2 first - done - preempt - | stored b1>b4; stored b3>b5
            #5   152.784ms +30.307 | prefill 0/0 decode 1 | blocks 0/6 run 0 wait 1 | emit 1 first - done 1 preempt 2 | removed b5
            #6   183.091ms +16.577 | prefill 1/5 decode 0 | blocks 0/6 run 0 wait 0 | emit 2 first - done 2 preempt - | removed b4; stored b3>b5
        "#]],
    );
}

#[test]
fn chunked_prefill_of_a_shared_prefix() {
    check(
        with(|c| c.max_num_batched_tokens = 6),
        vec![request(1, 0..10, 2), request(2, (0..8).chain(50..52), 2)],
        expect![[r#"
            #0     0.000ms +16.593 | prefill 1/6 decode 0 | blocks 2/64 run 1 wait 1 | emit - first - done - preempt - | stored ->b0
            #1    16.593ms +16.593 | prefill 2/6 decode 0 | blocks 4/64 run 2 wait 0 | emit 1,2 first 1,2 done - preempt - | stored b0>b1
            #2    33.185ms + 9.015 | prefill 0/0 decode 2 | blocks 0/64 run 0 wait 0 | emit 1,2 first - done 1,2 preempt - | -
        "#]],
    );
}
