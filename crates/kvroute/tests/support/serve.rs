//! The proxy configuration tests start from. Included with `#[path]`.

use kvroute_proxy::ServeConfig;
use kvroute_proxy::config::{ModelConfig, ServerConfig, UpstreamConfig};

/// A proxy whose listeners take free loopback ports, which tokenizes with the built-in tokenizer
/// (no model directory) unless handed a model, probes no worker's health and lists no worker.
pub fn loopback() -> ServeConfig {
    ServeConfig {
        server: ServerConfig {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            ..Default::default()
        },
        model: ModelConfig {
            approximate_tokenizer: true,
            ..Default::default()
        },
        upstream: UpstreamConfig {
            health_interval_ms: 0,
            ..Default::default()
        },
        ..ServeConfig::default()
    }
}
