//! Which workers serve which LoRA adapter: the rule that a request naming an adapter is routed
//! only among the workers that serve it.
//!
//! A worker serves its base model and the adapters it has loaded; the driver tells the router
//! each worker's adapters ([`Router::handle_adapters`](super::Router::handle_adapters)) when it
//! learns them (vLLM lists them on `/v1/models`, and loads or unloads them at run time). A
//! request without an adapter may go to any worker; one with an adapter only to a worker whose
//! set holds it, and among those cache overlap and load decide as for the base model.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::ids::WorkerKey;

/// The workers of each adapter.
#[derive(Clone, Debug, Default)]
pub(super) struct Adapters {
    by_name: BTreeMap<Arc<str>, BTreeSet<WorkerKey>>,
}

impl Adapters {
    /// Sets `worker`'s adapters to `names` (empty strings ignored); whether anything changed.
    pub(super) fn set(&mut self, worker: WorkerKey, names: &[&str]) -> bool {
        let wanted: BTreeSet<&str> = names.iter().copied().filter(|n| !n.is_empty()).collect();
        let mut changed = false;
        self.by_name.retain(|name, workers| {
            if !wanted.contains(name.as_ref()) {
                changed |= workers.remove(&worker);
            }
            !workers.is_empty()
        });
        for name in wanted {
            match self.by_name.get_mut(name) {
                Some(workers) => changed |= workers.insert(worker),
                None => {
                    self.by_name.insert(name.into(), BTreeSet::from([worker]));
                    changed = true;
                }
            }
        }
        changed
    }

    /// Forgets `worker`.
    pub(super) fn remove_worker(&mut self, worker: WorkerKey) {
        self.set(worker, &[]);
    }

    /// Whether `worker` may take a request for `adapter` (any worker may take one without).
    pub(super) fn serves(&self, adapter: Option<&str>, worker: WorkerKey) -> bool {
        match adapter {
            None => true,
            Some(name) => self.by_name.get(name).is_some_and(|w| w.contains(&worker)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{DpRank, WorkerId};

    fn key(n: u64) -> WorkerKey {
        WorkerKey::new(WorkerId(n), DpRank(0))
    }

    #[test]
    fn a_worker_serves_exactly_the_adapters_it_was_last_given() {
        let mut a = Adapters::default();
        assert!(a.set(key(1), &["x", "y", ""]));
        assert!(a.set(key(2), &["y"]));
        assert!(!a.set(key(1), &["y", "x"]), "the same set again changes nothing");
        assert!(a.set(key(1), &["y"]));
        assert!(!a.serves(Some("x"), key(1)));
        assert!(a.serves(Some("y"), key(1)) && a.serves(Some("y"), key(2)));
        assert!(a.serves(None, key(3)) && !a.serves(Some("y"), key(3)));
        assert!(
            !a.serves(Some(""), key(1)),
            "the empty name is no adapter anyone serves"
        );
        a.remove_worker(key(2));
        assert_eq!(a.by_name.get("y"), Some(&BTreeSet::from([key(1)])));
        assert!(
            !a.by_name.contains_key("x"),
            "an adapter nobody serves is forgotten"
        );
    }
}
