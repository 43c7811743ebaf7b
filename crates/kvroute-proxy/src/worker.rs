//! A worker's life as the proxy sees it: a closed set of states and one pure transition
//! function, so that every rule of membership (health streaks, operator drains, registration
//! checks, removal) is a row of one table and can be tested as such.
//!
//! ```text
//!            3 failed checks in a row, or unreachable
//!   Ready ─────────────────────────────────────────────▶ Unhealthy
//!     ▲  ◀───────────────────────────────────────────────    │
//!     │            2 passing checks in a row                 │
//!     │                                                      │
//!     │   a registration check fails (Ready or Unhealthy)    │
//!     │   ───────────────────────────▶ Misconfigured         │
//!     │   ◀─────────────────────────── (out of routing)      │
//!     │        every check passes                            │
//!     │ drain                        drain (Misconfigured too)│
//!     ▼                                                      ▼
//!   Draining ── no request in flight, 3 failed checks, ──▶ Drained
//!                or unreachable
//!
//!   any state ── removed ──▶ Gone
//! ```
//!
//! A worker enters routing as soon as it is added (`Ready`): the proxy is optimistic, and a
//! worker that is not up yet fails its first request's connect, which takes it out at once
//! (`Unreachable`). The thresholds are the configuration's `health_failure_threshold` and
//! `health_success_threshold` ([`HealthPolicy`]).
//!
//! **Misconfigured workers are out of routing.** The registration checks
//! ([`crate::checks`]) run when a worker is added and when it comes back; one that fails
//! (the worker does not serve the configured model, its KV blocks are not the router's size)
//! means its answers would fail or the router's predictions for it would be wrong, so it takes
//! no requests until every check passes again. Being misconfigured says nothing of health:
//! failed health checks leave it misconfigured, passing ones run the checks again.

use serde::Serialize;

/// Where a worker is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerState {
    /// In routing. `failed`: health checks failed in a row (fewer than the threshold).
    Ready {
        /// Checks failed in a row.
        failed: u32,
    },
    /// Out of routing after failing: its requests in flight stay booked on it until they end,
    /// and its cache view is kept (its KV events say whether its cache survived); it comes back
    /// after enough passing checks in a row.
    Unhealthy {
        /// Checks passed in a row.
        passed: u32,
    },
    /// Out of routing because a registration check failed (the reasons are the registry's);
    /// back to `Ready` once every check passes.
    Misconfigured,
    /// Drained by an operator: keeps its running requests, takes no new ones.
    Draining {
        /// Checks failed in a row.
        failed: u32,
    },
    /// Out of routing for good: drained with nothing left in flight, or failed while draining
    /// or after. It stays listed until it is removed.
    Drained,
    /// Removed by an operator: forgotten.
    Gone,
}

/// What happens to a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerEvent {
    /// A health check passed.
    CheckPassed,
    /// A health check failed (no answer in time, or not 2xx).
    CheckFailed,
    /// A request could not connect to it.
    Unreachable,
    /// An operator asked to drain it.
    DrainRequested,
    /// The router books no request on it any more.
    Idle,
    /// A registration check found it misconfigured.
    ChecksFailed,
    /// Every registration check passes (again).
    ChecksPassed,
    /// An operator removed it.
    Removed,
}

/// How many checks in a row flip a worker's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Failed checks in a row that take a routable worker out.
    pub failures: u32,
    /// Passing checks in a row that bring an unhealthy worker back.
    pub successes: u32,
}

/// A worker's state by name, as the admin API lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StateName {
    /// [`WorkerState::Ready`].
    Ready,
    /// [`WorkerState::Unhealthy`].
    Unhealthy,
    /// [`WorkerState::Misconfigured`].
    Misconfigured,
    /// [`WorkerState::Draining`].
    Draining,
    /// [`WorkerState::Drained`].
    Drained,
    /// [`WorkerState::Gone`].
    Gone,
}

impl WorkerState {
    /// A worker just added.
    pub const ADDED: Self = Self::Ready { failed: 0 };

    /// The state after `event`, under `policy`.
    pub fn on(self, event: WorkerEvent, policy: HealthPolicy) -> Self {
        use WorkerEvent::*;
        use WorkerState::*;
        let reached = |n: u32, threshold: u32| n.saturating_add(1) >= threshold;
        match (self, event) {
            (_, Removed) | (Gone, _) => Gone,
            (Ready { .. }, CheckPassed) => Ready { failed: 0 },
            (Ready { failed }, CheckFailed) if reached(failed, policy.failures) => Unhealthy { passed: 0 },
            (Ready { failed }, CheckFailed) => Ready { failed: failed + 1 },
            (Ready { .. } | Unhealthy { .. }, Unreachable) => Unhealthy { passed: 0 },
            (Ready { .. }, DrainRequested) => Draining { failed: 0 },
            (Ready { .. } | Unhealthy { .. }, ChecksFailed) => Misconfigured,
            (Ready { .. } | Unhealthy { .. } | Draining { .. } | Drained, ChecksPassed) => self,
            (Misconfigured, ChecksPassed) => Ready { failed: 0 },
            // A misconfigured worker has nothing in flight: its drain is complete at once.
            (Misconfigured, DrainRequested) => Drained,
            (Misconfigured, CheckPassed | CheckFailed | Unreachable | Idle | ChecksFailed) => Misconfigured,
            // A drain is the operator's: it goes on whatever a check finds.
            (Draining { .. } | Drained, ChecksFailed) => self,
            (Unhealthy { passed }, CheckPassed) if reached(passed, policy.successes) => Ready { failed: 0 },
            (Unhealthy { passed }, CheckPassed) => Unhealthy { passed: passed + 1 },
            (Unhealthy { .. }, CheckFailed) => Unhealthy { passed: 0 },
            // An unhealthy worker takes no requests: its drain is complete at once (whatever is
            // still booked on it leaves the router with it).
            (Unhealthy { .. }, DrainRequested) => Drained,
            (Draining { .. }, CheckPassed) => Draining { failed: 0 },
            (Draining { failed }, CheckFailed) if reached(failed, policy.failures) => Drained,
            (Draining { failed }, CheckFailed) => Draining { failed: failed + 1 },
            (Draining { .. }, Unreachable | Idle) => Drained,
            (Draining { .. }, DrainRequested) => self,
            (Ready { .. } | Unhealthy { .. }, Idle) => self,
            (Drained, CheckPassed | CheckFailed | Unreachable | DrainRequested | Idle) => Drained,
        }
    }

    /// Whether its ranks are in the router (taking requests, or finishing them).
    pub fn in_router(self) -> bool {
        matches!(self, Self::Ready { .. } | Self::Draining { .. })
    }

    /// Whether it takes new requests.
    pub fn routable(self) -> bool {
        matches!(self, Self::Ready { .. })
    }

    /// Its name.
    pub fn name(self) -> StateName {
        match self {
            Self::Ready { .. } => StateName::Ready,
            Self::Unhealthy { .. } => StateName::Unhealthy,
            Self::Misconfigured => StateName::Misconfigured,
            Self::Draining { .. } => StateName::Draining,
            Self::Drained => StateName::Drained,
            Self::Gone => StateName::Gone,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::WorkerEvent::*;
    use super::WorkerState::*;
    use super::*;

    const POLICY: HealthPolicy = HealthPolicy {
        failures: 3,
        successes: 2,
    };

    #[test]
    fn transitions() {
        // (state, event, expected state), under 3 failures out and 2 passes back.
        let table: &[(WorkerState, WorkerEvent, WorkerState)] = &[
            (Ready { failed: 0 }, CheckPassed, Ready { failed: 0 }),
            (Ready { failed: 2 }, CheckPassed, Ready { failed: 0 }),
            (Ready { failed: 0 }, CheckFailed, Ready { failed: 1 }),
            (Ready { failed: 1 }, CheckFailed, Ready { failed: 2 }),
            (Ready { failed: 2 }, CheckFailed, Unhealthy { passed: 0 }),
            (Ready { failed: 1 }, Unreachable, Unhealthy { passed: 0 }),
            (Ready { failed: 1 }, DrainRequested, Draining { failed: 0 }),
            (Ready { failed: 0 }, Idle, Ready { failed: 0 }),
            (Ready { failed: 0 }, Removed, Gone),
            (Unhealthy { passed: 0 }, CheckPassed, Unhealthy { passed: 1 }),
            (Unhealthy { passed: 1 }, CheckPassed, Ready { failed: 0 }),
            (Unhealthy { passed: 1 }, CheckFailed, Unhealthy { passed: 0 }),
            (Unhealthy { passed: 1 }, Unreachable, Unhealthy { passed: 0 }),
            (Unhealthy { passed: 1 }, DrainRequested, Drained),
            (Unhealthy { passed: 1 }, Idle, Unhealthy { passed: 1 }),
            (Unhealthy { passed: 0 }, Removed, Gone),
            (Draining { failed: 1 }, CheckPassed, Draining { failed: 0 }),
            (Draining { failed: 0 }, CheckFailed, Draining { failed: 1 }),
            (Draining { failed: 2 }, CheckFailed, Drained),
            (Draining { failed: 0 }, Unreachable, Drained),
            (Draining { failed: 1 }, DrainRequested, Draining { failed: 1 }),
            (Draining { failed: 0 }, Idle, Drained),
            (Draining { failed: 0 }, Removed, Gone),
            (Drained, CheckPassed, Drained),
            (Drained, CheckFailed, Drained),
            (Drained, Unreachable, Drained),
            (Drained, DrainRequested, Drained),
            (Drained, Idle, Drained),
            (Drained, Removed, Gone),
            (Ready { failed: 1 }, ChecksFailed, Misconfigured),
            (Ready { failed: 1 }, ChecksPassed, Ready { failed: 1 }),
            (Unhealthy { passed: 1 }, ChecksFailed, Misconfigured),
            (Unhealthy { passed: 1 }, ChecksPassed, Unhealthy { passed: 1 }),
            (Misconfigured, CheckPassed, Misconfigured),
            (Misconfigured, CheckFailed, Misconfigured),
            (Misconfigured, Unreachable, Misconfigured),
            (Misconfigured, Idle, Misconfigured),
            (Misconfigured, ChecksFailed, Misconfigured),
            (Misconfigured, ChecksPassed, Ready { failed: 0 }),
            (Misconfigured, DrainRequested, Drained),
            (Misconfigured, Removed, Gone),
            (Draining { failed: 1 }, ChecksFailed, Draining { failed: 1 }),
            (Draining { failed: 1 }, ChecksPassed, Draining { failed: 1 }),
            (Drained, ChecksFailed, Drained),
            (Drained, ChecksPassed, Drained),
            (Gone, ChecksFailed, Gone),
            (Gone, CheckPassed, Gone),
            (Gone, DrainRequested, Gone),
            (Gone, Removed, Gone),
        ];
        for &(state, event, want) in table {
            assert_eq!(state.on(event, POLICY), want, "{state:?} × {event:?}");
        }
    }

    #[test]
    fn a_threshold_of_one_flips_on_the_first_check() {
        let policy = HealthPolicy {
            failures: 1,
            successes: 1,
        };
        assert_eq!(
            WorkerState::ADDED.on(CheckFailed, policy),
            Unhealthy { passed: 0 }
        );
        assert_eq!(
            Unhealthy { passed: 0 }.on(CheckPassed, policy),
            Ready { failed: 0 }
        );
    }

    #[test]
    fn membership_follows_the_state() {
        // (state, in the router, routable, name)
        let table: &[(WorkerState, bool, bool, StateName)] = &[
            (Ready { failed: 2 }, true, true, StateName::Ready),
            (Unhealthy { passed: 1 }, false, false, StateName::Unhealthy),
            (Misconfigured, false, false, StateName::Misconfigured),
            (Draining { failed: 0 }, true, false, StateName::Draining),
            (Drained, false, false, StateName::Drained),
            (Gone, false, false, StateName::Gone),
        ];
        for &(state, in_router, routable, name) in table {
            assert_eq!(
                (state.in_router(), state.routable(), state.name()),
                (in_router, routable, name),
                "{state:?}"
            );
        }
    }
}
