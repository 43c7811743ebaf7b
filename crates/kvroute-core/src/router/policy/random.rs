//! `random`: a uniformly random eligible worker (Dynamo's and SGLang gateway's `random`).

use super::{Candidate, Policy};
use crate::router::request::RequestView;
use crate::router::rng::Rng;

/// See the module docs.
#[derive(Clone, Copy, Debug)]
pub(super) struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(&mut self, _: &RequestView<'_>, candidates: &[Candidate], rng: &mut Rng) -> usize {
        rng.below(candidates.len())
    }
}
