//! [`SeqTracker`]: each case by hand, then a publisher that drops batches and restarts, a replay
//! buffer, and a subscriber that follows the tracker's instructions, checked to apply every
//! batch once and in order.

use std::collections::VecDeque;

use kvroute_wire::{ReplayStatus, SeqStatus, SeqTracker};
use proptest::prelude::*;

#[test]
fn in_order_then_duplicates_after_a_replay() {
    let mut t = SeqTracker::new();
    assert_eq!(t.observe_live(0), SeqStatus::InOrder);
    assert_eq!(t.observe_live(1), SeqStatus::InOrder);
    assert_eq!(t.next_expected(), 2);
    // 2 and 3 are dropped; 4 reveals the gap and is not applied.
    assert_eq!(t.observe_live(4), SeqStatus::Gap { missing: 2..4 });
    // Another live batch while the replay is under way reports the same start.
    assert_eq!(t.observe_live(5), SeqStatus::Gap { missing: 2..5 });
    // The replay from 2: everything the publisher buffers from there.
    for seq in 2..=6 {
        assert_eq!(t.observe_replayed(seq), ReplayStatus::InOrder);
    }
    // Live 6 was replayed already; 7 follows.
    assert_eq!(t.observe_live(6), SeqStatus::Duplicate);
    assert_eq!(t.observe_live(7), SeqStatus::InOrder);
    // A replay asked twice repeats itself.
    assert_eq!(t.observe_replayed(3), ReplayStatus::Duplicate);
}

#[test]
fn a_late_joiner_sees_a_gap_from_zero() {
    let mut t = SeqTracker::new();
    assert_eq!(t.observe_live(1000), SeqStatus::Gap { missing: 0..1000 });
    // The publisher buffers only 990 on: the rest are lost, and the tracker moves on.
    assert_eq!(t.observe_replayed(990), ReplayStatus::Lost { missing: 0..990 });
    assert_eq!(t.observe_replayed(991), ReplayStatus::InOrder);
}

#[test]
fn skipping_a_gap_applies_the_batch_that_reported_it() {
    let mut t = SeqTracker::new();
    assert_eq!(t.skip_gap(), None);
    assert_eq!(t.observe_live(0), SeqStatus::InOrder);
    assert_eq!(t.skip_gap(), None);
    assert_eq!(t.observe_live(3), SeqStatus::Gap { missing: 1..3 });
    assert_eq!(t.skip_gap(), Some(1..3));
    assert_eq!(t.next_expected(), 4);
    assert_eq!(t.observe_live(4), SeqStatus::InOrder);
}

#[test]
fn a_sequence_number_that_goes_back_is_a_restart() {
    let mut t = SeqTracker::new();
    for seq in 0..5 {
        t.observe_live(seq);
    }
    assert_eq!(t.observe_live(0), SeqStatus::Restart { missing: 0..0 });
    assert_eq!(t.observe_live(1), SeqStatus::InOrder);
    // Restarted again, and its batches 0 and 1 were dropped.
    assert_eq!(t.observe_live(1), SeqStatus::Restart { missing: 0..1 });
    // Even the same number again: a PUB socket never repeats a batch.
    let mut t = SeqTracker::new();
    assert_eq!(t.observe_live(0), SeqStatus::InOrder);
    assert_eq!(t.observe_live(0), SeqStatus::Restart { missing: 0..0 });
}

#[test]
fn the_largest_sequence_number_does_not_overflow() {
    // No run gets there (and on the replay socket it is the end marker); it must not panic.
    let mut t = SeqTracker::new();
    assert_eq!(t.observe_live(u64::MAX), SeqStatus::Gap { missing: 0..u64::MAX });
    assert_eq!(t.skip_gap(), Some(0..u64::MAX));
    assert_eq!(
        t.observe_live(u64::MAX),
        SeqStatus::Restart { missing: 0..u64::MAX }
    );
    assert_eq!(
        t.observe_replayed(u64::MAX),
        ReplayStatus::Lost { missing: 0..u64::MAX }
    );
}

/// One step of the model: the publisher publishes a batch (delivered live or dropped), or
/// restarts.
#[derive(Clone, Debug)]
enum Step {
    Publish { delivered: bool },
    Restart,
}

/// A publisher with a replay buffer of the last `capacity` batches, numbering batches of each
/// run from 0; a batch's value names it across runs.
struct Publisher {
    run: u32,
    next_seq: u64,
    buffer: VecDeque<(u64, (u32, u64))>,
    capacity: usize,
}

impl Publisher {
    fn publish(&mut self) -> (u64, (u32, u64)) {
        let batch = (self.next_seq, (self.run, self.next_seq));
        self.next_seq += 1;
        if self.buffer.len() == self.capacity {
            self.buffer.pop_front();
        }
        self.buffer.push_back(batch);
        batch
    }

    fn replay(&self, start: u64) -> Vec<(u64, (u32, u64))> {
        self.buffer
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .copied()
            .collect()
    }
}

/// A subscriber that does what the tracker says, with replays served at once.
#[derive(Default)]
struct Subscriber {
    tracker: SeqTracker,
    /// Batches applied since the worker was last cleared.
    applied: Vec<(u32, u64)>,
    lost: Vec<u64>,
}

impl Subscriber {
    fn live(&mut self, seq: u64, value: (u32, u64), publisher: &Publisher) {
        match self.tracker.observe_live(seq) {
            SeqStatus::InOrder => self.applied.push(value),
            SeqStatus::Duplicate => {}
            SeqStatus::Gap { missing } => self.replay(missing.start, publisher),
            SeqStatus::Restart { missing } => {
                self.applied.clear();
                self.lost.clear();
                if missing.is_empty() {
                    self.applied.push(value);
                } else {
                    self.replay(missing.start, publisher);
                }
            }
        }
    }

    fn replay(&mut self, start: u64, publisher: &Publisher) {
        for (seq, value) in publisher.replay(start) {
            match self.tracker.observe_replayed(seq) {
                ReplayStatus::InOrder => self.applied.push(value),
                ReplayStatus::Duplicate => {}
                ReplayStatus::Lost { missing } => {
                    self.lost.extend(missing);
                    self.applied.push(value);
                }
            }
        }
    }
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        8 => any::<bool>().prop_map(|delivered| Step::Publish { delivered }),
        1 => Just(Step::Restart),
    ];
    proptest::collection::vec(step, 0..80)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// The run's batches, applied once each and in order, except those reported lost; none lost
    /// while the buffer holds the whole run. (A restart must be seen by its first batch, or by
    /// one numbered no higher than the last live batch before it: the wire carries no run id.)
    #[test]
    fn the_subscriber_applies_every_batch_once_in_order(steps in steps(), capacity in 1usize..40) {
        let mut publisher = Publisher { run: 0, next_seq: 0, buffer: VecDeque::new(), capacity };
        let mut subscriber = Subscriber::default();
        let mut restarted = false;
        for step in steps {
            match step {
                Step::Restart => {
                    publisher = Publisher { run: publisher.run + 1, next_seq: 0, buffer: VecDeque::new(), capacity };
                    restarted = true;
                }
                Step::Publish { delivered } => {
                    let (seq, value) = publisher.publish();
                    if delivered || std::mem::take(&mut restarted) {
                        subscriber.live(seq, value, &publisher);
                    }
                }
            }
            let upto = subscriber.tracker.next_expected();
            let expected: Vec<(u32, u64)> = (0..upto)
                .filter(|seq| !subscriber.lost.contains(seq))
                .map(|seq| (publisher.run, seq))
                .collect();
            // Before the run's first batch arrives, the tracker still counts the last run.
            if !restarted {
                prop_assert_eq!(&subscriber.applied, &expected);
                if publisher.next_seq as usize <= capacity {
                    prop_assert!(subscriber.lost.is_empty(), "lost {:?}", subscriber.lost);
                }
            }
        }
    }
}
