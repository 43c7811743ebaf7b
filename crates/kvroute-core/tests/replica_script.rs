//! Data-driven tests of the replica-sync protocol ([`ReplicaProtocol`]), with no server: a
//! script of what peers say, link changes and the passing of time goes in; the protocol's
//! actions, carried out on a real [`Router`] (replica 1, with workers 1 and 2), come out as text,
//! compared with `tests/data/replica/NAME.expected`.
//! `UPDATE_EXPECT=1 cargo test -p kvroute-core --test replica_script` rewrites the snapshots; read
//! the diff before keeping it.
//!
//! # Script language
//!
//! One command per line; `#` starts a comment line; comments and blank lines are copied to the
//! snapshot. Time starts at 0 and moves with `at`. After every line the harness checks
//! [`Router::check_invariants`].
//!
//! **Events** are `add:r7@2` (request r7 booked on worker 2, a four-block prompt), `first:r7`
//! (its prefill is done) and `free:r7`.
//!
//! | command | meaning |
//! | --- | --- |
//! | `config heartbeat=MS timeout=MS join=MS asks=N reannounces=N parts=N batch=MS lazy=MS max=N` | protocol settings (first); `parts`: events per snapshot part; `batch`, `lazy`, `max`: the [`Batcher`]'s |
//! | `at 1500` | the time is now 1,500 ms |
//! | `start` | the link is up: join |
//! | `link up`, `link down` | the link changed |
//! | `nobody-listening` | the transport saw no responder to a request |
//! | `from 2 events SEQ EVENT...` | replica 2's batch number SEQ |
//! | `from 2 heartbeat LAST` | replica 2's heartbeat, its last batch LAST |
//! | `from 2 ask` | replica 2 asks for this replica's snapshot |
//! | `from 2 snapshot last=N part=P end\|more [peers=3,4] EVENT...` | a part of replica 2's snapshot |
//! | `route r1` | this replica routes and books its request r1 (a four-block prompt) |
//! | `first r1`, `finish r1` | this replica's request r1 has its first token, finishes |
//! | `publish` | this replica's exported changes since the last `publish`, as one batch |
//! | `queue` | this replica's exported changes into its [`Batcher`], each with its urgency |
//! | `flush` | the batcher's changes, if due now, published as one batch |
//! | `timeout` | the next timeout, if any |
//! | `tick` | the protocol's timeouts due now |
//! | `loads` | requests booked per worker, and the peers heard |
//! | `counters` | the protocol's non-zero counters |
//!
//! Every command's line is copied to the snapshot, followed by ` => ` and its result (`ok`, or
//! what it says); the actions it caused follow on lines starting with `  + `, each carried out:
//! sends are printed, snapshots taken from the router and cut into parts, changes applied and
//! bookings released.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::ids::{DpRank, LocalBlockHash, RequestId, SequenceHash, WorkerId, WorkerKey};
use kvroute_core::router::replica::{
    Action, BatchConfig, BatchSeq, Batcher, LinkState, Message, ProtocolConfig, Release, ReplicaProtocol,
    SnapshotPart, To,
};
use kvroute_core::router::{
    Booking, LoadChange, Output, PrefillLoadHint, Prompt, RouteOutcome, RouteRequest, Router, RouterConfig,
    RouterId, SyncEvent, SyncMode, TenantId, WorkerRole, WorkerSpec,
};
use kvroute_core::time::Timestamp;

#[path = "support/script.rs"]
#[macro_use]
mod script;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/replica");
const ME: RouterId = RouterId(1);

fn num<T: std::str::FromStr>(key: &str, value: &str) -> T {
    value
        .parse()
        .unwrap_or_else(|_| panic!("bad value {value:?} for {key}"))
}

fn ms_of(t: Timestamp) -> u64 {
    t.as_nanos() / 1_000_000
}

fn request_id(spec: &str) -> RequestId {
    let n = spec
        .strip_prefix('r')
        .unwrap_or_else(|| panic!("request ids look like r1, got {spec:?}"));
    RequestId(num("request", n))
}

fn worker(spec: &str) -> WorkerKey {
    WorkerKey::new(WorkerId(num("worker", spec)), DpRank(0))
}

/// A four-block booking on `w`.
fn booking(w: WorkerKey) -> Booking {
    Booking {
        worker: w,
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
    }
}

/// `add:r7@2`, `first:r7`, `free:r7`, from replica `from`.
fn event(from: RouterId, spec: &str) -> SyncEvent {
    let (kind, rest) = spec
        .split_once(':')
        .unwrap_or_else(|| panic!("events look like add:r1@2, first:r1, free:r1; got {spec:?}"));
    let (request, change) = match kind {
        "add" => {
            let (r, w) = rest
                .split_once('@')
                .unwrap_or_else(|| panic!("add:rN@W, got {spec:?}"));
            (request_id(r), LoadChange::Added(booking(worker(w))))
        }
        "first" => (request_id(rest), LoadChange::PrefillDone),
        "free" => (request_id(rest), LoadChange::Freed),
        other => panic!("bad event kind {other:?}"),
    };
    SyncEvent {
        router: from,
        request,
        change,
    }
}

fn fmt_event(e: &SyncEvent) -> String {
    match &e.change {
        LoadChange::Added(b) => format!("add:r{}@{}", e.request.0, b.worker.worker.0),
        LoadChange::PrefillDone => format!("first:r{}", e.request.0),
        LoadChange::Freed => format!("free:r{}", e.request.0),
        LoadChange::Session { worker, .. } => format!("session:{worker}"),
    }
}

fn fmt_events(events: &[SyncEvent]) -> String {
    events.iter().map(fmt_event).collect::<Vec<_>>().join(" ")
}

fn fmt_to(to: To) -> String {
    match to {
        To::Everyone => "everyone".to_owned(),
        To::Peer(p) => format!("replica {}", p.0),
    }
}

fn fmt_message(m: &Message<SyncEvent>) -> String {
    match m {
        Message::Events { seq, events } => format!("events #{} [{}]", seq.0, fmt_events(events)),
        Message::Heartbeat { last } => format!("heartbeat (last #{})", last.0),
        Message::SnapshotRequest => "ask".to_owned(),
        Message::Snapshot(p) => format!(
            "snapshot last=#{} part {}{} peers [{}] [{}]",
            p.last.0,
            p.part,
            if p.is_last { " end" } else { " more" },
            p.peers
                .iter()
                .map(|p| p.0.to_string())
                .collect::<Vec<_>>()
                .join(","),
            fmt_events(&p.events)
        ),
    }
}

struct Harness {
    config: ProtocolConfig,
    batch_config: BatchConfig,
    batcher: Option<Batcher<SyncEvent>>,
    /// Events per snapshot part.
    part_size: usize,
    protocol: Option<ReplicaProtocol>,
    router: Router,
    now: Timestamp,
}

impl Harness {
    fn new() -> Self {
        let mut config = RouterConfig {
            router_id: ME,
            block_size: 4,
            ..RouterConfig::default()
        };
        config.sync.mode = SyncMode::Export;
        let mut router = Router::new(config).expect("router config");
        for w in ["1", "2"] {
            router
                .handle_worker_added(
                    Timestamp::ZERO,
                    WorkerSpec::new(worker(w), WorkerRole::Aggregated, 100),
                )
                .expect("worker");
        }
        Self {
            config: ProtocolConfig::default(),
            batch_config: BatchConfig::default(),
            batcher: None,
            part_size: 64,
            protocol: None,
            router,
            now: Timestamp::ZERO,
        }
    }

    fn protocol(&mut self) -> &mut ReplicaProtocol {
        let config = self.config;
        self.protocol
            .get_or_insert_with(|| ReplicaProtocol::new(ME, config))
    }

    fn run(&mut self, line: &str) -> String {
        let mut words = line.split_whitespace();
        let command = words.next().unwrap_or_default();
        let args: Vec<&str> = words.collect();
        let arg = |i: usize| {
            *args
                .get(i)
                .unwrap_or_else(|| panic!("{command} needs argument {i}"))
        };
        let now = self.now;
        match command {
            "config" => {
                assert!(self.protocol.is_none(), "config must come first");
                for a in &args {
                    let (key, value) = a
                        .split_once('=')
                        .unwrap_or_else(|| panic!("expected key=value, got {a:?}"));
                    let ms = || Duration::from_millis(num(key, value));
                    match key {
                        "heartbeat" => self.config.heartbeat_interval = ms(),
                        "timeout" => self.config.peer_timeout = ms(),
                        "join" => self.config.join_timeout = ms(),
                        "asks" => self.config.snapshot_asks = num(key, value),
                        "reannounces" => self.config.reannounces = num(key, value),
                        "parts" => self.part_size = num(key, value),
                        "batch" => self.batch_config.window = ms(),
                        "lazy" => self.batch_config.lazy_window = ms(),
                        "max" => self.batch_config.max_events = num(key, value),
                        other => panic!("unknown config key {other:?}"),
                    }
                }
                "ok".to_owned()
            }
            "at" => {
                self.now = Timestamp::from_millis(num("at", arg(0)));
                "ok".to_owned()
            }
            "start" => {
                let actions = self.protocol().start(now);
                self.carry_out(actions)
            }
            "link" => {
                let link = match arg(0) {
                    "up" => LinkState::Connected,
                    "down" => LinkState::Disconnected,
                    other => panic!("link up or down, not {other:?}"),
                };
                let actions = self.protocol().handle_link(now, link);
                self.carry_out(actions)
            }
            "nobody-listening" => {
                let actions = self.protocol().handle_nobody_listening(now);
                self.carry_out(actions)
            }
            "from" => {
                let from = RouterId(num("replica", arg(0)));
                let message = self.message(from, &args[1..]);
                let actions = self.protocol().handle(now, from, message);
                self.carry_out(actions)
            }
            "route" => {
                let locals: Vec<LocalBlockHash> = (0..4).map(|i| LocalBlockHash(100 + i)).collect();
                let request = RouteRequest::new(
                    request_id(arg(0)),
                    Prompt::Blocks {
                        locals: &locals,
                        prompt_tokens: 16,
                    },
                );
                match self.router.handle_request(now, &request) {
                    Ok(RouteOutcome::Routed(d)) => format!("routed {}", d.worker.worker.0),
                    Ok(other) => format!("{other:?}"),
                    Err(e) => format!("error: {e}"),
                }
            }
            "publish" => {
                let mut batch = Vec::new();
                while let Some(e) = self.router.poll_sync_event() {
                    batch.push(e);
                }
                match self.protocol().publish(now, batch) {
                    Some(m) => format!("send everyone {}", fmt_message(&m)),
                    None => "nothing sent".to_owned(),
                }
            }
            "first" | "finish" => {
                let id = request_id(arg(0));
                let done = if command == "first" {
                    self.router.handle_first_token(now, id)
                } else {
                    self.router.handle_finished(now, id)
                };
                match done {
                    Ok(_) => "ok".to_owned(),
                    Err(e) => format!("error: {e}"),
                }
            }
            "queue" => {
                let config = self.batch_config;
                let batcher = self.batcher.get_or_insert_with(|| Batcher::new(config));
                let mut queued = 0;
                while let Some(e) = self.router.poll_sync_event() {
                    let urgency = e.change.urgency();
                    batcher.push(now, e, urgency);
                    queued += 1;
                }
                match batcher.poll_timeout() {
                    Some(t) => format!(
                        "{queued} queued, {} waiting, due at {} ms",
                        batcher.len(),
                        ms_of(t)
                    ),
                    None => format!("{queued} queued, none waiting"),
                }
            }
            "flush" => {
                let config = self.batch_config;
                let batcher = self.batcher.get_or_insert_with(|| Batcher::new(config));
                match batcher.take_due(now) {
                    Some(batch) => match self.protocol().publish(now, batch) {
                        Some(m) => format!("send everyone {}", fmt_message(&m)),
                        None => "nothing sent".to_owned(),
                    },
                    None => match batcher.poll_timeout() {
                        Some(t) => format!("not due (at {} ms)", ms_of(t)),
                        None => "none waiting".to_owned(),
                    },
                }
            }
            "timeout" => match self.protocol().poll_timeout() {
                Some(t) => format!("at {} ms", ms_of(t)),
                None => "none".to_owned(),
            },
            "tick" => {
                let actions = self.protocol().handle_timeout(now);
                self.carry_out(actions)
            }
            "loads" => {
                let metrics = self.router.metrics();
                let loads: Vec<String> = metrics
                    .workers
                    .iter()
                    .map(|w| format!("worker {}: {}", w.spec.key.worker.0, w.load.requests))
                    .collect();
                let peers: Vec<String> = self.protocol().peers().map(|p| p.0.to_string()).collect();
                format!("{}; peers [{}]", loads.join(", "), peers.join(","))
            }
            "counters" => format!("{:?}", self.protocol().counters()),
            other => panic!("unknown command {other:?}"),
        }
    }

    fn joined(&mut self) -> String {
        if self.protocol().is_joined() {
            "joined".to_owned()
        } else {
            "joining".to_owned()
        }
    }

    fn message(&self, from: RouterId, args: &[&str]) -> Message<SyncEvent> {
        let kind = args.first().copied().unwrap_or_default();
        match kind {
            "events" => Message::Events {
                seq: BatchSeq(num("seq", args[1])),
                events: args[2..].iter().map(|e| event(from, e)).collect(),
            },
            "heartbeat" => Message::Heartbeat {
                last: BatchSeq(num("last", args[1])),
            },
            "ask" => Message::SnapshotRequest,
            "snapshot" => {
                let mut part = SnapshotPart {
                    peers: Vec::new(),
                    last: BatchSeq(0),
                    part: 0,
                    is_last: true,
                    events: Vec::new(),
                };
                for a in &args[1..] {
                    match a.split_once('=') {
                        Some(("last", v)) => part.last = BatchSeq(num("last", v)),
                        Some(("part", v)) => part.part = num("part", v),
                        Some(("peers", v)) => {
                            part.peers = v.split(',').map(|p| RouterId(num("peer", p))).collect();
                        }
                        _ if *a == "end" => part.is_last = true,
                        _ if *a == "more" => part.is_last = false,
                        _ => part.events.push(event(from, a)),
                    }
                }
                Message::Snapshot(part)
            }
            other => panic!("bad message kind {other:?}"),
        }
    }

    /// Carries out `actions` on the router; returns what they did, one line each.
    fn carry_out(&mut self, actions: Vec<Action<SyncEvent>>) -> String {
        let mut lines = vec![self.joined()];
        let now = self.now;
        for action in actions {
            match action {
                Action::Send { to, message } => {
                    lines.push(format!("send {} {}", fmt_to(to), fmt_message(&message)));
                }
                Action::SendSnapshot { to } => {
                    let state = self.router.sync_snapshot();
                    let parts: Vec<Vec<SyncEvent>> =
                        state.chunks(self.part_size.max(1)).map(<[_]>::to_vec).collect();
                    let messages = self.protocol().snapshot_messages(parts);
                    for m in messages {
                        lines.push(format!("send {} {}", fmt_to(to), fmt_message(&m)));
                    }
                }
                Action::Apply { from, events } => {
                    let mut refused = 0;
                    for e in &events {
                        match self.router.handle_sync_event(now, e) {
                            Ok(outputs) => assert!(outputs.iter().all(|o| matches!(o, Output::Routed(_)))),
                            Err(_) => refused += 1,
                        }
                    }
                    let note = if refused > 0 {
                        format!(" ({refused} refused)")
                    } else {
                        String::new()
                    };
                    lines.push(format!("apply from {}: [{}]{note}", from.0, fmt_events(&events)));
                }
                Action::Release { peer, cause } => {
                    let outputs = self.router.handle_peer_lost(now, peer);
                    assert!(outputs.iter().all(|o| matches!(o, Output::Routed(_))));
                    let why = match cause {
                        Release::Silent => "silent",
                        Release::Replaced => "replaced",
                    };
                    lines.push(format!("release {} ({why})", peer.0));
                }
            }
        }
        lines.join("\n  + ")
    }
}

impl script::Harness for Harness {
    fn run(&mut self, input: &str) -> String {
        Harness::run(self, input)
    }

    fn check(&self) -> Result<(), String> {
        self.router.check_invariants()
    }
}

fn run_script(name: &str) {
    script::run_file(Path::new(DATA), name, &mut Harness::new());
}

scripts!(
    join_alone,
    join_with_peers,
    join_timeout,
    join_race,
    snapshot_in_parts,
    peer_timeout,
    duplicates_and_gaps,
    reconnect,
    tombstones,
    batching,
    heartbeats_ride_on_batches,
);
