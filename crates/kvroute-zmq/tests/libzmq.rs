//! Interoperation with libzmq, the ZeroMQ library vLLM and SGLang use, through a pyzmq peer
//! (`tests/data/libzmq_peer.py`): our subscriber against a vLLM-like libzmq publisher (live
//! frames, replay over DEALER/ROUTER), and a libzmq SUB and DEALER against our publisher.
//!
//! The peer needs Python with pyzmq (`pip install pyzmq`; `KVROUTE_PYTHON` names the
//! interpreter, `python3` by default). Without it these tests skip, saying so, and fail in CI.

use std::process::Stdio;
use std::time::Duration;

use kvroute_core::ids::{ExternalBlockHash, WorkerId};
use kvroute_wire::{BlockStored, EventBatch, EventEncoding, WireEvent};
use kvroute_zmq::{EventPublisher, PublisherConfig, SubscriberConfig, SubscriberEvent, spawn_subscriber};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::mpsc;
use tokio::time::timeout;

const PEER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/libzmq_peer.py");
use kvroute_testkit::{External, PATIENCE, require};
const WORKER: WorkerId = WorkerId(9);

/// The Python interpreter with pyzmq, or `None` (after saying so) when there is none outside CI.
async fn python() -> Option<String> {
    let python = std::env::var("KVROUTE_PYTHON").unwrap_or_else(|_| "python3".into());
    let found = Command::new(&python)
        .args(["-c", "import zmq"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .is_ok_and(|status| status.success());
    require(External::Pyzmq, found).then_some(python)
}

fn peer(python: &str, args: &[&str]) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(python)
        .arg(PEER)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the peer");
    let stdout = child.stdout.take().expect("piped stdout");
    (child, BufReader::new(stdout).lines())
}

async fn line(lines: &mut Lines<BufReader<ChildStdout>>) -> String {
    timeout(PATIENCE, lines.next_line())
        .await
        .expect("the peer answers in time")
        .expect("read the peer")
        .expect("the peer is running")
}

fn payload(i: u64) -> Vec<u8> {
    EventBatch {
        topic: String::new(),
        seq: 0,
        ts: i as f64,
        events: vec![WireEvent::BlockStored(BlockStored {
            block_hashes: vec![ExternalBlockHash(i)],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            cache_salt: None,
            group_idx: None,
        })],
        dp_rank: Some(0),
    }
    .encode_payload(EventEncoding::Map)
    .expect("encode")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_subscriber_follows_a_libzmq_publisher_and_replays_from_it() {
    let Some(python) = python().await else { return };
    let (mut child, mut lines) = peer(&python, &["publish"]);
    let ports = line(&mut lines).await;
    let [_, pub_port, router_port] = ports.split(' ').collect::<Vec<_>>()[..] else {
        panic!("unexpected {ports:?}")
    };
    let mut config = SubscriberConfig::new(WORKER, format!("tcp://127.0.0.1:{pub_port}"));
    config.replay_endpoint = Some(format!("tcp://127.0.0.1:{router_port}"));
    let (tx, mut rx) = mpsc::channel(1024);
    let handle = spawn_subscriber(config, tx).await.expect("spawn_subscriber");
    let stdin = child.stdin.as_mut().expect("piped stdin");
    let mut send = async |command: &str, i: u64| {
        let text = format!("{command} {}\n", hex(&payload(i)));
        stdin.write_all(text.as_bytes()).await.expect("write to the peer");
        stdin.flush().await.expect("flush");
    };

    // Warm up until the subscription has reached libzmq's PUB.
    let mut published = 0;
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while seen.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "never connected");
        send("PUB", published).await;
        published += 1;
        while let Ok(Some(event)) = timeout(Duration::from_millis(20), rx.recv()).await {
            seen.push(event);
        }
    }
    // Two batches dropped, two sent: the first sent one shows the gap, the replay fills it.
    for command in ["DROP", "DROP", "PUB", "PUB"] {
        send(command, published).await;
        published += 1;
    }
    while seen.len() < published as usize {
        match timeout(PATIENCE, rx.recv()).await {
            Ok(Some(event)) => seen.push(event),
            _ => panic!(
                "{} of {published} events: {seen:?}, {:?}",
                seen.len(),
                handle.counters().snapshot()
            ),
        }
    }
    for (i, event) in seen.iter().enumerate() {
        let SubscriberEvent::Batch { batch, .. } = event else {
            panic!("unexpected {event:?}")
        };
        assert_eq!(batch.seq, i as u64);
        assert_eq!(batch.topic, "kv@libzmq");
        assert_eq!(
            EventBatch::decode_payload("", 0, &payload(i as u64))
                .expect("decode")
                .events,
            batch.events
        );
    }
    let counters = handle.counters().snapshot();
    assert!(counters.replayed >= 3, "{counters:?}");
    assert_eq!(
        (counters.gaps_lost, counters.decode_errors),
        (0, 0),
        "{counters:?}"
    );
    let _ = stdin.write_all(b"QUIT\n").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libzmq_subscriber_and_dealer_read_our_publisher() {
    let Some(python) = python().await else { return };
    let publisher = EventPublisher::start(PublisherConfig {
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        ..PublisherConfig::new("tcp://127.0.0.1:0")
    })
    .await
    .expect("start");
    let replay = publisher.replay_endpoint().expect("replay").to_owned();
    let (_child, mut lines) = peer(&python, &["subscribe", publisher.endpoint(), &replay]);

    // Publish until libzmq's SUB has a message; it then asks for a replay from 0.
    let (tx, mut live) = mpsc::channel(1);
    tokio::spawn(async move {
        let first = line(&mut lines).await;
        let _ = tx.send((first, lines)).await;
    });
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let (first, mut lines) = loop {
        assert!(tokio::time::Instant::now() < deadline, "never connected");
        let i = publisher.next_seq();
        publisher
            .publish(
                EventBatch::decode_payload("", 0, &payload(i))
                    .expect("decode")
                    .events,
                Some(0),
                i as f64,
            )
            .expect("publish");
        if let Ok(Some(got)) = timeout(Duration::from_millis(20), live.recv()).await {
            break got;
        }
    };
    let [kind, frames, _seq] = first.split(' ').collect::<Vec<_>>()[..] else {
        panic!("unexpected {first:?}")
    };
    assert_eq!((kind, frames), ("LIVE", "3"));
    // The replay holds everything published (from 0), each reply `["", topic, seq, payload]`
    // as a DEALER receives it, then the end marker.
    let mut seq = 0;
    loop {
        let reply = line(&mut lines).await;
        if reply == "END" {
            break;
        }
        let [kind, frames, got, hex_payload] = reply.split(' ').collect::<Vec<_>>()[..] else {
            panic!("unexpected {reply:?}")
        };
        assert_eq!((kind, frames, got), ("REPLY", "4", seq.to_string().as_str()));
        assert_eq!(hex_payload, hex(&payload(seq)));
        seq += 1;
    }
    assert!(seq >= 1);
}
