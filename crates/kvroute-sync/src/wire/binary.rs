//! The binary layout of version 4: little-endian, hand-framed, read without trusting a length.
//!
//! ```text
//! message  := version:u8 (4)  from:u64  body
//! body     := 0 seq:var at_us:opt events          (events)
//!           | 1 seq:var                           (heartbeat)
//!           | 2                                   (snapshot request)
//!           | 3 peers:var u64* part:var last:u8 seq:var events   (snapshot)
//! events   := n:var item*
//! item     := 0 r:var w:worker flags:u8 [pw:worker] o:var pt:var ht:var [hd:var] [eo:var]
//!               [s:var] tn:var blocks:var u64*     (a booking; flags: pw 1, hd 2, eo 4, s 8)
//!           | 1 r:var | 2 r:var                    (prefill done, freed)
//!           | 3 s:var w:worker                     (session)
//!           | 4 credential:u8 config:str           (worker added; config as JSON text)
//!           | 5 url:str | 6 url:str               (worker draining, removed)
//! worker   := 0 url:str rank:var | k:var rank:var  (k ≥ 1: the message's k-th URL written inline)
//! opt      := 0 | 1 value:var     str := len:var UTF-8     var := LEB128, at most 10 bytes
//! ```
//!
//! A block hash takes 8 bytes (raw `u64`), the count of a booking's blocks 1 to 3: a block costs
//! at most 9 bytes with its booking's share of framing once a booking has 3 blocks or more.
//! Inline URLs (the first [`MAX_URLS`] of a message) are numbered in order, so a batch or a
//! snapshot names each worker once.

use super::{
    Body, DecodeError, Envelope, MAX_CHAIN_BLOCKS, MAX_EVENTS, SyncItem, WIRE_VERSION, WorkerChange,
    WorkerRef, secret_key,
};

/// The most URLs a message numbers for reference (later ones are written inline every time).
pub const MAX_URLS: usize = 256;

const EVENTS: u8 = 0;
const HEARTBEAT: u8 = 1;
const SNAPSHOT_REQUEST: u8 = 2;
const SNAPSHOT: u8 = 3;

const ADDED: u8 = 0;
const PREFILL_DONE: u8 = 1;
const FREED: u8 = 2;
const SESSION: u8 = 3;
const WORKER_ADDED: u8 = 4;
const WORKER_DRAINING: u8 = 5;
const WORKER_REMOVED: u8 = 6;

const HAS_PW: u8 = 1;
const HAS_HD: u8 = 2;
const HAS_EO: u8 = 4;
const HAS_S: u8 = 8;

/// Writes `envelope` in the version 4 layout.
pub fn encode(envelope: &Envelope) -> Vec<u8> {
    let mut w = Writer {
        out: Vec::with_capacity(size_hint(&envelope.body)),
        urls: Vec::new(),
    };
    w.out.push(WIRE_VERSION as u8);
    w.out.extend_from_slice(&envelope.from.to_le_bytes());
    match &envelope.body {
        Body::Events { seq, at_us, events } => {
            w.out.push(EVENTS);
            w.var(*seq);
            match at_us {
                None => w.out.push(0),
                Some(t) => {
                    w.out.push(1);
                    w.var(*t);
                }
            }
            w.events(events);
        }
        Body::Heartbeat { seq } => {
            w.out.push(HEARTBEAT);
            w.var(*seq);
        }
        Body::SnapshotRequest => w.out.push(SNAPSHOT_REQUEST),
        Body::Snapshot {
            peers,
            part,
            last,
            seq,
            events,
        } => {
            w.out.push(SNAPSHOT);
            w.var(peers.len() as u64);
            for p in peers {
                w.out.extend_from_slice(&p.to_le_bytes());
            }
            w.var(u64::from(*part));
            w.out.push(u8::from(*last));
            w.var(*seq);
            w.events(events);
        }
    }
    w.out
}

/// About the encoded size of `body`, for one allocation.
fn size_hint(body: &Body) -> usize {
    let events = match body {
        Body::Events { events, .. } | Body::Snapshot { events, .. } => events.as_slice(),
        Body::Heartbeat { .. } | Body::SnapshotRequest => &[],
    };
    32 + events
        .iter()
        .map(|e| match e {
            SyncItem::Added { c, .. } => 64 + 8 * c.len(),
            _ => 16,
        })
        .sum::<usize>()
}

struct Writer<'a> {
    out: Vec<u8>,
    /// The URLs numbered so far, in order.
    urls: Vec<&'a str>,
}

impl<'a> Writer<'a> {
    fn var(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.out.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.out.push(v as u8);
    }

    fn str(&mut self, s: &str) {
        self.var(s.len() as u64);
        self.out.extend_from_slice(s.as_bytes());
    }

    fn worker(&mut self, w: &'a WorkerRef) {
        match self.urls.iter().position(|u| *u == w.url) {
            Some(k) => self.var(k as u64 + 1),
            None => {
                self.out.push(0);
                self.str(&w.url);
                if self.urls.len() < MAX_URLS {
                    self.urls.push(&w.url);
                }
            }
        }
        self.var(u64::from(w.rank));
    }

    fn events(&mut self, events: &'a [SyncItem]) {
        self.var(events.len() as u64);
        for e in events {
            self.item(e);
        }
    }

    fn item(&mut self, e: &'a SyncItem) {
        match e {
            SyncItem::Added {
                r,
                w,
                pw,
                o,
                pt,
                c,
                ht,
                hd,
                eo,
                s,
                tn,
            } => {
                self.out.push(ADDED);
                self.var(*r);
                self.worker(w);
                let flags = if pw.is_some() { HAS_PW } else { 0 }
                    | if hd.is_some() { HAS_HD } else { 0 }
                    | if eo.is_some() { HAS_EO } else { 0 }
                    | if s.is_some() { HAS_S } else { 0 };
                self.out.push(flags);
                if let Some(pw) = pw {
                    self.worker(pw);
                }
                self.var(u64::from(*o));
                self.var(*pt);
                self.var(*ht);
                if let Some(hd) = hd {
                    self.var(*hd);
                }
                if let Some(eo) = eo {
                    self.var(u64::from(*eo));
                }
                if let Some(s) = s {
                    self.var(*s);
                }
                self.var(u64::from(*tn));
                self.var(c.len() as u64);
                // Sized once, then filled: a loop the compiler vectorizes.
                let start = self.out.len();
                self.out.resize(start + 8 * c.len(), 0);
                for (to, h) in self.out[start..].chunks_exact_mut(8).zip(c) {
                    to.copy_from_slice(&h.to_le_bytes());
                }
            }
            SyncItem::PrefillDone { r } => {
                self.out.push(PREFILL_DONE);
                self.var(*r);
            }
            SyncItem::Freed { r } => {
                self.out.push(FREED);
                self.var(*r);
            }
            SyncItem::Session { s, w } => {
                self.out.push(SESSION);
                self.var(*s);
                self.worker(w);
            }
            SyncItem::Worker(WorkerChange::Added { config, credential }) => {
                self.out.push(WORKER_ADDED);
                self.out.push(u8::from(*credential));
                self.str(&config.to_string());
            }
            SyncItem::Worker(WorkerChange::Draining { url }) => {
                self.out.push(WORKER_DRAINING);
                self.str(url);
            }
            SyncItem::Worker(WorkerChange::Removed { url }) => {
                self.out.push(WORKER_REMOVED);
                self.str(url);
            }
        }
    }
}

/// Reads a version 4 message (its first byte checked by the caller). Never panics; allocates
/// no more than the message's own length justifies.
pub fn decode(bytes: &[u8]) -> Result<Envelope, DecodeError> {
    let mut r = Reader {
        buf: bytes,
        at: 1,
        urls: Vec::new(),
    };
    let from = r.u64()?;
    let body = match r.u8("the body's kind")? {
        EVENTS => {
            let seq = r.var("a batch number")?;
            let at_us = match r.u8("a timestamp's presence")? {
                0 => None,
                1 => Some(r.var("a timestamp")?),
                _ => return Err(r.bad_byte("a timestamp's presence")),
            };
            let events = r.events()?;
            Body::Events { seq, at_us, events }
        }
        HEARTBEAT => Body::Heartbeat {
            seq: r.var("a batch number")?,
        },
        SNAPSHOT_REQUEST => Body::SnapshotRequest,
        SNAPSHOT => {
            let n = r.count(8, usize::MAX, "the peers' count")?;
            let mut peers = Vec::with_capacity(n);
            for _ in 0..n {
                peers.push(r.u64()?);
            }
            let part = r.var_u32("a part number")?;
            let last = match r.u8("the last part's flag")? {
                0 => false,
                1 => true,
                _ => return Err(r.bad_byte("the last part's flag")),
            };
            let seq = r.var("a batch number")?;
            let events = r.events()?;
            Body::Snapshot {
                peers,
                part,
                last,
                seq,
                events,
            }
        }
        _ => return Err(r.bad_byte("the body's kind")),
    };
    if r.at != bytes.len() {
        return Err(r.bad("the end of the message"));
    }
    Ok(Envelope { from, body })
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    /// The URLs written inline so far, in order (at most [`MAX_URLS`]).
    urls: Vec<String>,
}

impl Reader<'_> {
    fn bad(&self, what: &'static str) -> DecodeError {
        DecodeError::Invalid { what, at: self.at }
    }

    /// The byte just read was not `what`.
    fn bad_byte(&self, what: &'static str) -> DecodeError {
        DecodeError::Invalid {
            what,
            at: self.at.saturating_sub(1),
        }
    }

    fn bad_at(what: &'static str, at: usize) -> DecodeError {
        DecodeError::Invalid { what, at }
    }

    fn left(&self) -> usize {
        self.buf.len().saturating_sub(self.at)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        let b = *self.buf.get(self.at).ok_or_else(|| self.bad(what))?;
        self.at += 1;
        Ok(b)
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let bytes = self
            .buf
            .get(self.at..self.at + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .ok_or_else(|| self.bad("a 64-bit number"))?;
        self.at += 8;
        Ok(u64::from_le_bytes(bytes))
    }

    fn var(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let start = self.at;
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let Some(&b) = self.buf.get(self.at) else {
                return Err(Self::bad_at(what, start));
            };
            self.at += 1;
            if shift == 63 && b > 1 {
                return Err(Self::bad_at(what, start));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err(Self::bad_at(what, start))
    }

    fn var_u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let start = self.at;
        let v = self.var(what)?;
        u32::try_from(v).map_err(|_| Self::bad_at(what, start))
    }

    /// A number that must fit a `usize`, and where it started.
    fn var_usize(&mut self, what: &'static str) -> Result<(usize, usize), DecodeError> {
        let start = self.at;
        let v = self.var(what)?;
        Ok((usize::try_from(v).map_err(|_| Self::bad_at(what, start))?, start))
    }

    /// A count of items of at least `min_bytes` bytes each, at most `max`, that the rest of
    /// the message can hold.
    fn count(&mut self, min_bytes: usize, max: usize, what: &'static str) -> Result<usize, DecodeError> {
        let (n, start) = self.var_usize(what)?;
        if n > max || n.saturating_mul(min_bytes) > self.left() {
            return Err(Self::bad_at(what, start));
        }
        Ok(n)
    }

    fn str(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let n = self.count(1, usize::MAX, what)?;
        let bytes = &self.buf[self.at..self.at + n];
        let s = std::str::from_utf8(bytes).map_err(|_| self.bad(what))?;
        self.at += n;
        Ok(s.to_owned())
    }

    fn worker(&mut self) -> Result<WorkerRef, DecodeError> {
        let (k, start) = self.var_usize("a worker")?;
        let url = match k {
            0 => {
                let url = self.str("a worker's URL")?;
                if self.urls.len() < MAX_URLS {
                    self.urls.push(url.clone());
                }
                url
            }
            k => self
                .urls
                .get(k - 1)
                .ok_or_else(|| Self::bad_at("a worker", start))?
                .clone(),
        };
        let rank = self.var_u32("a worker's rank")?;
        Ok(WorkerRef { url, rank })
    }

    fn events(&mut self) -> Result<Vec<SyncItem>, DecodeError> {
        let (n, start) = self.var_usize("the events' count")?;
        if n > MAX_EVENTS {
            return Err(DecodeError::TooManyEvents(n));
        }
        // Every event takes at least two bytes.
        if n.saturating_mul(2) > self.left() {
            return Err(Self::bad_at("the events' count", start));
        }
        let mut events = Vec::with_capacity(n);
        for _ in 0..n {
            events.push(self.item()?);
        }
        Ok(events)
    }

    fn item(&mut self) -> Result<SyncItem, DecodeError> {
        Ok(match self.u8("an event's kind")? {
            ADDED => {
                let r = self.var("a request id")?;
                let w = self.worker()?;
                let flags = self.u8("a booking's flags")?;
                if flags & !(HAS_PW | HAS_HD | HAS_EO | HAS_S) != 0 {
                    return Err(self.bad_byte("a booking's flags"));
                }
                let pw = if flags & HAS_PW != 0 {
                    Some(self.worker()?)
                } else {
                    None
                };
                let o = self.var_u32("a booking's overlap")?;
                let pt = self.var("a booking's prompt tokens")?;
                let ht = self.var("a booking's hint")?;
                let hd = if flags & HAS_HD != 0 {
                    Some(self.var("a booking's hint")?)
                } else {
                    None
                };
                let eo = if flags & HAS_EO != 0 {
                    Some(self.var_u32("a booking's output hint")?)
                } else {
                    None
                };
                let s = if flags & HAS_S != 0 {
                    Some(self.var("a booking's session")?)
                } else {
                    None
                };
                let tn = self.var_u32("a booking's tenant")?;
                let (blocks, start) = self.var_usize("a booking's blocks")?;
                if blocks > MAX_CHAIN_BLOCKS {
                    return Err(DecodeError::ChainTooLong(blocks));
                }
                if blocks.saturating_mul(8) > self.left() {
                    return Err(Self::bad_at("a booking's blocks", start));
                }
                let raw = &self.buf[self.at..self.at + 8 * blocks];
                let c = raw
                    .chunks_exact(8)
                    .map(|b| {
                        let mut h = [0u8; 8];
                        h.copy_from_slice(b);
                        u64::from_le_bytes(h)
                    })
                    .collect();
                self.at += 8 * blocks;
                SyncItem::Added {
                    r,
                    w,
                    pw,
                    o,
                    pt,
                    c,
                    ht,
                    hd,
                    eo,
                    s,
                    tn,
                }
            }
            PREFILL_DONE => SyncItem::PrefillDone {
                r: self.var("a request id")?,
            },
            FREED => SyncItem::Freed {
                r: self.var("a request id")?,
            },
            SESSION => SyncItem::Session {
                s: self.var("a session")?,
                w: self.worker()?,
            },
            WORKER_ADDED => {
                let credential = match self.u8("a credential's flag")? {
                    0 => false,
                    1 => true,
                    _ => return Err(self.bad_byte("a credential's flag")),
                };
                let text = self.str("a worker's configuration")?;
                let config: serde_json::Value = serde_json::from_str(&text).map_err(DecodeError::Config)?;
                if let Some(key) = secret_key(&config) {
                    return Err(DecodeError::Secret(key));
                }
                SyncItem::Worker(WorkerChange::Added { config, credential })
            }
            WORKER_DRAINING => SyncItem::Worker(WorkerChange::Draining {
                url: self.str("a worker's URL")?,
            }),
            WORKER_REMOVED => SyncItem::Worker(WorkerChange::Removed {
                url: self.str("a worker's URL")?,
            }),
            _ => return Err(self.bad_byte("an event's kind")),
        })
    }
}
