//! The wire format of replica sync: one [`Envelope`] per NATS message, versioned, carrying
//! one of the protocol's [`Message`]s ([`Body::from_message`], [`Body::into_message`]).
//!
//! Workers are named on the wire by their base URL and data-parallel rank ([`WorkerRef`]), never
//! by a replica's own [`WorkerId`]s, which each replica assigns in the order it learns of its
//! workers. The converters ([`SyncItem::from_sync`], [`SyncItem::to_sync`]) take the
//! replica's mapping as closures.
//!
//! **Versions.** The first byte names the format. Version 4 ([`binary`], [`WIRE_VERSION`]) is
//! binary: its first byte is 4, a block hash takes 8 bytes. Versions 1 to 3 were JSON ([`json`]),
//! a message starting with `{`. [`decode`] reads version 4 only and refuses any other with
//! [`DecodeError::Version`], naming the format, the version and the sender where it can read
//! them, so a replica of another version is told apart from garbage: replicas of different
//! versions refuse each other and a fleet is upgraded whole. Version 2 was the first to carry no
//! credential, version 3 added sessions and tenants, version 4 carries the same messages as 3.
//!
//! [`decode`] never panics: it refuses a message over [`MAX_MESSAGE_BYTES`], bytes that are not
//! a message of this version, batches past [`MAX_EVENTS`] events or chains past
//! [`MAX_CHAIN_BLOCKS`] blocks, and a worker's configuration that carries a credential
//! ([`SECRET_KEYS`]), each with a [`DecodeError`] naming what was wrong. No count read off the
//! wire allocates more than the message's own length can fill.
//!
//! **No secret on the wire.** A sync message never carries a credential: a worker's
//! configuration goes without its `api-key`, and each replica resolves the credential from its
//! own configuration.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::ids::{DpRank, RequestId, SequenceHash, WorkerId, WorkerKey};
use kvroute_core::router::replica::{BatchSeq, Message, SnapshotPart};
use kvroute_core::router::{Booking, LoadChange, PrefillLoadHint, RouterId, SessionId, SyncEvent, TenantId};
use serde::{Deserialize, Serialize};

pub mod binary;
pub mod json;

/// The format version this build writes and reads: 4, binary ([`binary`]).
pub const WIRE_VERSION: u32 = 4;
/// The keys of a worker's configuration that hold a credential: never on the wire.
pub const SECRET_KEYS: &[&str] = &["api-key"];
/// The largest message decoded (NATS's default `max_payload` is 1 MiB).
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// The most events one message may carry.
pub const MAX_EVENTS: usize = 1 << 16;
/// The most prompt blocks one booking may carry.
pub const MAX_CHAIN_BLOCKS: usize = 1 << 17;

/// One message: who sent it and what it says (the format version is the encoding's).
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    /// The sending replica.
    pub from: u64,
    /// What it says.
    pub body: Body,
}

/// What a message says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Body {
    /// A batch of the sender's changes, in the order it made them.
    Events {
        /// The batch's number: a sender numbers its batches 1, 2, ….
        #[serde(default)]
        seq: u64,
        /// When the sender's transport took the batch's first change off its queue,
        /// microseconds since the Unix epoch (for the receiver's measure of sync latency).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at_us: Option<u64>,
        /// The changes.
        events: Vec<SyncItem>,
    },
    /// The sender is alive.
    Heartbeat {
        /// The number of the sender's last batch (0: none yet).
        #[serde(default)]
        seq: u64,
    },
    /// Asks every replica (or the one addressed) for its [`Body::Snapshot`]; sent with a reply
    /// subject.
    SnapshotRequest,
    /// The sender's whole state: its registry and its in-flight bookings. A reply to a
    /// [`Body::SnapshotRequest`], or announced after a reconnection. Part 0 replaces whatever
    /// the receiver held of the sender's bookings; later parts (a large state is sent in parts
    /// under the size limit) add to it.
    Snapshot {
        /// Every replica the sender hears (itself excluded), so a joining replica knows whose
        /// answers to wait for.
        peers: Vec<u64>,
        /// The part's number, from 0.
        part: u32,
        /// Whether it is the last part.
        last: bool,
        /// The number of the sender's last batch before the snapshot: batches up to it are in
        /// it.
        #[serde(default)]
        seq: u64,
        /// Its registry (as [`SyncItem::Worker`]), its bookings (as [`SyncItem::Added`]
        /// and [`SyncItem::PrefillDone`]), then its sessions (as [`SyncItem::Session`]).
        events: Vec<SyncItem>,
    },
}

/// A worker rank, as every replica names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerRef {
    /// The worker's base URL (no trailing slash).
    pub url: String,
    /// The data-parallel rank.
    pub rank: u32,
}

/// One change a replica made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case", deny_unknown_fields)]
pub enum SyncItem {
    /// A request was booked ([`LoadChange::Added`]).
    Added {
        /// The sender's request id.
        r: u64,
        /// The decode worker.
        w: WorkerRef,
        /// The prefill worker, when disaggregated.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pw: Option<WorkerRef>,
        /// Prompt blocks cached on `w` at admission.
        o: u32,
        /// Prompt tokens.
        pt: u64,
        /// Sequence hashes of the prompt's full blocks.
        c: Vec<u64>,
        /// Prefill load hint: uncached prompt tokens.
        ht: u64,
        /// Prefill load hint: expected duration, nanoseconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hd: Option<u64>,
        /// Output-length hint.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        eo: Option<u32>,
        /// The request's session ([`SessionId`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        s: Option<u64>,
        /// The tenant ([`TenantId`]: its place in the `[[tenant]]` list, which replicas share;
        /// 0 or absent: no configured tenant).
        #[serde(default, skip_serializing_if = "is_zero")]
        tn: u32,
    },
    /// The request's prefill is done ([`LoadChange::PrefillDone`]).
    PrefillDone {
        /// The sender's request id.
        r: u64,
    },
    /// The request left the books ([`LoadChange::Freed`]).
    Freed {
        /// The sender's request id.
        r: u64,
    },
    /// A session's binding ([`LoadChange::Session`]), in a snapshot.
    Session {
        /// The session ([`SessionId`]).
        s: u64,
        /// Its worker.
        w: WorkerRef,
    },
    /// An operator's change to the worker registry.
    Worker(WorkerChange),
}

/// An operator's change to the worker registry (health is each replica's own business).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkerChange {
    /// A worker was added, with its configuration (the proxy's `[[worker]]` table, as JSON; the
    /// receiver validates it as it would its own), never its credential ([`SECRET_KEYS`]).
    Added {
        /// The configuration, without its credential.
        config: serde_json::Value,
        /// Whether the sender calls the worker with a credential (the receiver then needs one
        /// of its own for it).
        #[serde(default)]
        credential: bool,
    },
    /// The worker at `url` is draining.
    Draining {
        /// Its base URL.
        url: String,
    },
    /// The worker at `url` was removed.
    Removed {
        /// Its base URL.
        url: String,
    },
}

/// A message format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Versions 1 to 3.
    Json,
    /// Version 4 on.
    Binary,
}

impl Format {
    /// Its name in logs and metric labels: `json`, `binary`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Binary => "binary",
        }
    }
}

/// Why bytes were not a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Larger than [`MAX_MESSAGE_BYTES`].
    #[error("message of {0} bytes is over the limit of {MAX_MESSAGE_BYTES}")]
    TooLarge(usize),
    /// JSON that is not a message (the path and reason are serde's).
    #[error("not a sync message: {0}")]
    Malformed(#[from] serde_json::Error),
    /// Bytes that are not a message of this version: what was expected, at which byte.
    #[error("not a sync message: bad {what} at byte {at}")]
    Invalid {
        /// What was read there.
        what: &'static str,
        /// Its offset.
        at: usize,
    },
    /// A message of another format version.
    #[error(
        "sync message {}in {} format version {version}; this build reads binary format version {WIRE_VERSION} (replicas of different versions refuse each other: upgrade the fleet whole)",
        from.map(|f| format!("from replica {f:016x} ")).unwrap_or_default(),
        format.name()
    )]
    Version {
        /// Its format.
        format: Format,
        /// Its version.
        version: u32,
        /// Its sender, where it could be read.
        from: Option<u64>,
    },
    /// Too many events in one message.
    #[error("{0} events in one message; at most {MAX_EVENTS}")]
    TooManyEvents(usize),
    /// A booking with too long a chain.
    #[error("a booking of {0} blocks; at most {MAX_CHAIN_BLOCKS}")]
    ChainTooLong(usize),
    /// A worker's configuration that is not JSON.
    #[error("not a sync message: a worker's configuration: {0}")]
    Config(serde_json::Error),
    /// A worker's configuration that carries a credential (the key, never its value).
    #[error("a worker's configuration carries {0:?}: sync messages never carry credentials")]
    Secret(&'static str),
}

/// About how many bytes `event` takes on the wire (for cutting batches under the size limit).
pub fn weight(event: &SyncItem) -> usize {
    match event {
        SyncItem::Added { w, pw, c, .. } => {
            64 + w.url.len() + pw.as_ref().map_or(0, |p| p.url.len() + 8) + 8 * c.len()
        }
        SyncItem::PrefillDone { .. } | SyncItem::Freed { .. } => 12,
        SyncItem::Session { w, .. } => 24 + w.url.len(),
        SyncItem::Worker(WorkerChange::Added { config, .. }) => 16 + config.to_string().len(),
        SyncItem::Worker(WorkerChange::Draining { url } | WorkerChange::Removed { url }) => 16 + url.len(),
    }
}

/// Cuts `events` into runs of at most `max_events` events and about `max_bytes` bytes each
/// (an event larger than `max_bytes` goes alone), in order. Empty in, empty out.
pub fn pack(events: Vec<SyncItem>, max_events: usize, max_bytes: usize) -> Vec<Vec<SyncItem>> {
    let mut out = Vec::new();
    let (mut run, mut bytes) = (Vec::new(), 0);
    for e in events {
        let w = weight(&e);
        if !run.is_empty() && (run.len() >= max_events.max(1) || bytes + w > max_bytes) {
            out.push(std::mem::take(&mut run));
            bytes = 0;
        }
        bytes += w;
        run.push(e);
    }
    if !run.is_empty() {
        out.push(run);
    }
    out
}

/// The first of [`SECRET_KEYS`] that worker configuration `config` holds, if any.
pub fn secret_key(config: &serde_json::Value) -> Option<&'static str> {
    let map = config.as_object()?;
    SECRET_KEYS.iter().copied().find(|k| map.contains_key(*k))
}

/// Serializes an envelope in this build's format ([`binary`], version [`WIRE_VERSION`]).
pub fn encode(envelope: &Envelope) -> Vec<u8> {
    binary::encode(envelope)
}

/// Parses and checks a message of this build's version; names the format and version of any
/// other ([`DecodeError::Version`]). Never panics.
pub fn decode(bytes: &[u8]) -> Result<Envelope, DecodeError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(DecodeError::TooLarge(bytes.len()));
    }
    match bytes.first() {
        Some(&b) if u32::from(b) == WIRE_VERSION => binary::decode(bytes),
        // JSON (versions 1 to 3): its version and sender, to name them.
        Some(b'{' | b' ' | b'\t' | b'\n' | b'\r') => {
            let json::Header { v, from } = serde_json::from_slice(bytes)?;
            Err(DecodeError::Version {
                format: Format::Json,
                version: v,
                from,
            })
        }
        // Another binary version (the first byte a control character, as 4 is).
        Some(&b) if (1..0x20).contains(&b) => Err(DecodeError::Version {
            format: Format::Binary,
            version: u32::from(b),
            from: bytes
                .get(1..9)
                .and_then(|f| <[u8; 8]>::try_from(f).ok())
                .map(u64::from_le_bytes),
        }),
        _ => Err(DecodeError::Invalid {
            what: "format version",
            at: 0,
        }),
    }
}

impl Body {
    /// The wire form of a protocol message.
    pub fn from_message(message: Message<SyncItem>) -> Self {
        match message {
            Message::Events { seq, events } => Body::Events {
                seq: seq.0,
                at_us: None,
                events,
            },
            Message::Heartbeat { last } => Body::Heartbeat { seq: last.0 },
            Message::SnapshotRequest => Body::SnapshotRequest,
            Message::Snapshot(p) => Body::Snapshot {
                peers: p.peers.into_iter().map(|p| p.0).collect(),
                part: p.part,
                last: p.is_last,
                seq: p.last.0,
                events: p.events,
            },
        }
    }

    /// The protocol message this body carries.
    pub fn into_message(self) -> Message<SyncItem> {
        match self {
            Body::Events { seq, events, .. } => Message::Events {
                seq: BatchSeq(seq),
                events,
            },
            Body::Heartbeat { seq } => Message::Heartbeat { last: BatchSeq(seq) },
            Body::SnapshotRequest => Message::SnapshotRequest,
            Body::Snapshot {
                peers,
                part,
                last,
                seq,
                events,
            } => Message::Snapshot(SnapshotPart {
                peers: peers.into_iter().map(RouterId).collect(),
                last: BatchSeq(seq),
                part,
                is_last: last,
                events,
            }),
        }
    }
}

/// Whether a tenant number is 0 (left off the JSON).
fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl SyncItem {
    /// The wire form of `event`, naming workers through `name` (a worker's base URL); `None` if
    /// `name` knows a worker it books on no longer.
    pub fn from_sync(event: &SyncEvent, name: impl Fn(WorkerId) -> Option<String>) -> Option<Self> {
        let r = event.request.0;
        let reference = |key: WorkerKey| {
            name(key.worker).map(|url| WorkerRef {
                url,
                rank: key.dp_rank.0,
            })
        };
        Some(match &event.change {
            LoadChange::Added(b) => SyncItem::Added {
                r,
                w: reference(b.worker)?,
                pw: match b.prefill_worker {
                    Some(p) => Some(reference(p)?),
                    None => None,
                },
                o: b.overlap_blocks,
                pt: b.prompt_tokens,
                c: b.chain.iter().map(|h| h.0).collect(),
                ht: b.hint.tokens,
                hd: b
                    .hint
                    .expected_duration
                    .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
                eo: b.expected_output_tokens,
                s: b.session.map(|s| s.0),
                tn: b.tenant.0,
            },
            LoadChange::PrefillDone => SyncItem::PrefillDone { r },
            LoadChange::Freed => SyncItem::Freed { r },
            LoadChange::Session { session, worker } => SyncItem::Session {
                s: session.0,
                w: reference(*worker)?,
            },
        })
    }

    /// The router's form of this event from replica `from`, finding workers through `id` (a
    /// base URL to this replica's id). `None` for a registry change, or a booking on a worker
    /// this replica does not know.
    pub fn to_sync(&self, from: RouterId, id: impl Fn(&str) -> Option<WorkerId>) -> Option<SyncEvent> {
        let key = |w: &WorkerRef| id(&w.url).map(|worker| WorkerKey::new(worker, DpRank(w.rank)));
        let (r, change) = match self {
            SyncItem::Added {
                r,
                w,
                pw,
                o,
                pt,
                c,
                ht,
                hd,
                eo,
                s,
                tn,
            } => {
                let booking = Booking {
                    worker: key(w)?,
                    overlap_blocks: *o,
                    prefill_worker: match pw {
                        Some(p) => Some(key(p)?),
                        None => None,
                    },
                    prompt_tokens: *pt,
                    chain: c.iter().map(|&h| SequenceHash(h)).collect::<Arc<[_]>>(),
                    hint: PrefillLoadHint {
                        tokens: *ht,
                        expected_duration: hd.map(Duration::from_nanos),
                    },
                    expected_output_tokens: *eo,
                    session: s.map(SessionId),
                    tenant: TenantId(*tn),
                };
                (*r, LoadChange::Added(booking))
            }
            SyncItem::PrefillDone { r } => (*r, LoadChange::PrefillDone),
            SyncItem::Freed { r } => (*r, LoadChange::Freed),
            SyncItem::Session { s, w } => (
                0,
                LoadChange::Session {
                    session: SessionId(*s),
                    worker: key(w)?,
                },
            ),
            SyncItem::Worker(_) => return None,
        };
        Some(SyncEvent {
            router: from,
            request: RequestId(r),
            change,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booking() -> SyncEvent {
        SyncEvent {
            router: RouterId(7),
            request: RequestId(42),
            change: LoadChange::Added(Booking {
                worker: WorkerKey::new(WorkerId(3), DpRank(1)),
                overlap_blocks: 2,
                prefill_worker: Some(WorkerKey::new(WorkerId(4), DpRank(0))),
                prompt_tokens: 100,
                chain: vec![SequenceHash(1), SequenceHash(u64::MAX)].into(),
                hint: PrefillLoadHint {
                    tokens: 68,
                    expected_duration: Some(Duration::from_millis(5)),
                },
                expected_output_tokens: Some(9),
                session: Some(SessionId(u64::MAX)),
                tenant: TenantId(2),
            }),
        }
    }

    #[test]
    fn events_round_trip_through_urls_and_bytes() {
        let name = |w: WorkerId| Some(format!("http://w{}", w.0));
        let id = |u: &str| u.strip_prefix("http://w")?.parse().ok().map(WorkerId);
        let events = [
            booking(),
            SyncEvent {
                router: RouterId(7),
                request: RequestId(42),
                change: LoadChange::PrefillDone,
            },
            SyncEvent {
                router: RouterId(7),
                request: RequestId(42),
                change: LoadChange::Freed,
            },
            SyncEvent {
                router: RouterId(7),
                request: RequestId(0),
                change: LoadChange::Session {
                    session: SessionId(5),
                    worker: WorkerKey::new(WorkerId(3), DpRank(1)),
                },
            },
        ];
        let wire: Vec<SyncItem> = events
            .iter()
            .map(|e| SyncItem::from_sync(e, name).unwrap())
            .collect();
        let envelope = Envelope {
            from: 7,
            body: Body::Events {
                seq: 3,
                at_us: Some(1_700_000_000_000_000),
                events: wire,
            },
        };
        let back = decode(&encode(&envelope)).unwrap();
        assert_eq!(back, envelope);
        let Body::Events { events: wire, .. } = back.body else {
            panic!()
        };
        let again: Vec<SyncEvent> = wire.iter().map(|e| e.to_sync(RouterId(7), id).unwrap()).collect();
        assert_eq!(again, events);
    }

    #[test]
    fn an_unknown_worker_is_no_event() {
        let wire = SyncItem::from_sync(&booking(), |w| Some(format!("http://w{}", w.0))).unwrap();
        assert!(wire.to_sync(RouterId(7), |_| None).is_none());
        assert!(SyncItem::from_sync(&booking(), |_| None).is_none());
    }

    /// A version 4 message from replica 1 with `body` after the header.
    fn v4(body: &[u8]) -> Vec<u8> {
        let mut bytes = vec![4];
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(body);
        bytes
    }

    #[test]
    fn bad_binary_messages_are_named() {
        let credential = {
            let mut b = vec![0, 0, 0, 1, 4, 1];
            let config = br#"{"url":"http://h:1","api-key":"sk-1"}"#;
            b.push(config.len() as u8);
            b.extend_from_slice(config);
            b
        };
        // A booking: request 1, worker "u" rank 0, no options, o, pt, ht, tn 0, then its blocks.
        let booking = |blocks: &[u8], hashes: usize| {
            let mut b = vec![0, 0, 0, 1, 0, 1, 0, 1, b'u', 0, 0, 0, 0, 0, 0];
            b.extend_from_slice(blocks);
            b.extend(std::iter::repeat_n(7, 8 * hashes));
            b
        };
        // (bytes, expected error's text contains)
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "bad format version at byte 0"),
            (vec![0], "bad format version at byte 0"),
            (vec![0xff, 1], "bad format version at byte 0"),
            (vec![4], "bad a 64-bit number at byte 1"),
            (v4(&[9]), "bad the body's kind at byte 9"),
            (v4(&[1, 0, 0]), "bad the end of the message at byte 11"),
            (v4(&[1, 0x80]), "bad a batch number"),
            (
                v4(&[1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02]),
                "bad a batch number",
            ),
            (v4(&[0, 0, 2, 0]), "bad a timestamp's presence"),
            (v4(&[0, 0, 0, 0xff, 0xff, 0x7f]), "2097151 events in one message"),
            (v4(&[0, 0, 0, 100, 1, 1]), "bad the events' count"),
            (v4(&[3, 0xff, 0x7f]), "bad the peers' count"),
            (v4(&[3, 0, 0, 2, 0, 0]), "bad the last part's flag"),
            (v4(&[0, 0, 0, 1, 7, 0]), "bad an event's kind"),
            (v4(&[0, 0, 0, 1, 3, 1, 2, 0]), "bad a worker at"),
            (v4(&[0, 0, 0, 1, 5, 2, 0xc3, 0x28]), "bad a worker's URL"),
            (v4(&booking(&[0x81, 0x80, 0x08], 0)), "a booking of 131073 blocks"),
            (v4(&booking(&[3], 2)), "bad a booking's blocks"),
            (
                v4(&[0, 0, 0, 1, 0, 1, 0, 1, b'u', 0, 0x10]),
                "bad a booking's flags",
            ),
            (v4(&[0, 0, 0, 1, 4, 1, 1, b'{']), "a worker's configuration: EOF"),
            (v4(&credential), "carries \"api-key\""),
        ];
        for (bytes, want) in &cases {
            let err = decode(bytes).unwrap_err().to_string();
            assert!(err.contains(want), "{bytes:?}: {err}");
            assert!(
                !err.contains("sk-1"),
                "an error never repeats a credential: {err}"
            );
        }
        // The well-formed booking these cases bend decodes.
        let ok = decode(&v4(&booking(&[2], 2))).unwrap();
        let Body::Events { events, .. } = ok.body else {
            panic!()
        };
        assert!(matches!(&events[..], [SyncItem::Added { c, .. }] if c == &[0x0707_0707_0707_0707; 2]));
        let big = vec![4; MAX_MESSAGE_BYTES + 1];
        assert!(matches!(decode(&big), Err(DecodeError::TooLarge(_))));
    }

    #[test]
    fn other_versions_are_refused_by_format_and_version() {
        // (bytes, expected error's text contains)
        let cases: &[(&[u8], &str)] = &[
            // Version 3, the JSON format before this one, names its sender.
            (
                br#"{"v":3,"from":1,"body":{"kind":"heartbeat","seq":2}}"#,
                "sync message from replica 0000000000000001 in json format version 3; this build reads binary format version 4",
            ),
            (
                br#" {"v":2,"from":1,"body":{"kind":"heartbeat"}}"#,
                "in json format version 2;",
            ),
            (br#"{"v":1}"#, "sync message in json format version 1;"),
            (
                b"\x05\x01\0\0\0\0\0\0\0\x01\0",
                "from replica 0000000000000001 in binary format version 5;",
            ),
            (b"\x06", "sync message in binary format version 6;"),
            (br#"{"from":1}"#, "not a sync message"),
            (b"{", "not a sync message"),
        ];
        for (bytes, want) in cases {
            let err = decode(bytes).unwrap_err().to_string();
            assert!(err.contains(want), "{:?}: {err}", String::from_utf8_lossy(bytes));
        }
        assert!(matches!(
            decode(br#"{"v":3,"from":1,"body":{"kind":"heartbeat"}}"#),
            Err(DecodeError::Version {
                format: Format::Json,
                version: 3,
                from: Some(1)
            })
        ));
    }

    #[test]
    fn bad_json_messages_are_named() {
        // The JSON codec kept for measurement refuses as version 3 did.
        let cases: &[(&[u8], &str)] = &[
            (b"", "not a sync message"),
            (br#"{"v":4,"from":1,"body":{"kind":"heartbeat"}}"#, "version 4"),
            (br#"{"v":2,"from":1,"body":{"kind":"heartbeat"}}"#, "version 2"),
            (br#"{"v":3,"from":1,"body":{"kind":"gossip"}}"#, "not a sync message"),
            (br#"{"v":3,"from":1,"body":{"kind":"heartbeat"},"x":0}"#, "not a sync message"),
            (br#"{"v":3,"from":-1,"body":{"kind":"heartbeat"}}"#, "not a sync message"),
            (
                br#"{"v":3,"from":1,"body":{"kind":"events","events":[{"t":"freed"}]}}"#,
                "not a sync message",
            ),
            (
                br#"{"v":3,"from":1,"body":{"kind":"events","events":[{"t":"worker","op":"added","config":{"url":"http://h:1","api-key":"sk-1"}}]}}"#,
                "carries \"api-key\"",
            ),
        ];
        for (bytes, want) in cases {
            let err = json::decode(bytes).unwrap_err().to_string();
            assert!(err.contains(want), "{:?}: {err}", String::from_utf8_lossy(bytes));
            assert!(
                !err.contains("sk-1"),
                "an error never repeats a credential: {err}"
            );
        }
    }
}
