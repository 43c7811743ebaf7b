//! The LoRA adapters each worker serves, as its `/v1/models` lists them (`crate::adapters`
//! reads it), told to the router (`Router::handle_adapters`), which routes a request naming an
//! adapter only among the workers that serve it.

use std::collections::BTreeMap;

use kvroute_core::ids::WorkerId;

use super::Driver;

/// Adapters by name, each with the path it was loaded from (`root`), if listed.
pub type AdapterSet = BTreeMap<String, Option<String>>;

impl Driver {
    /// Sets the adapters worker `id` serves. Requests queued for one of them may now go there.
    /// A worker not in the registry is ignored. The router is told each time, changed or not:
    /// a worker taken out of routing and back (misconfigured, then fixed) was forgotten there.
    pub fn set_adapters(&self, id: WorkerId, adapters: AdapterSet) {
        let mut inner = self.lock();
        if inner.registry.get(id).is_none() {
            return;
        }
        let names: Vec<&str> = adapters.keys().map(String::as_str).collect();
        let now = self.now();
        for key in inner.keys(id) {
            let out = inner.router.handle_adapters(now, key, &names);
            self.dispatch(&mut inner, out);
        }
        if inner.adapters.get(&id) != Some(&adapters) {
            tracing::info!(worker = id.0, adapters = ?names, "the worker's LoRA adapters");
            inner.adapters.insert(id, adapters);
        }
    }

    /// Every adapter some worker in the registry serves, by name.
    pub fn adapters(&self) -> AdapterSet {
        let inner = self.lock();
        let mut all = AdapterSet::new();
        for (id, set) in &inner.adapters {
            if inner.registry.get(*id).is_some() {
                all.extend(set.iter().map(|(name, root)| (name.clone(), root.clone())));
            }
        }
        all
    }

    /// Whether some worker in the registry serves adapter `name`.
    pub fn serves_adapter(&self, name: &str) -> bool {
        let inner = self.lock();
        inner
            .adapters
            .iter()
            .any(|(id, set)| set.contains_key(name) && inner.registry.get(*id).is_some())
    }
}
