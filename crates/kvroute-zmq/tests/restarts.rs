//! Restarts over loopback TCP: a publisher restarted (on new or the same ports, after a long
//! outage), a subscriber started first or restarted. Shares `support/zmq.rs` with
//! `loopback.rs` and `recovery.rs`.

#[path = "support/zmq.rs"]
mod zmq;

use zmq::*;

fn events_for_restart() -> Vec<WireEvent> {
    vec![stored(&[7], None, 4)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_publisher_is_reported_and_its_new_run_follows() {
    // The subscriber binds and the publishers connect out to it (llm-d's centralized mode),
    // so the second publisher reaches the same subscriber without reusing a port.
    let mut config = SubscriberConfig::new(WORKER, "tcp://*:0");
    assert_eq!(config.effective_mode(), SocketMode::Bind);
    config.topic = "kv@".into();
    let (handle, mut rx) = spawn(config, 1024).await;
    let port = handle.endpoint().rsplit(':').next().expect("a port").to_owned();
    // Neither publisher has a replay socket.
    let start = || {
        EventPublisher::start(PublisherConfig {
            mode: Some(SocketMode::Connect),
            ..loopback(false).with_endpoint(format!("tcp://127.0.0.1:{port}"))
        })
    };

    let first = start().await.expect("first publisher");
    join(&first, &handle, &mut rx).await;
    // Far more batches than the second publisher's warm-up will number, so that its batches
    // are recognisably a new run (the wire has no run id: only a sequence number that goes
    // back shows a restart).
    publish_empty(&first, &mut rx, 300).await;
    first.shutdown().await;

    // The subscriber has no replay endpoint configured for the new run either: the new
    // publisher's warm-up batches it missed are reported lost, then the run goes on.
    let second = start().await.expect("second publisher");
    let events = join(&second, &handle, &mut rx).await;
    assert!(
        matches!(events[0], SubscriberEvent::Restarted { worker: STREAM }),
        "{events:?}"
    );
    let counters = handle.counters().snapshot();
    assert_eq!(counters.restarts, 1, "{counters:?}");
    let seq = second.publish(events_for_restart(), None, 0.0).expect("publish");
    let batch = next_batch(&mut rx).await;
    assert_eq!((batch.seq, batch.events), (seq, events_for_restart()));
}

/// Stops `first` and starts a new publisher on its live and replay ports, as an engine restarted
/// in place: its sequence starts again at 0.
async fn restart_in_place(first: EventPublisher) -> EventPublisher {
    let (endpoint, replay) = (
        first.endpoint().to_owned(),
        first.replay_endpoint().expect("replay").to_owned(),
    );
    first.shutdown().await;
    EventPublisher::start(PublisherConfig {
        replay_endpoint: Some(replay),
        ..loopback(true).with_endpoint(endpoint)
    })
    .await
    .expect("restart on the same ports")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restarted_on_the_same_ports_is_followed_with_replay() {
    let Joined {
        publisher: first,
        handle,
        mut rx,
        ..
    } = joined(loopback(true), |_| {}).await;
    publish_empty(&first, &mut rx, 300).await;
    // The same ports, as an engine restarted in place would have. The subscriber reconnects by
    // itself; what the new run published before it did comes back through the replay socket.
    let second = restart_in_place(first).await;
    let events = join(&second, &handle, &mut rx).await;
    assert!(
        matches!(events[0], SubscriberEvent::Restarted { worker: STREAM }),
        "{events:?}"
    );
    assert_eq!(
        batch_seqs(&events[1..]),
        (0..second.next_seq()).collect::<Vec<_>>()
    );
    assert_eq!(handle.counters().snapshot().restarts, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_is_seen_before_the_new_run_publishes_anything() {
    // An engine restarted in place on the same ports, idle since: the subscriber reconnects by
    // itself and its resync finds that the publisher no longer has the last batch it received,
    // so the view is cleared at once instead of at the new run's first batch.
    let Joined {
        publisher: first,
        handle,
        mut rx,
        ..
    } = joined(loopback(true), |_| {}).await;
    publish_empty(&first, &mut rx, 5).await;
    let second = restart_in_place(first).await;
    assert!(
        matches!(next(&mut rx).await, SubscriberEvent::Restarted { worker: STREAM }),
        "the restart is reported with nothing published"
    );
    assert_eq!(second.next_seq(), 0);
    let counters = handle.counters().snapshot();
    assert_eq!((counters.restarts, counters.reconnects), (1, 1), "{counters:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_started_first_waits_for_its_publisher() {
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let (handle, mut rx) = spawn(SubscriberConfig::new(WORKER, endpoint.clone()), 16).await;
    assert_eq!(handle.mode(), SocketMode::Connect);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let publisher = EventPublisher::start(PublisherConfig::new(endpoint))
        .await
        .expect("start");
    let events = join(&publisher, &handle, &mut rx).await;
    assert!(
        events
            .iter()
            .all(|e| matches!(e, SubscriberEvent::Batch { .. } | SubscriberEvent::GapLost { .. })),
        "{events:?}"
    );
    // Dropping the handle stops the task, which closes the channel.
    drop(handle);
    while let Some(_event) = timeout(PATIENCE, rx.recv()).await.expect("the channel closes") {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connecting_publisher_reaches_a_restarted_subscriber() {
    let (first, mut rx) = bound("tcp://127.0.0.1:0").await;
    let endpoint = first.endpoint().to_owned();
    let publisher = EventPublisher::start(PublisherConfig {
        mode: Some(SocketMode::Connect),
        ..PublisherConfig::new(endpoint.clone())
    })
    .await
    .expect("start");
    join(&publisher, &first, &mut rx).await;
    first.shutdown().await;

    // A new subscriber on the same port (the router restarted): the publisher connects again.
    let (second, mut rx) = bound(endpoint).await;
    let events = join(&publisher, &second, &mut rx).await;
    // It joined a run already under way and has no replay endpoint: what came before is lost.
    assert!(
        matches!(events[0], SubscriberEvent::GapLost { ref missing, .. } if missing.start == 0),
        "{events:?}"
    );
    assert!(!second.is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_back_after_a_long_outage_is_heard_from_within_the_reconnect_cap() {
    // The `zeromq` crate's own reconnection doubles its delay (0.1, 0.3, 0.7, 1.5, 3.1, 6.3,
    // 12.7 s after the loss): a publisher back after 7 s would be reached 5.7 s late. With the
    // cap, attempts are at most about a second apart.
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let start = || EventPublisher::start(PublisherConfig::new(endpoint.clone()));
    let first = start().await.expect("first");
    let (handle, mut rx) = spawn(SubscriberConfig::new(WORKER, endpoint.clone()), 1024).await;
    join(&first, &handle, &mut rx).await;
    first.shutdown().await;
    // The outage: a fixed wait is what is being tested here, not a race.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let second = start().await.expect("second");
    let back = tokio::time::Instant::now();
    // Publish until the subscriber hears the new run (PUB drops what it sends unconnected).
    let heard = loop {
        second.publish(Vec::new(), None, 1.0).expect("publish");
        if let Ok(Some(event)) = timeout(Duration::from_millis(20), rx.recv()).await {
            break event;
        }
        assert!(back.elapsed() < PATIENCE, "never reconnected");
    };
    let late = back.elapsed();
    assert!(
        matches!(
            heard,
            SubscriberEvent::Restarted { .. }
                | SubscriberEvent::Batch { .. }
                | SubscriberEvent::GapLost { .. }
        ),
        "{heard:?}"
    );
    assert!(
        late < Duration::from_millis(3_000),
        "heard {late:?} after the publisher was back"
    );
    assert!(handle.counters().snapshot().reconnects >= 1);
}
