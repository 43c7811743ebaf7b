//! One worker's table (`[[worker]]`, the `--worker` flag, the admin API's body): its endpoint,
//! KV-event sockets, role and limits, checked once.

use kvroute_core::router::WorkerRole;
use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::{EngineKind, invalid};

/// One worker: an OpenAI-compatible engine endpoint and, optionally, its KV-event sockets.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct WorkerConfig {
    /// Base URL of the worker's OpenAI API, e.g. `http://10.0.0.5:8000` (plain HTTP).
    pub url: String,
    /// The worker's KV-event PUB endpoint, e.g. `tcp://10.0.0.5:5557`. None: no events (the
    /// router sees this worker's cache only through its own decisions, if the cache mode
    /// predicts).
    #[serde(default)]
    pub events: Option<String>,
    /// Whether kvroute connects to `events` (the default: the engine binds, as vLLM does for
    /// `tcp://*:P` and `ipc://` endpoints) or binds it (`bind`: the engine connects, as vLLM does
    /// for a concrete `tcp://host:P`). A bound endpoint must name its interface: wildcards
    /// (`*`, `0.0.0.0`, `::`) are refused, as they would listen on every interface.
    #[serde(default)]
    pub events_mode: Option<kvroute_zmq::SocketMode>,
    /// The worker's replay ROUTER endpoint, for filling sequence gaps.
    #[serde(default)]
    pub replay: Option<String>,
    /// The topic of its events (vLLM's default is empty).
    #[serde(default)]
    pub topic: String,
    /// Tokens per KV block; must equal the router's block size (checked). Default: the router's.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Data-parallel ranks behind the URL; each is a cache of its own, selected as the
    /// worker's `engine` reads it. Default 1.
    #[serde(default = "one", rename = "dp")]
    pub dp_size: u32,
    /// `agg` (prefill and decode), `prefill` (prefills for decode workers: the first hop of a
    /// disaggregated request) or `decode` (decodes, with the prompt's KV from a prefill worker
    /// when the decider says so, else computed locally). Default `agg`.
    #[serde(default = "agg")]
    pub role: String,
    /// KV-cache capacity in blocks (for busy thresholds and capacity-aware policies). Default
    /// 16,384.
    #[serde(default = "default_capacity", rename = "capacity")]
    pub capacity_blocks: u64,
    /// Concurrent requests the engine runs (vLLM `max_num_seqs`). Default 256.
    #[serde(default = "default_max_requests")]
    pub max_requests: u64,
    /// A `prefill` worker's bootstrap server port, in SGLang's protocol (`disagg-protocol =
    /// "sglang"`; SGLang's `--disaggregation-bootstrap-port`). None sends `null`: the engine's
    /// default port.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// The engine: `vllm` or `sglang` (how a request names its data-parallel rank). Default
    /// `vllm`.
    #[serde(default)]
    pub engine: EngineKind,
    /// A credential the engine wants (`vllm serve --api-key`): sent as `Authorization: Bearer`
    /// on every call to it (generation, health checks). None: a client's own `Authorization`
    /// is passed on with its generation requests, unless kvroute checks API keys itself.
    /// Never listed by the admin API.
    #[serde(default)]
    pub api_key: Option<String>,
    /// Whether the proxy asks this engine to re-announce the cached blocks a request reuses
    /// while the worker's cache view is rebuilt ([`Reannounce`]). Default `auto`.
    #[serde(default)]
    pub reannounce: Reannounce,
    /// The model it serves, one of the `[[model]]` tables' names (`model=NAME` in the flag
    /// form). None: the model the proxy serves, or, with several, the one its `/v1/models`
    /// lists, read when it is added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// Whether the proxy asks a worker's engine to re-announce the prefix-cache blocks each request
/// reuses (vLLM's `"vllm_xargs": {"kv_cache_report_mode": "full"}`) while the worker's cache
/// view is being rebuilt after events were lost for good, for at most `reannounce-window-ms`.
///
/// vLLM 0.32 keeps any `vllm_xargs` key in the request's `SamplingParams.extra_args` (checking
/// only that integers fit 64 bits) and reads the ones it knows, so a vLLM without this feature
/// ignores the key rather than refusing the request; an SGLang engine has no `vllm_xargs`.
/// `off` is for an engine that refuses it anyway (a gateway with a strict schema in front, a
/// fork).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reannounce {
    /// Ask while the view is rebuilt, if the engine is vLLM (`engine = "vllm"`).
    #[default]
    Auto,
    /// Never ask.
    Off,
}

impl std::str::FromStr for Reannounce {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Off),
            other => Err(format!("{other:?}: auto or off")),
        }
    }
}

fn one() -> u32 {
    1
}
fn agg() -> String {
    "agg".to_owned()
}
fn default_capacity() -> u64 {
    16_384
}
fn default_max_requests() -> u64 {
    256
}

impl WorkerConfig {
    /// A worker at `url` with every other field at its default.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            events: None,
            events_mode: None,
            replay: None,
            topic: String::new(),
            block_size: None,
            dp_size: 1,
            role: agg(),
            capacity_blocks: default_capacity(),
            max_requests: default_max_requests(),
            bootstrap_port: None,
            engine: EngineKind::Vllm,
            api_key: None,
            reannounce: Reannounce::Auto,
            model: None,
        }
    }

    /// Parses the flag form `URL[,events=EP][,events-mode=bind|connect][,replay=EP][,topic=T]
    /// [,dp=N][,block-size=N][,role=R][,capacity=N][,max-requests=N][,bootstrap-port=N]
    /// [,engine=vllm|sglang][,api-key=K][,reannounce=auto|off][,model=NAME]`: the keys of a
    /// `[[worker]]` table.
    pub fn parse_flag(s: &str) -> Result<Self, ConfigError> {
        fn num<T: TryFrom<u64>>(k: &str, v: &str) -> Result<T, ConfigError> {
            let n: u64 = v
                .parse()
                .map_err(|_| invalid("--worker", format!("{k}={v} is not a whole number")))?;
            T::try_from(n).map_err(|_| {
                let ty = std::any::type_name::<T>();
                invalid("--worker", format!("{k}={v} is past the largest {k} ({ty})"))
            })
        }
        let mut parts = s.split(',');
        let mut w = Self::new(parts.next().unwrap_or_default().trim());
        for part in parts {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| invalid("--worker", format!("{part:?} is not key=value")))?;
            match k.trim() {
                "events" => w.events = Some(v.to_owned()),
                "events-mode" => {
                    w.events_mode = Some(match v {
                        "bind" => kvroute_zmq::SocketMode::Bind,
                        "connect" => kvroute_zmq::SocketMode::Connect,
                        other => {
                            return Err(invalid(
                                "--worker",
                                format!("events-mode={other:?}: bind or connect"),
                            ));
                        }
                    })
                }
                "replay" => w.replay = Some(v.to_owned()),
                "topic" => w.topic = v.to_owned(),
                "dp" => w.dp_size = num(k, v)?,
                "block-size" => w.block_size = Some(num(k, v)?),
                "role" => w.role = v.to_owned(),
                "capacity" => w.capacity_blocks = num(k, v)?,
                "max-requests" => w.max_requests = num(k, v)?,
                "engine" => {
                    w.engine = v
                        .parse()
                        .map_err(|e| invalid("--worker", format!("engine={e}")))?
                }
                "bootstrap-port" => w.bootstrap_port = Some(num(k, v)?),
                "api-key" => w.api_key = Some(v.to_owned()),
                "model" => w.model = Some(v.to_owned()),
                "reannounce" => {
                    w.reannounce = v
                        .parse()
                        .map_err(|e| invalid("--worker", format!("reannounce={e}")))?
                }
                other => return Err(invalid("--worker", format!("unknown key {other:?}"))),
            }
        }
        Ok(w)
    }

    /// Checks the worker against the router's block size and the fleet's disaggregation
    /// protocol.
    pub fn validate(&self, router_block_size: u32, protocol: EngineKind) -> Result<(), ConfigError> {
        let f = |name: &str| format!("worker {}: {name}", self.url);
        let uri: hyper::Uri = self.url.parse().map_err(|_| invalid(f("url"), "is not a URL"))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(invalid(f("url"), "must be http://host:port"));
        }
        if self.dp_size == 0 || self.dp_size > 1024 {
            return Err(invalid(f("dp"), "must be 1 to 1024"));
        }
        if let Some(bs) = self.block_size
            && bs != router_block_size
        {
            return Err(invalid(
                f("block-size"),
                format!("{bs} differs from the router's block size {router_block_size}"),
            ));
        }
        if role_of(&self.role).is_none() {
            return Err(invalid(
                f("role"),
                format!("{:?}: agg, prefill or decode", self.role),
            ));
        }
        if self.capacity_blocks == 0 || self.max_requests == 0 {
            return Err(invalid(f("capacity/max-requests"), "must be at least 1"));
        }
        if self.api_key.as_deref().is_some_and(|k| !is_token(k)) {
            return Err(invalid(f("api-key"), TOKEN_RULE));
        }
        if self.model.as_deref() == Some("") {
            return Err(invalid(f("model"), "must not be empty"));
        }
        if self.replay.is_some() && self.events.is_none() {
            return Err(invalid(f("replay"), "needs an events endpoint"));
        }
        if self.events_mode.is_some() && self.events.is_none() {
            return Err(invalid(f("events-mode"), "needs an events endpoint"));
        }
        if let Some(events) = &self.events {
            check_event_endpoints(events, self.replay.as_deref(), &self.topic)
                .map_err(|m| invalid(f("events"), m))?;
        }
        // Rank r publishes on the endpoint's port plus r: that port must exist.
        if self.dp_size > 1 {
            for (field, endpoint) in [("events", &self.events), ("replay", &self.replay)] {
                if let Some(endpoint) = endpoint
                    && let Err(e) = kvroute_zmq::rank_endpoint(endpoint, self.dp_size - 1)
                {
                    return Err(invalid(f(field), e.to_string()));
                }
            }
        }
        if self.bootstrap_port.is_some() {
            if self.role() != WorkerRole::Prefill {
                return Err(invalid(f("bootstrap-port"), "only a prefill worker has one"));
            }
            if protocol != EngineKind::Sglang {
                return Err(invalid(
                    f("bootstrap-port"),
                    "is SGLang's: set disagg-protocol = \"sglang\"",
                ));
            }
        }
        Ok(())
    }

    /// The role the router books this worker under (a role [`WorkerConfig::validate`] refused
    /// counts as `agg`).
    pub fn role(&self) -> WorkerRole {
        role_of(&self.role).unwrap_or(WorkerRole::Aggregated)
    }
}

/// What a credential may be: it travels in an HTTP header.
pub(super) const TOKEN_RULE: &str = "must be 1 to 4096 visible ASCII characters, without spaces";

pub(super) fn is_token(s: &str) -> bool {
    !s.is_empty() && s.len() <= 4096 && s.bytes().all(|b| b.is_ascii_graphic())
}

/// Checks a worker's KV-event endpoints: ZMQ endpoints (`tcp://host:port`, `ipc://path`), with
/// no wildcard host, which would make kvroute listen on every interface (the events endpoint)
/// or name nothing to connect to (the replay endpoint, which kvroute always connects to).
fn check_event_endpoints(events: &str, replay: Option<&str>, topic: &str) -> Result<(), String> {
    let config = kvroute_zmq::SubscriberConfig {
        replay_endpoint: replay.map(str::to_owned),
        topic: topic.to_owned(),
        ..kvroute_zmq::SubscriberConfig::new(kvroute_core::ids::WorkerId(0), events)
    };
    config
        .validate()
        .map_err(|e| format!("{e} (a ZMQ endpoint: tcp://HOST:PORT or ipc://PATH)"))?;
    for (name, endpoint) in [("events", Some(events)), ("replay", replay)] {
        if let Some(endpoint) = endpoint
            && kvroute_zmq::subscriber_mode(endpoint) == kvroute_zmq::SocketMode::Bind
        {
            return Err(format!(
                "{name}={endpoint} has a wildcard host, which would listen on every interface; \
                 name the engine's host to connect to, or, for an engine that connects to \
                 kvroute, the interface to listen on with events-mode=bind"
            ));
        }
    }
    Ok(())
}

/// The core's role named `name` (`agg`, `prefill`, `decode`), by the core's own names.
fn role_of(name: &str) -> Option<WorkerRole> {
    [WorkerRole::Aggregated, WorkerRole::Prefill, WorkerRole::Decode]
        .into_iter()
        .find(|r| r.name() == name)
}

#[cfg(test)]
mod event_endpoint_tests {
    use super::*;
    use crate::config::ServeConfig;

    #[test]
    fn event_endpoints_must_parse_and_name_their_interface() {
        // (flag, accepted, a word the error must contain)
        let cases: &[(&str, bool, &str)] = &[
            ("http://h:1,events=tcp://10.0.0.5:5557", true, ""),
            (
                "http://h:1,events=tcp://engine.local:5557,replay=tcp://engine.local:5558",
                true,
                "",
            ),
            ("http://h:1,events=ipc:///run/ev.sock", true, ""),
            (
                "http://h:1,events=tcp://127.0.0.1:5557,events-mode=bind",
                true,
                "",
            ),
            ("http://h:1,events=garbage", false, "ZMQ endpoint"),
            ("http://h:1,events=tcp://h", false, "ZMQ endpoint"),
            (
                "http://h:1,events=tcp://h:1,replay=nonsense",
                false,
                "ZMQ endpoint",
            ),
            ("http://h:1,events=tcp://*:5557", false, "every interface"),
            ("http://h:1,events=tcp://0.0.0.0:5557", false, "every interface"),
            ("http://h:1,events=tcp://[::]:5557", false, "every interface"),
            (
                "http://h:1,events=tcp://h:1,replay=tcp://*:5558",
                false,
                "every interface",
            ),
            ("http://h:1,events-mode=bind", false, "needs an events endpoint"),
        ];
        for &(flag, accepted, word) in cases {
            let result =
                WorkerConfig::parse_flag(flag).and_then(|w| w.validate(16, EngineKind::Vllm).map(|()| w));
            match result {
                Ok(_) => assert!(accepted, "{flag} was accepted"),
                Err(e) => {
                    assert!(!accepted, "{flag}: {e}");
                    assert!(e.to_string().contains(word), "{flag}: {e}");
                }
            }
        }
        assert!(WorkerConfig::parse_flag("http://h:1,events=tcp://h:1,events-mode=listen").is_err());
        let w = WorkerConfig::parse_flag("http://h:1,events=tcp://127.0.0.1:5557,events-mode=bind").unwrap();
        assert_eq!(w.events_mode, Some(kvroute_zmq::SocketMode::Bind));
        let c = ServeConfig::from_toml_str(
            "[[worker]]\nurl = \"http://h:1\"\nevents = \"tcp://127.0.0.1:5557\"\nevents-mode = \"bind\"\n",
        )
        .unwrap();
        assert_eq!(c.workers[0].events_mode, Some(kvroute_zmq::SocketMode::Bind));
    }
}
