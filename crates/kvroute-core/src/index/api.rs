//! The methods both index layouts share word for word: the worker table, the counters, the
//! slower tiers and the one place an event changes the index. Each layout keeps the same fields
//! for them (`slots`, `stats`, `tiers`) and brings its own tree operations (`apply_stored`,
//! `apply_removed`, `clear_worker`, `apply_tier_stored`, `holder_count`); the macro writes the
//! rest into the layout's `impl` once.

macro_rules! shared_index_api {
    () => {
        /// Each worker's matched depth for the query `locals`: how many blocks from block 0 of
        /// the query's prefix it holds. Workers with depth 0 are left out.
        ///
        /// With `early_exit`, the walk stops once a single worker remains; that worker's depth is
        /// then a lower bound (it matches at least that deep).
        pub fn find_matches(&self, locals: &[LocalBlockHash], early_exit: bool) -> OverlapScores {
            let mut out = OverlapScores::default();
            self.find_matches_into(locals, early_exit, &mut out);
            out
        }

        /// The workers tracked, in slot order.
        pub fn workers(&self) -> impl Iterator<Item = WorkerKey> + '_ {
            self.slots.iter().map(|(_, s)| s.key)
        }

        /// Whether `worker` holds the block the engine calls `external`.
        pub fn holds(&self, worker: WorkerKey, external: ExternalBlockHash) -> bool {
            self.slots.holds(worker, external)
        }

        /// The external hashes of every block `worker` holds, in no particular order.
        pub fn held_blocks(&self, worker: WorkerKey) -> impl Iterator<Item = ExternalBlockHash> + '_ {
            self.slots
                .get(worker)
                .into_iter()
                .flat_map(|s| s.blocks.iter().map(|(e, _)| ExternalBlockHash(e)))
        }

        /// How many blocks `worker` holds.
        pub fn block_count(&self, worker: WorkerKey) -> usize {
            self.slots.block_count(worker)
        }

        /// How many of `worker`'s blocks no other worker holds: the cached prefix the fleet loses
        /// with it. Walks the worker's blocks (for scale-down choices, not the routing path).
        pub fn sole_blocks(&self, worker: WorkerKey) -> usize {
            let Some(s) = self.slots.get(worker) else {
                return 0;
            };
            s.blocks
                .iter()
                .filter(|&(_, block)| self.holder_count(block) == 1)
                .count()
        }

        /// The counters of what the index was asked to do.
        pub fn stats(&self) -> IndexStats {
            self.stats
        }

        /// Applies one event of `worker`: the one place an engine's event changes the index.
        pub fn apply_event(&mut self, worker: WorkerKey, event: IndexEvent<'_>) -> Result<(), IndexError> {
            match event {
                IndexEvent::Stored { parent, blocks } => self.apply_stored(worker, parent, blocks),
                IndexEvent::Removed { blocks } => self.apply_removed(worker, blocks).map(drop),
                IndexEvent::Cleared => self.clear_worker(worker),
                IndexEvent::TierStored { tier, blocks } => self.apply_tier_stored(worker, tier, blocks),
                IndexEvent::TierRemoved { tier, blocks } => self.apply_tier_removed(worker, tier, blocks),
            }
        }

        /// `worker` dropped `externals` from `tier`; blocks it did not hold there are ignored.
        pub fn apply_tier_removed(
            &mut self,
            worker: WorkerKey,
            tier: Tier,
            externals: &[ExternalBlockHash],
        ) -> Result<(), IndexError> {
            self.slot_index(worker)?;
            self.tiers.remove(&mut self.stats, worker, tier, externals);
            Ok(())
        }

        /// Whether any worker holds a block on a slower tier (when none does, a lookup need not
        /// ask for the tiers' runs).
        pub fn has_tier_blocks(&self) -> bool {
            !self.tiers.is_empty()
        }

        /// Blocks `worker` holds on `tier`.
        pub fn tier_block_count(&self, worker: WorkerKey, tier: Tier) -> usize {
            self.tiers.get(tier).count(worker)
        }

        /// Whether `worker` holds the block the engine calls `external` on `tier`.
        pub fn tier_holds(&self, worker: WorkerKey, tier: Tier, external: ExternalBlockHash) -> bool {
            self.tiers.get(tier).holds(worker, external)
        }

        /// For each worker that holds blocks on `tier`, in key order: how many blocks of `chain`
        /// past its GPU depth (`gpu(worker)`) it holds there in a row, onto `out` where above 0.
        /// This is the tier's hit an engine would load back instead of computing.
        pub fn tier_runs_into(
            &self,
            tier: Tier,
            chain: &[SequenceHash],
            gpu: impl Fn(WorkerKey) -> u32,
            out: &mut Vec<(WorkerKey, u32)>,
        ) {
            out.clear();
            let set = self.tiers.get(tier);
            if set.is_empty() {
                return;
            }
            for worker in set.workers() {
                let run = set.run(worker, chain, gpu(worker));
                if run > 0 {
                    out.push((worker, run));
                }
            }
        }

        /// The slower tiers' invariants, and that they hold no worker the index does not track.
        fn check_tiers(&self) -> Result<(), String> {
            self.tiers.check()?;
            for tier in Tier::ALL {
                if let Some(w) = self
                    .tiers
                    .get(tier)
                    .workers()
                    .into_iter()
                    .find(|&w| !self.slots.contains(w))
                {
                    return Err(format!(
                        "{tier:?} holds blocks of worker {w}, which is not tracked"
                    ));
                }
            }
            Ok(())
        }

        /// `worker`'s slot, counting an unknown worker.
        fn slot_index(&mut self, worker: WorkerKey) -> Result<usize, IndexError> {
            let slot = self.slots.index_of(worker);
            if slot.is_err() {
                self.stats.unknown_worker += 1;
            }
            slot
        }
    };
}
