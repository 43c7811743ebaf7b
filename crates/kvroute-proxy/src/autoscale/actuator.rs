//! How the planner's decisions reach the fleet: one trait, an implementation per way of
//! running workers (`process`, `external`, `dry-run`), chosen in the planner's file's
//! `[actuator]` table ([`ActuatorConfig`]) and made by [`build`].
//!
//! The autoscaler, not the actuator, drains: before [`Actuator::release`] is called the worker
//! is out of routing and its requests have finished (or its drain timed out).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kvroute_core::ids::WorkerId;
use kvroute_planner::Pool;
use serde::Deserialize;

use super::process::{Placeholder, ProcessActuator};
use crate::fleet::Fleet;
use crate::metrics::Metrics;

/// Carries out the planner's decisions.
pub trait Actuator: Send + Sync + 'static {
    /// The planner wants `n` workers in `pool` (told at start and at every decision).
    fn set_desired(&self, pool: Pool, n: u32);
    /// Provisions one more worker of `pool`. Returns at once; the worker joins the fleet (through
    /// `Fleet::add`) when it is ready.
    fn provision(&self, pool: Pool);
    /// Worker `id` at `url` has been drained and removed from routing: end it.
    fn release(&self, id: WorkerId, url: &str);
    /// Workers provisioned and not yet in the fleet, one entry each, by pool.
    fn pending(&self) -> Vec<Pool>;
}

/// The planner file's `[actuator]` table: how workers are started and ended.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ActuatorConfig {
    /// kvroute starts and stops worker processes itself, from a command template per pool.
    Process(Box<ProcessConfig>),
    /// An outside autoscaler (KEDA, an HPA) owns the workers: kvroute publishes
    /// `kvroute_planner_desired_workers{pool}` and workers arrive through `--worker`, the
    /// admin API or discovery. (Empty braces: so that a key it does not have is refused.)
    External {},
    /// Logs what it would do and publishes the same gauge as `external`.
    DryRun {},
}

/// `kind = "process"`: the worker command of each pool used, and the processes' limits.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessConfig {
    /// Aggregated workers' command.
    #[serde(default)]
    pub agg: Option<WorkerTemplate>,
    /// Prefill workers' command.
    #[serde(default)]
    pub prefill: Option<WorkerTemplate>,
    /// Decode workers' command.
    #[serde(default)]
    pub decode: Option<WorkerTemplate>,
    /// How long a started worker has to serve the model (`/v1/models`) and be routable, in
    /// seconds; one that is not by then is killed and forgotten. Default 600 (a real vLLM
    /// loads its weights and compiles first).
    #[serde(default = "default_ready_timeout_s")]
    pub ready_timeout_s: u64,
    /// How long a released worker has to exit after SIGTERM before it is sent SIGKILL, in
    /// seconds. Default 30.
    #[serde(default = "default_stop_grace_s")]
    pub stop_grace_s: u64,
    /// Where each worker's stdout and stderr go (`worker-{index}.log`; the folder is made if
    /// need be). None: inherited from kvroute.
    #[serde(default)]
    pub log_dir: Option<PathBuf>,
    /// The `{host}` of the templates. Default `127.0.0.1`. Ports are picked free on loopback
    /// whatever it is.
    #[serde(default = "default_host")]
    pub host: String,
}

/// One pool's worker: the command that starts it and the worker line that registers it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerTemplate {
    /// The command, as an argv array (no shell): the program, then its arguments. Placeholders
    /// `{port}`, `{events_port}`, `{replay_port}` (`{events_port}` + 1), `{model}`, `{host}`
    /// and `{index}` are filled in each time. A `{` not followed by a name is kept as is, so
    /// JSON arguments need no escaping (vLLM's `--kv-events-config`, with
    /// `"endpoint": "ipc:///run/ev-{index}.sock"` filled in). An argv has no shell: environment
    /// variables are set with `env` as the program (`["env", "VLLM_HOST_IP=127.0.0.1", "vllm", ...]`).
    pub command: Vec<String>,
    /// The worker line (the `--worker` flag's form) of the started worker, with the same
    /// placeholders, e.g. `http://127.0.0.1:{port},events=tcp://127.0.0.1:{events_port}`.
    pub worker: String,
}

fn default_ready_timeout_s() -> u64 {
    600
}

fn default_stop_grace_s() -> u64 {
    30
}

fn default_host() -> String {
    "127.0.0.1".to_owned()
}

/// What is wrong with an `[actuator]` table.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ActuatorConfigError {
    /// The table is not a valid `[actuator]` table.
    #[error("[actuator]: {0}")]
    Parse(String),
    /// A `process` actuator with no pool's command.
    #[error(
        "[actuator] kind = \"process\" needs the command of at least one pool: [actuator.agg], [actuator.prefill] or [actuator.decode]"
    )]
    NoPool,
    /// A pool's command is empty.
    #[error("[actuator.{pool}] command is empty: it needs at least the program")]
    EmptyCommand {
        /// The pool.
        pool: &'static str,
    },
    /// A template names a placeholder that does not exist, or has an unclosed brace.
    #[error(
        "[actuator.{pool}] {field}: {problem} in {text:?} (placeholders: {{port}}, {{events_port}}, {{replay_port}}, {{model}}, {{host}}, {{index}})"
    )]
    Placeholder {
        /// The pool.
        pool: &'static str,
        /// `command` or `worker`.
        field: &'static str,
        /// What is wrong.
        problem: String,
        /// The template text.
        text: String,
    },
    /// The worker line, filled in, is no valid worker.
    #[error("[actuator.{pool}] worker: {message}")]
    Worker {
        /// The pool.
        pool: &'static str,
        /// Why.
        message: String,
    },
    /// The worker line's role is not the pool's.
    #[error("[actuator.{pool}] worker: its role is {role:?}, not the pool's (add ,role={want} to the line)")]
    WrongRole {
        /// The pool.
        pool: &'static str,
        /// The line's role.
        role: String,
        /// The pool's role.
        want: &'static str,
    },
    /// A time limit of zero.
    #[error("[actuator] {field} must be at least 1 (seconds)")]
    ZeroTime {
        /// The field.
        field: &'static str,
    },
}

impl ActuatorConfig {
    /// Reads an `[actuator]` table (as TOML) and checks it.
    pub fn from_toml(table: toml::Table) -> Result<Self, ActuatorConfigError> {
        let config: Self = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ActuatorConfigError::Parse(e.message().to_owned()))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot: a process actuator's templates and limits.
    pub fn validate(&self) -> Result<(), ActuatorConfigError> {
        match self {
            Self::Process(p) => p.validate(),
            Self::External {} | Self::DryRun {} => Ok(()),
        }
    }
}

impl ProcessConfig {
    /// Each configured pool with its template, in pool order.
    pub fn templates(&self) -> impl Iterator<Item = (Pool, &WorkerTemplate)> {
        [
            (Pool::Agg, &self.agg),
            (Pool::Prefill, &self.prefill),
            (Pool::Decode, &self.decode),
        ]
        .into_iter()
        .filter_map(|(pool, t)| t.as_ref().map(|t| (pool, t)))
    }

    /// Pool `pool`'s template, if configured.
    pub fn template(&self, pool: Pool) -> Option<&WorkerTemplate> {
        match pool {
            Pool::Agg => self.agg.as_ref(),
            Pool::Prefill => self.prefill.as_ref(),
            Pool::Decode => self.decode.as_ref(),
        }
    }

    fn validate(&self) -> Result<(), ActuatorConfigError> {
        if self.templates().next().is_none() {
            return Err(ActuatorConfigError::NoPool);
        }
        for (field, value) in [
            ("ready_timeout_s", self.ready_timeout_s),
            ("stop_grace_s", self.stop_grace_s),
        ] {
            if value == 0 {
                return Err(ActuatorConfigError::ZeroTime { field });
            }
        }
        for (pool, t) in self.templates() {
            let name = pool.name();
            if t.command.is_empty() {
                return Err(ActuatorConfigError::EmptyCommand { pool: name });
            }
            let check = |field: &'static str, text: &str| {
                Placeholder::check(text).map_err(|problem| ActuatorConfigError::Placeholder {
                    pool: name,
                    field,
                    problem,
                    text: text.to_owned(),
                })
            };
            for arg in &t.command {
                check("command", arg)?;
            }
            check("worker", &t.worker)?;
            // A sample filling, to check the line's form and role once.
            let line = Placeholder::fill(&t.worker, &Placeholder::sample(&self.host));
            let worker_error = |e: crate::config::ConfigError| ActuatorConfigError::Worker {
                pool: name,
                message: e.to_string(),
            };
            let worker = crate::config::WorkerConfig::parse_flag(&line).map_err(worker_error)?;
            // The router's block size and protocol are checked again when it joins the fleet.
            let block_size = worker.block_size.unwrap_or(16);
            worker.validate(block_size, worker.engine).map_err(worker_error)?;
            let want = pool_role(pool);
            if worker.role() != want {
                return Err(ActuatorConfigError::WrongRole {
                    pool: name,
                    role: worker.role.clone(),
                    want: want.name(),
                });
            }
        }
        Ok(())
    }
}

/// The worker role of `pool`'s workers.
pub fn pool_role(pool: Pool) -> kvroute_core::router::WorkerRole {
    use kvroute_core::router::WorkerRole;
    match pool {
        Pool::Agg => WorkerRole::Aggregated,
        Pool::Prefill => WorkerRole::Prefill,
        Pool::Decode => WorkerRole::Decode,
    }
}

/// The actuator `config` describes, over `fleet` (checked with [`ActuatorConfig::validate`]
/// first).
pub fn build(config: &ActuatorConfig, fleet: Arc<Fleet>) -> Result<Arc<dyn Actuator>, ActuatorConfigError> {
    config.validate()?;
    let metrics = fleet.driver().metrics.clone();
    Ok(match config {
        ActuatorConfig::Process(p) => Arc::new(ProcessActuator::new((**p).clone(), fleet)),
        ActuatorConfig::External {} => Arc::new(External::new(metrics, Mode::External)),
        ActuatorConfig::DryRun {} => Arc::new(External::new(metrics, Mode::DryRun)),
    })
}

/// Whether an [`External`] actuator only publishes or also tells what it would do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `external`: an outside autoscaler acts on the gauge.
    External,
    /// `dry-run`: nobody acts; each decision is logged as what would be done.
    DryRun,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::External => "external",
            Self::DryRun => "dry-run",
        }
    }
}

/// The `external` and `dry-run` actuators: publish the desired workers per pool
/// (`kvroute_planner_desired_workers{pool}`) and keep them; provisioning and releasing are
/// left to someone else, and only logged.
#[derive(Debug)]
pub struct External {
    metrics: Metrics,
    mode: Mode,
    desired: Mutex<BTreeMap<Pool, u32>>,
}

impl External {
    /// Publishing into `metrics`.
    pub fn new(metrics: Metrics, mode: Mode) -> Self {
        Self {
            metrics,
            mode,
            desired: Mutex::default(),
        }
    }

    /// The workers wanted per pool, as last told.
    pub fn desired(&self) -> BTreeMap<Pool, u32> {
        self.desired.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Actuator for External {
    fn set_desired(&self, pool: Pool, n: u32) {
        let before = self
            .desired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pool, n);
        self.metrics
            .planner_desired_workers
            .with_label_values(&[pool.name()])
            .set(i64::from(n));
        if before != Some(n) {
            match self.mode {
                Mode::DryRun => tracing::info!(
                    actuator = self.mode.name(),
                    pool = pool.name(),
                    desired = n,
                    "would scale the pool"
                ),
                Mode::External => tracing::info!(
                    actuator = self.mode.name(),
                    pool = pool.name(),
                    desired = n,
                    "desired workers published"
                ),
            }
        }
    }

    fn provision(&self, pool: Pool) {
        let what = match self.mode {
            Mode::DryRun => "would start a worker",
            Mode::External => "a worker is wanted; the outside autoscaler starts it",
        };
        tracing::info!(actuator = self.mode.name(), pool = pool.name(), "{what}");
    }

    fn release(&self, id: WorkerId, url: &str) {
        let what = match self.mode {
            Mode::DryRun => "would stop a worker",
            Mode::External => "a worker is released; the outside autoscaler stops it",
        };
        tracing::info!(actuator = self.mode.name(), worker = id.0, url, "{what}");
    }

    fn pending(&self) -> Vec<Pool> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ActuatorConfig, ActuatorConfigError> {
        ActuatorConfig::from_toml(text.parse::<toml::Table>().unwrap())
    }

    const AGG: &str = r#"
        kind = "process"
        [agg]
        command = ["kvroute", "mock", "--port", "{port}", "--event-port", "{events_port}", "--model-name", "{model}"]
        worker = "http://{host}:{port},events=tcp://{host}:{events_port},replay=tcp://{host}:{replay_port}"
    "#;

    #[test]
    fn kinds_and_defaults() {
        assert_eq!(parse("kind = \"external\"").unwrap(), ActuatorConfig::External {});
        assert_eq!(parse("kind = \"dry-run\"").unwrap(), ActuatorConfig::DryRun {});
        let ActuatorConfig::Process(p) = parse(AGG).unwrap() else {
            panic!("not a process actuator");
        };
        assert_eq!((p.ready_timeout_s, p.stop_grace_s), (600, 30));
        assert_eq!(p.log_dir, None);
        assert_eq!(
            p.templates().map(|(pool, _)| pool).collect::<Vec<_>>(),
            [Pool::Agg]
        );
    }

    /// A real vLLM's template: environment through `env`, a JSON argument whose braces are
    /// kept and whose placeholders are filled, events on an `ipc://` socket vLLM binds.
    #[test]
    fn a_vllm_template_with_a_json_argument_is_accepted() {
        let text = r#"
            kind = "process"
            [agg]
            command = ["env", "VLLM_HOST_IP=127.0.0.1", "python", "-m", "vllm.entrypoints.openai.api_server",
                       "--port", "{port}", "--kv-events-config",
                       '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"ipc:///run/ev-{index}.sock","replay_endpoint":"tcp://127.0.0.1:{replay_port}","topic":"kv-events"}']
            worker = "http://127.0.0.1:{port},events=ipc:///run/ev-{index}.sock,replay=tcp://127.0.0.1:{replay_port},block-size=32"
        "#;
        let ActuatorConfig::Process(p) = parse(text).unwrap() else {
            panic!("not a process actuator");
        };
        let json = p.agg.as_ref().unwrap().command.last().unwrap();
        let filled = Placeholder::fill(json, &Placeholder::sample("127.0.0.1"));
        let value: serde_json::Value = serde_json::from_str(&filled).unwrap();
        assert_eq!(value["endpoint"], "ipc:///run/ev-0.sock");
        assert_eq!(value["replay_endpoint"], "tcp://127.0.0.1:5558");
    }

    /// Every wrong table is refused, with an error naming what is wrong.
    #[test]
    fn wrong_tables_are_refused_by_name() {
        let prefill = r#"
            kind = "process"
            [prefill]
            command = ["vllm", "serve", "{model}", "--port", "{port}"]
            worker = "http://{host}:{port}"
        "#;
        // (table, expected error text)
        let cases: &[(&str, &str)] = &[
            ("kind = \"kubernetes\"", "unknown variant"),
            ("kind = \"external\"\nreplicas = 3", "unknown field"),
            ("kind = \"process\"", "at least one pool"),
            (
                "kind = \"process\"\n[agg]\ncommand = []\nworker = \"http://h:1\"",
                "command is empty",
            ),
            (
                "kind = \"process\"\n[agg]\ncommand = [\"x\", \"{prt}\"]\nworker = \"http://h:1\"",
                "prt",
            ),
            (
                "kind = \"process\"\n[agg]\ncommand = [\"x\", \"{port\"]\nworker = \"http://h:1\"",
                "unclosed",
            ),
            (
                "kind = \"process\"\n[agg]\ncommand = [\"x\"]\nworker = \"http://h:1\"\nextra = 1",
                "unknown field",
            ),
            (
                "kind = \"process\"\n[agg]\ncommand = [\"x\"]\nworker = \"ftp://h:{port}\"",
                "worker",
            ),
            (
                "kind = \"process\"\nstop_grace_s = 0\n[agg]\ncommand = [\"x\"]\nworker = \"http://h:{port}\"",
                "stop_grace_s",
            ),
            (prefill, "role"),
        ];
        for &(text, want) in cases {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
        assert!(parse(&prefill.replace("{port}\"", "{port},role=prefill\"")).is_ok());
    }

    #[test]
    fn external_publishes_the_desired_workers() {
        let metrics = Metrics::new();
        for mode in [Mode::External, Mode::DryRun] {
            let a = External::new(metrics.clone(), mode);
            a.set_desired(Pool::Agg, 3);
            a.set_desired(Pool::Decode, 1);
            a.set_desired(Pool::Agg, 2);
            a.provision(Pool::Agg);
            a.release(WorkerId(4), "http://w");
            assert_eq!(a.pending(), []);
            assert_eq!(a.desired(), BTreeMap::from([(Pool::Agg, 2), (Pool::Decode, 1)]));
            let text = metrics.render();
            assert!(
                text.contains("kvroute_planner_desired_workers{pool=\"agg\"} 2"),
                "{text}"
            );
            assert!(text.contains("kvroute_planner_desired_workers{pool=\"decode\"} 1"));
        }
    }
}
