//! `least-loaded`: the worker with the fewest booked requests, ties broken at random.
//!
//! Dynamo's `least-loaded` mode and BLIS's `least-loaded` count in-flight requests (BLIS adds
//! the engine's queue depth and batch size, which a router without load metrics does not see);
//! the booked requests are the router's own count of exactly that.

use super::{Candidate, Policy};
use crate::router::request::RequestView;
use crate::router::rng::Rng;
use crate::router::select::argmin;

/// See the module docs.
#[derive(Clone, Copy, Debug)]
pub(super) struct LeastLoaded;

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn select(&mut self, _: &RequestView<'_>, candidates: &[Candidate], rng: &mut Rng) -> usize {
        argmin(candidates.iter().map(|c| f64::from(c.load.requests)), rng)
    }
}
