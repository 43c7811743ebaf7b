//! What arrives on a bound SUB socket from whoever connects: arbitrary bytes, and ZMTP 3
//! streams (greeting, READY, message frames) with mutated flags, lengths that lie, and cuts
//! anywhere. The subscriber must never panic or stop: each peer's garbage is dropped with its
//! connection, and afterwards a real publisher's batches still arrive.
//!
//! Forged frame lengths stay at or under 64 KiB: the `zeromq` crate reserves a frame's claimed
//! length before reading it and has no message-size limit (its read-buffer options are "not a
//! message-size or memory limit"), so a peer claiming terabytes would abort the process. That is
//! why a bound events endpoint must name its interface (wildcards are refused in the proxy's
//! configuration) and why kvroute connects to engines by default.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use kvroute_core::ids::WorkerId;
use kvroute_zmq::{
    EventPublisher, PublisherConfig, SocketMode, SubscriberConfig, SubscriberEvent, spawn_subscriber,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tokio::sync::mpsc;

/// The 64-byte ZMTP 3.0 greeting of a NULL-mechanism client.
fn greeting() -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    g.extend_from_slice(b"NULL");
    g.resize(32, 0);
    g.push(0); // as-server
    g.resize(64, 0);
    g
}

/// A READY command saying the peer is a PUB socket.
fn ready() -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut frame = vec![0x04, body.len() as u8];
    frame.extend(body);
    frame
}

/// One frame: its flags byte, body, and maybe a length that lies.
#[derive(Clone, Debug)]
struct Frame {
    flags: u8,
    body: Vec<u8>,
    claimed: Option<u64>,
}

#[derive(Clone, Debug)]
enum Input {
    Raw(Vec<u8>),
    Zmtp {
        frames: Vec<Frame>,
        cut: Option<prop::sample::Index>,
        greet: bool,
    },
}

fn frame() -> impl Strategy<Value = Frame> {
    (
        prop_oneof![Just(0u8), Just(1), Just(2), Just(3), Just(4), any::<u8>()],
        proptest::collection::vec(any::<u8>(), 0..300),
        proptest::option::of(prop_oneof![0u64..300, 0u64..=65_536]),
    )
        .prop_map(|(flags, body, claimed)| Frame { flags, body, claimed })
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..600).prop_map(Input::Raw),
        (
            proptest::collection::vec(frame(), 0..6),
            proptest::option::of(any::<prop::sample::Index>()),
            any::<bool>(),
        )
            .prop_map(|(frames, cut, greet)| Input::Zmtp { frames, cut, greet }),
    ]
}

fn bytes(input: &Input) -> Vec<u8> {
    match input {
        Input::Raw(b) => b.clone(),
        Input::Zmtp { frames, cut, greet } => {
            let mut out = if *greet { greeting() } else { Vec::new() };
            out.extend(ready());
            for f in frames {
                out.push(f.flags);
                // A lie may claim more than the body, never less, and ends the stream: the
                // rest of a longer body, or the frames after a short one, would be read as
                // the next frame's header, whose 8-byte length is then anything (the abort
                // the module docs describe), not a bounded forgery.
                let claimed = f.claimed.unwrap_or(0).max(f.body.len() as u64);
                let lies = claimed > f.body.len() as u64;
                if f.flags & 0x02 != 0 {
                    out.extend_from_slice(&claimed.min(65_536).to_be_bytes());
                } else {
                    let len = claimed.min(255);
                    out.push(len as u8);
                    if (len as usize) < f.body.len() {
                        // A short frame cannot say its body's length: send what it says.
                        out.extend_from_slice(&f.body[..len as usize]);
                        continue;
                    }
                }
                out.extend_from_slice(&f.body);
                if lies {
                    break;
                }
            }
            if let Some(cut) = cut {
                out.truncate(cut.index(out.len() + 1));
            }
            out
        }
    }
}

/// Each frame length the `zeromq` crate would read from `stream`, as its decoder walks it:
/// a greeting it accepts (signature bytes and a known mechanism), then flags and a 1- or
/// 8-byte length per frame.
fn claimed_lengths(stream: &[u8]) -> Vec<u64> {
    let mut lengths = Vec::new();
    let Some(greeting) = stream.get(..64) else {
        return lengths;
    };
    let mechanism = greeting[12..32].split(|&b| b == 0).next().unwrap_or_default();
    if greeting[0] != 0xff || greeting[9] != 0x7f || ![&b"NULL"[..], b"PLAIN", b"CURVE"].contains(&mechanism)
    {
        return lengths;
    }
    let mut at = 64;
    while let Some(&flags) = stream.get(at) {
        let (len, header) = if flags & 0x02 != 0 {
            match stream.get(at + 1..at + 9) {
                Some(b) => (u64::from_be_bytes(b.try_into().expect("8 bytes")), 9),
                None => break,
            }
        } else {
            match stream.get(at + 1) {
                Some(&b) => (u64::from(b), 2),
                None => break,
            }
        };
        lengths.push(len);
        at = at.saturating_add(header).saturating_add(len as usize);
    }
    lengths
}

/// A runner of `cases` inputs that persists no failure file.
fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

#[test]
fn forged_streams_claim_at_most_64_kib_per_frame() {
    runner(20_000)
        .run(&input(), |input| {
            let stream = bytes(&input);
            let lengths = claimed_lengths(&stream);
            prop_assert!(
                lengths.iter().all(|&len| len <= 65_536),
                "{lengths:?} in {input:?}"
            );
            Ok(())
        })
        .expect("every input");
}

#[test]
fn garbage_from_peers_never_stops_a_bound_subscriber() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (handle, mut rx) = rt.block_on(async {
        let (tx, rx) = mpsc::channel(1 << 16);
        let config = SubscriberConfig {
            mode: Some(SocketMode::Bind),
            ..SubscriberConfig::new(WorkerId(1), "tcp://127.0.0.1:0")
        };
        (spawn_subscriber(config, tx).await.expect("bind"), rx)
    });
    let addr = handle.endpoint().trim_start_matches("tcp://").to_owned();
    runner(48)
        .run(&input(), |input| {
            let mut peer = TcpStream::connect(&addr).map_err(|e| TestCaseError::fail(e.to_string()))?;
            // The subscriber may hang up mid-write: that is an answer too.
            let _ = peer.write_all(&bytes(&input));
            drop(peer);
            prop_assert!(!handle.is_finished(), "the subscriber stopped on {input:?}");
            Ok(())
        })
        .expect("every input");
    // A real publisher still gets through.
    let arrived = rt.block_on(async {
        let publisher = EventPublisher::start(PublisherConfig {
            mode: Some(SocketMode::Connect),
            ..PublisherConfig::new(handle.endpoint())
        })
        .await
        .expect("publisher");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            publisher.publish(Vec::new(), Some(0), 0.0).expect("publish");
            while let Ok(Some(event)) = tokio::time::timeout(Duration::from_millis(20), rx.recv()).await {
                if matches!(event, SubscriberEvent::Batch { .. }) {
                    return true;
                }
            }
            if tokio::time::Instant::now() > deadline {
                return false;
            }
        }
    });
    assert!(arrived, "no batch from a real publisher after the garbage");
    assert!(!handle.is_finished());
    rt.block_on(handle.shutdown());
}
