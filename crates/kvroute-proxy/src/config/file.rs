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
    // ServeConfig::model (the single-model keys: None when unset, as `[[model]]` tables
    // refuse them)
    model_name: Option<String>,
    model_dir: Option<PathBuf>,
    approximate_tokenizer: Option<bool>,
    tokenizer_cache_bytes: usize,
    #[serde(rename = "model")]
    models: Vec<ModelTable>,
    // ServeConfig::routing
    policy: String,
    block_size: Option<u32>,
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
    session_header: Option<String>,
    session_idle_timeout_ms: u64,
    max_sessions: usize,
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
    nats_lazy_ms: u64,
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
    // ServeConfig::discovery
    discover_dns: Option<String>,
    discover_dns_type: Option<DnsRecordKind>,
    discover_dns_server: Option<String>,
    discover_file: Option<PathBuf>,
    discover_interval_ms: u64,
    discover_worker_template: Option<String>,
    discover_port: Option<u16>,
    discover_drain_timeout_ms: u64,
    #[serde(rename = "worker")]
    workers: Vec<WorkerConfig>,
    // ServeConfig::tenants
    tenant_header: Option<String>,
    priority_header: Option<String>,
    forward_priority: bool,
    #[serde(rename = "tenant")]
    tenants: Vec<TenantConfig>,
}

impl Default for ServeFile {
    /// The defaults, the single-model keys unset (a file with `[[model]]` tables has none).
    fn default() -> Self {
        let mut file: Self = ServeConfig::default().into();
        file.model_name = None;
        file.model_dir = None;
        file.approximate_tokenizer = None;
        file.block_size = None;
        file
    }
}

/// The conversions between [`ServeFile`] and [`ServeConfig`], each group's keys named once:
/// both directions take every key apart by name and put it back by name, and `file_to_config`
/// and `config_to_file` (statements run in between, with every key bound) rebind the keys whose
/// form differs between the two.
macro_rules! flat_groups {
    (
        groups { $( $group:ident: $group_ty:ident { $($key:ident),* $(,)? } ),* $(,)? }
        whole { $($whole:ident),* $(,)? }
        file_to_config { $($to_config:tt)* }
        config_to_file { $($to_file:tt)* }
    ) => {
        impl TryFrom<ServeFile> for ServeConfig {
            type Error = ConfigError;

            fn try_from(file: ServeFile) -> Result<Self, ConfigError> {
                let ServeFile { $($($key,)*)* $($whole,)* } = file;
                $($to_config)*
                Ok(Self { $( $group: $group_ty { $($key,)* }, )* $($whole,)* })
            }
        }

        impl From<ServeConfig> for ServeFile {
            fn from(config: ServeConfig) -> Self {
                let ServeConfig { $( $group: $group_ty { $($key,)* }, )* $($whole,)* } = config;
                $($to_file)*
                Self { $($($key,)*)* $($whole,)* }
            }
        }
    };
}

flat_groups! {
    groups {
        server: ServerConfig {
            listen, admin_listen, admin_token, api_key, header_read_timeout_ms,
            body_read_timeout_ms, idle_timeout_ms, drain_timeout_ms, debug_headers, threads,
        },
        model: ModelConfig { model_name, model_dir, approximate_tokenizer, tokenizer_cache_bytes },
        routing: RoutingConfig {
            policy, block_size, seed, decider, disagg_protocol, cache, queue_capacity,
            queue_timeout_ms, when_empty, busy_requests_fraction, max_blocks_per_worker,
            reannounce_window_ms, session_header, session_idle_timeout_ms, max_sessions,
        },
        limits: LimitsConfig { max_body_bytes, max_prompt_tokens },
        upstream: UpstreamConfig {
            request_timeout_ms, connect_timeout_ms, health_interval_ms, health_timeout_ms,
            health_failure_threshold, health_success_threshold,
        },
        replicas: ReplicasConfig {
            nats, nats_subject_prefix, nats_heartbeat_ms, nats_peer_timeout_ms, nats_lazy_ms,
            nats_token, nats_token_file, nats_user, nats_password, nats_password_file,
            nats_credentials, nats_tls_ca, nats_tls_cert, nats_tls_key, peer_worker_api_key,
            peer_worker_api_key_file,
        },
        discovery: DiscoveryConfig {
            discover_dns, discover_dns_type, discover_dns_server, discover_file,
            discover_interval_ms, discover_worker_template, discover_port,
            discover_drain_timeout_ms,
        },
        tenants: TenantsConfig { tenant_header, priority_header, forward_priority, tenants },
    }
    whole { models, workers }
    file_to_config {
        if !models.is_empty() {
            let flat: Vec<&str> = [
                ("model-name", model_name.is_some()),
                ("model-dir", model_dir.is_some()),
                ("approximate-tokenizer", approximate_tokenizer.is_some()),
                ("block-size", block_size.is_some()),
            ]
            .into_iter()
            .filter_map(|(key, set)| set.then_some(key))
            .collect();
            if !flat.is_empty() {
                return Err(invalid(
                    flat.join("/"),
                    "the single-model keys cannot be mixed with [[model]] tables: give each \
                     model's name, model-dir or approximate-tokenizer and block-size in its table",
                ));
            }
        }
        let model = ModelConfig::default();
        let model_name = model_name.unwrap_or(model.model_name);
        let approximate_tokenizer = approximate_tokenizer.unwrap_or(model.approximate_tokenizer);
        let block_size = block_size.unwrap_or(RoutingConfig::default().block_size);
    }
    config_to_file {
        // With `[[model]]` tables the single-model keys are each table's.
        let single = models.is_empty();
        let (model_name, approximate_tokenizer, block_size) = match single {
            true => (Some(model_name), Some(approximate_tokenizer), Some(block_size)),
            false => (None, None, None),
        };
        let model_dir = model_dir.filter(|_| single);
    }
}
