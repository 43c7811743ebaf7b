//! `kvroute bench sync`: the CPU and bytes of replica sync a request, the binary format (version
//! 4) beside the JSON format before it (version 3), in one run on the same messages.
//!
//! A request's sync is three changes (booked, prefill done, freed). Here they travel in one
//! message, as about one batch a request does at a moderate rate. Each request is timed in
//! three parts, each on its own:
//!
//! * **send**: the sender's work: `SyncItem::from_sync` of the three changes and encoding the
//!   message (`wire::encode`, or `wire::json::encode` for version 3).
//! * **receive**: one peer's decoding (`wire::decode` / `wire::json::decode`) and
//!   `SyncItem::to_sync` of each change, workers found by URL.
//! * **apply**: one peer's `Router::handle_sync_event` of the three changes (the same in both
//!   formats; a router of four workers).
//!
//! Three replicas together spend send + 2 × (receive + apply) a request (`codec_ns` leaves
//! apply out). Not covered: the NATS client, the transport task's wake-ups and the proxy's lock
//! around the apply, which are the same in both formats.
//!
//! Formats alternate within each repetition; a figure is the median repetition's mean. Each part
//! is a function of its own (`send_json_v3`, `receive_binary_v4`, `apply_changes`, …) for
//! counting instructions under `valgrind --tool=callgrind`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::ids::{DpRank, RequestId, SequenceHash, WorkerId, WorkerKey};
use kvroute_core::router::{
    Booking, LoadChange, PrefillLoadHint, Router, RouterConfig, RouterId, SyncEvent, TenantId, WorkerRole,
    WorkerSpec,
};
use kvroute_core::time::Timestamp;
use kvroute_sync::wire::{self, Body, Envelope, SyncItem};
use serde::Serialize;

/// Workers a booking may name (the demo's four).
pub(super) const WORKERS: usize = 4;

/// A router of `config` over the benchmarks' fleet: [`WORKERS`] aggregated workers of 65,536
/// blocks.
pub(super) fn fleet_router(config: RouterConfig) -> anyhow::Result<Router> {
    let mut router = Router::new(config)?;
    for w in 0..WORKERS {
        router.handle_worker_added(
            Timestamp::ZERO,
            WorkerSpec::new(
                WorkerKey::new(WorkerId(w as u64), DpRank(0)),
                WorkerRole::Aggregated,
                1 << 16,
            ),
        )?;
    }
    Ok(router)
}
/// Distinct prompts the requests cycle through.
const POOL: usize = 64;

/// A format of the sync message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncFormat {
    /// Version 3, JSON.
    JsonV3,
    /// Version 4, binary.
    BinaryV4,
}

impl SyncFormat {
    fn encode(self, e: &Envelope) -> Vec<u8> {
        match self {
            SyncFormat::JsonV3 => wire::json::encode(e),
            SyncFormat::BinaryV4 => wire::encode(e),
        }
    }

    fn decode(self, bytes: &[u8]) -> Result<Envelope, wire::DecodeError> {
        match self {
            SyncFormat::JsonV3 => wire::json::decode(bytes),
            SyncFormat::BinaryV4 => wire::decode(bytes),
        }
    }
}

/// One format's figures at one booking size.
#[derive(Clone, Debug, Serialize)]
pub struct SyncBenchReport {
    /// Always `sync`.
    pub bench: &'static str,
    /// The format.
    pub format: SyncFormat,
    /// Prompt blocks a booking carries.
    pub blocks: usize,
    /// Requests timed a repetition.
    pub requests: usize,
    /// Bytes of a request's message.
    pub bytes_per_request: usize,
    /// `bytes_per_request` over `blocks`.
    pub bytes_per_block: f64,
    /// What one more block in the booking adds, in bytes.
    pub marginal_bytes_per_block: f64,
    /// The sender's work a request, nanoseconds (mean of the median repetition).
    pub send_ns: f64,
    /// One peer's decoding and conversion a request, nanoseconds.
    pub receive_ns: f64,
    /// One peer's router applying the request's changes, nanoseconds.
    pub apply_ns: f64,
    /// Three replicas' encoding and decoding a request: send + 2 × receive.
    pub codec_ns: f64,
    /// Three replicas' whole measured path a request: send + 2 × (receive + apply).
    pub total_ns: f64,
    /// For the binary format: `codec_ns` over the JSON format's, in the same run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub codec_vs_json: Option<f64>,
    /// For the binary format: `total_ns` over the JSON format's, in the same run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_vs_json: Option<f64>,
}

fn url(w: usize) -> String {
    format!("http://127.0.0.1:{}", 8001 + w)
}

/// The three changes of request `r` (its prompt `chain`) by replica `from`.
fn changes(from: RouterId, r: u64, chain: &Arc<[SequenceHash]>) -> [SyncEvent; 3] {
    let request = RequestId(r);
    let booking = Booking {
        worker: WorkerKey::new(WorkerId(r % WORKERS as u64), DpRank(0)),
        overlap_blocks: (chain.len() / 2) as u32,
        prefill_worker: None,
        prompt_tokens: chain.len() as u64 * 16 + 7,
        chain: chain.clone(),
        hint: PrefillLoadHint {
            tokens: chain.len() as u64 * 8 + 7,
            expected_duration: Some(Duration::from_micros(1_234)),
        },
        expected_output_tokens: Some(128),
        session: None,
        tenant: TenantId(0),
    };
    [
        SyncEvent {
            router: from,
            request,
            change: LoadChange::Added(booking),
        },
        SyncEvent {
            router: from,
            request,
            change: LoadChange::PrefillDone,
        },
        SyncEvent {
            router: from,
            request,
            change: LoadChange::Freed,
        },
    ]
}

/// The sender's work: the router's changes to the wire's, and the message's bytes.
fn send(format: SyncFormat, from: RouterId, r: u64, changes: &[SyncEvent], urls: &[String]) -> Vec<u8> {
    let events: Vec<SyncItem> = changes
        .iter()
        .filter_map(|e| SyncItem::from_sync(e, |w| urls.get(w.0 as usize).cloned()))
        .collect();
    format.encode(&Envelope {
        from: from.0,
        body: Body::Events {
            seq: r + 1,
            at_us: Some(1_765_000_000_000_000 + r),
            events,
        },
    })
}

/// A peer's work before its router: the bytes to the message, the wire's changes to the router's.
fn receive(format: SyncFormat, bytes: &[u8], urls: &[String]) -> anyhow::Result<Vec<SyncEvent>> {
    let envelope = format.decode(bytes)?;
    let Body::Events { events, .. } = envelope.body else {
        anyhow::bail!("the {format:?} message came back as another kind");
    };
    let sender = RouterId(envelope.from);
    let find = |u: &str| urls.iter().position(|x| x == u).map(|w| WorkerId(w as u64));
    Ok(events.iter().filter_map(|e| e.to_sync(sender, find)).collect())
}

// One function a format and part, never inlined, so that a profiler (`callgrind_annotate
// --inclusive=yes`) counts each part's instructions on its own.

#[inline(never)]
fn send_json_v3(from: RouterId, r: u64, changes: &[SyncEvent], urls: &[String]) -> Vec<u8> {
    send(SyncFormat::JsonV3, from, r, changes, urls)
}

#[inline(never)]
fn send_binary_v4(from: RouterId, r: u64, changes: &[SyncEvent], urls: &[String]) -> Vec<u8> {
    send(SyncFormat::BinaryV4, from, r, changes, urls)
}

#[inline(never)]
fn receive_json_v3(bytes: &[u8], urls: &[String]) -> anyhow::Result<Vec<SyncEvent>> {
    receive(SyncFormat::JsonV3, bytes, urls)
}

#[inline(never)]
fn receive_binary_v4(bytes: &[u8], urls: &[String]) -> anyhow::Result<Vec<SyncEvent>> {
    receive(SyncFormat::BinaryV4, bytes, urls)
}

#[inline(never)]
fn apply_changes(peer: &mut Router, changes: &[SyncEvent]) -> anyhow::Result<()> {
    for e in changes {
        black_box(peer.handle_sync_event(Timestamp::ZERO, e)?);
    }
    Ok(())
}

/// The per-request means of one pass, nanoseconds: send, receive, apply.
#[derive(Clone, Copy, Default)]
struct Pass {
    send: f64,
    receive: f64,
    apply: f64,
}

/// Runs `requests` requests in `format` through a sender and one peer (a fresh router).
fn pass(
    format: SyncFormat,
    pool: &[Arc<[SequenceHash]>],
    requests: usize,
    urls: &[String],
) -> anyhow::Result<Pass> {
    let from = RouterId(1);
    let mut peer = fleet_router(RouterConfig {
        router_id: RouterId(2),
        ..RouterConfig::default()
    })?;
    let (mut send, mut receive, mut apply) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for r in 0..requests as u64 {
        let chain = &pool[r as usize % pool.len()];
        let changes = changes(from, r, chain);
        let t0 = Instant::now();
        let bytes = match format {
            SyncFormat::JsonV3 => send_json_v3(from, r, &changes, urls),
            SyncFormat::BinaryV4 => send_binary_v4(from, r, &changes, urls),
        };
        let t1 = Instant::now();
        let received = match format {
            SyncFormat::JsonV3 => receive_json_v3(black_box(&bytes), urls)?,
            SyncFormat::BinaryV4 => receive_binary_v4(black_box(&bytes), urls)?,
        };
        let t2 = Instant::now();
        apply_changes(&mut peer, &received)?;
        let t3 = Instant::now();
        anyhow::ensure!(received.len() == 3, "a {format:?} request's changes were lost");
        send += t1 - t0;
        receive += t2 - t1;
        apply += t3 - t2;
    }
    let n = requests.max(1) as f64;
    Ok(Pass {
        send: send.as_nanos() as f64 / n,
        receive: receive.as_nanos() as f64 / n,
        apply: apply.as_nanos() as f64 / n,
    })
}

/// Both formats at each booking size in `blocks`, `requests` requests a repetition.
pub fn run(
    blocks: &[usize],
    requests: usize,
    reps: usize,
    seed: u64,
) -> anyhow::Result<Vec<SyncBenchReport>> {
    let urls: Vec<String> = (0..WORKERS).map(url).collect();
    let formats = [SyncFormat::JsonV3, SyncFormat::BinaryV4];
    let mut reports = Vec::new();
    for &n in blocks {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let pool: Vec<Arc<[SequenceHash]>> = (0..POOL)
            .map(|_| {
                (0..n)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        SequenceHash(state)
                    })
                    .collect()
            })
            .collect();
        let mut passes: [Vec<Pass>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..reps.max(1) {
            for (i, &format) in formats.iter().enumerate() {
                passes[i].push(pass(format, &pool, requests, &urls)?);
            }
        }
        let line = |format: SyncFormat, passes: &mut Vec<Pass>, json: Option<&SyncBenchReport>| {
            passes.sort_by(|a, b| {
                (a.send + 2.0 * (a.receive + a.apply)).total_cmp(&(b.send + 2.0 * (b.receive + b.apply)))
            });
            let p = passes[passes.len() / 2];
            let size = |chain: &Arc<[SequenceHash]>| {
                send(format, RouterId(1), 1, &changes(RouterId(1), 1, chain), &urls).len()
            };
            let bytes = size(&pool[0]);
            let doubled: Arc<[SequenceHash]> = pool[0].iter().chain(pool[1].iter()).copied().collect();
            let codec = p.send + 2.0 * p.receive;
            let total = p.send + 2.0 * (p.receive + p.apply);
            SyncBenchReport {
                bench: "sync",
                format,
                blocks: n,
                requests,
                bytes_per_request: bytes,
                bytes_per_block: bytes as f64 / n.max(1) as f64,
                marginal_bytes_per_block: (size(&doubled) - bytes) as f64 / n.max(1) as f64,
                send_ns: p.send,
                receive_ns: p.receive,
                apply_ns: p.apply,
                codec_ns: codec,
                total_ns: total,
                codec_vs_json: json.map(|j| codec / j.codec_ns),
                total_vs_json: json.map(|j| total / j.total_ns),
            }
        };
        let [json_passes, binary_passes] = &mut passes;
        let json = line(SyncFormat::JsonV3, json_passes, None);
        let binary = line(SyncFormat::BinaryV4, binary_passes, Some(&json));
        reports.push(json);
        reports.push(binary);
    }
    Ok(reports)
}
