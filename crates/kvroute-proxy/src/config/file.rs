//! [`ServeConfig`] as a file and the flags name it: one flat table of kebab-case keys, and the
//! conversions to and from the grouped form the proxy reads.

use serde::{Deserialize, Serialize};

use super::*;

/// [`ServeConfig`] as a file and the flags name it: one flat table of kebab-case keys, unknown
/// ones refused (serde's `flatten` cannot refuse them, hence this form).
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub(super) struct ServeFile {
    // ServeConfig::server
    listen: String,
    admin_listen: String,
    admin_token: Option<String>,
    api_key: Vec<String>,
    header_read_timeout_ms: u64,
    body_read_timeout_ms: u64,
    idle_timeout_ms: u64,
    drain_timeout_ms: u64,
    debug_headers: bool,
    threads: usize,
    // ServeConfig::model
    model_name: String,
    model_dir: Option<PathBuf>,
    approximate_tokenizer: bool,
    tokenizer_cache_bytes: usize,
    // ServeConfig::routing
    policy: String,
    block_size: u32,
    seed: u64,
    decider: String,
    disagg_protocol: EngineKind,
    cache: String,
    queue_capacity: usize,
    queue_timeout_ms: u64,
    when_empty: String,
    busy_requests_fraction: Option<f64>,
    max_blocks_per_worker: usize,
    reannounce_window_ms: u64,
    // ServeConfig::limits
    max_body_bytes: usize,
    max_prompt_tokens: usize,
    // ServeConfig::upstream
    request_timeout_ms: u64,
    connect_timeout_ms: u64,
    health_interval_ms: u64,
    health_timeout_ms: u64,
    health_failure_threshold: u32,
    health_success_threshold: u32,
    // ServeConfig::replicas
    nats: Option<String>,
    nats_subject_prefix: String,
    nats_heartbeat_ms: u64,
    nats_peer_timeout_ms: u64,
    #[serde(skip_serializing)]
    nats_token: Option<Secret>,
    nats_token_file: Option<PathBuf>,
    nats_user: Option<String>,
    #[serde(skip_serializing)]
    nats_password: Option<Secret>,
    nats_password_file: Option<PathBuf>,
    nats_credentials: Option<PathBuf>,
    nats_tls_ca: Option<PathBuf>,
    nats_tls_cert: Option<PathBuf>,
    nats_tls_key: Option<PathBuf>,
    #[serde(skip_serializing)]
    peer_worker_api_key: Option<Secret>,
    peer_worker_api_key_file: Option<PathBuf>,
    #[serde(rename = "worker")]
    workers: Vec<WorkerConfig>,
}

impl Default for ServeFile {
    fn default() -> Self {
        ServeConfig::default().into()
    }
}

impl From<ServeFile> for ServeConfig {
    fn from(file: ServeFile) -> Self {
        let ServeFile {
            listen,
            admin_listen,
            admin_token,
            api_key,
            header_read_timeout_ms,
            body_read_timeout_ms,
            idle_timeout_ms,
            drain_timeout_ms,
            model_name,
            model_dir,
            approximate_tokenizer,
            debug_headers,
            policy,
            block_size,
            seed,
            decider,
            disagg_protocol,
            cache,
            queue_capacity,
            queue_timeout_ms,
            when_empty,
            busy_requests_fraction,
            max_body_bytes,
            max_prompt_tokens,
            request_timeout_ms,
            connect_timeout_ms,
            health_interval_ms,
            health_timeout_ms,
            health_failure_threshold,
            health_success_threshold,
            threads,
            max_blocks_per_worker,
            reannounce_window_ms,
            tokenizer_cache_bytes,
            nats,
            nats_subject_prefix,
            nats_heartbeat_ms,
            nats_peer_timeout_ms,
            nats_token,
            nats_token_file,
            nats_user,
            nats_password,
            nats_password_file,
            nats_credentials,
            nats_tls_ca,
            nats_tls_cert,
            nats_tls_key,
            peer_worker_api_key,
            peer_worker_api_key_file,
            workers,
        } = file;
        Self {
            server: ServerConfig {
                listen,
                admin_listen,
                admin_token,
                api_key,
                header_read_timeout_ms,
                body_read_timeout_ms,
                idle_timeout_ms,
                drain_timeout_ms,
                debug_headers,
                threads,
            },
            model: ModelConfig {
                model_name,
                model_dir,
                approximate_tokenizer,
                tokenizer_cache_bytes,
            },
            routing: RoutingConfig {
                policy,
                block_size,
                seed,
                decider,
                disagg_protocol,
                cache,
                queue_capacity,
                queue_timeout_ms,
                when_empty,
                busy_requests_fraction,
                max_blocks_per_worker,
                reannounce_window_ms,
            },
            limits: LimitsConfig {
                max_body_bytes,
                max_prompt_tokens,
            },
            upstream: UpstreamConfig {
                request_timeout_ms,
                connect_timeout_ms,
                health_interval_ms,
                health_timeout_ms,
                health_failure_threshold,
                health_success_threshold,
            },
            replicas: ReplicasConfig {
                nats,
                nats_subject_prefix,
                nats_heartbeat_ms,
                nats_peer_timeout_ms,
                nats_token,
                nats_token_file,
                nats_user,
                nats_password,
                nats_password_file,
                nats_credentials,
                nats_tls_ca,
                nats_tls_cert,
                nats_tls_key,
                peer_worker_api_key,
                peer_worker_api_key_file,
            },
            workers,
        }
    }
}

impl From<ServeConfig> for ServeFile {
    fn from(config: ServeConfig) -> Self {
        let ServeConfig {
            server:
                ServerConfig {
                    listen,
                    admin_listen,
                    admin_token,
                    api_key,
                    header_read_timeout_ms,
                    body_read_timeout_ms,
                    idle_timeout_ms,
                    drain_timeout_ms,
                    debug_headers,
                    threads,
                },
            model:
                ModelConfig {
                    model_name,
                    model_dir,
                    approximate_tokenizer,
                    tokenizer_cache_bytes,
                },
            routing:
                RoutingConfig {
                    policy,
                    block_size,
                    seed,
                    decider,
                    disagg_protocol,
                    cache,
                    queue_capacity,
                    queue_timeout_ms,
                    when_empty,
                    busy_requests_fraction,
                    max_blocks_per_worker,
                    reannounce_window_ms,
                },
            limits:
                LimitsConfig {
                    max_body_bytes,
                    max_prompt_tokens,
                },
            upstream:
                UpstreamConfig {
                    request_timeout_ms,
                    connect_timeout_ms,
                    health_interval_ms,
                    health_timeout_ms,
                    health_failure_threshold,
                    health_success_threshold,
                },
            replicas:
                ReplicasConfig {
                    nats,
                    nats_subject_prefix,
                    nats_heartbeat_ms,
                    nats_peer_timeout_ms,
                    nats_token,
                    nats_token_file,
                    nats_user,
                    nats_password,
                    nats_password_file,
                    nats_credentials,
                    nats_tls_ca,
                    nats_tls_cert,
                    nats_tls_key,
                    peer_worker_api_key,
                    peer_worker_api_key_file,
                },
            workers,
        } = config;
        Self {
            listen,
            admin_listen,
            admin_token,
            api_key,
            header_read_timeout_ms,
            body_read_timeout_ms,
            idle_timeout_ms,
            drain_timeout_ms,
            model_name,
            model_dir,
            approximate_tokenizer,
            debug_headers,
            policy,
            block_size,
            seed,
            decider,
            disagg_protocol,
            cache,
            queue_capacity,
            queue_timeout_ms,
            when_empty,
            busy_requests_fraction,
            max_body_bytes,
            max_prompt_tokens,
            request_timeout_ms,
            connect_timeout_ms,
            health_interval_ms,
            health_timeout_ms,
            health_failure_threshold,
            health_success_threshold,
            threads,
            max_blocks_per_worker,
            reannounce_window_ms,
            tokenizer_cache_bytes,
            nats,
            nats_subject_prefix,
            nats_heartbeat_ms,
            nats_peer_timeout_ms,
            nats_token,
            nats_token_file,
            nats_user,
            nats_password,
            nats_password_file,
            nats_credentials,
            nats_tls_ca,
            nats_tls_cert,
            nats_tls_key,
            peer_worker_api_key,
            peer_worker_api_key_file,
            workers,
        }
    }
}
