//! Property: whatever batches of a peer's changes are lost or repeated on the way, a replica
//! running the protocol ends with exactly the peer's bookings: repeats are dropped, and a loss
//! (seen as a gap in the batch numbers, or in the heartbeat that follows) makes it ask for the
//! peer's snapshot, which replaces what it held.

use std::collections::BTreeSet;
use std::sync::Arc;

use kvroute_core::ids::{DpRank, RequestId, SequenceHash, WorkerId, WorkerKey};
use kvroute_core::router::replica::{
    Action, BatchSeq, Message, ProtocolConfig, ReplicaProtocol, SnapshotPart, To,
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
