//! Property: whatever batches of a peer's changes are lost or repeated on the way, a replica
//! running the protocol ends with exactly the peer's bookings: repeats are dropped, and a loss
//! (seen as a gap in the batch numbers, or in the heartbeat that follows) makes it ask for the
//! peer's snapshot, which replaces what it held.
//!
//! Batching, against a plain model: a change goes out no later than its window (urgent or lazy)
//! and never before the earliest deadline of those waiting, in order, in batches of at most the
//! maximum; heartbeats go out only after an interval with no batch, and a connected replica is
//! never silent for longer than the interval.

use std::collections::BTreeSet;
use std::sync::Arc;

use kvroute_core::ids::{DpRank, RequestId, SequenceHash, WorkerId, WorkerKey};
use std::time::Duration;

use kvroute_core::router::replica::{
    Action, BatchConfig, BatchSeq, Batcher, Message, ProtocolConfig, ReplicaProtocol, SnapshotPart, To,
    Urgency,
};
use kvroute_core::router::{
    Booking, LoadChange, PrefillLoadHint, Router, RouterConfig, RouterId, SyncEvent, TenantId, WorkerRole,
    WorkerSpec,
};
use kvroute_core::time::Timestamp;
use proptest::prelude::*;

const PEER: RouterId = RouterId(2);

fn event(request: u64, change: LoadChange) -> SyncEvent {
    SyncEvent {
        router: PEER,
        request: RequestId(request),
        change,
    }
}

fn added(request: u64) -> SyncEvent {
    event(
        request,
        LoadChange::Added(Booking {
            worker: WorkerKey::new(WorkerId(1), DpRank(0)),
            overlap_blocks: 0,
            prefill_worker: None,
            prompt_tokens: 16,
            chain: (1..=4).map(SequenceHash).collect::<Arc<[_]>>(),
            hint: PrefillLoadHint {
                tokens: 16,
                expected_duration: None,
            },
            expected_output_tokens: None,
            session: None,
            tenant: TenantId::OTHER,
        }),
    )
}

/// Carries out `actions` on `router`; whether a snapshot of the peer was asked for.
fn carry_out(router: &mut Router, now: Timestamp, actions: Vec<Action<SyncEvent>>) -> bool {
    let mut asked = false;
    for action in actions {
        match action {
            Action::Apply { events, .. } => {
                for e in &events {
                    router.handle_sync_event(now, e).expect("known worker");
                }
            }
            Action::Release { peer, .. } => {
                router.handle_peer_lost(now, peer);
            }
            Action::Send {
                to: To::Peer(PEER),
                message: Message::SnapshotRequest,
            } => asked = true,
            Action::Send { .. } | Action::SendSnapshot { .. } => {}
        }
    }
    asked
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_replica_ends_with_the_peers_bookings_whatever_is_lost_or_repeated(
        // (which change, drop this batch, repeat this batch)
        steps in proptest::collection::vec((0u64..12, any::<bool>(), any::<bool>()), 1..60),
        loss_every in 2usize..8,
    ) {
        let mut router = Router::new(RouterConfig {
            router_id: RouterId(1),
            block_size: 4,
            ..RouterConfig::default()
        })
        .expect("config");
        router
            .handle_worker_added(
                Timestamp::ZERO,
                WorkerSpec::new(WorkerKey::new(WorkerId(1), DpRank(0)), WorkerRole::Aggregated, 1000),
            )
            .expect("worker");
        let mut protocol = ReplicaProtocol::new(RouterId(1), ProtocolConfig::default());
        let now = Timestamp::from_millis(1);
        carry_out(&mut router, now, protocol.start(now));
        // The peer answers the join: nothing booked yet.
        let answer = Message::Snapshot(SnapshotPart {
            peers: vec![],
            last: BatchSeq(0),
            part: 0,
            is_last: true,
            events: vec![],
        });
        carry_out(&mut router, now, protocol.handle(now, PEER, answer));
        prop_assert!(protocol.is_joined());

        // The peer's model: what it has booked. Each step, one batch, books a new request or
        // frees a booked one (request ids are never reused, as a router's are not).
        let mut booked = BTreeSet::new();
        let (mut seq, mut lost, mut asked, mut next) = (0, false, false, 0);
        for (i, &(choice, drop, repeat)) in steps.iter().enumerate() {
            let e = match booked.iter().nth(choice as usize % booked.len().max(1)).copied() {
                Some(request) if choice % 3 == 0 => {
                    booked.remove(&request);
                    event(request, LoadChange::Freed)
                }
                _ => {
                    next += 1;
                    booked.insert(next);
                    added(next)
                }
            };
            seq += 1;
            let message = Message::Events { seq: BatchSeq(seq), events: vec![e] };
            if drop && i % loss_every == 0 {
                lost = true;
                continue;
            }
            for _ in 0..(1 + usize::from(repeat)) {
                asked |= carry_out(&mut router, now, protocol.handle(now, PEER, message.clone()));
            }
        }
        asked |= carry_out(
            &mut router,
            now,
            protocol.handle(now, PEER, Message::Heartbeat { last: BatchSeq(seq) }),
        );
        prop_assert_eq!(asked, lost, "a snapshot is asked for exactly when a batch was lost");
        if asked {
            let snapshot = Message::Snapshot(SnapshotPart {
                peers: vec![],
                last: BatchSeq(seq),
                part: 0,
                is_last: true,
                events: booked.iter().map(|&r| added(r)).collect(),
            });
            carry_out(&mut router, now, protocol.handle(now, PEER, snapshot));
        }
        prop_assert_eq!(router.metrics().active_now, booked.len());
        router.check_invariants().map_err(TestCaseError::fail)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_change_leaves_by_its_deadline_and_none_before_the_batch_is_due(
        // (ms since the previous change, urgent)
        changes in proptest::collection::vec((0u64..80, any::<bool>()), 1..80),
        window_ms in 0u64..5,
        lazy_ms in 0u64..200,
        max_events in 1usize..6,
    ) {
        let config = BatchConfig {
            window: Duration::from_millis(window_ms),
            lazy_window: Duration::from_millis(lazy_ms),
            max_events,
        };
        let mut batcher = Batcher::new(config);
        // The model: each change's deadline, by its index.
        let mut deadlines = Vec::new();
        let mut sent: Vec<(Timestamp, Vec<usize>)> = Vec::new();
        let mut now = Timestamp::ZERO;
        let drain = |batcher: &mut Batcher<usize>, until: Option<Timestamp>, sent: &mut Vec<(Timestamp, Vec<usize>)>| {
            // A driver: takes each batch when it is due, up to `until`.
            while let Some(due) = batcher.poll_timeout() {
                if until.is_some_and(|u| due > u) {
                    break;
                }
                if due > Timestamp::ZERO {
                    prop_assert!(batcher.take_due(due - Duration::from_nanos(1)).is_none(), "not due before");
                }
                let batch = batcher.take_due(due).expect("due");
                sent.push((due, batch));
            }
            Ok(())
        };
        for (i, &(gap, urgent)) in changes.iter().enumerate() {
            now = now + Duration::from_millis(gap);
            drain(&mut batcher, Some(now), &mut sent)?;
            let urgency = if urgent { Urgency::Urgent } else { Urgency::Lazy };
            let wait = if urgent { config.window } else { config.lazy_window };
            deadlines.push(now + wait);
            batcher.push(now, i, urgency);
            if batcher.len() >= max_events {
                // Full: due at once.
                prop_assert_eq!(batcher.poll_timeout(), Some(now));
            }
        }
        drain(&mut batcher, None, &mut sent)?;
        prop_assert!(batcher.is_empty());
        let order: Vec<usize> = sent.iter().flat_map(|(_, b)| b.iter().copied()).collect();
        prop_assert_eq!(order, (0..changes.len()).collect::<Vec<_>>(), "every change once, in order");
        for (at, batch) in &sent {
            prop_assert!(!batch.is_empty() && batch.len() <= max_events);
            // Never late: no change in it past its deadline.
            for &i in batch {
                prop_assert!(*at <= deadlines[i], "change {} due {:?} went at {:?}", i, deadlines[i], at);
            }
            // Never early: the earliest deadline among them has come, or the batch is full.
            let earliest = batch.iter().map(|&i| deadlines[i]).min().expect("non-empty");
            prop_assert!(*at == earliest || batch.len() == max_events);
        }
    }

    #[test]
    fn heartbeats_go_out_only_after_an_interval_without_a_batch(
        // ms between this replica's batches
        gaps in proptest::collection::vec(1u64..2500, 1..40),
    ) {
        let interval = Duration::from_millis(1000);
        let config = ProtocolConfig {
            heartbeat_interval: interval,
            reannounces: 0,
            ..ProtocolConfig::default()
        };
        let mut protocol = ReplicaProtocol::new(RouterId(1), config);
        let start = Timestamp::from_millis(1);
        let _: Vec<Action<u32>> = protocol.start(start);
        let _: Vec<Action<u32>> = protocol.handle_nobody_listening(start);
        // Every broadcast: (when, is a heartbeat).
        let mut said: Vec<(Timestamp, bool)> = vec![(start, false)];
        let mut now = start;
        let timeouts = |protocol: &mut ReplicaProtocol, until: Timestamp, said: &mut Vec<(Timestamp, bool)>| {
            while let Some(t) = protocol.poll_timeout().filter(|&t| t <= until) {
                for a in protocol.handle_timeout::<u32>(t) {
                    if let Action::Send { to: To::Everyone, message: Message::Heartbeat { .. } } = a {
                        said.push((t, true));
                    }
                }
            }
        };
        for &gap in &gaps {
            now = now + Duration::from_millis(gap);
            timeouts(&mut protocol, now, &mut said);
            prop_assert!(protocol.publish(now, vec![7u32]).is_some());
            said.push((now, false));
        }
        let end = now + interval * 3;
        timeouts(&mut protocol, end, &mut said);
        said.push((end, false));
        for pair in said.windows(2) {
            let ((a, _), (b, heartbeat)) = (pair[0], pair[1]);
            prop_assert!(b.saturating_since(a) <= interval, "silent from {:?} to {:?}", a, b);
            if heartbeat {
                prop_assert_eq!(b.saturating_since(a), interval, "a heartbeat only after a whole interval without a batch");
            }
        }
    }
}
