//! The planner, live: the same `kvroute_planner::Planner` the simulator drives, fed from what
//! the proxy observes, its decisions carried out by an [`actuator::Actuator`].

pub mod actuator;
pub mod process;
pub mod removal;
