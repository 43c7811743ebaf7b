//! From wire events to the router's index.
//!
//! The router does not trust the engine's hashes to mean anything beyond naming a block: it
//! hashes each stored block's `token_ids` itself with [`BlockHasher`] (the event's LoRA name and
//! the worker's cache namespace as salt), so that a prompt's blocks, hashed the same way, find
//! them; the engine's hashes become the blocks' external ids, which later removals name. The
//! conversion produces the owned [`KvEvent`] of `kvroute_core::events`, the simulated engine's event
//! type, which lends itself to [`IndexLayout::apply_event`], the one place events change an
//! index: wire events and simulated ones reach the index by the same path.
//!
//! What is not applied is said, never dropped silently ([`SkipReason`]):
//!
//! * **Other media.** Events on the GPU tier (`medium` `"GPU"`, any case, or nil from engines
//!   that predate the field) change the prefix tree, which models what a worker can serve from
//!   GPU memory. Events of a tracked slower tier ([`Tier`]: `"CPU"`, vLLM's offloading
//!   connector) become [`KvEvent::TierStored`] / [`KvEvent::TierRemoved`], kept apart from the
//!   GPU's: treating a CPU-tier removal as a GPU one would drop prefixes the GPU still holds
//!   (SGLang PR #39108: every prefix became unroutable after one device turnover while the host
//!   tier kept it for hours), and a CPU-tier store would claim blocks the GPU does not hold.
//!   The connector's stores carry no tokens: the index places them by the GPU blocks it knows
//!   under the same hashes. Any other medium (a disk tier) is skipped.
//! * **Other KV-cache groups.** Hybrid models send one event per group; the router tracks one
//!   ([`ApplyConfig::group_idx`]), and events without a group count as group 0.
//! * **Another block size.** The router hashes a worker's prompts at one block size; blocks of
//!   another size could never match them.
//! * **Blocks without tokens.** A store needs `block_size` tokens per block. When tokens are
//!   short (offload events send none; a truncated event sends some), the blocks whose tokens are
//!   all there, from the first on, are applied (they continue the chain from the parent), and
//!   the rest are reported. When there are more tokens than blocks (hybrid models skip null
//!   blocks in `block_hashes` but not in `token_ids`), which tokens belong to which block cannot
//!   be known, so nothing is applied.
//! * **Unknown event types**, reported by tag.

use std::fmt;
use std::num::NonZeroU32;

use kvroute_core::events::{BlocksRemoved, BlocksStored, KvEvent, TierBlocks};
use kvroute_core::hash::{BlockHasher, HashSalt, PromptHasher};
use kvroute_core::ids::WorkerKey;
use kvroute_core::index::{IndexError, IndexLayout, StoredBlock, Tier};

use crate::event::{BlockStored, MEDIUM_GPU, WireEvent};

/// How one worker's events map onto the router's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApplyConfig<'a> {
    /// Tokens per block, as the router hashes this worker's prompts. Events of another block
    /// size are skipped.
    pub block_size: NonZeroU32,
    /// The worker's cache namespace, salted into the hashes with each event's LoRA name (see
    /// [`HashSalt`]); `None` for none.
    pub namespace: Option<&'a str>,
    /// The KV-cache group the router tracks; 0 for models with one group.
    pub group_idx: u32,
}

/// Why an event, or part of one, did not reach the index. Routine: count it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SkipReason {
    /// The event is about a cache tier other than the GPU's.
    OtherMedium(String),
    /// The event is about a KV-cache group the router does not track.
    OtherGroup(u32),
    /// The event's blocks are not the size the router hashes with.
    BlockSize {
        /// The event's block size.
        event: u32,
        /// The router's.
        router: u32,
    },
    /// The last `blocks` blocks of a store came without all their tokens; the blocks before them
    /// were applied.
    MissingTokens {
        /// Blocks not applied.
        blocks: usize,
    },
    /// A store with more tokens than its blocks hold, which cannot be split into blocks; nothing
    /// was applied.
    ExcessTokens {
        /// Tokens sent.
        tokens: usize,
        /// Blocks sent.
        blocks: usize,
    },
    /// An event type this crate does not know.
    UnknownEvent(String),
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipReason::OtherMedium(medium) => write!(f, "medium {medium:?} is not the GPU's"),
            SkipReason::OtherGroup(group) => write!(f, "KV-cache group {group} is not tracked"),
            SkipReason::BlockSize { event, router } => {
                write!(
                    f,
                    "blocks of {event} tokens, but the router hashes blocks of {router}"
                )
            }
            SkipReason::MissingTokens { blocks } => write!(f, "{blocks} blocks came without their tokens"),
            SkipReason::ExcessTokens { tokens, blocks } => {
                write!(f, "{tokens} tokens do not split into {blocks} blocks")
            }
            SkipReason::UnknownEvent(tag) => write!(f, "unknown event type {tag:?}"),
        }
    }
}

/// A wire event as the index takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conversion {
    /// What to apply; `None` when nothing is.
    pub event: Option<KvEvent>,
    /// What was left out, and why.
    pub skipped: Option<SkipReason>,
}

/// What applying one event did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApplyReport {
    /// The operation applied.
    pub applied: Applied,
    /// What was left out, and why.
    pub skipped: Option<SkipReason>,
}

/// The operation an event became. Block counts are those sent to the index; its
/// [`IndexStats`](kvroute_core::index::IndexStats) say how many changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Nothing (see the report's skip reason, if any).
    Nothing,
    /// A store of this many blocks.
    Stored {
        /// Blocks stored.
        blocks: usize,
    },
    /// A removal of this many blocks.
    Removed {
        /// Blocks named.
        blocks: usize,
    },
    /// The worker was cleared.
    Cleared,
    /// A store of this many blocks on a slower tier.
    TierStored {
        /// The tier.
        tier: Tier,
        /// Blocks stored.
        blocks: usize,
    },
    /// A removal of this many blocks from a slower tier.
    TierRemoved {
        /// The tier.
        tier: Tier,
        /// Blocks named.
        blocks: usize,
    },
}

impl WireEvent {
    /// This event as the index takes it, under `config`.
    pub fn to_kv_event(&self, config: &ApplyConfig<'_>) -> Conversion {
        let skip = |reason| Conversion {
            event: None,
            skipped: Some(reason),
        };
        let whole = |event| Conversion {
            event: Some(event),
            skipped: None,
        };
        match self {
            WireEvent::BlockStored(stored) => {
                match other_tier(stored.medium.as_deref(), stored.group_idx, config) {
                    Some(_)
                        if let Some(tier) =
                            slower_tier(stored.medium.as_deref(), stored.group_idx, config) =>
                    {
                        whole(KvEvent::TierStored(TierBlocks {
                            tier,
                            block_hashes: stored.block_hashes.clone(),
                        }))
                    }
                    Some(reason) => skip(reason),
                    None => stored_blocks(stored, config),
                }
            }
            WireEvent::BlockRemoved(removed) => {
                match other_tier(removed.medium.as_deref(), removed.group_idx, config) {
                    Some(_)
                        if let Some(tier) =
                            slower_tier(removed.medium.as_deref(), removed.group_idx, config) =>
                    {
                        whole(KvEvent::TierRemoved(TierBlocks {
                            tier,
                            block_hashes: removed.block_hashes.clone(),
                        }))
                    }
                    Some(reason) => skip(reason),
                    None => whole(KvEvent::Removed(BlocksRemoved {
                        block_hashes: removed.block_hashes.clone(),
                    })),
                }
            }
            WireEvent::AllBlocksCleared => whole(KvEvent::AllCleared),
            WireEvent::Unknown { tag } => skip(SkipReason::UnknownEvent(tag.clone())),
        }
    }

    /// Applies this event to `index` (either layout) as `worker`'s: [`WireEvent::to_kv_event`],
    /// then [`IndexLayout::apply_event`]. An error is the index's refusal (an unknown worker or parent, a
    /// conflicting block); a store applies its blocks up to the bad one.
    pub fn apply_to(
        &self,
        index: &mut impl IndexLayout,
        worker: WorkerKey,
        config: &ApplyConfig<'_>,
    ) -> Result<ApplyReport, IndexError> {
        let Conversion { event, skipped } = self.to_kv_event(config);
        let applied = match &event {
            None => Applied::Nothing,
            Some(KvEvent::Stored(stored)) => Applied::Stored {
                blocks: stored.blocks.len(),
            },
            Some(KvEvent::Removed(removed)) => Applied::Removed {
                blocks: removed.block_hashes.len(),
            },
            Some(KvEvent::AllCleared) => Applied::Cleared,
            Some(KvEvent::TierStored(t)) => Applied::TierStored {
                tier: t.tier,
                blocks: t.block_hashes.len(),
            },
            Some(KvEvent::TierRemoved(t)) => Applied::TierRemoved {
                tier: t.tier,
                blocks: t.block_hashes.len(),
            },
        };
        if let Some(event) = &event {
            index.apply_event(worker, event.as_index_event())?;
        }
        Ok(ApplyReport { applied, skipped })
    }
}

/// Why an event of `medium` and `group` is not the tracked GPU cache's, if it is not.
fn other_tier(medium: Option<&str>, group: Option<u32>, config: &ApplyConfig<'_>) -> Option<SkipReason> {
    if let Some(medium) = medium
        && !medium.eq_ignore_ascii_case(MEDIUM_GPU)
    {
        return Some(SkipReason::OtherMedium(medium.to_owned()));
    }
    let group = group.unwrap_or(0);
    (group != config.group_idx).then_some(SkipReason::OtherGroup(group))
}

/// The tracked slower tier of an event of `medium` and `group`, if it is one (of the tracked
/// group).
fn slower_tier(medium: Option<&str>, group: Option<u32>, config: &ApplyConfig<'_>) -> Option<Tier> {
    let tier = Tier::from_medium(medium?)?;
    (group.unwrap_or(0) == config.group_idx).then_some(tier)
}

/// The blocks of a GPU store that have their tokens, hashed by the router.
fn stored_blocks(stored: &BlockStored, config: &ApplyConfig<'_>) -> Conversion {
    let router = config.block_size.get();
    if stored.block_size != router {
        return Conversion {
            event: None,
            skipped: Some(SkipReason::BlockSize {
                event: stored.block_size,
                router,
            }),
        };
    }
    let block_size = router as usize;
    let (blocks, tokens) = (stored.block_hashes.len(), stored.token_ids.len());
    let needed = blocks.saturating_mul(block_size);
    let (full, skipped) = if tokens == needed {
        (blocks, None)
    } else if tokens < needed {
        let full = tokens / block_size;
        (
            full,
            Some(SkipReason::MissingTokens {
                blocks: blocks - full,
            }),
        )
    } else {
        (0, Some(SkipReason::ExcessTokens { tokens, blocks }))
    };
    if full == 0 {
        return Conversion { event: None, skipped };
    }
    let token_ids = &stored.token_ids[..full * block_size];
    let salt = HashSalt {
        lora_name: stored.lora_name.as_deref(),
        namespace: config.namespace,
    };
    let mut locals = BlockHasher::new(block_size, &salt).local_hashes(token_ids);
    // vLLM folds a request's `cache_salt` into the extra keys of its first block alone: a store
    // that starts a sequence carries it, and its first block is hashed under it as the router
    // hashes a salted prompt's (`PromptHasher`); later blocks follow from the chain.
    if stored.parent_block_hash.is_none()
        && let Some(salt) = stored.cache_salt.as_deref().filter(|s| !s.is_empty())
        && let Some(first) = locals.first_mut()
    {
        let salted = PromptHasher::new(
            block_size,
            &HashSalt {
                lora_name: stored.lora_name.as_deref(),
                namespace: Some(salt),
            },
        );
        *first = salted.local_hash(0, &token_ids[..block_size]);
    }
    let blocks = locals
        .into_iter()
        .zip(&stored.block_hashes)
        .map(|(local, &external)| StoredBlock { local, external })
        .collect();
    let event = KvEvent::Stored(BlocksStored {
        parent_block_hash: stored.parent_block_hash,
        blocks,
        token_ids: token_ids.to_vec(),
        block_size: stored.block_size,
        lora_name: stored.lora_name.clone(),
        cache_salt: stored
            .cache_salt
            .clone()
            .filter(|_| stored.parent_block_hash.is_none()),
    });
    Conversion {
        event: Some(event),
        skipped,
    }
}
