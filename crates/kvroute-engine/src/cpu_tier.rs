//! The host-memory KV tier: vLLM's native offloading (`--kv-offloading-backend native`, its
//! `OffloadingConnector` with the CPU backend and LRU manager), as the engine models it.
//!
//! * **Offload.** Every block newly cached on the GPU is copied to the tier as it is computed
//!   (vLLM's connector stores a request's full blocks as they are computed, not when the GPU
//!   evicts them); one already there is only touched. A full tier first evicts its least
//!   recently used block. Each copy is a `BlockStored` with `medium` `"CPU"` and each
//!   eviction a `BlockRemoved` with it ([`KvEvent::TierStored`], [`KvEvent::TierRemoved`]),
//!   in the order they happen, after the GPU's own events of the same blocks. The copy itself
//!   costs no engine time (vLLM overlaps it with compute).
//! * **Load.** A prompt's blocks past its GPU prefix hit that the tier holds in a row are loaded
//!   back instead of computed (`CpuTier::run`): they count as computed tokens, the pass that
//!   admits the request takes their transfer's time longer ([`KvTransfer::duration`], the same
//!   link model as disaggregated imports), and once on the GPU they are cached there as
//!   computed blocks are. vLLM loads asynchronously while other requests run; adding the load
//!   to the pass is BLIS's mirror model, an upper bound on what the load costs the batch.
//! * Block size on the tier is the GPU's (vLLM's `block_size_factor` 1).

use std::collections::BTreeMap;

use kvroute_core::events::{KvEvent, TierBlocks};
use kvroute_core::ids::ExternalBlockHash;
use kvroute_core::index::Tier;
use kvroute_core::key_hasher::KeyMap;
use serde::Deserialize;

use crate::config::EngineConfig;
use crate::metrics::ForwardPass;
use crate::spec::SpecError;
use crate::transfer::KvTransfer;

/// The engine's host-memory tier, if it has one ([`EngineConfig::cpu_offload`](crate::EngineConfig)).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuOffload {
    /// Blocks the tier holds (vLLM sizes it in GiB with `--kv-offloading-size`; this is that
    /// size over the bytes of one block).
    pub num_blocks: u32,
    /// The host-to-device link a load crosses; set by the caller from the model (not read from
    /// a file: the default is [`KvTransfer::default`]).
    #[serde(skip)]
    pub link: KvTransfer,
}

impl CpuOffload {
    /// A tier of `num_blocks` blocks over `link`.
    pub fn new(num_blocks: u32, link: KvTransfer) -> Self {
        Self { num_blocks, link }
    }

    /// What a block loaded from this tier costs against one computed, on `engine`, in `[0, 1]`:
    /// the router's price of a tier block (`kv:tier=X`). The link's time for a pass's worth of
    /// blocks (`max_num_batched_tokens` tokens) over the time of the pass that prefills them
    /// from an empty context.
    pub fn block_cost(&self, engine: &EngineConfig) -> Result<f64, SpecError> {
        let blocks = (engine.max_num_batched_tokens / engine.block_size).max(1);
        let tokens = blocks * engine.block_size;
        let mut pass = ForwardPass::default();
        pass.add_prefill(tokens, 0);
        let prefill = engine.timing.build()?.pass_secs(&pass);
        let load = self.link.duration(blocks, engine.block_size).as_secs_f64();
        Ok(if prefill > 0.0 {
            (load / prefill).min(1.0)
        } else {
            1.0
        })
    }
}

/// The tier's blocks in least-recently-used order; see the module docs.
#[derive(Debug)]
pub(crate) struct CpuTier {
    capacity: u32,
    /// Each block's last use.
    stamps: KeyMap<ExternalBlockHash, u64>,
    /// Blocks by last use, oldest first.
    lru: BTreeMap<u64, ExternalBlockHash>,
    clock: u64,
}

impl CpuTier {
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            stamps: KeyMap::default(),
            lru: BTreeMap::new(),
            clock: 0,
        }
    }

    /// How many of `hashes`, from the first, the tier holds in a row.
    pub fn run(&self, hashes: &[ExternalBlockHash]) -> usize {
        hashes.iter().take_while(|h| self.stamps.contains_key(h)).count()
    }

    fn touch(&mut self, hash: ExternalBlockHash) -> bool {
        self.clock += 1;
        let Some(stamp) = self.stamps.get_mut(&hash) else {
            return false;
        };
        self.lru.remove(stamp);
        *stamp = self.clock;
        self.lru.insert(self.clock, hash);
        true
    }

    /// Marks `hashes` used (a load).
    pub fn touch_all(&mut self, hashes: &[ExternalBlockHash]) {
        for &h in hashes {
            self.touch(h);
        }
    }

    /// Copies `hashes` (newly cached on the GPU) to the tier, evicting the least recently used
    /// blocks for room, with their events onto `events`.
    pub fn offload(&mut self, hashes: &[ExternalBlockHash], events: &mut Vec<KvEvent>) {
        for &h in hashes {
            if self.touch(h) {
                continue;
            }
            if self.stamps.len() as u32 >= self.capacity
                && let Some((_, old)) = self.lru.pop_first()
            {
                self.stamps.remove(&old);
                push(events, old, false);
            }
            self.stamps.insert(h, self.clock);
            self.lru.insert(self.clock, h);
            push(events, h, true);
        }
    }

    /// Forgets every block (the prefix cache's reset clears every tier).
    pub fn clear(&mut self) {
        self.stamps.clear();
        self.lru.clear();
    }

    /// Every block the tier holds, in hash order.
    pub fn hashes(&self) -> Vec<ExternalBlockHash> {
        let mut h: Vec<ExternalBlockHash> = self.stamps.keys().copied().collect();
        h.sort_unstable();
        h
    }

    /// The two orders agree and the tier is within its capacity.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.stamps.len() != self.lru.len() || self.stamps.len() as u32 > self.capacity {
            return Err(format!(
                "CPU tier: {} blocks, {} in LRU order, capacity {}",
                self.stamps.len(),
                self.lru.len(),
                self.capacity
            ));
        }
        match self.lru.iter().find(|(s, h)| self.stamps.get(h) != Some(s)) {
            Some((s, h)) => Err(format!("CPU tier: {h:?} at {s} in LRU order, not its stamp")),
            None => Ok(()),
        }
    }
}

/// Appends a store (`stored`) or eviction of `hash` to `events`, joining the last event when it
/// is of the same kind.
fn push(events: &mut Vec<KvEvent>, hash: ExternalBlockHash, stored: bool) {
    match (events.last_mut(), stored) {
        (Some(KvEvent::TierStored(t)), true) | (Some(KvEvent::TierRemoved(t)), false) => {
            t.block_hashes.push(hash)
        }
        _ => {
            let t = TierBlocks {
                tier: Tier::Cpu,
                block_hashes: vec![hash],
            };
            events.push(if stored {
                KvEvent::TierStored(t)
            } else {
                KvEvent::TierRemoved(t)
            });
        }
    }
}
