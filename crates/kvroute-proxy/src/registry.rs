//! The worker registry: every worker the proxy knows, and everything the proxy holds for it:
//! its configuration, its [`WorkerState`], its registration checks' verdicts, its ranks' cache
//! views ([`WorkerViews`]) and its KV-event subscribers ([`Subscribers`], stopped when its entry
//! goes). What a change of state means for
//! the router (ranks entering, draining or leaving it) is the driver's ([`crate::driver`]),
//! which is the one place entries are added and removed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use axum::http::Uri;
use kvroute_http::openai::Endpoint;

use kvroute_core::ids::WorkerId;
use serde::Serialize;

use crate::checks::{Check, Verdict};
use crate::config::WorkerConfig;
use crate::views::WorkerViews;
use crate::worker::{HealthPolicy, StateName, WorkerEvent, WorkerState};

/// A worker as the proxy knows it.
#[derive(Debug)]
pub struct WorkerEntry {
    /// Its configuration.
    pub config: WorkerConfig,
    /// Its base URL without a trailing slash.
    pub base: String,
    /// The same, with the generation endpoints' URLs parsed once (what requests are sent to).
    pub urls: Arc<WorkerUrls>,
    /// Where it is in its life.
    pub state: WorkerState,
    /// The registration checks that find it misconfigured, with their reasons.
    pub problems: BTreeMap<Check, String>,
    /// The block size of its latest KV events (what [`Check::BlockSize`] last judged).
    pub event_block_size: Option<u32>,
    /// Its ranks' cache views, as its KV events tell.
    pub views: WorkerViews,
    /// Its KV-event subscribers (none until they are started, or without events).
    pub subscribers: Subscribers,
    /// Since when it has taken requests (`None` while it takes none): the planner leaves a
    /// worker's latencies out while it warms up.
    pub routable_since: Option<Instant>,
}

/// A worker's KV-event subscriber tasks ([`crate::events`]), one per rank: they run while this
/// lives, so a worker's subscribers stop when its registry entry goes, whichever path removes
/// it (an operator, a peer replica, the proxy stopping).
#[derive(Debug, Default)]
pub struct Subscribers(Vec<tokio::task::JoinHandle<()>>);

impl Subscribers {
    /// Owns `tasks` (each stops when this is dropped).
    pub fn new(tasks: Vec<tokio::task::JoinHandle<()>>) -> Self {
        Self(tasks)
    }

    /// How many there are (one per rank with an endpoint).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Drop for Subscribers {
    fn drop(&mut self) {
        self.0.iter().for_each(tokio::task::JoinHandle::abort);
    }
}

/// A worker's base URL and its generation endpoints' URLs under it, parsed once when it is
/// registered rather than for every request.
#[derive(Debug, Default)]
pub struct WorkerUrls {
    /// The base URL without a trailing slash.
    pub base: String,
    /// `/v1/completions` under it (`None` if that is no URL: a request then fails as it is built).
    completions: Option<Uri>,
    /// `/v1/chat/completions` under it.
    chat: Option<Uri>,
}

impl WorkerUrls {
    /// The URLs under `base` (without a trailing slash).
    pub fn new(base: String) -> Self {
        let under = |endpoint: Endpoint| Uri::try_from(format!("{base}{}", endpoint.path())).ok();
        Self {
            completions: under(Endpoint::Completions),
            chat: under(Endpoint::Chat),
            base,
        }
    }

    /// `endpoint`'s URL at this worker, if the base URL makes one.
    pub fn endpoint(&self, endpoint: Endpoint) -> Option<&Uri> {
        match endpoint {
            Endpoint::Completions => self.completions.as_ref(),
            Endpoint::Chat => self.chat.as_ref(),
        }
    }
}

/// A worker as the admin API lists it.
#[derive(Debug, Serialize)]
pub struct WorkerStatus {
    /// Its id.
    pub id: u64,
    /// Its configuration.
    #[serde(flatten)]
    pub config: WorkerConfig,
    /// Its state by name.
    pub state: StateName,
    /// Whether it takes new requests (its state is `ready`).
    pub routable: bool,
    /// Why it is misconfigured, by check (empty when every check passes).
    pub misconfigured: BTreeMap<Check, String>,
    /// Requests the router books on it (all ranks).
    pub active_requests: u64,
    /// Blocks the index says it holds (all ranks).
    pub cached_blocks: u64,
    /// How far its cache view can be trusted (from its KV events).
    pub view: crate::views::ViewSummary,
}

/// One worker's change of state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// Before.
    pub from: WorkerState,
    /// After.
    pub to: WorkerState,
    /// Its data-parallel ranks (each is a worker to the router).
    pub ranks: u32,
}

/// Every worker, by id (ids are never reused).
#[derive(Debug)]
pub struct Registry {
    workers: BTreeMap<WorkerId, WorkerEntry>,
    /// The workers in state [`WorkerState::Draining`], kept with each change of state: the
    /// driver asks after them at the end of every request, which must not cost a scan of the
    /// fleet.
    draining: BTreeSet<WorkerId>,
    /// The next id, shared by the registries of one process (one per model), so that an id
    /// names one worker in the whole proxy.
    next: Arc<std::sync::atomic::AtomicU64>,
    policy: HealthPolicy,
}

impl Registry {
    /// An empty registry whose health streaks follow `policy`.
    pub fn new(policy: HealthPolicy) -> Self {
        Self::numbering_from(policy, Arc::default())
    }

    /// [`Self::new`], taking its ids from `next` (shared with other registries).
    pub fn numbering_from(policy: HealthPolicy, next: Arc<std::sync::atomic::AtomicU64>) -> Self {
        Self {
            workers: BTreeMap::new(),
            draining: BTreeSet::new(),
            next,
            policy,
        }
    }

    /// Registers a worker in state [`WorkerState::ADDED`] (not yet in the router: the driver
    /// puts it there) and returns its id.
    pub fn add(&mut self, config: WorkerConfig) -> WorkerId {
        let id = WorkerId(self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let base = config.url.trim_end_matches('/').to_owned();
        self.workers.insert(
            id,
            WorkerEntry {
                config,
                urls: Arc::new(WorkerUrls::new(base.clone())),
                base,
                state: WorkerState::ADDED,
                problems: BTreeMap::new(),
                event_block_size: None,
                views: WorkerViews::default(),
                subscribers: Subscribers::default(),
                routable_since: WorkerState::ADDED.routable().then(Instant::now),
            },
        );
        id
    }

    /// Applies `event` to worker `id`; `None` if there is no such worker. A worker whose new
    /// state is [`WorkerState::Gone`] stays until [`Self::forget`] (its last state is still
    /// to be carried out).
    pub fn apply(&mut self, id: WorkerId, event: WorkerEvent) -> Option<Transition> {
        let entry = self.workers.get_mut(&id)?;
        let from = entry.state;
        let to = from.on(event, self.policy);
        entry.state = to;
        match (from.routable(), to.routable()) {
            (false, true) => entry.routable_since = Some(Instant::now()),
            (_, false) => entry.routable_since = None,
            (true, true) => {}
        }
        if matches!(to, WorkerState::Draining { .. }) {
            self.draining.insert(id);
        } else {
            self.draining.remove(&id);
        }
        let ranks = entry.config.dp_size;
        Some(Transition { from, to, ranks })
    }

    /// Keeps `check`'s `verdict` on worker `id`: its reason, or none. `None` if there is no
    /// such worker or the verdict is the one it had; else the new reason (`Some(None)`: the
    /// check passes again).
    pub fn set_verdict(&mut self, id: WorkerId, check: Check, verdict: Verdict) -> Option<Option<String>> {
        let entry = self.workers.get_mut(&id)?;
        let reason = verdict.err();
        if entry.problems.get(&check) == reason.as_ref() {
            return None;
        }
        match &reason {
            Some(r) => entry.problems.insert(check, r.clone()),
            None => entry.problems.remove(&check),
        };
        Some(reason)
    }

    /// Notes the block size of worker `id`'s latest KV events; whether it changed.
    pub fn note_event_block_size(&mut self, id: WorkerId, block_size: u32) -> bool {
        match self.workers.get_mut(&id) {
            Some(entry) if entry.event_block_size != Some(block_size) => {
                entry.event_block_size = Some(block_size);
                true
            }
            _ => false,
        }
    }

    /// Forgets worker `id` if it is [`WorkerState::Gone`].
    pub fn forget(&mut self, id: WorkerId) {
        if self.get(id).is_some_and(|w| w.state == WorkerState::Gone) {
            self.workers.remove(&id);
        }
    }

    /// Worker `id`.
    pub fn get(&self, id: WorkerId) -> Option<&WorkerEntry> {
        self.workers.get(&id)
    }

    /// Gives worker `id` its subscribers (replacing, and so stopping, any it had). If there
    /// is no such worker (it was removed meanwhile) they are dropped, and so stopped, at once.
    pub fn adopt(&mut self, id: WorkerId, subscribers: Subscribers) {
        if let Some(entry) = self.workers.get_mut(&id).filter(|w| w.state != WorkerState::Gone) {
            entry.subscribers = subscribers;
        }
    }

    /// Worker `id`'s cache views, to change (`None`: no such worker, or gone).
    pub fn views_mut(&mut self, id: WorkerId) -> Option<&mut WorkerViews> {
        self.workers
            .get_mut(&id)
            .filter(|w| w.state != WorkerState::Gone)
            .map(|w| &mut w.views)
    }

    /// Stops every worker's subscribers (the proxy stops).
    pub fn stop_subscribers(&mut self) {
        for entry in self.workers.values_mut() {
            entry.subscribers = Subscribers::default();
        }
    }

    /// The worker at base URL `url` (without a trailing slash) that is not gone: how replicas
    /// name a worker to each other.
    pub fn find(&self, url: &str) -> Option<WorkerId> {
        let url = url.trim_end_matches('/');
        self.iter()
            .find(|(_, w)| w.base == url && w.state != WorkerState::Gone)
            .map(|(id, _)| id)
    }

    /// Every worker, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, &WorkerEntry)> {
        self.workers.iter().map(|(&id, w)| (id, w))
    }

    /// The workers being drained (without a scan of the fleet).
    pub fn draining(&self) -> impl Iterator<Item = (WorkerId, &WorkerEntry)> {
        self.draining
            .iter()
            .filter_map(|&id| self.workers.get(&id).map(|w| (id, w)))
    }

    /// Whether worker `id`'s ranks are in the router.
    pub fn in_router(&self, id: WorkerId) -> bool {
        self.get(id).is_some_and(|w| w.state.in_router())
    }

    /// Whether some worker takes new requests.
    pub fn any_routable(&self) -> bool {
        self.workers.values().any(|w| w.state.routable())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The URLs parsed at registration are the ones a request would have parsed from the base
    /// URL and the path; a base URL that makes none leaves the request to fail as it is built.
    #[test]
    fn endpoint_urls_are_parsed_once_as_a_request_would_parse_them() {
        for base in [
            "http://127.0.0.1:8000",
            "http://worker-3.internal:9000/prefix",
            "https://h",
            "http://[::1]:80",
            "127.0.0.1:8000",
            "http://a b",
            "",
        ] {
            let urls = WorkerUrls::new(base.to_owned());
            assert_eq!(urls.base, base);
            for endpoint in [Endpoint::Completions, Endpoint::Chat] {
                let whole = format!("{base}{}", endpoint.path());
                assert_eq!(
                    urls.endpoint(endpoint),
                    Uri::try_from(whole.as_str()).ok().as_ref(),
                    "{whole}"
                );
                let built = axum::http::Request::post(whole).body(());
                assert_eq!(
                    urls.endpoint(endpoint).cloned(),
                    built.ok().map(|r| r.uri().clone()),
                    "{base}"
                );
            }
        }
    }

    #[test]
    fn removal_forgets_a_worker_and_ids_are_not_reused() {
        let mut registry = Registry::new(HealthPolicy {
            failures: 3,
            successes: 2,
        });
        let config = WorkerConfig::parse_flag("http://127.0.0.1:1/").unwrap();
        let a = registry.add(config.clone());
        assert_eq!(registry.get(a).unwrap().base, "http://127.0.0.1:1");
        let t = registry.apply(a, WorkerEvent::Removed).unwrap();
        assert_eq!((t.from, t.to), (WorkerState::ADDED, WorkerState::Gone));
        assert_eq!(registry.get(a).unwrap().state, WorkerState::Gone);
        registry.forget(a);
        assert!(registry.get(a).is_none());
        assert!(registry.apply(a, WorkerEvent::CheckPassed).is_none());
        assert_ne!(registry.add(config), a);
    }

    #[test]
    fn verdicts_are_kept_by_check_and_only_changes_are_reported() {
        let mut registry = Registry::new(HealthPolicy {
            failures: 3,
            successes: 2,
        });
        let a = registry.add(WorkerConfig::parse_flag("http://127.0.0.1:1/").unwrap());
        let bad = || Err("wrong".to_owned());
        // (check, verdict, change reported, reasons after)
        let script: &[(Check, Verdict, Option<Option<&str>>, usize)] = &[
            (Check::Model, Ok(()), None, 0),
            (Check::Model, bad(), Some(Some("wrong")), 1),
            (Check::Model, bad(), None, 1),
            (Check::BlockSize, bad(), Some(Some("wrong")), 2),
            (Check::Model, Ok(()), Some(None), 1),
            (Check::BlockSize, Ok(()), Some(None), 0),
        ];
        for (step, (check, verdict, change, reasons)) in script.iter().enumerate() {
            let got = registry.set_verdict(a, *check, verdict.clone());
            assert_eq!(got.as_ref().map(|r| r.as_deref()), *change, "step {step}");
            assert_eq!(registry.get(a).unwrap().problems.len(), *reasons, "step {step}");
        }
        assert!(registry.note_event_block_size(a, 16));
        assert!(!registry.note_event_block_size(a, 16));
        assert!(registry.note_event_block_size(a, 32));
        assert!(registry.set_verdict(WorkerId(99), Check::Model, Ok(())).is_none());
    }

    #[test]
    fn the_draining_workers_follow_every_change_of_state() {
        let mut registry = Registry::new(HealthPolicy {
            failures: 1,
            successes: 1,
        });
        let config = |port: u16| WorkerConfig::parse_flag(&format!("http://127.0.0.1:{port}")).unwrap();
        let (a, b) = (registry.add(config(1)), registry.add(config(2)));
        let draining = |r: &Registry| r.draining().map(|(id, _)| id).collect::<Vec<_>>();
        // (worker, event, draining after): the set against the states themselves.
        let script = [
            (a, WorkerEvent::CheckPassed, vec![]),
            (b, WorkerEvent::CheckPassed, vec![]),
            (a, WorkerEvent::DrainRequested, vec![a]),
            (b, WorkerEvent::DrainRequested, vec![a, b]),
            (a, WorkerEvent::CheckPassed, vec![a, b]),
            (a, WorkerEvent::Idle, vec![b]),
            (b, WorkerEvent::Removed, vec![]),
        ];
        for (step, (id, event, want)) in script.into_iter().enumerate() {
            registry.apply(id, event);
            assert_eq!(draining(&registry), want, "step {step}");
            let scanned: Vec<_> = registry
                .iter()
                .filter(|(_, w)| matches!(w.state, WorkerState::Draining { .. }))
                .map(|(id, _)| id)
                .collect();
            assert_eq!(scanned, want, "step {step}: the states say otherwise");
        }
        registry.forget(b);
        assert!(draining(&registry).is_empty());
    }
}
