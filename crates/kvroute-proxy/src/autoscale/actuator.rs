//! How the planner's decisions reach the fleet: one trait, an implementation per way of
//! running workers (`process`, `external`, `dry-run`), chosen in the planner's file.
//!
//! The autoscaler, not the actuator, drains: before [`Actuator::release`] is called the worker
//! is out of routing and its requests have finished (or its drain timed out).

use kvroute_core::ids::WorkerId;
use kvroute_planner::Pool;

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
