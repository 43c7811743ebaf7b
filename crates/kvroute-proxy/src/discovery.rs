//! Workers found rather than listed: a DNS name re-resolved (A/AAAA records, or SRV records as a
//! Kubernetes headless service gives), a file re-read (a mounted ConfigMap), every
//! `discover-interval-ms`.
//!
//! The decision is sans-IO: [`Membership::step`] takes a source's answer and the fleet as it is
//! and says which workers to add and which to retire, remembering the workers the source added.
//! Its rules:
//!
//! * **A failed answer removes nothing.** A resolution or read that fails, an answer with a bad
//!   line, or one with no worker at all changes nothing (the error is logged and counted): a
//!   source that loses every worker at once is far likelier broken than scaled to zero.
//! * **Discovery removes only what it added.** A worker listed by a flag, added by the admin
//!   API or by a peer replica is never retired by discovery; a URL already in the fleet is not
//!   added again.
//! * **The fleet converges to the last answer**: after a successful answer, the workers the
//!   source added are exactly those it lists (but those another path had added first).
//!
//! Workers are known by base URL: a line changed for a URL already in the fleet (its `dp`, its
//! events endpoint) is not applied to the running worker; list it without, then with, the change.
//!
//! The IO around it is thin: the resolver ([`hickory_resolver`]) or the file read, on a Tokio
//! interval. Workers that appear join through [`Fleet::add`] (their registration checks run, as
//! for the admin API's); one that disappears leaves through [`Fleet::retire`] (drained, then
//! removed). The file is read by path each time, and compared by content, so a ConfigMap update
//! (a symlink swapped) or a file renamed over the old one is seen.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use kvroute_core::ids::WorkerId;

use crate::config::{
    DiscoverySpec, DnsRecordKind, DnsSource, EngineKind, ServeConfig, WorkerConfig, WorkerTemplate,
};
use crate::fleet::{Fleet, RetireOutcome};

/// A discovery source, by kind (its metrics label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SourceKind {
    /// A DNS name.
    Dns,
    /// A watched file.
    File,
}

impl SourceKind {
    /// Its label in the metrics and the log.
    pub fn label(self) -> &'static str {
        match self {
            Self::Dns => "dns",
            Self::File => "file",
        }
    }
}

/// A source's answer: the workers it lists, by base URL (without a trailing slash).
pub type Listing = BTreeMap<String, WorkerConfig>;

/// What to do after an answer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// Workers to add ([`Fleet::add`]); [`Membership::added`] is told of each that joins.
    pub add: Vec<WorkerConfig>,
    /// Workers the source added and no longer lists, to retire ([`Fleet::retire`]), by URL.
    pub retire: Vec<(String, WorkerId)>,
}

/// The workers one source added that are still its own, by URL: the state of discovery's
/// sans-IO core (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    owned: BTreeMap<String, WorkerId>,
}

impl Membership {
    /// The changes `answer` calls for, given `fleet` (every worker in the fleet by base URL,
    /// whoever added it). A failed or empty answer calls for none. The workers to retire stop
    /// being the source's at once; a worker the source added that left the fleet by another
    /// path (an operator removed it) is forgotten, and added again if still listed.
    pub fn step(&mut self, answer: &Result<Listing, String>, fleet: &BTreeMap<String, WorkerId>) -> Changes {
        self.owned.retain(|url, id| fleet.get(url) == Some(id));
        let listing = match answer {
            Ok(listing) if !listing.is_empty() => listing,
            _ => return Changes::default(),
        };
        let retire: Vec<(String, WorkerId)> = self
            .owned
            .iter()
            .filter(|(url, _)| !listing.contains_key(*url))
            .map(|(url, &id)| (url.clone(), id))
            .collect();
        for (url, _) in &retire {
            self.owned.remove(url);
        }
        let add = listing
            .iter()
            .filter(|(url, _)| !fleet.contains_key(*url))
            .map(|(_, config)| config.clone())
            .collect();
        Changes { add, retire }
    }

    /// Worker `id` at `url`, added for this source, joined the fleet.
    pub fn added(&mut self, url: String, id: WorkerId) {
        self.owned.insert(url, id);
    }

    /// How many of the fleet's workers are this source's.
    pub fn len(&self) -> usize {
        self.owned.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.owned.is_empty()
    }

    /// Whether the worker at `url` is this source's.
    pub fn owns(&self, url: &str) -> bool {
        self.owned.contains_key(url)
    }
}

/// A worker's base URL, as the fleet names it.
fn base(config: &WorkerConfig) -> String {
    config.url.trim_end_matches('/').to_owned()
}

/// How a source's lines are checked: against the router's block size (`None` with several
/// models, whose block sizes differ: each worker is checked against its model's when it is
/// added) and the fleet's disaggregation protocol.
pub type Routing = (Option<u32>, EngineKind);

/// `line` as a worker, checked as a `--worker` flag is; `at` names where it came from.
fn checked(line: &str, at: &str, (block_size, protocol): Routing) -> Result<WorkerConfig, String> {
    WorkerConfig::parse_flag(line)
        .and_then(|w| {
            let block_size = block_size.or(w.block_size).unwrap_or_default();
            w.validate(block_size, protocol).map(|()| w)
        })
        .map_err(|e| format!("{at}: {e}"))
}

/// A file's workers: one `--worker` line a line; blank lines and `#` comments ignored. A bad
/// line (named by number) or no worker at all refuses the whole file.
pub fn parse_file(text: &str, routing: Routing) -> Result<Listing, String> {
    let mut listing = Listing::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = format!("line {}", n + 1);
        let config = checked(line, &at, routing)?;
        let url = base(&config);
        if listing.insert(url.clone(), config).is_some() {
            return Err(format!("{at}: {url} is listed twice"));
        }
    }
    if listing.is_empty() {
        return Err("no worker listed".to_owned());
    }
    Ok(listing)
}

/// A DNS answer's workers: `template`'s line for each address and port (an IPv6 address in
/// brackets; lines that make the same URL are one worker). No address at all is an error.
pub fn dns_listing(
    answers: &[(IpAddr, u16)],
    template: &WorkerTemplate,
    routing: Routing,
) -> Result<Listing, String> {
    let mut listing = Listing::new();
    for &(ip, port) in answers {
        let host = match ip {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        let config = checked(&template.line(&host, port), &format!("{ip} port {port}"), routing)?;
        listing.entry(base(&config)).or_insert(config);
    }
    if listing.is_empty() {
        return Err("no address in the answer".to_owned());
    }
    Ok(listing)
}

/// Where one source's answers come from.
enum Asker {
    Dns {
        resolver: Box<TokioResolver>,
        source: DnsSource,
    },
    File(PathBuf),
}

impl Asker {
    fn kind(&self) -> SourceKind {
        match self {
            Self::Dns { .. } => SourceKind::Dns,
            Self::File(_) => SourceKind::File,
        }
    }

    /// The source's answer now.
    async fn ask(&self, routing: Routing) -> Result<Listing, String> {
        match self {
            Self::Dns { resolver, source } => {
                let answers = resolve(resolver, source).await?;
                dns_listing(&answers, &source.template, routing)
            }
            Self::File(path) => {
                let path = path.clone();
                let shown = path.display().to_string();
                let text = tokio::task::spawn_blocking(move || std::fs::read_to_string(path))
                    .await
                    .map_err(|e| format!("reading {shown}: {e}"))?
                    .map_err(|e| format!("reading {shown}: {e}"))?;
                parse_file(&text, routing).map_err(|e| format!("{shown}: {e}"))
            }
        }
    }
}

/// The resolver `source` asks: its server, or the system's; no cache (each answer is fresh),
/// and a failure within the interval.
fn resolver(source: &DnsSource, interval: Duration) -> Result<TokioResolver, String> {
    let mut builder = match source.server {
        Some(addr) => {
            let connections = [ConnectionConfig::udp(), ConnectionConfig::tcp()]
                .into_iter()
                .map(|mut c| {
                    c.port = addr.port();
                    c
                })
                .collect();
            let server = NameServerConfig::new(addr.ip(), true, connections);
            hickory_resolver::Resolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![server]),
                TokioRuntimeProvider::default(),
            )
        }
        None => hickory_resolver::Resolver::builder_tokio()
            .map_err(|e| format!("the system's DNS configuration: {e}"))?,
    };
    let options = builder.options_mut();
    options.timeout = interval.clamp(Duration::from_millis(100), Duration::from_secs(5));
    options.attempts = 1;
    builder.build().map_err(|e| format!("the DNS resolver: {e}"))
}

/// `source`'s addresses and ports, sorted: A/AAAA records at its port, or each SRV record's
/// target's addresses at the record's port.
async fn resolve(resolver: &TokioResolver, source: &DnsSource) -> Result<Vec<(IpAddr, u16)>, String> {
    resolver.clear_cache();
    let name = &source.name;
    let mut answers = Vec::new();
    match source.kind {
        DnsRecordKind::A => {
            let port = source.port.unwrap_or(0);
            let ips = resolver
                .lookup_ip(name.as_str())
                .await
                .map_err(|e| format!("resolving {name}: {e}"))?;
            answers.extend(ips.iter().map(|ip| (ip, port)));
        }
        DnsRecordKind::Srv => {
            let srv = resolver
                .srv_lookup(name.as_str())
                .await
                .map_err(|e| format!("resolving SRV {name}: {e}"))?;
            for record in srv.answers() {
                let RData::SRV(srv) = &record.data else { continue };
                let target = srv.target.to_ascii();
                let ips = resolver
                    .lookup_ip(target.as_str())
                    .await
                    .map_err(|e| format!("resolving {target} (SRV {name}): {e}"))?;
                answers.extend(ips.iter().map(|ip| (ip, srv.port)));
            }
        }
    }
    answers.sort_unstable();
    answers.dedup();
    Ok(answers)
}

/// Starts discovery's sources (one task each), when `spec` names any; their tasks. A worker
/// found joins the fleet of `fleets` (one per model, the first's metrics counting) its line
/// names (`model=NAME`), the only one, or the one its `/v1/models` lists.
pub fn start(
    fleets: &[Arc<Fleet>],
    spec: &DiscoverySpec,
) -> Result<Vec<tokio::task::JoinHandle<()>>, String> {
    let mut askers = Vec::new();
    if let Some(source) = &spec.dns {
        askers.push(Asker::Dns {
            resolver: Box::new(resolver(source, spec.interval)?),
            source: source.clone(),
        });
    }
    if let Some(path) = &spec.file {
        askers.push(Asker::File(path.clone()));
    }
    Ok(askers
        .into_iter()
        .map(|asker| tokio::spawn(run(fleets.to_vec(), asker, spec.interval, spec.drain_timeout)))
        .collect())
}

/// The fleet of `fleets` that worker `config` joins ([`start`]).
async fn fleet_for<'a>(fleets: &'a [Arc<Fleet>], config: &WorkerConfig) -> Result<&'a Arc<Fleet>, String> {
    let names: Vec<&str> = fleets
        .iter()
        .map(|f| f.driver().config.model.model_name.as_str())
        .collect();
    let Some(first) = fleets.first() else {
        return Err("no model to add it to".to_owned());
    };
    let timeout = ServeConfig::ms(first.driver().config.upstream.health_timeout_ms.max(1_000));
    let model = crate::adapters::model_for(&first.checker().client, config, &names, timeout).await?;
    fleets
        .iter()
        .find(|f| f.driver().config.model.model_name == model)
        .ok_or_else(|| format!("model {model:?} is none of those served ({})", names.join(", ")))
}

/// One source's loop: ask, step, apply, every `interval`.
async fn run(fleets: Vec<Arc<Fleet>>, asker: Asker, interval: Duration, drain_timeout: Duration) {
    let kind = asker.kind();
    let source = kind.label();
    let Some(fleet) = fleets.first() else {
        return;
    };
    let driver = Arc::clone(fleet.driver());
    let routing = (
        (fleets.len() == 1).then_some(driver.config.routing.block_size),
        driver.config.routing.disagg_protocol,
    );
    let gauge = driver.metrics.discovery_workers.with_label_values(&[source]);
    let errors = driver.metrics.discovery_errors.with_label_values(&[source]);
    let mut membership = Membership::default();
    let mut last_error: Option<String> = None;
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let answer = asker.ask(routing).await;
        match &answer {
            Err(e) => {
                errors.inc();
                if last_error.as_ref() != Some(e) {
                    tracing::warn!(
                        source,
                        error = e.as_str(),
                        "discovery: answer refused; no worker removed"
                    );
                }
                last_error = Some(e.clone());
            }
            Ok(listing) => {
                if last_error.take().is_some() {
                    tracing::info!(
                        source,
                        workers = listing.len(),
                        "discovery: the source answers again"
                    );
                }
            }
        }
        // Every model's workers (ids are unique across them).
        let in_fleet: BTreeMap<String, WorkerId> = fleets
            .iter()
            .flat_map(|f| f.driver().worker_urls())
            .map(|(id, url)| (url, id))
            .collect();
        let changes = membership.step(&answer, &in_fleet);
        for config in changes.add {
            let url = base(&config);
            let joined = match fleet_for(&fleets, &config).await {
                Ok(fleet) => fleet.add(config),
                Err(e) => Err(e),
            };
            match joined {
                Ok(id) => {
                    tracing::info!(source, url, worker = id.0, "discovery: worker added");
                    membership.added(url, id);
                }
                Err(e) => {
                    errors.inc();
                    tracing::warn!(source, url, error = e, "discovery: worker refused");
                }
            }
        }
        for (url, id) in changes.retire {
            tracing::info!(
                source,
                url,
                worker = id.0,
                "discovery: worker no longer listed; draining"
            );
            let holder = fleets.iter().find(|f| f.driver().worker_state(id).is_some());
            let fleet = Arc::clone(holder.unwrap_or(fleet));
            tokio::spawn(async move {
                match fleet.retire(id, drain_timeout).await {
                    RetireOutcome::Drained => {
                        tracing::info!(source, url, "discovery: worker drained and removed")
                    }
                    RetireOutcome::TimedOut { in_flight } => tracing::warn!(
                        source,
                        url,
                        in_flight,
                        "discovery: worker removed with requests in flight (drain timeout)"
                    ),
                    RetireOutcome::Gone => tracing::info!(source, url, "discovery: worker already gone"),
                }
            });
        }
        gauge.set(membership.len() as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ROUTING: Routing = (Some(16), EngineKind::Vllm);

    fn listing(ports: &[u16]) -> Listing {
        let text: String = ports.iter().map(|p| format!("http://127.0.0.1:{p}\n")).collect();
        parse_file(&text, ROUTING).unwrap()
    }

    fn url(port: u16) -> String {
        format!("http://127.0.0.1:{port}")
    }

    #[test]
    fn files_are_read_line_by_line_with_comments_and_refused_whole() {
        let got = parse_file(
            "# vLLM pods\n\nhttp://10.0.0.1:8000,events=tcp://10.0.0.1:5557\n  http://10.0.0.2:8000/  # x\n",
            ROUTING,
        );
        // A comment after a line is part of it: refused (the whole file with it).
        assert!(got.unwrap_err().starts_with("line 4:"));
        let got = parse_file(
            "# vLLM pods\n\nhttp://10.0.0.1:8000,events=tcp://10.0.0.1:5557\n  http://10.0.0.2:8000/\n",
            ROUTING,
        )
        .unwrap();
        let urls: Vec<&str> = got.keys().map(String::as_str).collect();
        assert_eq!(urls, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
        assert_eq!(
            got["http://10.0.0.1:8000"].events.as_deref(),
            Some("tcp://10.0.0.1:5557")
        );
        for (text, error) in [
            ("", "no worker listed"),
            ("# none\n\n", "no worker listed"),
            ("http://h:1\nhttp://h:1/\n", "line 2: http://h:1 is listed twice"),
            ("http://h:1\nhttp://h:2,dp=0\n", "line 2:"),
            ("http://h:1,bogus=1\n", "line 1:"),
        ] {
            let e = parse_file(text, ROUTING).unwrap_err();
            assert!(e.starts_with(error), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_dns_answer_makes_the_templates_lines() {
        let template = crate::config::ServeConfig::from_toml_str(
            "discover-dns = \"srv:w\"\ndiscover-worker-template = \"http://{host}:{port},events=tcp://{host}:5557\"\n",
        )
        .unwrap()
        .discovery()
        .unwrap()
        .unwrap()
        .dns
        .unwrap()
        .template;
        let answers = [
            ("10.0.0.1".parse().unwrap(), 8000),
            ("10.0.0.1".parse().unwrap(), 8000),
            ("fd00::7".parse().unwrap(), 8001),
        ];
        let got = dns_listing(&answers, &template, ROUTING).unwrap();
        let urls: Vec<&str> = got.keys().map(String::as_str).collect();
        assert_eq!(urls, ["http://10.0.0.1:8000", "http://[fd00::7]:8001"]);
        assert_eq!(
            got["http://[fd00::7]:8001"].events.as_deref(),
            Some("tcp://[fd00::7]:5557")
        );
        assert_eq!(
            dns_listing(&[], &template, ROUTING).unwrap_err(),
            "no address in the answer"
        );
    }

    #[test]
    fn a_failed_or_empty_answer_changes_nothing() {
        let mut m = Membership::default();
        let fleet = BTreeMap::new();
        let changes = m.step(&Ok(listing(&[1, 2])), &fleet);
        assert_eq!(changes.add.len(), 2);
        m.added(url(1), WorkerId(0));
        m.added(url(2), WorkerId(1));
        let fleet: BTreeMap<String, WorkerId> = [(url(1), WorkerId(0)), (url(2), WorkerId(1))].into();
        for answer in [Err("SERVFAIL".to_owned()), Ok(Listing::new())] {
            assert_eq!(m.step(&answer, &fleet), Changes::default(), "{answer:?}");
            assert_eq!(m.len(), 2);
        }
        // A worker that left: retired, and no longer the source's.
        let changes = m.step(&Ok(listing(&[1])), &fleet);
        assert_eq!(changes.retire, [(url(2), WorkerId(1))]);
        assert!(changes.add.is_empty());
        assert!(m.owns(&url(1)) && !m.owns(&url(2)));
    }

    #[test]
    fn workers_another_path_added_are_neither_added_again_nor_retired() {
        let mut m = Membership::default();
        // Port 9 came by a flag.
        let fleet: BTreeMap<String, WorkerId> = [(url(9), WorkerId(0))].into();
        let changes = m.step(&Ok(listing(&[9, 1])), &fleet);
        assert_eq!(changes.add.iter().map(base).collect::<Vec<_>>(), [url(1)]);
        m.added(url(1), WorkerId(1));
        let fleet: BTreeMap<String, WorkerId> = [(url(9), WorkerId(0)), (url(1), WorkerId(1))].into();
        let changes = m.step(&Ok(listing(&[1])), &fleet);
        assert_eq!(changes, Changes::default(), "the flag's worker stays");
        // An operator removed the discovered one: forgotten, and added again while listed.
        let fleet: BTreeMap<String, WorkerId> = [(url(9), WorkerId(0))].into();
        let changes = m.step(&Ok(listing(&[1])), &fleet);
        assert_eq!(changes.add.iter().map(base).collect::<Vec<_>>(), [url(1)]);
        assert!(changes.retire.is_empty());
    }

    /// One step of a fleet's life: a source's answer (the ports it lists, or a failure), or an
    /// operator's add or removal of a worker.
    #[derive(Clone, Debug)]
    enum Step {
        Answer(Option<Vec<u16>>),
        OperatorAdds(u16),
        OperatorRemoves(u16),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => prop::option::weighted(0.7, prop::collection::vec(1u16..8, 0..6)).prop_map(Step::Answer),
            1 => (1u16..8).prop_map(Step::OperatorAdds),
            1 => (1u16..8).prop_map(Step::OperatorRemoves),
        ]
    }

    proptest! {
        /// Against a model fleet (URL → id and who added it; a retired worker leaves at once):
        /// a failed answer changes nothing, discovery never retires what it did not add, and
        /// after each successful answer the source's workers are exactly the listed ones not
        /// added by another path.
        #[test]
        fn the_fleet_converges_to_the_last_answer(steps in prop::collection::vec(step(), 1..40)) {
            let mut fleet: BTreeMap<String, (WorkerId, bool)> = BTreeMap::new();
            let mut next = 0u64;
            let mut new_id = || { next += 1; WorkerId(next) };
            let mut m = Membership::default();
            for s in steps {
                match s {
                    Step::OperatorAdds(p) => {
                        fleet.entry(url(p)).or_insert_with(|| (new_id(), false));
                    }
                    Step::OperatorRemoves(p) => { fleet.remove(&url(p)); }
                    Step::Answer(answer) => {
                        let answer = match &answer {
                            Some(ports) if !ports.is_empty() => Ok(listing(&{
                                let mut p = ports.clone(); p.sort_unstable(); p.dedup(); p
                            })),
                            Some(_) => Ok(Listing::new()),
                            None => Err("failed".to_owned()),
                        };
                        let before = fleet.clone();
                        let ids: BTreeMap<String, WorkerId> = fleet.iter().map(|(u, (id, _))| (u.clone(), *id)).collect();
                        let changes = m.step(&answer, &ids);
                        for (u, id) in &changes.retire {
                            let (held, ours) = fleet.remove(u).expect("retires a worker in the fleet");
                            prop_assert!(ours, "retired {} that it did not add", u);
                            prop_assert_eq!(held, *id);
                        }
                        for config in changes.add {
                            let id = new_id();
                            prop_assert!(fleet.insert(base(&config), (id, true)).is_none(), "added twice");
                            m.added(base(&config), id);
                        }
                        match &answer {
                            Ok(listing) if !listing.is_empty() => {
                                let ours: Vec<&String> = fleet.iter().filter(|(_, (_, o))| *o).map(|(u, _)| u).collect();
                                let want: Vec<&String> = listing.keys().filter(|u| before.get(*u).is_none_or(|(_, o)| *o)).collect();
                                prop_assert_eq!(ours, want);
                                prop_assert!(listing.keys().all(|u| fleet.contains_key(u)));
                            }
                            _ => prop_assert_eq!(&fleet, &before, "a failed or empty answer changed the fleet"),
                        }
                    }
                }
                let ours = fleet.values().filter(|(_, o)| *o).count();
                // The membership may still hold a worker an operator removed until its next step.
                prop_assert!(m.len() >= ours);
            }
        }
    }
}
