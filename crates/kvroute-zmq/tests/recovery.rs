//! Gaps in a subscriber's stream over loopback TCP: batches dropped and recovered through the
//! replay socket, gaps lost without one or past its buffer, and resyncs while nothing new is
//! published. Shares `support/zmq.rs` with `loopback.rs` and `restarts.rs`.

#[path = "support/zmq.rs"]
mod zmq;

use zmq::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_is_recovered_through_replay() {
    for replay_layout in [ReplayLayout::TopicSeqPayload, ReplayLayout::SeqPayload] {
        let config = PublisherConfig {
            replay_layout,
            ..loopback(true)
        };
        let mut link = joined(config, |_| {}).await;

        let first = publish_dropping(&link.publisher, 2, 5);
        for i in 0..5 {
            let batch = next_batch(&mut link.rx).await;
            assert_eq!(
                (batch.seq, &batch.events),
                (first + i, &events(i)),
                "{replay_layout:?}"
            );
        }
        // A gap counts as recovered once its replay has ended, which may be just after its last
        // batch was handed on.
        let after = settled(&link.handle, |c| c.gaps_recovered > link.before.gaps_recovered).await;
        assert_eq!(
            after.gaps_detected - link.before.gaps_detected,
            1,
            "{replay_layout:?}: {after:?}"
        );
        assert_eq!(
            after.gaps_recovered - link.before.gaps_recovered,
            1,
            "{replay_layout:?}: {after:?}"
        );
        // The two dropped batches and the one that showed the gap, at least.
        assert!(
            after.replayed - link.before.replayed >= 3,
            "{replay_layout:?}: {after:?}"
        );
        assert_eq!(
            after.gaps_lost, link.before.gaps_lost,
            "{replay_layout:?}: {after:?}"
        );
        assert_eq!(
            after.emitted - link.before.emitted,
            5,
            "{replay_layout:?}: {after:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replay_endpoint_a_gap_is_lost_and_the_stream_goes_on() {
    let mut link = joined(loopback(false), |_| {}).await;

    let first = publish_dropping(&link.publisher, 1, 3);
    assert_eq!(next(&mut link.rx).await, gap_lost(first..first + 1));
    assert_eq!(next_batch(&mut link.rx).await.seq, first + 1);
    assert_eq!(next_batch(&mut link.rx).await.seq, first + 2);
    let after = link.handle.counters().snapshot();
    assert_eq!(after.gaps_detected - link.before.gaps_detected, 1);
    assert_eq!(after.gaps_lost - link.before.gaps_lost, 1);
    assert_eq!(after.batches_lost - link.before.batches_lost, 1);
    assert_eq!(after.gaps_recovered, link.before.gaps_recovered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_replay_endpoint_times_out_into_a_lost_gap() {
    // Nothing listens on a port that was free a moment ago.
    let unused = free_port();
    let mut link = joined(loopback(false), |c| {
        c.replay_endpoint = Some(format!("tcp://127.0.0.1:{unused}"));
        c.replay_timeout_ms = 200;
    })
    .await;

    let first = publish_dropping(&link.publisher, 1, 2);
    assert_eq!(next(&mut link.rx).await, gap_lost(first..first + 1));
    assert_eq!(next_batch(&mut link.rx).await.seq, first + 1);
    let after = link.handle.counters().snapshot();
    assert_eq!(
        after.replay_failures - link.before.replay_failures,
        1,
        "{after:?}"
    );
    assert_eq!(after.gaps_lost - link.before.gaps_lost, 1, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_older_than_the_replay_buffer_are_lost_and_the_rest_replayed() {
    let config = PublisherConfig {
        buffer_steps: 3,
        ..loopback(true)
    };
    let mut link = joined(config, |_| {}).await;

    let first = publish_dropping(&link.publisher, 5, 6);
    // The ring holds the last three (first + 3 ..= first + 5): the two before are gone.
    assert_eq!(next(&mut link.rx).await, gap_lost(first..first + 3));
    for i in 3..6 {
        let batch = next_batch(&mut link.rx).await;
        assert_eq!((batch.seq, batch.events), (first + i, events(i)));
    }
    let after = link.handle.counters().snapshot();
    assert_eq!(after.batches_lost - link.before.batches_lost, 3, "{after:?}");
    assert_eq!(after.replayed - link.before.replayed, 3, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_drops_are_all_recovered_in_order() {
    let config = PublisherConfig {
        encoding: EventEncoding::Positional,
        ..loopback(true)
    };
    let mut link = joined(config, |_| {}).await;

    // A fixed pattern of drops (1 to 4 batches, every few batches), 1 000 batches in all.
    let first = link.publisher.next_seq();
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut drops = 0;
    for i in 0..1_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if state.is_multiple_of(16) {
            link.publisher.drop_next(1 + state / 16 % 4);
            drops += 1;
        }
        link.publisher
            .publish(events(i), None, i as f64)
            .expect("publish");
    }
    // A drop at the end would swallow the last batches, which no later batch would reveal.
    link.publisher.drop_next(0);
    let last = link.publisher.publish(Vec::new(), None, 0.0).expect("publish");
    for i in 0..1_000 {
        let batch = next_batch(&mut link.rx).await;
        assert_eq!((batch.seq, batch.events), (first + i, events(i)));
    }
    assert_eq!(next_batch(&mut link.rx).await.seq, last);
    let after = link.handle.counters().snapshot();
    assert!(drops > 10, "the pattern drops too rarely: {drops}");
    assert_eq!(after.gaps_lost, link.before.gaps_lost, "{after:?}");
    assert!(after.gaps_detected - link.before.gaps_detected >= 1, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_fetches_batches_missed_while_nothing_new_is_published() {
    // A worker back from an outage: the batches it published meanwhile never reached the
    // subscriber, and it publishes nothing after. A requested resync brings them.
    let Joined {
        publisher,
        handle,
        mut rx,
        ..
    } = joined(loopback(true), |_| {}).await;
    let first = publish_dropping(&publisher, 3, 3);
    handle.resync_trigger().request();
    for i in 0..3 {
        let batch = next_batch(&mut rx).await;
        assert_eq!((batch.seq, batch.events), (first + i, events(i)));
    }
    let counters = handle.counters().snapshot();
    assert_eq!((counters.restarts, counters.gaps_lost), (0, 0), "{counters:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_of_a_publisher_past_its_buffer_reports_the_loss() {
    // More batches went by unseen than the publisher buffers: the last one received is gone
    // from its buffer, so the stream is taken up again from what it has, the rest lost.
    let Joined {
        publisher,
        handle,
        mut rx,
        ..
    } = joined(
        PublisherConfig {
            buffer_steps: 4,
            ..loopback(true)
        },
        |_| {},
    )
    .await;
    let first = publish_dropping(&publisher, 10, 10);
    handle.resync_trigger().request();
    assert!(matches!(next(&mut rx).await, SubscriberEvent::Restarted { .. }));
    match next(&mut rx).await {
        SubscriberEvent::GapLost { missing, .. } => assert_eq!(missing, 0..first + 6),
        other => panic!("expected the loss, got {other:?}"),
    }
    for i in 6..10 {
        assert_eq!(next_batch(&mut rx).await.seq, first + i);
    }
}
