//! Prefill/decode disaggregation: whether a request's prefill runs on a separate prefill worker.
//!
//! The decode worker is chosen first, from the workers that can decode. When it is a
//! [`WorkerRole::Decode`](super::WorkerRole::Decode) worker and the fleet has prefill workers,
//! the decider looks at the prompt's cache on that decode worker:
//!
//! ```text
//! uncached = prompt_tokens - cached_blocks * block_size      (effective_prefill_tokens)
//! disaggregate  <=>  uncached > threshold
//! ```
//!
//! The prefill worker then comes from the prefill pool under that pool's own policy.
//!
//! How the peers' prefix-threshold rules differ:
//!
//! * **llm-d** (`prefix-based-pd-decider`) disaggregates when `uncached >= threshold`, counts
//!   prompt tokens as characters / 4, and treats a threshold of 0 as "never".
//! * **BLIS** (`PrefixThresholdDecider`) uses `uncached > threshold` like kvroute, so a threshold
//!   of 0 disaggregates whenever any token is uncached; it never disaggregates an empty prompt
//!   (neither does kvroute: 0 uncached tokens is never above a threshold) and defaults to 16.
//! * **kvroute**: `>`, with exact token counts; "never" and "always" are separate deciders, so
//!   no threshold value is overloaded.

use super::load::effective_prefill_tokens;

/// Whether a request is disaggregated; see the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Decider {
    /// Prefill on the decode worker.
    Never,
    /// Prefill on a prefill worker whenever the decode worker is a decode-only worker and a
    /// prefill worker is available (Dynamo's behaviour once prefill workers register).
    #[default]
    Always,
    /// Prefill on a prefill worker when more than this many prompt tokens are not cached on the
    /// decode worker.
    PrefixThreshold {
        /// The threshold, in tokens.
        uncached_tokens: u64,
    },
}

/// A decider name that is none of `never`, `always` or a token count.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown decider {0:?}: never, always, or a threshold in uncached tokens")]
pub struct UnknownDecider(pub String);

impl Decider {
    /// The decider a name stands for, the vocabulary of every front end (`kvroute replay
    /// --decider`, `kvroute serve --decider`): `never`, `always`, or a number N, the
    /// [`Decider::PrefixThreshold`] of N uncached tokens.
    pub fn from_name(name: &str) -> Result<Self, UnknownDecider> {
        Ok(match name.trim() {
            "never" => Self::Never,
            "always" => Self::Always,
            n => Self::PrefixThreshold {
                uncached_tokens: n.parse().map_err(|_| UnknownDecider(name.to_owned()))?,
            },
        })
    }

    /// Whether to disaggregate a prompt of `prompt_tokens` with `cached_blocks` blocks of
    /// `block_size` tokens cached on the chosen decode worker.
    pub fn disaggregate(&self, prompt_tokens: u64, cached_blocks: u32, block_size: u32) -> bool {
        match *self {
            Self::Never => false,
            Self::Always => true,
            Self::PrefixThreshold { uncached_tokens } => {
                let cached = u64::from(cached_blocks) * u64::from(block_size);
                effective_prefill_tokens(prompt_tokens, cached) > uncached_tokens
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Decider;

    #[test]
    fn threshold_is_strict() {
        let d = Decider::PrefixThreshold { uncached_tokens: 32 };
        // 100 tokens, 4 blocks of 16 cached: 36 uncached.
        assert!(d.disaggregate(100, 4, 16));
        // 5 blocks cached: 20 uncached.
        assert!(!d.disaggregate(100, 5, 16));
        // Exactly at the threshold: not above it.
        assert!(!d.disaggregate(96, 4, 16));
        assert!(!Decider::PrefixThreshold { uncached_tokens: 0 }.disaggregate(0, 0, 16));
        assert!(Decider::PrefixThreshold { uncached_tokens: 0 }.disaggregate(1, 0, 16));
        assert!(!Decider::Never.disaggregate(1 << 20, 0, 16));
        assert!(Decider::Always.disaggregate(0, 0, 16));
    }

    #[test]
    fn names() {
        let cases = [
            ("never", Some(Decider::Never)),
            ("always", Some(Decider::Always)),
            ("512", Some(Decider::PrefixThreshold { uncached_tokens: 512 })),
            ("0", Some(Decider::PrefixThreshold { uncached_tokens: 0 })),
            ("-1", None),
            ("sometimes", None),
            ("", None),
        ];
        for (name, want) in cases {
            assert_eq!(Decider::from_name(name).ok(), want, "{name:?}");
        }
    }
}
