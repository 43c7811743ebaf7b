//! Data-driven tests of the router core: a script of events goes in (workers, KV events,
//! requests, first tokens, completions, ticks), a text snapshot of decisions and per-worker loads
//! comes out, compared with `tests/data/router/NAME.expected`.
//! `UPDATE_EXPECT=1 cargo test -p kvroute-core --test router_script` rewrites the snapshots; read
//! the diff before keeping it.
//!
//! # Script language
//!
//! One command per line; `#` starts a comment line; comments and blank lines are copied to the
//! snapshot. Time starts at 0 and moves with `at`. After every line the harness checks
//! [`Router::check_invariants`] and fails if it errs.
//!
//! **Prompts** are segments joined by `+`: `sys` is one block, `sys*3` three blocks, `~5` five
//! tokens of a trailing partial block. Block `k` of segment `name` always has the same tokens,
//! so `sys*2+a` and `sys*2+b` share their first two blocks.
//!
//! | command | meaning |
//! | --- | --- |
//! | `config key=value ...` | router settings (before anything else; see [`config`]) |
//! | `worker 1 agg cap=100`, `worker 2/1 decode cap=50 batch=2048 seqs=8` | add a worker (role `agg`, `prefill` or `decode`) |
//! | `drain 1`, `suspend 1`, `remove 1` | mark draining; take out of routing; remove |
//! | `at 1500` | the time is now 1,500 ms |
//! | `cache 1 PROMPT` | KV event: worker 1 stored the prompt's blocks (ext = sequence hash) |
//! | `evict 1 PROMPT [from=K]` | KV event: worker 1 removed the prompt's blocks from position K on |
//! | `clear 1` | KV event: worker 1 cleared its cache |
//! | `route r1 PROMPT [prio=N] [osl=N] [lora=X] [salt=X] [session=X]` | route a request |
//! | `explain PROMPT` | the candidates for a prompt, with projections and costs, without routing |
//! | `first r1`, `block r1`, `done r1`, `cancel r1` | lifecycle events |
//! | `remote r7 W PROMPT [cached=K] [prefill=P] [from=N] [session=X]` | replica 9 (or N) booked its request r7 on worker W |
//! | `remote-session X W [from=N]` | replica 9's (or N's) snapshot binds session X to worker W |
//! | `sessions` | every session's binding, least recently used first |
//! | `remote-first r7 [from=N]`, `remote-done r7 [from=N]` | replica 9's (or N's) lifecycle events |
//! | `peer-lost [N]` | replica 9 (or N) went silent: its bookings are released |
//! | `snapshot` | this router's in-flight bookings, then its sessions, as replica events |
//! | `echo r1` | this router's own "freed" event comes back (must be dropped) |
//! | `tick` | a timer tick |
//! | `loads`, `metrics` | per-worker loads; non-zero counters |
//! | `outbox` | the replica events this router exported since the last `outbox` |
//!
//! Every command's line is copied to the snapshot, followed by ` => ` and its result; outputs
//! that an input caused (released or dropped requests) follow on lines starting with `  + `.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::{
    DpRank, ExternalBlockHash, LocalBlockHash, RequestId, SequenceHash, WorkerId, WorkerKey,
};
use kvroute_core::router::{
    Booking, CacheMode, Candidate, CostParams, Decider, Decision, DecodeProjection, DropReason, IndexEvent,
    LoadChange, Output, PolicyConfig, PrefillLoadHint, Prompt, QueueOrder, RecentConfig, RejectReason,
    RequestView, RouteOutcome, RouteRequest, Router, RouterConfig, RouterError, RouterId, SessionId,
    SyncEvent, SyncMode, TenantId, WorkerRole, WorkerSpec, cost, stored_blocks,
};
use kvroute_core::time::Timestamp;

#[path = "support/script.rs"]
#[macro_use]
mod script;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/router");
const REPLICA: RouterId = RouterId(9);

/// Parses `1` or `1/2` into a worker key.
fn worker_key(spec: &str) -> WorkerKey {
    let (id, rank) = spec.split_once('/').unwrap_or((spec, "0"));
    WorkerKey::new(
        WorkerId(id.parse().unwrap_or_else(|_| panic!("bad worker {spec:?}"))),
        DpRank(rank.parse().unwrap_or_else(|_| panic!("bad rank {spec:?}"))),
    )
}

fn request_id(spec: &str) -> RequestId {
    let n = spec
        .strip_prefix('r')
        .unwrap_or_else(|| panic!("request ids look like r1, got {spec:?}"));
    RequestId(n.parse().unwrap_or_else(|_| panic!("bad request {spec:?}")))
}

fn ms(spec: &str) -> Duration {
    Duration::from_millis(
        spec.parse()
            .unwrap_or_else(|_| panic!("bad milliseconds {spec:?}")),
    )
}

fn num<T: std::str::FromStr>(key: &str, value: &str) -> T {
    value
        .parse()
        .unwrap_or_else(|_| panic!("bad value {value:?} for {key}"))
}

/// `key=value` arguments.
fn options<'a>(args: &[&'a str]) -> BTreeMap<&'a str, &'a str> {
    args.iter()
        .map(|a| {
            a.split_once('=')
                .unwrap_or_else(|| panic!("expected key=value, got {a:?}"))
        })
        .collect()
}

/// Builds a [`RouterConfig`] from `config` options:
///
/// `policy`, `prefill_policy` (names); `block`, `seed`, `router`; `projection=staged|full`,
/// `credit`, `scale`, `req_weight`, `temperature` (cost policies); `threshold`, `abs`, `rel`,
/// `tree` (sglang); `w_prefix`, `w_queue`, `w_kv` (llm-d); `decider=never|always|N`;
/// `cache=events|predict:TTL_MS|approx:TTL_MS[:MAX_BLOCKS]`; `busy_decode`, `busy_prefill`,
/// `busy_prefill_frac`, `busy_requests`; `queue` (capacity), `order=fcfs|spf`,
/// `when_empty=reject|queue`;
/// `request_ttl` (ms); `track_output=1`; `export=1`; `session_max`, `session_ttl` (ms),
/// `session_requests`, `session_decode` (overload fractions; `off` for none).
fn config(args: &[&str]) -> RouterConfig {
    let mut c = RouterConfig::default();
    let opts = options(args);
    let policy = |name: &str| PolicyConfig::from_name(name).unwrap_or_else(|e| panic!("{e}"));
    if let Some(name) = opts.get("policy") {
        c.policy = policy(name);
    }
    if let Some(name) = opts.get("prefill_policy") {
        c.prefill_policy = Some(policy(name));
    }
    for (&key, &value) in &opts {
        match key {
            "policy" | "prefill_policy" => {}
            "block" => c.block_size = num(key, value),
            "seed" => c.seed = num(key, value),
            "router" => c.router_id = RouterId(num(key, value)),
            "decider" => {
                c.decider = match value {
                    "never" => Decider::Never,
                    "always" => Decider::Always,
                    n => Decider::PrefixThreshold {
                        uncached_tokens: num(key, n),
                    },
                }
            }
            "cache" => c.cache = cache_mode(value),
            "busy_decode" => c.busy.decode_blocks_fraction = Some(num(key, value)),
            "busy_prefill" => c.busy.prefill_tokens = Some(num(key, value)),
            "busy_prefill_frac" => c.busy.prefill_tokens_fraction = Some(num(key, value)),
            "busy_requests" => c.busy.requests_fraction = Some(num(key, value)),
            "queue" => c.queue.capacity = num(key, value),
            "when_empty" => c.queue.when_empty = value.parse().unwrap_or_else(|e| panic!("{e}")),
            "order" => {
                c.queue.order = match value {
                    "fcfs" => QueueOrder::Fcfs,
                    "spf" => QueueOrder::ShortestPrefillFirst,
                    other => panic!("bad order {other:?}"),
                }
            }
            "request_ttl" => c.request_ttl = ms(value),
            "track_output" => c.track_output_blocks = value == "1",
            "session_max" => c.sessions.max_sessions = num(key, value),
            "session_ttl" => c.sessions.idle_ttl = ms(value),
            "session_requests" => c.sessions.overloaded.requests_fraction = fraction(key, value),
            "session_decode" => c.sessions.overloaded.decode_blocks_fraction = fraction(key, value),
            "export" => {
                c.sync.mode = if value == "1" {
                    SyncMode::Export
                } else {
                    SyncMode::Off
                }
            }
            _ => set_policy_param(&mut c.policy, key, value),
        }
    }
    c
}

/// A fraction, or `off`.
fn fraction(key: &str, value: &str) -> Option<f64> {
    (value != "off").then(|| num(key, value))
}

/// A session named in a script.
fn session(name: &str) -> SessionId {
    SessionId::from_header(name)
}

fn set_policy_param(policy: &mut PolicyConfig, key: &str, value: &str) {
    match policy {
        PolicyConfig::Kv(p) | PolicyConfig::Dynamo(p) => match key {
            "projection" => {
                p.cost.projection = match value {
                    "staged" => DecodeProjection::Staged,
                    "full" => DecodeProjection::Full,
                    other => panic!("bad projection {other:?}"),
                }
            }
            "credit" => p.cost.overlap_credit = num(key, value),
            "scale" => p.cost.prefill_load_scale = num(key, value),
            "req_weight" => p.cost.decode_active_request_weight = num(key, value),
            "evict" => p.cost.evict_weight = num(key, value),
            "fleet" => p.cost.fleet_weight = num(key, value),
            "stall" => p.cost.stall_weight = num(key, value),
            "transfer" => p.cost.transfer_block_cost = num(key, value),
            "temperature" => p.temperature = num(key, value),
            other => panic!("unknown cost option {other:?}"),
        },
        PolicyConfig::SglangCacheAware(s) => match key {
            "threshold" => s.cache_threshold = num(key, value),
            "abs" => s.balance_abs_threshold = num(key, value),
            "rel" => s.balance_rel_threshold = num(key, value),
            "tree" => s.max_tree_blocks = num(key, value),
            other => panic!("unknown sglang option {other:?}"),
        },
        PolicyConfig::LlmdWeighted(l) => match key {
            "w_prefix" => l.prefix_weight = num(key, value),
            "w_queue" => l.queue_weight = num(key, value),
            "w_kv" => l.kv_utilization_weight = num(key, value),
            other => panic!("unknown llm-d option {other:?}"),
        },
        _ => panic!("unknown config option {key:?}"),
    }
}

fn cache_mode(value: &str) -> CacheMode {
    let mut parts = value.split(':');
    let kind = parts.next().unwrap_or_default();
    let ttl = parts.next().map(ms);
    let max_blocks = parts.next().map_or(1 << 20, |m| num("max blocks", m));
    let recent = RecentConfig {
        ttl,
        max_blocks,
        prune_ratio: 1.0,
    };
    match kind {
        "events" => CacheMode::Events,
        "predict" => CacheMode::EventsWithPrediction(recent),
        "approx" => CacheMode::Approximate(recent),
        other => panic!("bad cache mode {other:?}"),
    }
}

/// A prompt: its tokens.
struct Prompts {
    bases: BTreeMap<String, u32>,
    block_size: u32,
}

impl Prompts {
    fn tokens(&mut self, spec: &str) -> Vec<u32> {
        let mut tokens = Vec::new();
        for segment in spec.split('+') {
            if let Some(partial) = segment.strip_prefix('~') {
                tokens.extend((0..num::<u32>("partial", partial)).map(|j| 999_000_000 + j));
                continue;
            }
            let (name, count) = segment.split_once('*').unwrap_or((segment, "1"));
            let next = self.bases.len() as u32;
            let base = *self
                .bases
                .entry(name.to_owned())
                .or_insert((next + 1) * 1_000_000);
            for k in 0..num::<u32>("block count", count) {
                tokens.extend((0..self.block_size).map(|j| base + k * self.block_size + j));
            }
        }
        tokens
    }

    /// Local and sequence hashes of a prompt's full blocks.
    fn hashes(&mut self, spec: &str) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
        let tokens = self.tokens(spec);
        let (mut locals, mut chain) = (Vec::new(), Vec::new());
        BlockHasher::new(self.block_size as usize, &HashSalt::NONE).hash_prompt(
            &tokens,
            &mut locals,
            &mut chain,
        );
        (locals, chain)
    }
}

struct Harness {
    router: Option<Router>,
    config: RouterConfig,
    prompts: Prompts,
    now: Timestamp,
    /// Session names by id, for printing.
    names: BTreeMap<SessionId, String>,
}

fn fmt_decision(d: &Decision) -> String {
    let mut s = format!("{} overlap {}", d.worker, d.overlap_blocks);
    if let Some(p) = &d.prefill {
        s += &format!(", prefill {} overlap {}", p.worker, p.overlap_blocks);
    }
    s += &format!(", hint {}", d.hint.tokens);
    if !d.waited.is_zero() {
        s += &format!(", waited {}ms", d.waited.as_millis());
    }
    s
}

fn fmt_outputs(outputs: &[Output]) -> String {
    if outputs.is_empty() {
        return "ok".to_owned();
    }
    let lines: Vec<String> = outputs
        .iter()
        .map(|o| match o {
            Output::Routed(d) => format!("  + routed r{} -> {}", d.request.0, fmt_decision(d)),
            Output::Dropped { request, reason } => {
                let why = match reason {
                    DropReason::Expired => "expired",
                    DropReason::WorkerRemoved => "worker removed",
                };
                format!("  + dropped r{} ({why})", request.0)
            }
        })
        .collect();
    format!("ok\n{}", lines.join("\n"))
}

fn fmt_error(e: &RouterError) -> String {
    match e {
        RouterError::UnknownRequest(id) => format!("error: unknown request r{}", id.0),
        RouterError::DuplicateRequest(id) => format!("error: duplicate request r{}", id.0),
        other => format!("error: {other}"),
    }
}

fn fmt_result<T>(r: Result<T, RouterError>, ok: impl FnOnce(T) -> String) -> String {
    match r {
        Ok(v) => ok(v),
        Err(e) => fmt_error(&e),
    }
}

impl Harness {
    fn new() -> Self {
        Self {
            router: None,
            config: RouterConfig::default(),
            prompts: Prompts {
                bases: BTreeMap::new(),
                block_size: 16,
            },
            now: Timestamp::ZERO,
            names: BTreeMap::new(),
        }
    }

    fn session_name(&self, id: SessionId) -> String {
        self.names.get(&id).cloned().unwrap_or_else(|| format!("{id:?}"))
    }

    fn sessions(&mut self) -> String {
        let snapshot = self.router().session_snapshot();
        let lines: Vec<String> = snapshot
            .iter()
            .filter_map(|e| match e.change {
                LoadChange::Session { session, worker } => {
                    Some(format!("  {} -> {worker}", self.session_name(session)))
                }
                _ => None,
            })
            .collect();
        let mut text = format!("{} sessions", lines.len());
        for line in lines {
            text = text + "\n" + &line;
        }
        text
    }

    fn router(&mut self) -> &mut Router {
        let config = &self.config;
        self.router
            .get_or_insert_with(|| Router::new(config.clone()).unwrap_or_else(|e| panic!("config: {e}")))
    }

    /// The cost weights `explain` prints under: the policy's own, or kvroute's.
    fn cost_params(&self) -> CostParams {
        match &self.config.policy {
            PolicyConfig::Kv(p) | PolicyConfig::Dynamo(p) => p.cost,
            _ => CostParams::KV,
        }
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
                assert!(self.router.is_none(), "config must come first");
                self.config = config(&args);
                self.prompts.block_size = self.config.block_size;
                "ok".to_owned()
            }
            "at" => {
                self.now = Timestamp::from_millis(num("at", arg(0)));
                "ok".to_owned()
            }
            "worker" => {
                let role = match arg(1) {
                    "agg" => WorkerRole::Aggregated,
                    "prefill" => WorkerRole::Prefill,
                    "decode" => WorkerRole::Decode,
                    other => panic!("bad role {other:?}"),
                };
                let opts = options(&args[2..]);
                let mut spec = WorkerSpec::new(
                    worker_key(arg(0)),
                    role,
                    num("cap", opts.get("cap").copied().unwrap_or("100")),
                );
                if let Some(b) = opts.get("batch") {
                    spec.max_batched_tokens = num("batch", b);
                }
                if let Some(s) = opts.get("seqs") {
                    spec.max_requests = num("seqs", s);
                }
                fmt_result(self.router().handle_worker_added(now, spec), |o| fmt_outputs(&o))
            }
            "suspend" => fmt_result(
                self.router().handle_worker_suspended(now, worker_key(arg(0))),
                |o| fmt_outputs(&o),
            ),
            "sessions" => self.sessions(),
            "remote-session" => {
                self.names.insert(session(arg(0)), arg(0).to_owned());
                let event = SyncEvent {
                    router: from(&args[2..]),
                    request: RequestId(0),
                    change: LoadChange::Session {
                        session: session(arg(0)),
                        worker: worker_key(arg(1)),
                    },
                };
                fmt_result(self.router().handle_sync_event(now, &event), |o| fmt_outputs(&o))
            }
            "adapters" => {
                // `adapters W a,b`: worker W serves adapters a and b (`-` for none).
                let names: Vec<&str> = arg(1).split(',').filter(|n| *n != "-").collect();
                let key = worker_key(arg(0));
                fmt_outputs(&self.router().handle_adapters(now, key, &names))
            }
            "drain" => fmt_result(
                self.router().handle_worker_draining(now, worker_key(arg(0))),
                |()| "ok".to_owned(),
            ),
            "remove" => fmt_result(
                self.router().handle_worker_removed(now, worker_key(arg(0))),
                |o| fmt_outputs(&o),
            ),
            "cache" | "evict" | "clear" => self.kv_event(command, &args),
            "route" => self.route(&args),
            "explain" => self.explain(arg(0)),
            "first" => fmt_result(self.router().handle_first_token(now, request_id(arg(0))), |o| {
                fmt_outputs(&o)
            }),
            "block" => fmt_result(self.router().handle_output_block(now, request_id(arg(0))), |()| {
                "ok".to_owned()
            }),
            "done" => fmt_result(self.router().handle_finished(now, request_id(arg(0))), |o| {
                fmt_outputs(&o)
            }),
            "cancel" => fmt_result(self.router().handle_cancelled(now, request_id(arg(0))), |o| {
                fmt_outputs(&o)
            }),
            "remote" => self.remote(&args),
            "remote-first" | "remote-done" | "echo" => {
                let change = if command == "remote-first" {
                    LoadChange::PrefillDone
                } else {
                    LoadChange::Freed
                };
                let router = if command == "echo" {
                    self.config.router_id
                } else {
                    from(&args[1..])
                };
                let event = SyncEvent {
                    router,
                    request: request_id(arg(0)),
                    change,
                };
                fmt_result(self.router().handle_sync_event(now, &event), |o| fmt_outputs(&o))
            }
            "tick" => fmt_outputs(&self.router().handle_tick(now)),
            "loads" => self.loads(),
            "metrics" => self.metrics(),
            "outbox" => self.outbox(),
            "peer-lost" => {
                let peer = args.first().map_or(REPLICA, |n| RouterId(num("peer", n)));
                fmt_outputs(&self.router().handle_peer_lost(now, peer))
            }
            "snapshot" => {
                let mut events = self.router().sync_snapshot();
                events.extend(self.router().session_snapshot());
                let lines: Vec<String> = events.iter().map(fmt_event).collect();
                format!("{} events\n{}", lines.len(), lines.join("\n"))
            }
            other => panic!("unknown command {other:?}"),
        }
    }

    fn kv_event(&mut self, command: &str, args: &[&str]) -> String {
        let worker = worker_key(args[0]);
        let now = self.now;
        let result = match command {
            "clear" => self.router().handle_kv_event(now, worker, IndexEvent::Cleared),
            "cache" => {
                let (locals, chain) = self.prompts.hashes(args[1]);
                let blocks = stored_blocks(&locals, &chain);
                self.router().handle_kv_event(
                    now,
                    worker,
                    IndexEvent::Stored {
                        parent: None,
                        blocks: &blocks,
                    },
                )
            }
            _ => {
                let (_, chain) = self.prompts.hashes(args[1]);
                let from: usize = options(&args[2..]).get("from").map_or(0, |f| num("from", f));
                let blocks: Vec<ExternalBlockHash> = chain[from..].iter().map(|&s| s.into()).collect();
                self.router()
                    .handle_kv_event(now, worker, IndexEvent::Removed { blocks: &blocks })
            }
        };
        fmt_result(result, |()| "ok".to_owned())
    }

    fn route(&mut self, args: &[&str]) -> String {
        let id = request_id(args[0]);
        let tokens = self.prompts.tokens(args[1]);
        let opts = options(&args[2..]);
        let mut request = RouteRequest::new(id, Prompt::Tokens(&tokens));
        request.lora_name = opts.get("lora").copied();
        request.cache_salt = opts.get("salt").copied();
        request.priority = opts.get("prio").map_or(0, |p| num("prio", p));
        request.expected_output_tokens = opts.get("osl").map(|o| num("osl", o));
        request.session = opts.get("session").map(|s| session(s));
        self.names
            .extend(opts.get("session").map(|s| (session(s), s.to_string())));
        let now = self.now;
        fmt_result(
            self.router().handle_request(now, &request),
            |outcome| match outcome {
                RouteOutcome::Routed(d) => format!("routed {}", fmt_decision(&d)),
                RouteOutcome::Queued => "queued".to_owned(),
                RouteOutcome::Rejected(RejectReason::NoEligibleWorker) => {
                    "rejected (no eligible worker)".to_owned()
                }
                RouteOutcome::Rejected(RejectReason::QueueFull) => "rejected (queue full)".to_owned(),
            },
        )
    }

    fn explain(&mut self, prompt: &str) -> String {
        let tokens = self.prompts.tokens(prompt);
        let blocks = (tokens.len() / self.config.block_size as usize) as u32;
        let now = self.now;
        let params = self.cost_params();
        let block_size = self.config.block_size;
        let candidates = match self
            .router()
            .candidates(now, &RouteRequest::new(RequestId(0), Prompt::Tokens(&tokens)))
        {
            Ok(c) => c,
            Err(e) => return fmt_error(&e),
        };
        let chain: Arc<[SequenceHash]> = self.prompts.hashes(prompt).1.into();
        let fleet_load = self.router().fleet_load();
        let view = RequestView {
            now,
            id: RequestId(0),
            prompt_tokens: tokens.len() as u64,
            block_size,
            chain: &chain,
            fleet_load,
        };
        let cost_under = |c: &Candidate, projection| cost(&CostParams { projection, ..params }, &view, c);
        let lines: Vec<String> = candidates
            .iter()
            .map(|c| {
                format!(
                    "  {} overlap {}/{blocks}, prefill tokens {}, decode full {} staged {}, requests {}, cost staged {:.2} full {:.2}",
                    c.worker(),
                    c.overlap_blocks,
                    c.load.prefill_tokens,
                    c.projection.decode_blocks_full,
                    c.projection.decode_blocks_staged,
                    c.load.requests,
                    cost_under(c, DecodeProjection::Staged),
                    cost_under(c, DecodeProjection::Full),
                )
            })
            .collect();
        format!("{} candidates\n{}", candidates.len(), lines.join("\n"))
    }

    fn remote(&mut self, args: &[&str]) -> String {
        let id = request_id(args[0]);
        let worker = worker_key(args[1]);
        let tokens = self.prompts.tokens(args[2]);
        let (_, chain) = self.prompts.hashes(args[2]);
        let opts = options(&args[3..]);
        let cached: u32 = opts.get("cached").map_or(0, |c| num("cached", c));
        let booking = Booking {
            worker,
            overlap_blocks: cached,
            prefill_worker: opts.get("prefill").map(|p| worker_key(p)),
            prompt_tokens: tokens.len() as u64,
            hint: PrefillLoadHint::new(tokens.len() as u64, cached, self.config.block_size, None),
            chain: chain.into(),
            expected_output_tokens: None,
            session: opts.get("session").map(|s| session(s)),
            tenant: TenantId::OTHER,
        };
        self.names
            .extend(opts.get("session").map(|s| (session(s), s.to_string())));
        let event = SyncEvent {
            router: from(&args[3..]),
            request: id,
            change: LoadChange::Added(booking),
        };
        let now = self.now;
        fmt_result(self.router().handle_sync_event(now, &event), |o| fmt_outputs(&o))
    }

    fn loads(&mut self) -> String {
        let metrics = self.router().metrics();
        let lines: Vec<String> = metrics
            .workers
            .iter()
            .map(|w| {
                let l = &w.load;
                format!(
                    "  {} {}{}: requests {}, prefill {} ({} tokens), decode {} (staged {}, output {}), cached {}",
                    w.spec.key,
                    w.spec.role,
                    if w.draining { " draining" } else { "" },
                    l.requests,
                    l.prefill_requests,
                    l.prefill_tokens,
                    l.decode_blocks,
                    l.staged_decode_blocks,
                    l.output_blocks,
                    w.cached_blocks,
                )
            })
            .collect();
        let mut text = format!("{} active, {} queued", metrics.active_now, metrics.queued_now);
        if metrics.queued_without_worker_now > 0 {
            text += &format!(" ({} for want of any worker)", metrics.queued_without_worker_now);
        }
        for line in lines {
            text = text + "\n" + &line;
        }
        text
    }

    fn outbox(&mut self) -> String {
        let mut lines = Vec::new();
        while let Some(event) = self.router().poll_sync_event() {
            lines.push(fmt_event(&event));
        }
        format!("{} events\n{}", lines.len(), lines.join("\n"))
    }

    fn metrics(&mut self) -> String {
        let c = self.router().metrics().counters;
        let text = format!("{c:?}");
        let body = text
            .trim_start_matches("RouterCounters { ")
            .trim_end_matches(" }");
        let nonzero: Vec<&str> = body.split(", ").filter(|kv| !kv.ends_with(": 0")).collect();
        nonzero.join(", ")
    }
}

/// The replica named by a `from=N` option, or replica 9.
fn from(args: &[&str]) -> RouterId {
    options(args)
        .get("from")
        .map_or(REPLICA, |n| RouterId(num("from", n)))
}

fn fmt_event(event: &SyncEvent) -> String {
    let what = match &event.change {
        LoadChange::Added(b) => {
            format!(
                "added on {} (overlap {}, prefill worker {:?}, hint {})",
                b.worker,
                b.overlap_blocks,
                b.prefill_worker.map(|w| w.to_string()),
                b.hint.tokens
            ) + if b.session.is_some() { ", session" } else { "" }
        }
        LoadChange::PrefillDone => "prefill done".to_owned(),
        LoadChange::Freed => "freed".to_owned(),
        LoadChange::Session { worker, .. } => format!("session on {worker}"),
    };
    format!("  router {} r{}: {what}", event.router.0, event.request.0)
}

impl script::Harness for Harness {
    fn run(&mut self, input: &str) -> String {
        Harness::run(self, input)
    }

    fn check(&self) -> Result<(), String> {
        self.router.as_ref().map_or(Ok(()), Router::check_invariants)
    }
}

fn run_script(name: &str) {
    script::run_file(Path::new(DATA), name, &mut Harness::new());
}

scripts!(
    three_workers_cost,
    staged_tie,
    shared_prefix,
    drain_to_zero,
    expiry,
    queue_fcfs,
    queue_spf,
    queue_when_empty,
    decider,
    decider_always,
    decider_never,
    staged_scale,
    kv_default,
    eviction_pressure,
    workers,
    output_blocks,
    approximate,
    predict_on_route,
    replica_sync,
    replica_tombstones,
    policy_round_robin,
    policy_random,
    policy_least_loaded,
    policy_power_of_two,
    policy_dynamo,
    policy_sglang,
    policy_llmd,
    sessions,
    session_replicas,
    adapters,
    decode_cache,
    fleet_load,
    stall,
);
