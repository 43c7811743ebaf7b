//! Each worker rank's cache view as the KV-event intake ([`crate::events`]) sees it: whether it
//! can be trusted ([`ViewState`], listed by the admin API as a [`ViewSummary`]), whether a
//! replay is catching it up, and the subscriber's resync trigger. While a rank's view is rebuilt
//! after lost batches, a request routed there may ask its engine to re-announce the blocks it
//! reuses (`Views::kv_cache_report`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_http::openai::KvCacheReport;
use kvroute_zmq::ResyncTrigger;
use serde::Serialize;

use crate::config::{EngineKind, Reannounce};

/// How far one rank's cache view can be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ViewState {
    /// Every batch of the engine's current run was applied, in order.
    Live,
    /// Batches were lost for good (a gap the replay could not cover, or no replay socket): the
    /// view was cleared then, and holds only what arrived since.
    RebuiltAfterGap {
        /// When the view was cleared, in milliseconds since the Unix epoch.
        since_unix_ms: u64,
        /// Batches lost since the view was last exact.
        lost_batches: u64,
    },
}

/// A worker's view as the admin API lists it: `none` without KV events, else the least
/// trusted of its ranks' states, with the ranks in that state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ViewSummary {
    /// No KV events configured: the router sees the worker's cache only through its own
    /// decisions, if the cache mode predicts.
    None,
    /// Some ranks are catching up through the engine's replay socket (after a reconnection,
    /// when the worker is back from failed health checks, or to fill a gap): the view is
    /// missing what the replay still brings. Then `live` or `rebuilt_after_gap`.
    Replaying {
        /// The earliest sequence number those ranks asked the replay for.
        from_seq: u64,
        /// The replay endpoint asked (of the first of those ranks).
        endpoint: String,
        /// Those ranks.
        ranks: Vec<u32>,
    },
    /// Every rank's view is [`ViewState::Live`].
    Live,
    /// Some ranks lost batches ([`ViewState::RebuiltAfterGap`]).
    RebuiltAfterGap {
        /// The earliest of those ranks' `since_unix_ms`.
        since_unix_ms: u64,
        /// Batches lost, summed over those ranks.
        lost_batches: u64,
        /// Those ranks.
        ranks: Vec<u32>,
    },
}

/// Every subscribed rank's view state and resync trigger.
#[derive(Clone, Debug, Default)]
pub struct Views(Arc<Mutex<ViewBook>>);

/// Each rank's view.
type ViewBook = BTreeMap<WorkerKey, RankView>;

/// One rank's view: its state, when it was last cleared for lost batches, and its subscriber's
/// resync trigger once started.
#[derive(Debug)]
struct RankView {
    state: ViewState,
    /// Set with [`ViewState::RebuiltAfterGap`]: when the view was last cleared (the start of
    /// the re-announcement window).
    cleared_at: Option<Instant>,
    /// While a replay runs: the sequence number and endpoint it asked.
    replaying: Option<(u64, String)>,
    trigger: Option<ResyncTrigger>,
}

impl Default for RankView {
    fn default() -> Self {
        Self {
            state: ViewState::Live,
            cleared_at: None,
            replaying: None,
            trigger: None,
        }
    }
}

impl Views {
    fn lock(&self) -> std::sync::MutexGuard<'_, ViewBook> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rank `key`'s view is exact again.
    pub(crate) fn exact(&self, key: WorkerKey) {
        let mut views = self.lock();
        let view = views.entry(key).or_default();
        view.state = ViewState::Live;
        view.cleared_at = None;
    }

    pub(crate) fn lost(&self, key: WorkerKey, batches: u64) {
        let mut views = self.lock();
        let entry = views.entry(key).or_default();
        // Cleared again: the window starts again.
        entry.cleared_at = Some(Instant::now());
        entry.state = match entry.state {
            ViewState::Live => ViewState::RebuiltAfterGap {
                since_unix_ms: unix_ms(),
                lost_batches: batches,
            },
            ViewState::RebuiltAfterGap {
                since_unix_ms,
                lost_batches,
            } => ViewState::RebuiltAfterGap {
                since_unix_ms,
                lost_batches: lost_batches.saturating_add(batches),
            },
        };
    }

    /// Rank `key`'s replay from `from` (at `endpoint`) started, or (`None`) ended.
    pub(crate) fn replaying(&self, key: WorkerKey, replay: Option<(u64, String)>) {
        self.lock().entry(key).or_default().replaying = replay;
    }

    pub(crate) fn forget(&self, worker: WorkerId) {
        self.lock().retain(|key, _| key.worker != worker);
    }

    /// Asks each of worker `id`'s subscribers to resync.
    pub(crate) fn resync(&self, id: WorkerId) {
        for view in self.lock().range(rank_keys(id)).map(|(_, v)| v) {
            if let Some(trigger) = &view.trigger {
                trigger.request();
            }
        }
    }

    /// Keeps rank `key`'s resync trigger (its subscriber started).
    pub(crate) fn set_trigger(&self, key: WorkerKey, trigger: ResyncTrigger) {
        self.lock().entry(key).or_default().trigger = Some(trigger);
    }

    /// What a request routed to rank `key` asks of its engine's KV events: `Full` (re-announce
    /// the cached blocks it reuses) while the rank's view is rebuilt after lost batches, for at
    /// most `window` after it was cleared, if the worker's engine takes the request field
    /// (`engine` and `reannounce`, [`Reannounce`]); else vLLM's default.
    pub(crate) fn kv_cache_report(
        &self,
        key: WorkerKey,
        engine: EngineKind,
        reannounce: Reannounce,
        window: Duration,
    ) -> KvCacheReport {
        if reannounce != Reannounce::Auto || engine != EngineKind::Vllm {
            return KvCacheReport::Incremental;
        }
        let rebuilding = self
            .lock()
            .get(&key)
            .and_then(|v| v.cleared_at)
            .is_some_and(|at| at.elapsed() < window);
        if rebuilding {
            KvCacheReport::Full
        } else {
            KvCacheReport::Incremental
        }
    }

    /// Worker `id`'s view, for the admin API.
    pub(crate) fn summary(&self, id: WorkerId, has_events: bool) -> ViewSummary {
        if !has_events {
            return ViewSummary::None;
        }
        let views = self.lock();
        let mut replaying: Option<(u64, String, Vec<u32>)> = None;
        for (key, view) in views.range(rank_keys(id)) {
            if let Some((from, endpoint)) = &view.replaying {
                let r = replaying.get_or_insert_with(|| (*from, endpoint.clone(), Vec::new()));
                r.0 = r.0.min(*from);
                r.2.push(key.dp_rank.0);
            }
        }
        if let Some((from_seq, endpoint, ranks)) = replaying {
            return ViewSummary::Replaying {
                from_seq,
                endpoint,
                ranks,
            };
        }
        let (mut since, mut lost, mut ranks) = (u64::MAX, 0u64, Vec::new());
        for (key, view) in views.range(rank_keys(id)) {
            if let ViewState::RebuiltAfterGap {
                since_unix_ms,
                lost_batches,
            } = view.state
            {
                since = since.min(since_unix_ms);
                lost = lost.saturating_add(lost_batches);
                ranks.push(key.dp_rank.0);
            }
        }
        if ranks.is_empty() {
            ViewSummary::Live
        } else {
            ViewSummary::RebuiltAfterGap {
                since_unix_ms: since,
                lost_batches: lost,
                ranks,
            }
        }
    }
}

/// The keys of worker `id`'s ranks.
fn rank_keys(id: WorkerId) -> std::ops::RangeInclusive<WorkerKey> {
    WorkerKey::new(id, DpRank(0))..=WorkerKey::new(id, DpRank(u32::MAX))
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's target as the report mode depends on it: the rank, the engine and whether
    /// the worker allows re-announcements.
    #[derive(Debug)]
    struct Upstream {
        key: WorkerKey,
        engine: EngineKind,
        reannounce: Reannounce,
    }

    fn upstream(engine: EngineKind, reannounce: Reannounce) -> Upstream {
        Upstream {
            key: WorkerKey::new(WorkerId(7), DpRank(1)),
            engine,
            reannounce,
        }
    }

    fn report(views: &Views, upstream: &Upstream, window: Duration) -> KvCacheReport {
        views.kv_cache_report(upstream.key, upstream.engine, upstream.reannounce, window)
    }

    /// A rank's requests ask for re-announcements only while its view is rebuilt, within the
    /// window, and only of a vLLM engine whose worker allows it; the other ranks never.
    #[test]
    fn reannouncements_are_asked_while_a_view_is_rebuilt_within_the_window_of_vllm_engines() {
        use KvCacheReport::{Full, Incremental};
        let views = Views::default();
        let key = WorkerKey::new(WorkerId(7), DpRank(1));
        let long = Duration::from_secs(300);
        let vllm = upstream(EngineKind::Vllm, Reannounce::Auto);
        assert_eq!(report(&views, &vllm, long), Incremental, "live");
        views.lost(key, 3);
        // (upstream, window, wanted)
        let table = [
            (upstream(EngineKind::Vllm, Reannounce::Auto), long, Full),
            (upstream(EngineKind::Vllm, Reannounce::Off), long, Incremental),
            (upstream(EngineKind::Sglang, Reannounce::Auto), long, Incremental),
            (
                upstream(EngineKind::Vllm, Reannounce::Auto),
                Duration::ZERO,
                Incremental,
            ),
            (
                Upstream {
                    key: WorkerKey::new(WorkerId(7), DpRank(0)),
                    ..upstream(EngineKind::Vllm, Reannounce::Auto)
                },
                long,
                Incremental,
            ),
        ];
        for (upstream, window, wanted) in table {
            assert_eq!(
                report(&views, &upstream, window),
                wanted,
                "{upstream:?} {window:?}"
            );
        }
        // Exact again (a restart, a cache reset): no more.
        views.exact(key);
        assert_eq!(report(&views, &vllm, long), Incremental);
    }
}
