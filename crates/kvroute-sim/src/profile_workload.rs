//! Workloads shaped like inference-perf's `shared_prefix` profiles, as the real vLLM runs of the
//! calibration set were driven: `prefix_groups × users_per_group` prompts, each a system prompt
//! shared within its group followed by the user's own question, made once, shuffled (seeded)
//! and sent in turn, round and round; arrivals Poisson at a constant rate per stage
//! ([`RateStage`]: `8x600;20x600` is 8 requests a second for 600 s, then 20 for 600 s). A prompt
//! sent again finds its blocks cached, as on the real engine with prefix caching.

use std::time::Duration;

use kvroute_core::router::Rng;
use kvroute_core::time::Timestamp;

use crate::synthetic::exponential_secs;
use crate::workload::{Arrival, PromptHasher, SimRequest, Workload};

/// One stage of constant-rate arrivals.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateStage {
    /// Requests per second.
    pub rate_rps: f64,
    /// How long the stage lasts.
    pub duration: Duration,
}

/// Parses stages written `RATExSECONDS;RATExSECONDS…` (`8x600;20x600`), or says which stage is
/// wrong.
pub fn parse_rate_stages(text: &str) -> Result<Vec<RateStage>, String> {
    let mut stages = Vec::new();
    for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (rate, secs) = part
            .split_once('x')
            .ok_or_else(|| format!("rate stage {part:?}: expected RATExSECONDS, like 8x600"))?;
        let rate: f64 = rate
            .trim()
            .parse()
            .map_err(|_| format!("rate stage {part:?}: rate {rate:?} is not a number"))?;
        let secs: f64 = secs
            .trim()
            .parse()
            .map_err(|_| format!("rate stage {part:?}: seconds {secs:?} is not a number"))?;
        if !(rate.is_finite() && rate > 0.0 && secs.is_finite() && secs > 0.0 && secs < 1e9) {
            return Err(format!(
                "rate stage {part:?}: rate and seconds must be above zero"
            ));
        }
        stages.push(RateStage {
            rate_rps: rate,
            duration: Duration::from_secs_f64(secs),
        });
    }
    if stages.is_empty() {
        return Err(format!("rate stages {text:?}: none given"));
    }
    Ok(stages)
}

/// A `shared_prefix` profile.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedPrefixProfile {
    /// Groups, each with its own system prompt.
    pub prefix_groups: u32,
    /// Users (prompts) per group.
    pub users_per_group: u32,
    /// Tokens of each group's system prompt.
    pub system_prompt_tokens: u32,
    /// Tokens of each user's question.
    pub question_tokens: u32,
    /// Tokens every request generates.
    pub output_tokens: u32,
    /// Arrival stages, in order.
    pub stages: Vec<RateStage>,
    /// Seed of the shuffle and of the arrival gaps.
    pub seed: u64,
}

impl SharedPrefixProfile {
    /// Requests the stages offer on average.
    pub fn expected_requests(&self) -> f64 {
        self.stages
            .iter()
            .map(|s| s.rate_rps * s.duration.as_secs_f64())
            .sum()
    }

    /// The workload, at `block_size` tokens per block.
    pub fn generate(&self, block_size: u32) -> Workload {
        let mut rng = Rng::new(self.seed);
        let mut hasher = PromptHasher::new(block_size);
        let (groups, users) = (self.prefix_groups.max(1), self.users_per_group.max(1));
        let mut prompts = Vec::with_capacity((groups * users) as usize);
        for g in 0..groups {
            for u in 0..users {
                let tokens = hasher.buffer();
                let system = self.system_prompt_tokens as usize;
                tokens.resize(system + self.question_tokens as usize, 0);
                // Ids far from the other generators' so tokens never coincide by accident.
                crate::trace::fill_unique_tokens(&mut tokens[..system], 0xC0DE_0000 + u64::from(g), 0);
                let user = u64::from(g) * u64::from(users) + u64::from(u);
                crate::trace::fill_unique_tokens(&mut tokens[system..], 0xC0DE_0000_0000 + user, 0);
                prompts.push(hasher.locals());
            }
        }
        // Fisher-Yates, seeded.
        for i in (1..prompts.len()).rev() {
            let j = rng.below(i + 1);
            prompts.swap(i, j);
        }
        let prompt_tokens = self.system_prompt_tokens + self.question_tokens;
        let mut workload = Workload::new(block_size);
        let mut start = 0.0f64;
        for stage in &self.stages {
            let end = start + stage.duration.as_secs_f64();
            let mut t = start + exponential_secs(1.0 / stage.rate_rps, &mut rng);
            while t < end {
                let i = workload.requests.len() % prompts.len();
                workload.requests.push(SimRequest {
                    arrival: Arrival::At(Timestamp((t * 1e9).round() as u64)),
                    locals: prompts[i].clone(),
                    prompt_tokens,
                    output_tokens: self.output_tokens,
                });
                t += exponential_secs(1.0 / stage.rate_rps, &mut rng);
            }
            start = end;
        }
        workload
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(seed: u64) -> SharedPrefixProfile {
        SharedPrefixProfile {
            prefix_groups: 3,
            users_per_group: 2,
            system_prompt_tokens: 100,
            question_tokens: 40,
            output_tokens: 7,
            stages: parse_rate_stages("8x60;20x30").unwrap(),
            seed,
        }
    }

    #[test]
    fn stages_parse_and_bad_ones_are_named() {
        let s = parse_rate_stages("2.5x600;6x600").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].rate_rps, 2.5);
        assert_eq!(s[1].duration, Duration::from_secs(600));
        for bad in ["", "8", "8x", "ax600", "8x-1", "0x600"] {
            let err = parse_rate_stages(bad).unwrap_err();
            assert!(err.contains("stage"), "{bad}: {err}");
        }
    }

    #[test]
    fn prompts_share_their_groups_prefix_repeat_in_turn_and_arrive_at_the_stages_rates() {
        let p = profile(7);
        let w = p.generate(16);
        assert_eq!(w, p.generate(16), "seeded");
        assert_ne!(w, profile(8).generate(16));
        let n = w.requests.len() as f64;
        // 8 × 60 + 20 × 30 = 1,080 expected; Poisson's spread is about 33.
        assert!(
            (n - p.expected_requests()).abs() < 5.0 * p.expected_requests().sqrt(),
            "{n}"
        );
        let distinct: std::collections::BTreeSet<Vec<_>> =
            w.requests.iter().map(|r| r.locals.to_vec()).collect();
        assert_eq!(distinct.len(), 6);
        // Request i + 6 repeats request i's prompt.
        assert_eq!(w.requests[0].locals, w.requests[6].locals);
        // Every prompt starts with one of three system prompts (6 full blocks of 100 tokens).
        let prefixes: std::collections::BTreeSet<Vec<_>> = distinct.iter().map(|b| b[..6].to_vec()).collect();
        assert_eq!(prefixes.len(), 3);
        let first_stage = w
            .requests
            .iter()
            .filter(|r| matches!(r.arrival, Arrival::At(t) if t.as_nanos() < 60_000_000_000))
            .count() as f64;
        assert!((first_stage - 480.0).abs() < 5.0 * 480f64.sqrt(), "{first_stage}");
        assert!(
            w.requests
                .iter()
                .all(|r| r.prompt_tokens == 140 && r.output_tokens == 7)
        );
    }
}
