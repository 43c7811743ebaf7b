//! What every loaded worker has at least: the argmin scan's bound on the loaded workers it has
//! not visited (`scan::cross_floor`).
//!
//! A worker's cost for the blocks of a prompt it lacks grows with the requests booked on it
//! (the stall term) and with its eviction pressure. The scan visits the loaded workers in order
//! of their floor, which holds neither, and stops where no later worker can reach the lowest
//! cost; these lows let it count both at their least over the fleet:
//!
//! * the fewest requests booked on a loaded worker, from a count of loaded workers per request
//!   count, refiled with every load change ([`LoadedLows::refile`]);
//! * the least eviction pressure, by churn key ([`Churn::key`]): every worker's pressure decays
//!   at one rate and a key only grows, so the lowest key names the lowest pressure at any later
//!   time. The lowest key is lowered as a worker joins the loaded set and recomputed every
//!   [`LoadedLows::REFRESH_NS`] of the router's time, so it stays close.
//!
//! The same two figures are kept per slot ([`LoadedLows::requests_of`],
//! [`LoadedLows::pressure_of`]), in arrays a scan reads without the workers' loads: the scan
//! bounds each loaded worker the prompt overlaps by its own requests and pressure, far closer
//! to its cost than the fleet's lows, before it reads the worker's load.

use super::churn::Churn;
use crate::time::Timestamp;

/// What every loaded worker has at least, at a decision's time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Lows {
    /// Requests booked.
    pub(crate) requests: u32,
    /// Eviction pressure (up to rounding, some 1e-12 of it).
    pub(crate) pressure: f64,
}

/// The fleet's record of the lows; see the module docs.
#[derive(Clone, Debug)]
pub(crate) struct LoadedLows {
    /// Per count of booked requests, how many loaded workers have that many (index 0 unused:
    /// a loaded worker has one at least).
    by_requests: Vec<u32>,
    /// Per slot, the count it is filed under in `by_requests` (0: not filed).
    requests_of: Vec<u32>,
    /// Per slot, its worker's churn key, loaded or not ([`LoadedLows::rekey`]).
    keys_of: Vec<f64>,
    /// At most the churn key of every loaded worker.
    churn_key: f64,
    /// When `churn_key` was last recomputed.
    refreshed: Option<Timestamp>,
    /// The latest time a churn was recorded at, anywhere.
    latest: Timestamp,
}

impl Default for LoadedLows {
    fn default() -> Self {
        LoadedLows {
            by_requests: Vec::new(),
            requests_of: Vec::new(),
            keys_of: Vec::new(),
            churn_key: f64::INFINITY,
            refreshed: None,
            latest: Timestamp::ZERO,
        }
    }
}

impl LoadedLows {
    /// A thirty-second of the churn's half-life: a key that old is at most 2 % below the
    /// lowest one.
    const REFRESH_NS: u64 = Churn::HALF_LIFE_NS / 32;

    /// Forgets every worker, for a fleet of `slots` slots, none loaded.
    pub(crate) fn reset(&mut self, slots: usize) {
        *self = LoadedLows {
            requests_of: vec![0; slots],
            keys_of: vec![f64::NEG_INFINITY; slots],
            latest: self.latest,
            ..LoadedLows::default()
        };
    }

    /// The worker at `slot` has `requests` booked if loaded, 0 if not.
    pub(crate) fn refile(&mut self, slot: usize, requests: u32) {
        let old = std::mem::replace(&mut self.requests_of[slot], requests);
        if requests == old {
            return;
        }
        if old > 0 {
            self.by_requests[old as usize] -= 1;
        }
        if requests > 0 {
            let n = requests as usize;
            if self.by_requests.len() <= n {
                self.by_requests.resize(n + 1, 0);
            }
            self.by_requests[n] += 1;
        }
    }

    /// The worker at `slot` has churn key `key` (it evicted, or its slot was filled).
    pub(crate) fn rekey(&mut self, slot: usize, key: f64) {
        self.keys_of[slot] = key;
    }

    /// The requests booked on the worker at `slot` (0 if it is not loaded).
    pub(crate) fn requests_of(&self, slot: usize) -> u32 {
        self.requests_of[slot]
    }

    /// At most the eviction pressure of the worker at `slot` at `now` (up to rounding, some
    /// 1e-12 of it).
    pub(crate) fn pressure_of(&self, slot: usize, now: Timestamp) -> f64 {
        Churn::pressure_floor(self.keys_of[slot], self.latest, now)
    }

    /// A worker whose churn key is `key` joined the loaded set.
    pub(crate) fn joined(&mut self, key: f64) {
        self.churn_key = self.churn_key.min(key);
    }

    /// A churn was recorded at `now`.
    pub(crate) fn recorded(&mut self, now: Timestamp) {
        self.latest = self.latest.max(now);
    }

    /// The lows at `now`; `keys` are the loaded workers' churn keys, read when the lowest is
    /// due to be recomputed.
    pub(crate) fn at(&mut self, now: Timestamp, keys: impl Iterator<Item = f64>) -> Lows {
        if self
            .refreshed
            .is_none_or(|t| now.as_nanos() >= t.as_nanos() + Self::REFRESH_NS)
        {
            self.churn_key = keys.fold(f64::INFINITY, f64::min);
            self.refreshed = Some(now);
        }
        let requests = self.by_requests.iter().position(|&n| n > 0);
        Lows {
            requests: requests.map_or(0, |n| n as u32),
            // No loaded worker: nothing to bound.
            pressure: match requests {
                Some(_) => Churn::pressure_floor(self.churn_key, self.latest, now),
                None => 0.0,
            },
        }
    }

    /// Checks the lows against the loaded workers, each as `(slot, requests, churn key)`: the
    /// count per request count, each slot's key, and every key at least the lowest kept (up to
    /// rounding).
    pub(crate) fn check(&self, loaded: impl Iterator<Item = (usize, u32, f64)>) -> Result<(), String> {
        let mut by_requests = vec![0u32; self.by_requests.len()];
        for (slot, requests, key) in loaded {
            if self.keys_of[slot].to_bits() != key.to_bits() {
                return Err(format!(
                    "slot {slot} is keyed {}, its churn key is {key}",
                    self.keys_of[slot]
                ));
            }
            if requests == 0 || self.requests_of[slot] != requests {
                return Err(format!(
                    "slot {slot} is filed under {} requests, has {requests}",
                    self.requests_of[slot]
                ));
            }
            match by_requests.get_mut(requests as usize) {
                Some(count) => *count += 1,
                None => return Err(format!("slot {slot}'s {requests} requests are not counted")),
            }
            if key < self.churn_key - 1e-9 {
                return Err(format!(
                    "slot {slot}'s churn key {key} is below the loaded workers' lowest {}",
                    self.churn_key
                ));
            }
        }
        if by_requests != self.by_requests {
            return Err("the loaded workers' request counts are stale".to_owned());
        }
        Ok(())
    }
}
