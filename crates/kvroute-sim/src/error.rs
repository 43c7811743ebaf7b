//! Why a simulation could not run, or found its own state inconsistent.

use kvroute_core::router::{ConfigError as RouterConfigError, RouterError};
use kvroute_core::time::Timestamp;
use kvroute_engine::ConfigError as EngineConfigError;

/// A simulation error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The router's configuration is invalid.
    #[error("router config: {0}")]
    RouterConfig(#[from] RouterConfigError),
    /// The engine's configuration is invalid.
    #[error("engine config: {0}")]
    EngineConfig(#[from] EngineConfigError),
    /// The configuration is inconsistent (block sizes, worker count, probabilities).
    #[error("simulation config: {0}")]
    Config(String),
    /// The planner's configuration is invalid.
    #[error("{0}")]
    Planner(#[from] kvroute_planner::PlannerError),
    /// The workload is inconsistent (a session turn that follows a later request).
    #[error("workload: {0}")]
    Workload(String),
    /// The router refused an input the simulator believed valid.
    #[error("router: {0}")]
    Router(#[from] RouterError),
    /// An event was due before the current time.
    #[error("the clock went back from {from:?} to {to:?}")]
    ClockWentBack {
        /// The current time.
        from: Timestamp,
        /// The event's time.
        to: Timestamp,
    },
    /// An end-of-run invariant does not hold.
    #[error("invariant violated: {0}")]
    Invariant(String),
}
