//! `kvroute serve`'s configuration: a TOML file (unknown keys rejected, kebab-case keys that are
//! the CLI's flag names) that flags override, validated once by [`ServeConfig::validate`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kvroute_core::router::{
    RouterConfig, RouterOptions, RouterSpec, SessionConfig, SyncConfig, SyncMode, WhenEmpty, WorkerRole,
};
pub use kvroute_http::EngineKind;
use kvroute_sync::{ClientCertificate, NatsAuth, NatsTls, Secret};
use serde::{Deserialize, Serialize};

pub use discovery::{DiscoveryConfig, DiscoverySpec, DnsRecordKind, DnsSource, WorkerTemplate};
use file::ServeFile;
pub use models::ModelTable;
use models::within;
pub use tenants::{TenantConfig, TenantsConfig};
pub use worker::{Reannounce, WorkerConfig};
use worker::{TOKEN_RULE, is_token};

mod discovery;
mod file;
mod models;
mod tenants;
mod worker;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A field has a value outside its range or vocabulary.
    #[error("{field}: {message}")]
    Invalid {
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The router refused its part of the configuration.
    #[error("router: {0}")]
    Router(#[from] kvroute_core::router::ConfigError),
    /// The TOML did not parse (unknown keys included).
    #[error("{0}")]
    Parse(String),
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// Where `kvroute serve` takes its tokenizer from ([`ServeConfig::tokenizer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerSource<'a> {
    /// The model directory's `tokenizer.json`.
    Dir(&'a std::path::Path),
    /// The built-in tiny byte-level tokenizer.
    BuiltIn,
}

/// Everything `kvroute serve` needs, grouped by concern. Every field has a default, so a file
/// names only what it changes.
///
/// A file (and the CLI's flags) names the fields flat, by their kebab-case keys (`policy`,
/// `nats-heartbeat-ms`, `[[worker]]`): each key is the field of the same name in its group.
/// Unknown keys are refused.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(try_from = "ServeFile", into = "ServeFile")]
pub struct ServeConfig {
    /// Listeners, client connections and the inference API's keys.
    pub server: ServerConfig,
    /// The model served and its tokenizer (with [`Self::models`], only its
    /// `tokenizer_cache_bytes`, each model's own).
    pub model: ModelConfig,
    /// Several models (`[[model]]` tables), each with its tokenizer, block size, policy and
    /// workers; empty: the one model of [`Self::model`]. See [`Self::stacks`].
    pub models: Vec<ModelTable>,
    /// The router: policy, cache view, decider, queue and busy threshold, view bounds.
    pub routing: RoutingConfig,
    /// The largest request accepted.
    pub limits: LimitsConfig,
    /// Calls to workers: their timeouts and health checks.
    pub upstream: UpstreamConfig,
    /// Router replicas' sync over NATS: the server, its credentials and TLS, the peers' worker key.
    pub replicas: ReplicasConfig,
    /// Workers found rather than listed: a DNS name, a watched file.
    pub discovery: DiscoveryConfig,
    /// The workers (`[[worker]]` tables; the CLI's `--worker`).
    pub workers: Vec<WorkerConfig>,
    /// Tenants (`[[tenant]]` tables), their fair-share weights and limits, and the priority
    /// and tenant headers.
    pub tenants: TenantsConfig,
}

/// The listeners, the timeouts of client connections, the inference API's keys and the runtime.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerConfig {
    /// Where to listen. Default `127.0.0.1:8000`.
    pub listen: String,
    /// Where the admin API (`/admin/...`) listens: its own listener, never the inference
    /// port. Default `127.0.0.1:8100` (loopback).
    pub admin_listen: String,
    /// The bearer token the admin API requires (`Authorization: Bearer T`). Required when
    /// `admin-listen` is beyond loopback. Default: none (loopback only).
    pub admin_token: Option<String>,
    /// API keys of the inference API (`Authorization: Bearer K`; several allowed). Empty: no
    /// key needed. `/health` and `/metrics` need none. Default: none.
    pub api_key: Vec<String>,
    /// Longest a client may take to send a request's headers (from accept, or from the first
    /// byte of a keep-alive connection's next request); past it the connection is closed.
    /// Default 10,000 ms.
    pub header_read_timeout_ms: u64,
    /// Longest a client may take to send a request's body (408 past it). Default 30,000 ms.
    pub body_read_timeout_ms: u64,
    /// How long a keep-alive connection may wait idle for its next request. Default 60,000 ms.
    pub idle_timeout_ms: u64,
    /// On SIGTERM or Ctrl-C: how long streams in flight may take to finish before the process
    /// exits anyway. Default 30,000 ms.
    pub drain_timeout_ms: u64,
    /// Add `x-kvroute-worker`, `x-kvroute-dp-rank` and `x-kvroute-predicted-cached-tokens` to
    /// each response (debugging and end-to-end checks). Default false.
    pub debug_headers: bool,
    /// Runtime worker threads (0: one per core). Default 0.
    pub threads: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8000".to_owned(),
            admin_listen: "127.0.0.1:8100".to_owned(),
            admin_token: None,
            api_key: Vec::new(),
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            idle_timeout_ms: 60_000,
            drain_timeout_ms: 30_000,
            debug_headers: false,
            threads: 0,
        }
    }
}

/// The model served and the tokenizer its prompts are routed by.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The model name served (`/v1/models`). Default `tiny`.
    pub model_name: String,
    /// A local directory with `tokenizer.json` (and `tokenizer_config.json` for chat): the
    /// engines' tokenizer. Required, unless `approximate_tokenizer` is set.
    pub model_dir: Option<PathBuf>,
    /// Without `model_dir`, tokenize with the built-in tiny byte-level tokenizer: exact for
    /// mock workers started without a model directory, approximate (few or no cache hits)
    /// for any real engine. Default false: `kvroute serve` refuses to start without a
    /// tokenizer.
    pub approximate_tokenizer: bool,
    /// Bytes the conversation cache of chat prompts' tokens and block hashes may hold
    /// (`kvroute_http::prefix_cache`: a follow-up turn tokenizes and hashes only its new text and
    /// blocks; with several models, each model's); 0 turns it off. Default 256 MiB.
    pub tokenizer_cache_bytes: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            model_name: "tiny".to_owned(),
            model_dir: None,
            approximate_tokenizer: false,
            tokenizer_cache_bytes: 256 << 20,
        }
    }
}

/// The router's vocabulary (policy, cache view, decider, queue, busy threshold: the grammar of
/// `kvroute_core::router::spec`) and the bounds of its cache views.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingConfig {
    /// Routing policy spec (`kv`, `dynamo:full`, `kv:staged:scale=2`, `round-robin`, ...; the
    /// grammar of `kvroute_core::router::spec`). Default `kv`.
    pub policy: String,
    /// Tokens per KV block, as the engines use. Default 16 (vLLM's default).
    pub block_size: u32,
    /// Router seed. Default 0.
    pub seed: u64,
    /// Whether a request routed to a `decode` worker has its prefill on a `prefill` worker
    /// first (the two-hop flow): `always`, `never`, or a number N: when more than N prompt
    /// tokens are not cached on the chosen decode worker (the core's prefix-threshold
    /// decider; the vocabulary of `kvroute replay --decider`). Default `always`.
    pub decider: String,
    /// How prefill and decode workers hand a request's KV over: `vllm` (two hops with
    /// `kv_transfer_params`) or `sglang` (bootstrap host, port and room, sent to both at once).
    /// Default `vllm`.
    pub disagg_protocol: EngineKind,
    /// Where the router's cache view comes from: `events`, `predict` (events plus its own
    /// recent decisions) or `approximate` (its decisions only), the last two with options
    /// (`approximate:ttl=120:max-blocks=N`; `kvroute_core::router::spec`). Default `events`.
    pub cache: String,
    /// Requests that may wait when every worker is busy; past it, 503 with `Retry-After`.
    /// Default 1,024.
    pub queue_capacity: usize,
    /// How long a request may wait in the queue before a 503. Default 30,000 ms.
    pub queue_timeout_ms: u64,
    /// What a request meets when no worker can take it (none added, or none in routing):
    /// `reject` (503 at once) or `queue` (it waits in the queue, within `queue-capacity` and
    /// `queue-timeout-ms`, for a worker to be added or come back: a fleet scaled to zero).
    /// Default `reject`.
    pub when_empty: String,
    /// A worker is busy when its requests exceed this fraction of its `max_requests`. Default:
    /// never busy.
    pub busy_requests_fraction: Option<f64>,
    /// The most KV blocks the router's view keeps per worker rank; past it, the rank's oldest
    /// blocks are evicted (counted in `kvroute_index_blocks_evicted_total`). Engines' own
    /// removals keep a view within the engine's cache; this bounds memory when they are lost.
    /// Default 1,048,576 (about 70 MiB per rank at its fullest).
    pub max_blocks_per_worker: usize,
    /// After a rank's view was cleared for lost events, how long requests routed to it ask its
    /// engine to re-announce the cached blocks they reuse (worker key `reannounce`), unless the
    /// view is exact again sooner. The hot prefixes come back with their first reuse; the
    /// window bounds the extra events. Default 300,000 ms.
    pub reannounce_window_ms: u64,
    /// The request header that names a conversation (`x-session-id`): its requests stay on
    /// the worker that served it while that worker is not overloaded, and move once when it is
    /// (the rule of `kvroute_core::router::session`), on every replica. Default: none (no
    /// session affinity).
    pub session_header: Option<String>,
    /// A session unused this long is forgotten, ms. Default 1,800,000 (30 min).
    pub session_idle_timeout_ms: u64,
    /// The most sessions kept; past it the least recently used is forgotten. Default 65,536.
    pub max_sessions: usize,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            policy: "kv".to_owned(),
            block_size: 16,
            seed: 0,
            decider: "always".to_owned(),
            disagg_protocol: EngineKind::Vllm,
            cache: "events".to_owned(),
            queue_capacity: 1024,
            queue_timeout_ms: 30_000,
            when_empty: WhenEmpty::default().name().to_owned(),
            busy_requests_fraction: None,
            max_blocks_per_worker: 1 << 20,
            reannounce_window_ms: 300_000,
            session_header: None,
            session_idle_timeout_ms: 30 * 60 * 1000,
            max_sessions: 1 << 16,
        }
    }
}

/// The largest request the proxy accepts.
#[derive(Clone, Debug, PartialEq)]
pub struct LimitsConfig {
    /// Largest request body, bytes (413 past it). Default 4 MiB.
    pub max_body_bytes: usize,
    /// Most prompt tokens (400 past it). Default 131,072.
    pub max_prompt_tokens: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            max_prompt_tokens: 131_072,
        }
    }
}

/// Calls to workers: connect and request timeouts, health checks.
#[derive(Clone, Debug, PartialEq)]
pub struct UpstreamConfig {
    /// Longest silence from a worker while a request runs (before its headers or between two
    /// chunks) before the request fails with 504. Default 600,000 ms.
    pub request_timeout_ms: u64,
    /// TCP connect timeout to a worker. Default 2,000 ms.
    pub connect_timeout_ms: u64,
    /// How often workers' `/health` is checked; 0 turns checks off. Default 5,000 ms.
    pub health_interval_ms: u64,
    /// Timeout of one health check. Default 1,000 ms.
    pub health_timeout_ms: u64,
    /// Failed health checks in a row that take a worker out of routing. Default 3. (A request
    /// that cannot connect to a worker takes it out at once.)
    pub health_failure_threshold: u32,
    /// Passing health checks in a row that bring an unhealthy worker back. Default 2.
    pub health_success_threshold: u32,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            request_timeout_ms: 600_000,
            connect_timeout_ms: 2_000,
            health_interval_ms: 5_000,
            health_timeout_ms: 1_000,
            health_failure_threshold: 3,
            health_success_threshold: 2,
        }
    }
}

/// Router replicas' sync over NATS: the server, the subjects, heartbeats, credentials and TLS, and
/// the credential of workers added by peers.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicasConfig {
    /// The NATS server through which router replicas share their load and worker registry,
    /// `nats://host:port`. None: no sync (this replica knows only its own requests). Default
    /// none.
    pub nats: Option<String>,
    /// The start of every sync subject: replicas with the same prefix form one fleet; fleets
    /// with different ones can share a NATS server. Default `kvroute`.
    pub nats_subject_prefix: String,
    /// How often a replica heartbeats on NATS. Default 1,000 ms.
    pub nats_heartbeat_ms: u64,
    /// How long a replica may stay silent before its peers release its requests' load.
    /// Default 3,000 ms (must exceed `nats-heartbeat-ms`).
    pub nats_peer_timeout_ms: u64,
    /// How long a request's prefill-done and freed changes may wait for this replica's next
    /// booking before they go to the peers on their own (they only lower a peer's view of load;
    /// a booking goes within 2 ms). Fewer NATS messages a request, at the cost of peers seeing
    /// finished work a little longer. Default 100 ms; 0: at once.
    pub nats_lazy_ms: u64,
    /// The token the NATS server requires (its `authorization { token }`). Better
    /// `nats-token-file`: a flag's value shows in the process list. Default none.
    pub nats_token: Option<Secret>,
    /// A file holding the NATS token (one line). Default none.
    pub nats_token_file: Option<PathBuf>,
    /// The NATS user, with `nats-password` or `nats-password-file`. Default none.
    pub nats_user: Option<String>,
    /// The NATS user's password. Better `nats-password-file`. Default none.
    pub nats_password: Option<Secret>,
    /// A file holding the NATS user's password (one line). Default none.
    pub nats_password_file: Option<PathBuf>,
    /// A NATS credentials file (`.creds`: a user JWT and its NKey seed, as `nsc` writes it).
    /// Default none.
    pub nats_credentials: Option<PathBuf>,
    /// PEM file of the CA certificates that verify the NATS server; implies TLS. Default: the
    /// system's CAs, and TLS only if the URL is `tls://` or the server asks for it.
    pub nats_tls_ca: Option<PathBuf>,
    /// This replica's client certificate (PEM), for a NATS server that verifies its clients
    /// (mutual TLS); with `nats-tls-key`; implies TLS. Default none.
    pub nats_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `nats-tls-cert`. Default none.
    pub nats_tls_key: Option<PathBuf>,
    /// The engine credential (`api-key`) this replica calls a worker added by a peer replica
    /// with, when that worker has one on the peer and this replica's own `[[worker]]` tables do
    /// not name it (replicas never send each other credentials). Better
    /// `peer-worker-api-key-file`. Default none: such a worker is refused.
    pub peer_worker_api_key: Option<Secret>,
    /// A file holding `peer-worker-api-key` (one line). Default none.
    pub peer_worker_api_key_file: Option<PathBuf>,
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        Self {
            nats: None,
            nats_subject_prefix: "kvroute".to_owned(),
            nats_heartbeat_ms: 1_000,
            nats_peer_timeout_ms: 3_000,
            nats_lazy_ms: 100,
            nats_token: None,
            nats_token_file: None,
            nats_user: None,
            nats_password: None,
            nats_password_file: None,
            nats_credentials: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            peer_worker_api_key: None,
            peer_worker_api_key_file: None,
        }
    }
}

impl ServeConfig {
    /// Parses a TOML file's text; unknown keys are errors.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))
    }

    /// Checks every field once, and returns the router configuration it implies (with
    /// `[[model]]` tables, each model's is checked, and the first model's returned).
    pub fn validate(&self) -> Result<RouterConfig, ConfigError> {
        if !self.models.is_empty() {
            let stacks = self.stacks()?;
            let mut first = None;
            for (stack, table) in stacks.iter().zip(&self.models) {
                let router = stack.validate().map_err(|e| within(&table.name, e))?;
                first.get_or_insert(router);
            }
            // An unpinned worker's block size is checked against its model's when it is added.
            for w in self.unpinned_workers() {
                let block_size = w.block_size.unwrap_or(self.routing.block_size);
                w.validate(block_size, self.routing.disagg_protocol)?;
            }
            return first.ok_or_else(|| invalid("model", "no [[model]] table"));
        }
        self.validate_one()
    }

    /// [`Self::validate`] for one model.
    fn validate_one(&self) -> Result<RouterConfig, ConfigError> {
        self.stacks()?;
        let listen = self.listen_addr()?;
        let admin = self.admin_listen_addr()?;
        if admin == listen && admin.port() != 0 {
            return Err(invalid(
                "admin-listen",
                "must differ from listen: the admin API has its own listener",
            ));
        }
        match &self.server.admin_token {
            Some(t) if !is_token(t) => return Err(invalid("admin-token", TOKEN_RULE)),
            None if !admin.ip().is_loopback() => {
                return Err(invalid(
                    "admin-token",
                    format!(
                        "required when the admin API listens beyond loopback (admin-listen {admin}): \
                         set --admin-token, or keep --admin-listen on 127.0.0.1"
                    ),
                ));
            }
            _ => {}
        }
        if self.server.api_key.iter().any(|k| !is_token(k)) {
            return Err(invalid("api-key", TOKEN_RULE));
        }
        for (field, ms) in [
            ("header-read-timeout-ms", self.server.header_read_timeout_ms),
            ("body-read-timeout-ms", self.server.body_read_timeout_ms),
            ("idle-timeout-ms", self.server.idle_timeout_ms),
            ("drain-timeout-ms", self.server.drain_timeout_ms),
            ("reannounce-window-ms", self.routing.reannounce_window_ms),
            ("session-idle-timeout-ms", self.routing.session_idle_timeout_ms),
        ] {
            if ms == 0 {
                return Err(invalid(field, "must be at least 1 ms"));
            }
        }
        if self.model.model_name.is_empty() {
            return Err(invalid("model-name", "must not be empty"));
        }
        if self.limits.max_body_bytes == 0 || self.limits.max_prompt_tokens == 0 {
            return Err(invalid("max-body-bytes/max-prompt-tokens", "must be at least 1"));
        }
        if self.upstream.request_timeout_ms == 0
            || self.upstream.connect_timeout_ms == 0
            || self.routing.queue_timeout_ms == 0
        {
            return Err(invalid(
                "request-timeout-ms/connect-timeout-ms/queue-timeout-ms",
                "must be at least 1 ms",
            ));
        }
        if self.upstream.health_interval_ms > 0 && self.upstream.health_timeout_ms == 0 {
            return Err(invalid("health-timeout-ms", "must be at least 1 ms"));
        }
        if self.upstream.health_failure_threshold == 0 || self.upstream.health_success_threshold == 0 {
            return Err(invalid(
                "health-failure-threshold/health-success-threshold",
                "must be at least 1",
            ));
        }
        let spec = RouterSpec::parse(&RouterOptions {
            policy: &self.routing.policy,
            cache: &self.routing.cache,
            decider: &self.routing.decider,
            block_size: self.routing.block_size,
            seed: self.routing.seed,
            queue_capacity: self.routing.queue_capacity,
            busy_requests_fraction: self.routing.busy_requests_fraction,
            when_empty: &self.routing.when_empty,
        })
        .map_err(|e| invalid(e.key, e.error.to_string()))?;
        self.validate_nats()?;
        self.tenants.validate()?;
        let router = RouterConfig {
            max_blocks_per_worker: Some(
                std::num::NonZeroUsize::new(self.routing.max_blocks_per_worker)
                    .ok_or_else(|| invalid("max-blocks-per-worker", "must be at least 1"))?,
            ),
            sync: SyncConfig {
                mode: if self.replicas.nats.is_some() {
                    SyncMode::Export
                } else {
                    SyncMode::Off
                },
                ..SyncConfig::default()
            },
            sessions: self.sessions()?,
            fair: self.tenants.fair(),
            ..spec.router_config()
        };
        router.validate()?;
        for w in &self.workers {
            w.validate(self.routing.block_size, self.routing.disagg_protocol)?;
        }
        Self::validate_fleet(self.workers.iter().map(WorkerConfig::role))?;
        self.discovery()?;
        Ok(router)
    }

    /// The session settings: the header a valid HTTP header name, at least one session.
    fn sessions(&self) -> Result<SessionConfig, ConfigError> {
        if let Some(name) = &self.routing.session_header
            && hyper::header::HeaderName::from_bytes(name.as_bytes()).is_err()
        {
            return Err(invalid(
                "session-header",
                format!("{name:?} is not an HTTP header name"),
            ));
        }
        if self.routing.max_sessions == 0 {
            return Err(invalid("max-sessions", "must be at least 1"));
        }
        Ok(SessionConfig {
            max_sessions: self.routing.max_sessions,
            idle_ttl: Self::ms(self.routing.session_idle_timeout_ms),
            ..SessionConfig::default()
        })
    }

    /// Checks the NATS keys: a `nats://` URL, a prefix of NATS subject tokens, a peer timeout
    /// longer than the heartbeat.
    fn validate_nats(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.replicas.nats {
            let uri: hyper::Uri = url
                .parse()
                .map_err(|_| invalid("nats", format!("{url:?} is not a URL")))?;
            if !matches!(uri.scheme_str(), Some("nats" | "tls")) || uri.authority().is_none() {
                return Err(invalid(
                    "nats",
                    format!("{url:?}: must be nats://host:port (or tls://host:port: TLS required)"),
                ));
            }
            if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
                return Err(invalid(
                    "nats",
                    "has credentials in it, which would be logged: give them as nats-token-file, \
                     nats-user and nats-password-file, or nats-credentials",
                ));
            }
        } else if let Some(key) = self.nats_security_keys().first() {
            return Err(invalid(*key, "needs nats (the server it is for)"));
        }
        let token_ok = |t: &str| {
            !t.is_empty()
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if !self.replicas.nats_subject_prefix.split('.').all(token_ok) {
            return Err(invalid(
                "nats-subject-prefix",
                format!(
                    "{:?}: dot-separated names of letters, digits, '-' and '_'",
                    self.replicas.nats_subject_prefix
                ),
            ));
        }
        if self.replicas.nats_heartbeat_ms == 0
            || self.replicas.nats_peer_timeout_ms <= self.replicas.nats_heartbeat_ms
        {
            return Err(invalid(
                "nats-peer-timeout-ms",
                format!(
                    "{} ms must exceed nats-heartbeat-ms ({} ms, at least 1)",
                    self.replicas.nats_peer_timeout_ms, self.replicas.nats_heartbeat_ms
                ),
            ));
        }
        self.nats_auth()?;
        self.nats_tls()?;
        self.peer_worker_api_key()?;
        Ok(())
    }

    /// The NATS credential and TLS keys that are set (they need `nats`).
    fn nats_security_keys(&self) -> Vec<&'static str> {
        [
            ("nats-token", self.replicas.nats_token.is_some()),
            ("nats-token-file", self.replicas.nats_token_file.is_some()),
            ("nats-user", self.replicas.nats_user.is_some()),
            ("nats-password", self.replicas.nats_password.is_some()),
            ("nats-password-file", self.replicas.nats_password_file.is_some()),
            ("nats-credentials", self.replicas.nats_credentials.is_some()),
            ("nats-tls-ca", self.replicas.nats_tls_ca.is_some()),
            ("nats-tls-cert", self.replicas.nats_tls_cert.is_some()),
            ("nats-tls-key", self.replicas.nats_tls_key.is_some()),
            ("peer-worker-api-key", self.replicas.peer_worker_api_key.is_some()),
            (
                "peer-worker-api-key-file",
                self.replicas.peer_worker_api_key_file.is_some(),
            ),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
        .collect()
    }

    /// How this replica proves itself to the NATS server: a token, a user and password, or a
    /// credentials file (at most one), each secret given inline or as a file (not both). Reads
    /// the files.
    pub fn nats_auth(&self) -> Result<NatsAuth, ConfigError> {
        let token = secret(
            ("nats-token", &self.replicas.nats_token),
            ("nats-token-file", &self.replicas.nats_token_file),
        )?;
        let password = secret(
            ("nats-password", &self.replicas.nats_password),
            ("nats-password-file", &self.replicas.nats_password_file),
        )?;
        let ways: Vec<&str> = [
            ("nats-token", token.is_some()),
            (
                "nats-user",
                self.replicas.nats_user.is_some() || password.is_some(),
            ),
            ("nats-credentials", self.replicas.nats_credentials.is_some()),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
        .collect();
        if ways.len() > 1 {
            return Err(invalid(
                ways.join("/"),
                format!(
                    "one way to authenticate to NATS: a token, a user and password, or a \
                     credentials file; {} were given",
                    ways.join(" and ")
                ),
            ));
        }
        Ok(
            match (
                token,
                &self.replicas.nats_user,
                password,
                &self.replicas.nats_credentials,
            ) {
                (Some(token), ..) => NatsAuth::Token(token),
                (None, Some(user), Some(password), _) => {
                    if user.is_empty() || user.chars().any(char::is_whitespace) {
                        return Err(invalid("nats-user", format!("{user:?}: a name without spaces")));
                    }
                    NatsAuth::UserPassword {
                        user: user.clone(),
                        password,
                    }
                }
                (None, Some(_), None, _) => {
                    return Err(invalid(
                        "nats-password",
                        "required with nats-user (or nats-password-file)",
                    ));
                }
                (None, None, Some(_), _) => return Err(invalid("nats-user", "required with nats-password")),
                (None, None, None, Some(path)) => {
                    kvroute_sync::connect::check_credentials_file(path)
                        .map_err(|e| invalid("nats-credentials", format!("{}: {e}", path.display())))?;
                    NatsAuth::CredentialsFile(path.clone())
                }
                (None, None, None, None) => NatsAuth::None,
            },
        )
    }

    /// TLS to the NATS server: required by a `tls://` URL or any `nats-tls-*` key; the CA
    /// and the client certificate and key (both or neither) must be readable files.
    pub fn nats_tls(&self) -> Result<NatsTls, ConfigError> {
        let file = |key: &str, path: &Option<PathBuf>| match path {
            Some(p) if !p.is_file() => Err(invalid(key, format!("{}: no such file", p.display()))),
            _ => Ok(path.clone()),
        };
        let ca = file("nats-tls-ca", &self.replicas.nats_tls_ca)?;
        let client = match (
            file("nats-tls-cert", &self.replicas.nats_tls_cert)?,
            file("nats-tls-key", &self.replicas.nats_tls_key)?,
        ) {
            (Some(cert), Some(key)) => Some(ClientCertificate { cert, key }),
            (None, None) => None,
            (Some(_), None) => return Err(invalid("nats-tls-key", "required with nats-tls-cert")),
            (None, Some(_)) => return Err(invalid("nats-tls-cert", "required with nats-tls-key")),
        };
        let tls_url = self
            .replicas
            .nats
            .as_deref()
            .is_some_and(|u| u.starts_with("tls://"));
        Ok(NatsTls {
            required: tls_url || ca.is_some() || client.is_some(),
            ca,
            client,
        })
    }

    /// `peer-worker-api-key`, inline or from its file (not both).
    pub fn peer_worker_api_key(&self) -> Result<Option<Secret>, ConfigError> {
        let key = secret(
            ("peer-worker-api-key", &self.replicas.peer_worker_api_key),
            (
                "peer-worker-api-key-file",
                &self.replicas.peer_worker_api_key_file,
            ),
        )?;
        if key.as_ref().is_some_and(|k| !is_token(k.expose())) {
            return Err(invalid("peer-worker-api-key", TOKEN_RULE));
        }
        Ok(key)
    }

    /// The sync transport's settings, when `nats` is set (reads the credential files).
    pub fn sync_config(&self) -> Result<Option<kvroute_sync::NatsSyncConfig>, ConfigError> {
        let Some(url) = &self.replicas.nats else {
            return Ok(None);
        };
        let mut config = kvroute_sync::NatsSyncConfig::new(url.clone(), &self.replicas.nats_subject_prefix);
        config.heartbeat_interval = Self::ms(self.replicas.nats_heartbeat_ms);
        config.peer_timeout = Self::ms(self.replicas.nats_peer_timeout_ms);
        config.batch_lazy_delay = Self::ms(self.replicas.nats_lazy_ms);
        config.auth = self.nats_auth()?;
        config.tls = self.nats_tls()?;
        Ok(Some(config))
    }

    /// Where the tokenizer comes from: `model_dir`, or the built-in one when
    /// `approximate_tokenizer` asks for it; an error naming both otherwise (routing on a
    /// tokenizer that is not the engines' finds no cached prefix).
    pub fn tokenizer(&self) -> Result<TokenizerSource<'_>, ConfigError> {
        match (&self.model.model_dir, self.model.approximate_tokenizer) {
            (Some(dir), _) => Ok(TokenizerSource::Dir(dir)),
            (None, true) => Ok(TokenizerSource::BuiltIn),
            (None, false) => Err(invalid(
                "model-dir",
                "is required: the engines' tokenizer (tokenizer.json), without which no prompt \
                 finds its cached prefix; or --approximate-tokenizer for the built-in tiny \
                 tokenizer (that of mock workers started without --model-dir)",
            )),
        }
    }

    /// Checks that a fleet of these roles can serve: some worker decodes (`agg` or `decode`),
    /// and `prefill` workers come with `decode` workers (the core sends prefills only for
    /// requests decoded on a `decode` worker). An empty fleet passes (workers may come through
    /// the admin API).
    pub fn validate_fleet(roles: impl IntoIterator<Item = WorkerRole>) -> Result<(), ConfigError> {
        let (mut agg, mut prefill, mut decode) = (0, 0, 0);
        for role in roles {
            match role {
                WorkerRole::Aggregated => agg += 1,
                WorkerRole::Prefill => prefill += 1,
                WorkerRole::Decode => decode += 1,
            }
        }
        if prefill > 0 && decode == 0 {
            let message = if agg == 0 {
                "a fleet of only prefill workers cannot serve: add decode (or agg) workers"
            } else {
                "prefill workers serve only decode workers, and this fleet has none (role = \"decode\")"
            };
            return Err(invalid("worker", message));
        }
        Ok(())
    }

    /// The listen address.
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        socket_addr("listen", &self.server.listen)
    }

    /// The admin API's listen address.
    pub fn admin_listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        socket_addr("admin-listen", &self.server.admin_listen)
    }

    /// The server's timeouts of client connections.
    pub fn conn_timeouts(&self) -> kvroute_http::net::ConnTimeouts {
        kvroute_http::net::ConnTimeouts {
            header_read: Self::ms(self.server.header_read_timeout_ms),
            idle: Self::ms(self.server.idle_timeout_ms),
        }
    }

    pub(crate) fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }
}

/// A secret given inline (`inline`) or as a file (`file`: its first line), not both; an error
/// names the keys and the file, never the secret.
fn secret(
    (inline_key, inline): (&str, &Option<Secret>),
    (file_key, file): (&str, &Option<PathBuf>),
) -> Result<Option<Secret>, ConfigError> {
    let value = match (inline, file) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                format!("{inline_key}/{file_key}"),
                format!("give {inline_key} or {file_key}, not both"),
            ));
        }
        (Some(s), None) => s.expose().to_owned(),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid(file_key, format!("{}: {e}", path.display())))?;
            text.lines().next().unwrap_or_default().to_owned()
        }
        (None, None) => return Ok(None),
    };
    if value.is_empty() || value.contains(['\r', '\n']) {
        let key = if inline.is_some() { inline_key } else { file_key };
        return Err(invalid(key, "must not be empty"));
    }
    Ok(Some(Secret::new(value)))
}

/// `text` as the address of `field`.
fn socket_addr(field: &str, text: &str) -> Result<SocketAddr, ConfigError> {
    if let Some((_, port)) = text.rsplit_once(':')
        && port.parse::<u16>().is_err()
    {
        return Err(invalid(
            field,
            format!("{text:?}: port {port:?} is not 0 to 65535"),
        ));
    }
    text.parse()
        .map_err(|e| invalid(field, format!("{text:?}: {e} (HOST:PORT)")))
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod nats_security_tests;
