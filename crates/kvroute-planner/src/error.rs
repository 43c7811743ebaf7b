//! The planner's errors.

use thiserror::Error;

/// Why a planner configuration is unusable.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum PlannerError {
    /// A parameter is out of range; the message names it.
    #[error("planner config: {0}")]
    Config(String),
}
