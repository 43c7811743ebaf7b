//! A worker's cache views, one per rank, as the KV-event intake ([`crate::events`]) sees them:
//! whether each can be trusted ([`ViewState`], listed by the admin API as a [`ViewSummary`]),
//! whether a replay is catching it up, and its subscriber's resync trigger. They are the
//! worker's own ([`WorkerViews`], kept in its registry entry, under the driver's lock). While a
//! rank's view is rebuilt after lost batches, a request routed there may ask its engine to
//! re-announce the blocks it reuses (`WorkerViews::kv_cache_report`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvroute_core::ids::DpRank;
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

/// A worker's views, by rank (a rank has one once something was said of it).
#[derive(Debug, Default)]
pub struct WorkerViews(BTreeMap<DpRank, RankView>);

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

impl WorkerViews {
    fn rank(&mut self, rank: DpRank) -> &mut RankView {
        self.0.entry(rank).or_default()
    }

    /// Rank `rank`'s view is exact again.
    pub(crate) fn exact(&mut self, rank: DpRank) {
        let view = self.rank(rank);
        view.state = ViewState::Live;
        view.cleared_at = None;
    }

    /// Rank `rank`'s view was cleared for `batches` lost for good.
    pub(crate) fn lost(&mut self, rank: DpRank, batches: u64) {
        let view = self.rank(rank);
        // Cleared again: the window starts again.
        view.cleared_at = Some(Instant::now());
        view.state = match view.state {
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

    /// Rank `rank`'s replay from `from` (at `endpoint`) started, or (`None`) ended.
    pub(crate) fn replaying(&mut self, rank: DpRank, replay: Option<(u64, String)>) {
        self.rank(rank).replaying = replay;
    }

    /// Keeps rank `rank`'s resync trigger (its subscriber started).
    pub(crate) fn set_trigger(&mut self, rank: DpRank, trigger: ResyncTrigger) {
        self.rank(rank).trigger = Some(trigger);
    }

    /// Asks each rank's subscriber to resync.
    pub(crate) fn resync(&self) {
        for trigger in self.0.values().filter_map(|v| v.trigger.as_ref()) {
            trigger.request();
        }
    }

    /// What a request routed to rank `rank` asks of its engine's KV events: `Full` (re-announce
    /// the cached blocks it reuses) while the rank's view is rebuilt after lost batches, for at
    /// most `window` after it was cleared, if the worker's engine takes the request field
    /// (`engine` and `reannounce`, [`Reannounce`]); else vLLM's default.
    pub(crate) fn kv_cache_report(
        &self,
        rank: DpRank,
        engine: EngineKind,
        reannounce: Reannounce,
        window: Duration,
    ) -> KvCacheReport {
        if reannounce != Reannounce::Auto || engine != EngineKind::Vllm {
            return KvCacheReport::Incremental;
        }
        let rebuilding = self
            .0
            .get(&rank)
            .and_then(|v| v.cleared_at)
            .is_some_and(|at| at.elapsed() < window);
        if rebuilding {
            KvCacheReport::Full
        } else {
            KvCacheReport::Incremental
        }
    }

    /// The worker's view, for the admin API (`has_events`: whether it has KV events at all).
    pub(crate) fn summary(&self, has_events: bool) -> ViewSummary {
        if !has_events {
            return ViewSummary::None;
        }
        let mut replaying: Option<(u64, String, Vec<u32>)> = None;
        for (rank, view) in &self.0 {
            if let Some((from, endpoint)) = &view.replaying {
                let r = replaying.get_or_insert_with(|| (*from, endpoint.clone(), Vec::new()));
                r.0 = r.0.min(*from);
                r.2.push(rank.0);
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
        for (rank, view) in &self.0 {
            if let ViewState::RebuiltAfterGap {
                since_unix_ms,
                lost_batches,
            } = view.state
            {
                since = since.min(since_unix_ms);
                lost = lost.saturating_add(lost_batches);
                ranks.push(rank.0);
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
        rank: DpRank,
        engine: EngineKind,
        reannounce: Reannounce,
    }

    fn upstream(engine: EngineKind, reannounce: Reannounce) -> Upstream {
        Upstream {
            rank: DpRank(1),
            engine,
            reannounce,
        }
    }

    fn report(views: &WorkerViews, upstream: &Upstream, window: Duration) -> KvCacheReport {
        views.kv_cache_report(upstream.rank, upstream.engine, upstream.reannounce, window)
    }

    /// A rank's requests ask for re-announcements only while its view is rebuilt, within the
    /// window, and only of a vLLM engine whose worker allows it; the other ranks never.
    #[test]
    fn reannouncements_are_asked_while_a_view_is_rebuilt_within_the_window_of_vllm_engines() {
        use KvCacheReport::{Full, Incremental};
        let mut views = WorkerViews::default();
        let key = DpRank(1);
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
                    rank: DpRank(0),
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
