//! `round-robin`: the next eligible worker in turn, ignoring cache and load (Dynamo's,
//! SGLang gateway's and BLIS's default mode). The cursor counts decisions, so when the set of
//! eligible workers changes it continues from the same count modulo the new size.

use super::{Candidate, Policy};
use crate::router::request::RequestView;
use crate::router::rng::Rng;

/// See the module docs.
#[derive(Clone, Debug, Default)]
pub(super) struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn select(&mut self, _: &RequestView<'_>, candidates: &[Candidate], _: &mut Rng) -> usize {
        let pick = self.next % candidates.len();
        self.next = self.next.wrapping_add(1);
        pick
    }
}
