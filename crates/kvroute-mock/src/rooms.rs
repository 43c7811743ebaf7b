//! SGLang's bootstrap rooms: where the prefill and decode sides of a pair meet.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use crate::driver::JobUpdate;

/// How long the decode side of an SGLang pair waits for its room's prefill.
pub const BOOTSTRAP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// SGLang's bootstrap rooms, by number: a prefill that finished before its decode side asked,
/// or a decode side waiting for its prefill.
#[derive(Default)]
pub(crate) struct Rooms {
    slots: Mutex<HashMap<u64, Slot>>,
}

enum Slot {
    /// The prefill ended (true: its KV is ready; false: it was refused) at this time.
    Done(bool, Instant),
    /// A decode side waits.
    Waiting(oneshot::Sender<bool>),
}

impl Rooms {
    /// The prefill of `room` ended: `ok` if its KV is ready.
    pub(crate) fn prefilled(&self, room: u64, ok: bool) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(Slot::Waiting(tx)) = slots.remove(&room) {
            let _ = tx.send(ok);
            return;
        }
        // Rooms no decode side claimed within the timeout are forgotten.
        if slots.len() >= 1024 {
            slots.retain(|_, slot| !matches!(slot, Slot::Done(_, at) if at.elapsed() > BOOTSTRAP_TIMEOUT));
        }
        slots.insert(room, Slot::Done(ok, Instant::now()));
    }

    /// Passes `progress` on, and marks `room` prefilled when it ends (refused: not ready).
    pub(crate) fn watch(
        self: &Arc<Self>,
        room: u64,
        mut progress: mpsc::UnboundedReceiver<JobUpdate>,
    ) -> mpsc::UnboundedReceiver<JobUpdate> {
        let (tx, rx) = mpsc::unbounded_channel();
        let rooms = Arc::clone(self);
        tokio::spawn(async move {
            let mut ok = false;
            while let Some(p) = progress.recv().await {
                let end = match &p {
                    JobUpdate::Done { .. } => Some(true),
                    JobUpdate::Refused(_) => Some(false),
                    _ => None,
                };
                let _ = tx.send(p);
                if let Some(end) = end {
                    ok = end;
                    break;
                }
            }
            rooms.prefilled(room, ok);
        });
        rx
    }

    /// Waits (at most `timeout`) for the prefill of `room`; true if its KV is ready.
    pub(crate) async fn wait(&self, room: u64, timeout: std::time::Duration) -> bool {
        let rx = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(Slot::Done(ok, _)) = slots.get(&room) {
                let ok = *ok;
                slots.remove(&room);
                return ok;
            }
            let (tx, rx) = oneshot::channel();
            slots.insert(room, Slot::Waiting(tx));
            rx
        };
        let forget = Forget { rooms: self, room };
        let ok = matches!(tokio::time::timeout(timeout, rx).await, Ok(Ok(true)));
        drop(forget);
        ok
    }
}

/// Removes a waiting decode side's slot when it stops waiting (answered, timed out or its
/// client left).
struct Forget<'a> {
    rooms: &'a Rooms,
    room: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        let mut slots = self.rooms.slots.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(slots.get(&self.room), Some(Slot::Waiting(_))) {
            slots.remove(&self.room);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Paused time: a wait that times out does so at once, at the virtual deadline.
    #[tokio::test(start_paused = true)]
    async fn a_room_is_met_whichever_side_comes_first() {
        let rooms = Arc::new(Rooms::default());
        let short = std::time::Duration::from_millis(20);
        // The prefill ends first; the decode side then finds it at once.
        rooms.prefilled(1, true);
        assert!(rooms.wait(1, short).await);
        // The decode side waits, then the prefill ends.
        let waiter = tokio::spawn({
            let rooms = Arc::clone(&rooms);
            async move { rooms.wait(2, std::time::Duration::from_secs(5)).await }
        });
        while !rooms.slots.lock().unwrap().contains_key(&2) {
            tokio::task::yield_now().await;
        }
        rooms.prefilled(2, true);
        assert!(waiter.await.unwrap());
        // A refused prefill, and one that never comes.
        rooms.prefilled(3, false);
        assert!(!rooms.wait(3, short).await);
        let t0 = tokio::time::Instant::now();
        assert!(!rooms.wait(4, short).await);
        assert_eq!(t0.elapsed(), short, "the decode side gave up at its deadline");
        assert!(rooms.slots.lock().unwrap().is_empty(), "every room was forgotten");

        // `watch` passes progress on and marks the room when the engine is done, even when
        // nobody reads the answer.
        let (tx, rx) = mpsc::unbounded_channel();
        drop(rooms.watch(5, rx));
        tx.send(JobUpdate::Tokens(vec![1])).unwrap();
        tx.send(JobUpdate::Done {
            completion_tokens: 1,
            reason: kvroute_engine::FinishReason::Length,
            last: Vec::new(),
        })
        .unwrap();
        assert!(rooms.wait(5, std::time::Duration::from_secs(5)).await);
    }
}
