//! [`EngineHost`]: one engine with what every driver does around it, once.
//!
//! The cluster simulator and the live mock workers both drive an engine through this host. It
//! owns the pass in flight, the imports of prefill/decode disaggregation (admission, the queue
//! of those waiting for blocks, the transfers on the link) and the ordering of KV events. The
//! driver owns time: it passes `now` in, and decides when to call what (the simulator at its
//! events' times, the mock when its timers fire).
//!
//! # The import admission rule
//!
//! [`EngineHost::import`] takes a request whose prompt another engine prefilled:
//!
//! * an import that could never be taken (its KV exceeds the whole cache, or it breaks the
//!   engine's other limits; [`Engine::check_import`]) is refused at once with a typed
//!   [`RequestError`];
//! * otherwise, if earlier imports wait, it waits behind them ([`ImportAdmission::Waiting`]);
//! * otherwise it starts if its blocks are free now, else it waits.
//!
//! Waiting imports start, in order, when [`EngineHost::start_waiting_imports`] finds their
//! blocks free (a driver calls it after each pass). A started import's KV lands after the
//! link's transfer time ([`KvTransfer::duration`], sped up like the engine's passes); the
//! driver calls [`EngineHost::land`] then, and the request decodes from the next pass.
//!
//! # KV events
//!
//! Events of calls made while a pass is in flight happened after that pass's (the engine
//! produced the pass's first): they are appended to the pass's output, delivered at its end.
//! Between passes they are returned, to publish at once.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use kvroute_core::events::KvEvent;
use kvroute_core::ids::RequestId;
use kvroute_core::time::{TimeScale, Timestamp};

use crate::engine::{Engine, StepOutput};
use crate::request::{EngineRequest, RequestError};
use crate::transfer::KvTransfer;

/// An engine, its pass in flight and its imports. See the module docs.
#[derive(Debug)]
pub struct EngineHost {
    engine: Engine,
    link: KvTransfer,
    scale: TimeScale,
    /// Imports waiting for blocks, in arrival order.
    waiting: VecDeque<EngineRequest>,
    /// Imports whose KV is on the link: when it lands, and the request.
    transfers: BTreeSet<(Timestamp, RequestId)>,
    /// The pass in flight, delivered at its end.
    in_flight: Option<StepOutput>,
}

/// What [`EngineHost::import`] did with an admissible import.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImportAdmission {
    /// Its blocks are reserved and its KV is on the link.
    Started(StartedImport),
    /// It waits for blocks, behind earlier imports.
    Waiting,
}

/// An import whose blocks are reserved and whose KV is on the link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartedImport {
    /// The request.
    pub id: RequestId,
    /// Prompt blocks found in this engine's prefix cache.
    pub hit_blocks: u32,
    /// Prompt blocks moved over the link.
    pub transfer_blocks: u32,
    /// How long the transfer takes.
    pub transfer_time: Duration,
    /// When its KV lands: call [`EngineHost::land`] then.
    pub lands: Timestamp,
    /// KV events to publish now (empty while a pass is in flight: they follow its events).
    pub events: Vec<KvEvent>,
}

/// An import that left the waiting queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImportStart {
    /// It started.
    Started(StartedImport),
    /// The engine refused it.
    Refused(RequestId, RequestError),
}

impl EngineHost {
    /// A host of `engine`, whose imports cross `link`.
    pub fn new(engine: Engine, link: KvTransfer) -> Self {
        let scale = TimeScale::new(engine.config().speedup).unwrap_or(TimeScale::REAL);
        Self {
            engine,
            link,
            scale,
            waiting: VecDeque::new(),
            transfers: BTreeSet::new(),
            in_flight: None,
        }
    }

    /// The engine, to read.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine, for what the host does not wrap (the simulator's skipped decode passes).
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Queues a local request (see [`Engine::add_request`]).
    pub fn add(&mut self, now: Timestamp, request: EngineRequest) -> Result<(), RequestError> {
        self.engine.add_request(now, request)
    }

    /// Admits an import under the rule of the module docs: refused (never fits), started, or
    /// waiting in order.
    pub fn import(
        &mut self,
        now: Timestamp,
        request: EngineRequest,
    ) -> Result<ImportAdmission, RequestError> {
        self.engine.check_import(&request)?;
        if !self.waiting.is_empty() {
            self.waiting.push_back(request);
            return Ok(ImportAdmission::Waiting);
        }
        match self.try_start(now, &request) {
            Err(RequestError::NoBlocksForImport { .. }) => {
                self.waiting.push_back(request);
                Ok(ImportAdmission::Waiting)
            }
            started => started.map(ImportAdmission::Started),
        }
    }

    /// Starts the waiting imports whose blocks are free now, in order; stops at the first that
    /// must wait on.
    pub fn start_waiting_imports(&mut self, now: Timestamp) -> Vec<ImportStart> {
        let mut started = Vec::new();
        while let Some(request) = self.waiting.front() {
            let id = request.id;
            let result = self.try_start(now, &request.clone());
            match result {
                Err(RequestError::NoBlocksForImport { .. }) => break,
                Ok(import) => started.push(ImportStart::Started(import)),
                Err(e) => started.push(ImportStart::Refused(id, e)),
            }
            self.waiting.pop_front();
        }
        started
    }

    fn try_start(&mut self, now: Timestamp, request: &EngineRequest) -> Result<StartedImport, RequestError> {
        let import = self.engine.import_request(now, request.clone())?;
        let bs = self.engine.config().block_size;
        let transfer_time = self.scale.modeled(self.link.duration(import.transfer_blocks, bs));
        let lands = now + transfer_time;
        self.transfers.insert((lands, request.id));
        Ok(StartedImport {
            id: request.id,
            hit_blocks: import.hit_blocks,
            transfer_blocks: import.transfer_blocks,
            transfer_time,
            lands,
            events: self.after_pass(import.events),
        })
    }

    /// Aborts request `id` (its client left) wherever it is: an import waiting for blocks
    /// leaves the queue, one on the link will not land, a request in the engine leaves it
    /// ([`Engine::abort_request`]). False if the host does not hold it.
    pub fn abort(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(i);
            return true;
        }
        self.transfers.retain(|&(_, r)| r != id);
        self.engine.abort_request(id)
    }

    /// The link this host's imports cross.
    pub fn link(&self) -> &KvTransfer {
        &self.link
    }

    /// Imports waiting for blocks.
    pub fn num_waiting_imports(&self) -> usize {
        self.waiting.len()
    }

    /// The next transfer to land: when, and the request.
    pub fn next_landing(&self) -> Option<(Timestamp, RequestId)> {
        self.transfers.first().copied()
    }

    /// Import `id`'s KV landed at `now`: the engine takes it as computed. Returns the KV events
    /// to publish now (see the module docs). The transfer is consumed either way: an error (the
    /// request left the engine without [`EngineHost::abort`]) does not leave it to land again.
    pub fn land(&mut self, now: Timestamp, id: RequestId) -> Result<Vec<KvEvent>, RequestError> {
        self.transfers.retain(|&(_, r)| r != id);
        let events = self.engine.complete_import(now, id)?;
        Ok(self.after_pass(events))
    }

    /// Starts a pass at `now` unless one is in flight or there is nothing to do; returns when
    /// it ends.
    pub fn step(&mut self, now: Timestamp) -> Option<Timestamp> {
        if self.in_flight.is_some() {
            return None;
        }
        let out = self.engine.step(now)?;
        let end = out.end;
        self.in_flight = Some(out);
        Some(end)
    }

    /// The pass in flight, if any.
    pub fn in_flight(&self) -> Option<&StepOutput> {
        self.in_flight.as_ref()
    }

    /// Ends the pass in flight: its output, to deliver now (at its end).
    pub fn finish_pass(&mut self) -> Option<StepOutput> {
        self.in_flight.take()
    }

    /// Whether the host holds no work: no pass, request, import or transfer.
    pub fn is_idle(&self) -> bool {
        self.in_flight.is_none()
            && self.waiting.is_empty()
            && self.engine.num_running() == 0
            && self.engine.num_waiting() == 0
            && self.engine.num_importing() == 0
    }

    /// `events` go after those of the pass in flight, or are returned to publish now.
    fn after_pass(&mut self, events: Vec<KvEvent>) -> Vec<KvEvent> {
        match &mut self.in_flight {
            Some(out) => {
                out.events.extend(events);
                Vec::new()
            }
            None => events,
        }
    }
}
