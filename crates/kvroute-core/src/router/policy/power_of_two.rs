//! `power-of-two`: two distinct workers drawn at random, and the one with fewer booked requests
//! (the first drawn on a tie), as SGLang gateway's `power_of_two` ("less-loaded of two random
//! workers") and Dynamo's `power-of-two` mode do. With one candidate, that one.

use super::{Candidate, Policy};
use crate::router::request::RequestView;
use crate::router::rng::Rng;

/// See the module docs.
#[derive(Clone, Copy, Debug)]
pub(super) struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power-of-two"
    }

    fn select(&mut self, _: &RequestView<'_>, candidates: &[Candidate], rng: &mut Rng) -> usize {
        let n = candidates.len();
        if n < 2 {
            return 0;
        }
        let first = rng.below(n);
        let mut second = rng.below(n - 1);
        if second >= first {
            second += 1;
        }
        if candidates[second].load.requests < candidates[first].load.requests {
            second
        } else {
            first
        }
    }
}
