//! Finding workers rather than listing them: the `discover-*` keys, and their one check
//! ([`ServeConfig::discovery`]), which turns them into the typed [`DiscoverySpec`] that
//! [`crate::discovery`] runs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, ServeConfig, WorkerConfig, invalid};

/// The DNS records a name is resolved to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DnsRecordKind {
    /// A and AAAA records: one worker per address, at `discover-port`.
    #[default]
    A,
    /// SRV records (`_http._tcp.NAME`, as a Kubernetes headless service gives): one worker per
    /// target address, at the record's port.
    Srv,
}

impl DnsRecordKind {
    /// Its name, as the flag takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::A => "a",
            Self::Srv => "srv",
        }
    }
}

impl std::str::FromStr for DnsRecordKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [Self::A, Self::Srv]
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("{s:?}: a or srv"))
    }
}

/// Where workers are found, and how they are let go: a DNS name re-resolved, a file re-read
/// (`discover-*` keys). Workers found are added as the admin API adds them; one a source stops
/// listing is drained, then removed.
#[derive(Clone, Debug, PartialEq)]
pub struct DiscoveryConfig {
    /// A DNS name whose records are the workers (`srv:NAME` for SRV records). Default none.
    pub discover_dns: Option<String>,
    /// The records of `discover-dns`: `a` (A and AAAA) or `srv`. Default `a`, or `srv` with
    /// the `srv:` prefix.
    pub discover_dns_type: Option<DnsRecordKind>,
    /// The DNS server asked, `IP:PORT`. Default: the system's (`/etc/resolv.conf`).
    pub discover_dns_server: Option<String>,
    /// A file of worker lines (the `--worker` syntax, one a line; `#` comments and blank lines
    /// ignored), as a mounted ConfigMap gives. Default none.
    pub discover_file: Option<PathBuf>,
    /// How often each source is resolved or read again. Default 5,000 ms.
    pub discover_interval_ms: u64,
    /// The worker line a DNS answer makes, with `{host}` (the address) and `{port}` (the SRV
    /// record's, or `discover-port`). Default `http://{host}:{port}`.
    pub discover_worker_template: Option<String>,
    /// The port of A records' workers (`{port}` in the template). Default none.
    pub discover_port: Option<u16>,
    /// How long a worker a source no longer lists may take to finish its requests before it
    /// is removed anyway. Default 60,000 ms.
    pub discover_drain_timeout_ms: u64,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            discover_dns: None,
            discover_dns_type: None,
            discover_dns_server: None,
            discover_file: None,
            discover_interval_ms: 5_000,
            discover_worker_template: None,
            discover_port: None,
            discover_drain_timeout_ms: 60_000,
        }
    }
}

/// The template of a DNS answer's worker line when none is given.
pub const DEFAULT_WORKER_TEMPLATE: &str = "http://{host}:{port}";

/// A worker line with `{host}` and `{port}` holes, checked once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerTemplate(String);

impl WorkerTemplate {
    /// The worker line for `host` (an address; IPv6 in brackets) and `port`.
    pub fn line(&self, host: &str, port: u16) -> String {
        self.0
            .replace("{host}", host)
            .replace("{port}", &port.to_string())
    }

    /// Whether it has a `{port}` hole.
    pub fn uses_port(&self) -> bool {
        self.0.contains("{port}")
    }
}

/// A DNS source, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsSource {
    /// The name resolved (without the `srv:` prefix).
    pub name: String,
    /// Its records.
    pub kind: DnsRecordKind,
    /// The server asked; `None`: the system's.
    pub server: Option<SocketAddr>,
    /// The line each answer makes.
    pub template: WorkerTemplate,
    /// The port of A records' workers.
    pub port: Option<u16>,
}

/// Discovery, checked: its sources and timings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoverySpec {
    /// The DNS source, if any.
    pub dns: Option<DnsSource>,
    /// The file source, if any.
    pub file: Option<PathBuf>,
    /// How often each source is asked again.
    pub interval: Duration,
    /// How long a worker let go may take to drain.
    pub drain_timeout: Duration,
}

impl ServeConfig {
    /// The discovery keys, checked: `None` when no source is set (and then no other
    /// `discover-*` key may be, but the timings).
    pub fn discovery(&self) -> Result<Option<DiscoverySpec>, ConfigError> {
        let d = &self.discovery;
        if d.discover_interval_ms == 0 {
            return Err(invalid("discover-interval-ms", "must be at least 1 ms"));
        }
        if d.discover_drain_timeout_ms == 0 {
            return Err(invalid("discover-drain-timeout-ms", "must be at least 1 ms"));
        }
        let dns = match &d.discover_dns {
            Some(name) => Some(self.dns_source(name)?),
            None => {
                for (key, set) in [
                    ("discover-dns-type", d.discover_dns_type.is_some()),
                    ("discover-dns-server", d.discover_dns_server.is_some()),
                    ("discover-worker-template", d.discover_worker_template.is_some()),
                    ("discover-port", d.discover_port.is_some()),
                ] {
                    if set {
                        return Err(invalid(key, "needs discover-dns (the name it is for)"));
                    }
                }
                None
            }
        };
        if d.discover_file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(invalid("discover-file", "must not be empty"));
        }
        if dns.is_none() && d.discover_file.is_none() {
            return Ok(None);
        }
        Ok(Some(DiscoverySpec {
            dns,
            file: d.discover_file.clone(),
            interval: Self::ms(d.discover_interval_ms),
            drain_timeout: Self::ms(d.discover_drain_timeout_ms),
        }))
    }

    fn dns_source(&self, given: &str) -> Result<DnsSource, ConfigError> {
        let d = &self.discovery;
        let (name, kind) = match (given.strip_prefix("srv:"), d.discover_dns_type) {
            (Some(_), Some(DnsRecordKind::A)) => {
                return Err(invalid(
                    "discover-dns",
                    format!("{given:?} asks for SRV records, discover-dns-type for A records"),
                ));
            }
            (Some(name), _) => (name, DnsRecordKind::Srv),
            (None, kind) => (given, kind.unwrap_or_default()),
        };
        let valid_name = !name.is_empty()
            && name.len() <= 253
            && name.trim_end_matches('.').split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            });
        if !valid_name {
            return Err(invalid(
                "discover-dns",
                format!("{given:?}: a DNS name (dot-separated labels of letters, digits, '-' and '_')"),
            ));
        }
        let server = d
            .discover_dns_server
            .as_deref()
            .map(|s| {
                s.parse::<SocketAddr>()
                    .map_err(|_| invalid("discover-dns-server", format!("{s:?}: IP:PORT")))
            })
            .transpose()?;
        let template = WorkerTemplate(
            d.discover_worker_template
                .clone()
                .unwrap_or_else(|| DEFAULT_WORKER_TEMPLATE.to_owned()),
        );
        if !template.0.contains("{host}") {
            return Err(invalid(
                "discover-worker-template",
                "must name {host}, where each answer's address goes",
            ));
        }
        if kind == DnsRecordKind::A && template.uses_port() && d.discover_port.is_none() {
            return Err(invalid(
                "discover-port",
                "required with A records when the worker template names {port}",
            ));
        }
        // The line an answer would make must be a worker.
        let sample = template.line("127.0.0.1", d.discover_port.unwrap_or(8000));
        WorkerConfig::parse_flag(&sample)
            .and_then(|w| w.validate(self.routing.block_size, self.routing.disagg_protocol))
            .map_err(|e| {
                invalid(
                    "discover-worker-template",
                    format!("makes no worker ({sample}): {e}"),
                )
            })?;
        Ok(DnsSource {
            name: name.to_owned(),
            kind,
            server,
            template,
            port: d.discover_port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_keys_are_checked_once_with_errors_naming_the_key() {
        // (TOML, the error's start, or "" when accepted)
        let cases: &[(&str, &str)] = &[
            ("", ""),
            ("discover-file = \"/etc/kvroute/workers\"\n", ""),
            (
                "discover-dns = \"srv:_http._tcp.vllm.ns.svc.cluster.local\"\n",
                "",
            ),
            ("discover-dns = \"vllm\"\ndiscover-dns-type = \"srv\"\n", ""),
            ("discover-dns = \"vllm\"\ndiscover-port = 8000\n", ""),
            (
                "discover-dns = \"vllm\"\ndiscover-port = 8000\ndiscover-dns-server = \"127.0.0.1:5353\"\n\
                 discover-worker-template = \"http://{host}:{port},events=tcp://{host}:5557\"\n",
                "",
            ),
            (
                "discover-dns = \"vllm\"\ndiscover-worker-template = \"http://{host}:8000\"\n",
                "",
            ),
            ("discover-dns = \"vllm\"\n", "discover-port: required"),
            (
                "discover-dns = \"srv:vllm\"\ndiscover-dns-type = \"a\"\n",
                "discover-dns: \"srv:vllm\" asks for SRV",
            ),
            ("discover-dns = \"a b\"\ndiscover-port = 1\n", "discover-dns:"),
            ("discover-dns = \"srv:\"\n", "discover-dns:"),
            ("discover-port = 8000\n", "discover-port: needs discover-dns"),
            (
                "discover-dns-server = \"127.0.0.1:53\"\n",
                "discover-dns-server: needs discover-dns",
            ),
            (
                "discover-dns = \"srv:v\"\ndiscover-dns-server = \"localhost:53\"\n",
                "discover-dns-server: \"localhost:53\"",
            ),
            (
                "discover-dns = \"srv:v\"\ndiscover-worker-template = \"http://w:{port}\"\n",
                "discover-worker-template: must name {host}",
            ),
            (
                "discover-dns = \"srv:v\"\ndiscover-worker-template = \"http://{host}:{port},dp=0\"\n",
                "discover-worker-template: makes no worker",
            ),
            ("discover-interval-ms = 0\n", "discover-interval-ms:"),
            ("discover-drain-timeout-ms = 0\n", "discover-drain-timeout-ms:"),
            ("discover-dns-type = \"mx\"\n", "unknown variant"),
            ("discover-dnss = \"v\"\n", "unknown field"),
        ];
        for (text, want) in cases {
            let result = ServeConfig::from_toml_str(text).and_then(|c| c.validate().map(|_| c));
            match result {
                Ok(_) => assert!(want.is_empty(), "{text}: accepted"),
                Err(e) => {
                    let e = e.to_string();
                    assert!(!want.is_empty() && e.contains(want), "{text}: {e}");
                }
            }
        }
    }

    #[test]
    fn the_checked_form_names_the_records_the_server_and_the_template() {
        let c = ServeConfig::from_toml_str(
            "discover-dns = \"srv:_http._tcp.vllm\"\ndiscover-dns-server = \"127.0.0.1:5353\"\n\
             discover-interval-ms = 250\ndiscover-worker-template = \"http://{host}:{port},dp=2\"\n",
        )
        .unwrap();
        let spec = c.discovery().unwrap().unwrap();
        let dns = spec.dns.unwrap();
        assert_eq!(dns.name, "_http._tcp.vllm");
        assert_eq!(dns.kind, DnsRecordKind::Srv);
        assert_eq!(dns.server, Some("127.0.0.1:5353".parse().unwrap()));
        assert_eq!(dns.template.line("10.0.0.7", 8001), "http://10.0.0.7:8001,dp=2");
        assert_eq!(spec.interval, Duration::from_millis(250));
        assert_eq!(spec.drain_timeout, Duration::from_secs(60));
        assert_eq!(spec.file, None);
        assert_eq!(ServeConfig::default().discovery().unwrap(), None);
        // The file round-trips the keys.
        let text = toml::to_string(&c).unwrap();
        assert_eq!(ServeConfig::from_toml_str(&text).unwrap(), c);
    }
}
