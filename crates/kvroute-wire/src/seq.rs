//! Sequence tracking: which batches of one publisher to apply, drop or ask again for.
//!
//! A publisher numbers its batches 0, 1, 2, ... from its start. Its PUB socket drops batches
//! when a subscriber falls behind (a gap is the only sign), never reorders or repeats them, and
//! starts again from 0 when the process restarts. Batches can also arrive a second time through
//! a replay. One [`SeqTracker`] per publisher (per engine endpoint and data-parallel rank) turns
//! each sequence number into what to do with its batch, so that a subscriber applies every batch
//! once, in order, or knows which it lost.
//!
//! Live batches and replayed ones are told apart because only a live sequence number that does
//! not grow means a restart: a PUB socket never sends one publisher's batches out of order, so
//! no threshold or guess is involved. The converse cannot be known: the wire carries no run id,
//! so a restarted publisher whose batches are all lost until its count passes the last one
//! received looks like a gap in the old run.
//!
//! # Driving it
//!
//! For a live batch, [`SeqTracker::observe_live`]:
//! * [`SeqStatus::InOrder`]: apply it.
//! * [`SeqStatus::Duplicate`]: drop it (a replay already applied it).
//! * [`SeqStatus::Gap`]: do not apply it; ask for a replay from `missing.start`, unless one from
//!   that start is already under way (live batches that arrive during a replay report the same
//!   start). The replay brings this batch again. Without a replay endpoint, call
//!   [`SeqTracker::skip_gap`] and apply it.
//! * [`SeqStatus::Restart`]: the publisher restarted; clear its worker in the index, drop
//!   replies of replays asked before, then act on `missing` as for a gap (an empty range: apply
//!   this batch).
//!
//! For a replayed batch, [`SeqTracker::observe_replayed`]:
//! * [`ReplayStatus::InOrder`]: apply it. [`ReplayStatus::Duplicate`]: drop it.
//! * [`ReplayStatus::Lost`]: the publisher no longer buffers `missing`; they are gone. The
//!   tracker moves past them: apply this batch, after deciding what the loss means for the
//!   worker's state (clearing it trades matches for never reporting a block the engine evicted).

use std::ops::Range;

/// What to do with a live batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SeqStatus {
    /// The next batch: apply it.
    InOrder,
    /// Already applied, through a replay: drop it.
    Duplicate,
    /// Batches `missing` never arrived. This batch (the one at `missing.end`) is not applied:
    /// ask for a replay from `missing.start`, which brings it again.
    Gap {
        /// The sequence numbers not received, this batch's excluded.
        missing: Range<u64>,
    },
    /// The sequence number went back: the publisher restarted and its cache is new. Clear the
    /// worker; then apply this batch if `missing` is empty, or else treat it as a [`Gap`].
    ///
    /// [`Gap`]: SeqStatus::Gap
    Restart {
        /// The batches of the new run before this one that never arrived (empty when this is
        /// its batch 0).
        missing: Range<u64>,
    },
}

/// What to do with a replayed batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayStatus {
    /// The next batch: apply it.
    InOrder,
    /// Already applied: drop it.
    Duplicate,
    /// The publisher's buffer no longer holds `missing`, which are lost. Apply this batch.
    Lost {
        /// The sequence numbers lost.
        missing: Range<u64>,
    },
}

/// Tracks one publisher's sequence numbers. See the module docs for how to drive it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeqTracker {
    /// The sequence number of the next batch to apply.
    next: u64,
    /// The highest live sequence number received since the publisher (re)started.
    last_live: Option<u64>,
}

impl SeqTracker {
    /// A tracker that has seen nothing: it expects batch 0, and a first live batch numbered
    /// higher reports the batches before it as a gap (the subscriber joined late).
    pub fn new() -> Self {
        Self::default()
    }

    /// The sequence number of the next batch to apply.
    pub fn next_expected(&self) -> u64 {
        self.next
    }

    /// Classifies a batch received live (from the SUB socket).
    pub fn observe_live(&mut self, seq: u64) -> SeqStatus {
        if self.last_live.is_some_and(|last| seq <= last) {
            *self = Self::new();
            return match self.observe_live(seq) {
                SeqStatus::Gap { missing } => SeqStatus::Restart { missing },
                _ => SeqStatus::Restart { missing: 0..0 },
            };
        }
        self.last_live = Some(seq);
        if seq < self.next {
            SeqStatus::Duplicate
        } else if seq == self.next {
            self.next = seq.saturating_add(1);
            SeqStatus::InOrder
        } else {
            SeqStatus::Gap {
                missing: self.next..seq,
            }
        }
    }

    /// Classifies a batch received in reply to a replay request.
    pub fn observe_replayed(&mut self, seq: u64) -> ReplayStatus {
        if seq < self.next {
            return ReplayStatus::Duplicate;
        }
        let missing = self.next..seq;
        self.next = seq.saturating_add(1);
        if missing.is_empty() {
            ReplayStatus::InOrder
        } else {
            ReplayStatus::Lost { missing }
        }
    }

    /// Gives up on the batches of the last reported gap: the last live batch, the one that
    /// reported it, is to be applied now. Returns the sequence numbers given up, or `None` when
    /// no gap is open.
    pub fn skip_gap(&mut self) -> Option<Range<u64>> {
        let last = self.last_live?;
        if last < self.next {
            return None;
        }
        let skipped = self.next..last;
        self.next = last.saturating_add(1);
        Some(skipped)
    }
}
