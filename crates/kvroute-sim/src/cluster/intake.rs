//! The run's requests: taken from their [`RequestSource`] as the run needs them, each kept with
//! its state while anything of the run may still touch it, then tallied and released in the
//! order of their ids, so that the run's memory follows the requests in flight.
//!
//! A source in arrival order ([`RequestSource::in_arrival_order`]) is read ahead only until the
//! latest fixed arrival taken is later than the earliest one pending: every request of the
//! session arriving next (its follow-ups included) is then known before it arrives. Any other
//! source is read whole at the start.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::VecDeque;
use std::ops::{Index, IndexMut};

use crate::config::ArrivalMode;
use crate::error::SimError;
use crate::workload::{Arrival, SimRequest};

use super::{ReqState, Run, Tokens};

/// A request taken from the source, and its state.
struct Slot<'w> {
    state: ReqState,
    request: Cow<'w, SimRequest>,
}

/// The requests taken and not yet released, by id: `base..base + slots.len()`.
pub(crate) struct Requests<'w> {
    slots: VecDeque<Slot<'w>>,
    /// Each slot's [`Tokens`], in a dense array of their own.
    tokens: VecDeque<Tokens>,
    base: usize,
    /// What a look at a request outside the window finds (none should happen: the run's check
    /// fails if one did).
    stray: ReqState,
    stray_tokens: Tokens,
    stray_id: Cell<Option<usize>>,
}

impl<'w> Requests<'w> {
    pub(super) fn new() -> Self {
        Self {
            slots: VecDeque::new(),
            tokens: VecDeque::new(),
            base: 0,
            stray: ReqState::default(),
            stray_tokens: Tokens::default(),
            stray_id: Cell::new(None),
        }
    }

    /// Requests taken so far.
    pub(super) fn taken(&self) -> usize {
        self.base + self.slots.len()
    }

    /// Where request `i` is in the window, if it is held.
    fn offset(&self, i: usize) -> Option<usize> {
        i.checked_sub(self.base).filter(|&k| k < self.slots.len())
    }

    fn slot(&self, i: usize) -> Option<&Slot<'w>> {
        self.offset(i).map(|k| &self.slots[k])
    }

    /// Request `i`'s tokens (a stray's if it is not held).
    pub(super) fn tokens(&self, i: usize) -> &Tokens {
        match self.offset(i) {
            Some(k) => &self.tokens[k],
            None => {
                self.note_stray(i);
                &self.stray_tokens
            }
        }
    }

    /// Request `i`'s tokens, to change (a stray's if it is not held).
    pub(super) fn tokens_mut(&mut self, i: usize) -> &mut Tokens {
        match self.offset(i) {
            Some(k) => &mut self.tokens[k],
            None => {
                self.note_stray(i);
                self.stray_tokens = Tokens::default();
                &mut self.stray_tokens
            }
        }
    }

    /// Request `i`, taken and not released (an error otherwise).
    pub(super) fn request(&self, i: usize) -> Result<&SimRequest, SimError> {
        self.slot(i)
            .map(|s| s.request.as_ref())
            .ok_or_else(|| SimError::Invariant(format!("request {i} is not held")))
    }

    /// The states of the requests held, in id order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &ReqState> {
        self.slots.iter().map(|s| &s.state)
    }

    /// A request looked at outside the window, if any was.
    pub(crate) fn stray(&self) -> Option<usize> {
        self.stray_id.get()
    }

    fn note_stray(&self, i: usize) {
        if self.stray_id.get().is_none() {
            self.stray_id.set(Some(i));
        }
    }
}

impl Index<usize> for Requests<'_> {
    type Output = ReqState;

    fn index(&self, i: usize) -> &ReqState {
        match self.slot(i) {
            Some(s) => &s.state,
            None => {
                self.note_stray(i);
                &self.stray
            }
        }
    }
}

impl IndexMut<usize> for Requests<'_> {
    fn index_mut(&mut self, i: usize) -> &mut ReqState {
        match self.offset(i) {
            Some(k) => &mut self.slots[k].state,
            None => {
                self.note_stray(i);
                self.stray = ReqState::default();
                &mut self.stray
            }
        }
    }
}

impl ReqState {
    /// Whether nothing of the run will touch it again: it finished, or it was turned away with
    /// no message of it still on its way.
    fn settled(&self, tokens: &Tokens) -> bool {
        !self.in_transit
            && (self.finished.is_some()
                || (self.rejected && !(tokens.emitted_first && self.first_token.is_none())))
    }

    /// Whether it completed or was turned away.
    fn done(&self) -> bool {
        self.finished.is_some() || self.rejected
    }
}

impl<'w> Run<'w> {
    /// Takes the requests the run may need before its next event: all of a source not in
    /// arrival order (at the start), else until a fixed arrival later than the earliest
    /// pending one is known.
    pub(super) fn take_requests(&mut self) -> Result<(), SimError> {
        if matches!(self.config.arrivals, ArrivalMode::Closed { .. }) {
            return Ok(());
        }
        while !self.source_done
            && (!self.streaming
                || self
                    .open
                    .front()
                    .is_none_or(|&(t, _)| self.latest_open.is_none_or(|l| l <= t)))
        {
            self.take_one()?;
        }
        Ok(())
    }

    /// Takes the source's next request, if any: its id.
    pub(super) fn take_one(&mut self) -> Result<Option<usize>, SimError> {
        if self.source_done {
            return Ok(None);
        }
        let Some(request) = self.source.next_request()? else {
            self.source_done = true;
            // A source in arrival order gave them in order; any other is taken whole, then sorted.
            if !self.streaming {
                self.open.make_contiguous().sort_unstable();
            }
            return Ok(None);
        };
        let i = self.reqs.taken();
        if i >= u32::MAX as usize {
            return Err(SimError::Workload(format!("more than {} requests", u32::MAX)));
        }
        if !matches!(self.config.arrivals, ArrivalMode::Closed { .. }) {
            match request.arrival {
                Arrival::At(t) => {
                    if self.streaming && self.latest_open.is_some_and(|l| t < l) {
                        return Err(SimError::Workload(format!(
                            "request {i} arrives before the request taken before it"
                        )));
                    }
                    self.latest_open = Some(t);
                    self.open.push_back((t, i as u32));
                }
                Arrival::After { request: leader, .. } if leader < i => {
                    if self.reqs.slot(leader).is_none_or(|s| s.state.done()) {
                        return Err(SimError::Workload(format!(
                            "request {i} follows request {leader}, which was over before request {i} was made"
                        )));
                    }
                    self.followers.entry(leader as u32).or_default().push(i as u32);
                }
                Arrival::After { request: leader, .. } => {
                    return Err(SimError::Workload(format!(
                        "request {i} follows request {leader}, which is not earlier"
                    )));
                }
            }
        } else if let Arrival::After { request: leader, .. } = request.arrival
            && leader >= i
        {
            return Err(SimError::Workload(format!(
                "request {i} follows request {leader}, which is not earlier"
            )));
        }
        self.reqs.slots.push_back(Slot {
            state: ReqState::default(),
            request,
        });
        self.reqs.tokens.push_back(Tokens::default());
        Ok(Some(i))
    }

    /// Tallies and releases the settled requests at the front of the window (all of them at
    /// the end of the run).
    pub(super) fn release_settled(&mut self, all: bool) {
        while let Some(front) = self.reqs.slots.front()
            && let Some(tokens) = self.reqs.tokens.front()
            && (all || front.state.settled(tokens))
        {
            let i = self.reqs.base;
            if let Some(slot) = self.reqs.slots.pop_front()
                && let Some(tokens) = self.reqs.tokens.pop_front()
            {
                self.tally.add(i, &slot.state, &tokens, &slot.request);
            }
            self.followers.remove(&(i as u32));
            self.reqs.base += 1;
        }
    }
}
