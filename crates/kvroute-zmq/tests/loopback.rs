//! Publisher and subscriber over loopback TCP: order and decoding, garbage, configs and
//! modes, a slow consumer, ipc endpoints, and events reaching an index. Gaps and replay are
//! in `recovery.rs`, restarts in `restarts.rs`; all share `support/zmq.rs`.

#[path = "support/zmq.rs"]
mod zmq;

use zmq::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_arrive_in_order_and_decode_as_published() {
    for encoding in [EventEncoding::Map, EventEncoding::Positional] {
        let publisher = EventPublisher::start(PublisherConfig {
            encoding,
            ..loopback(true)
        })
        .await
        .expect("start");
        let (handle, mut rx) = subscribe(&publisher, 1024, |_| {}).await;
        let warmup = join(&publisher, &handle, &mut rx).await;
        // Every warm-up batch arrives, in order: the ones sent before the subscription
        // reached the publisher come through the replay.
        assert_eq!(
            batch_seqs(&warmup),
            (0..publisher.next_seq()).collect::<Vec<_>>(),
            "{encoding:?}"
        );

        let first = publisher.next_seq();
        for i in 0..20 {
            let seq = publisher
                .publish(events(i), Some(i as u32 % 2), 1_767_225_600.0 + i as f64)
                .expect("publish");
            assert_eq!(seq, first + i);
        }
        for i in 0..20 {
            let batch = next_batch(&mut rx).await;
            let expected = EventBatch {
                topic: "kv@test".into(),
                seq: first + i,
                ts: 1_767_225_600.0 + i as f64,
                events: events(i),
                dp_rank: Some(i as u32 % 2),
            };
            assert_eq!(batch, expected, "{encoding:?}");
        }
        let counters = handle.counters().snapshot();
        assert_eq!(counters.emitted, first + 20, "{encoding:?}: {counters:?}");
        assert_eq!(
            (counters.gaps_lost, counters.decode_errors, counters.restarts),
            (0, 0, 0)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_reported_and_the_subscriber_goes_on() {
    let (handle, mut rx) = bound("tcp://127.0.0.1:0").await;
    let mut raw = zeromq::PubSocket::new();
    raw.connect(handle.endpoint()).await.expect("connect");
    let message = |frames: Vec<&[u8]>| {
        ZmqMessage::try_from(frames.into_iter().map(Bytes::copy_from_slice).collect::<Vec<_>>())
            .expect("frames")
    };

    // One frame, until the subscription has reached the publisher.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        assert!(tokio::time::Instant::now() < deadline, "never connected");
        raw.send(message(vec![b"one frame"])).await.expect("send");
        if let Ok(Some(event)) = timeout(Duration::from_millis(20), rx.recv()).await {
            assert!(matches!(event, SubscriberEvent::Error { .. }), "{event:?}");
            break;
        }
    }
    let payload = EventBatch {
        topic: String::new(),
        seq: 1,
        ts: 0.0,
        events: vec![stored(&[1], None, 4)],
        dp_rank: None,
    }
    .encode_payload(EventEncoding::Map)
    .expect("encode");
    let (seq0, seq1) = (0_u64.to_be_bytes(), 1_u64.to_be_bytes());
    let garbage: [Vec<&[u8]>; 4] = [
        vec![b"", b"short"],
        vec![b"", &seq0[..3], b"x"],
        vec![b"", &seq0, b"\xc1"],
        vec![b"", &seq1, &payload],
    ];
    for frames in garbage {
        raw.send(message(frames)).await.expect("send");
    }

    let mut errors = Vec::new();
    let batch = loop {
        match next(&mut rx).await {
            SubscriberEvent::Error { worker, error } => {
                assert_eq!(worker, STREAM);
                errors.push(error);
            }
            SubscriberEvent::Batch { batch, .. } => break batch,
            other => panic!("unexpected {other:?}"),
        }
    };
    // Batch 0 was undecodable but numbered, so batch 1 follows it in order.
    assert_eq!((batch.seq, batch.events.len()), (1, 1));
    let tail: Vec<&str> = errors.iter().rev().take(3).rev().map(String::as_str).collect();
    assert!(tail[0].contains("2 frames"), "{tail:?}");
    assert!(tail[1].contains("sequence number frame of 3 bytes"), "{tail:?}");
    assert!(tail[2].starts_with("batch 0:"), "{tail:?}");
    let counters = handle.counters().snapshot();
    assert_eq!(counters.decode_errors as usize, errors.len() + 1, "{counters:?}");
    assert_eq!(counters.gaps_detected, 0, "{counters:?}");
    assert!(!handle.is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn received_batches_build_the_index() {
    let publisher = EventPublisher::start(PublisherConfig {
        encoding: EventEncoding::Positional,
        replay_layout: ReplayLayout::SeqPayload,
        ..loopback(true)
    })
    .await
    .expect("start");
    let (handle, mut rx) = subscribe(&publisher, 1024, |_| {}).await;
    let mut index = RunIndex::new(IndexConfig::default());
    let config = ApplyConfig {
        block_size: NonZeroU32::new(4).expect("non-zero"),
        namespace: None,
        group_idx: 0,
    };
    let apply = |event: SubscriberEvent, index: &mut RunIndex| match event {
        SubscriberEvent::Batch { worker, batch } => {
            let key = batch.worker_key(worker);
            index.add_worker(key);
            for event in &batch.events {
                event.apply_to(index, key, &config).expect("apply");
            }
            Some(batch.seq)
        }
        other => panic!("unexpected {other:?}"),
    };
    for event in join(&publisher, &handle, &mut rx).await {
        apply(event, &mut index);
    }
    publisher
        .publish(vec![stored(&[11, 12, 13], None, 4)], Some(1), 0.0)
        .expect("publish");
    publisher
        .publish(vec![stored(&[14], Some(13), 4)], Some(1), 0.0)
        .expect("publish");
    let removed = WireEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![ExternalBlockHash(14)],
        medium: Some("GPU".into()),
        group_idx: None,
    });
    let last = publisher.publish(vec![removed], Some(1), 0.0).expect("publish");
    while apply(next(&mut rx).await, &mut index) != Some(last) {}
    let key = kvroute_core::ids::WorkerKey::new(WORKER, kvroute_core::ids::DpRank(1));
    assert_eq!(index.block_count(key), 3);
    index.check_invariants().expect("invariants");
}

#[test]
fn configs_reject_unknown_keys_and_fill_defaults() {
    let config: SubscriberConfig = toml::from_str(
        r#"
        worker = 4
        endpoint = "tcp://10.0.0.1:5557"
        replay_endpoint = "tcp://10.0.0.1:5558"
        "#,
    )
    .expect("parse");
    assert_eq!(
        config,
        SubscriberConfig {
            replay_endpoint: Some("tcp://10.0.0.1:5558".into()),
            ..SubscriberConfig::new(WorkerId(4), "tcp://10.0.0.1:5557")
        }
    );
    assert_eq!(config.effective_mode(), SocketMode::Connect);
    assert!(toml::from_str::<SubscriberConfig>("worker = 1\nendpoint = \"tcp://*:1\"\nhwm = 5").is_err());
    let with_mode: SubscriberConfig =
        toml::from_str("worker = 1\nendpoint = \"tcp://127.0.0.1:1\"\nmode = \"bind\"").expect("parse");
    assert_eq!(with_mode.effective_mode(), SocketMode::Bind);

    let publisher: PublisherConfig = toml::from_str(
        r#"
        endpoint = "tcp://*:5557"
        encoding = "positional"
        replay_layout = "seq_payload"
        "#,
    )
    .expect("parse");
    assert_eq!(
        publisher,
        PublisherConfig {
            encoding: EventEncoding::Positional,
            replay_layout: ReplayLayout::SeqPayload,
            ..PublisherConfig::new("tcp://*:5557")
        }
    );
    assert!(toml::from_str::<PublisherConfig>("endpoint = \"tcp://*:1\"\nbuffer = 5").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configs_are_refused_before_any_socket() {
    let (tx, _rx) = mpsc::channel(1);
    let mut config = SubscriberConfig::new(WORKER, "nonsense");
    assert!(spawn_subscriber(config.clone(), tx.clone()).await.is_err());
    config.endpoint = "tcp://127.0.0.1:1".into();
    config.replay_timeout_ms = 0;
    assert!(spawn_subscriber(config, tx).await.is_err());
    assert!(
        EventPublisher::start(PublisherConfig::new("udp://x"))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_loses_nothing() {
    let publisher = EventPublisher::start(loopback(true)).await.expect("start");
    // Room for one event: the subscriber waits on the consumer after every batch.
    let (handle, mut rx) = subscribe(&publisher, 1, |_| {}).await;
    join(&publisher, &handle, &mut rx).await;

    let first = publish_dropping(&publisher, 0, 300);
    for i in 0..300 {
        if i % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(next_batch(&mut rx).await.seq, first + i);
    }
    assert_eq!(handle.counters().snapshot().gaps_lost, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipc_endpoints_work_with_the_default_modes() {
    let dir = kvroute_testkit::Scratch::new("zmq");
    let path = |name: &str| format!("ipc://{}", dir.join(name).display());
    let publisher = EventPublisher::start(PublisherConfig {
        replay_endpoint: Some(path("replay.sock")),
        ..PublisherConfig::new(path("events.sock"))
    })
    .await
    .expect("start");
    // vLLM binds ipc endpoints, so a subscriber connects to them by default.
    let (handle, mut rx) = subscribe(&publisher, 1024, |c| c.topic.clear()).await;
    assert_eq!(handle.mode(), SocketMode::Connect);
    let events = join(&publisher, &handle, &mut rx).await;
    assert!(
        matches!(&events[0], SubscriberEvent::Batch { batch, .. } if batch.seq == 0),
        "{events:?}"
    );
    drop(handle);
    publisher.shutdown().await;
}
