//! Tenants: who a request is from (an API key or a header's value, mapped here), each tenant's
//! weight in the router queue's fair share and its rate limits, and how a request names its
//! priority.

use std::num::NonZeroU32;

use axum::http::HeaderName;
use kvroute_core::router::{FairConfig, TenantId};
use serde::{Deserialize, Serialize};

use super::worker::{TOKEN_RULE, is_token};
use super::{ConfigError, invalid};

/// The label of requests of no configured tenant.
pub const OTHER: &str = "other";

/// The tenants and the request headers that name a tenant and a priority.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantsConfig {
    /// A header whose value names the tenant (one of a tenant's `header-values`), read when
    /// the request's API key is no tenant's. Default: none.
    pub tenant_header: Option<String>,
    /// A header carrying the request's priority, an integer in vLLM's convention (lower is
    /// served first; 0 the default), read when the body has no `priority`. Default: none.
    pub priority_header: Option<String>,
    /// Whether the workers run with vLLM's `--scheduling-policy priority`: a request's
    /// priority is then sent on in its body (`priority`); otherwise it is taken out, as such an
    /// engine refuses a non-zero one, and only the router's queue orders by it. Default false.
    pub forward_priority: bool,
    /// The tenants (`[[tenant]]` tables).
    pub tenants: Vec<TenantConfig>,
}

/// One tenant (a `[[tenant]]` table).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TenantConfig {
    /// Its name: the `tenant` label of its metrics.
    pub name: String,
    /// Its API keys (`Authorization: Bearer K`); each is also a key of the inference API.
    /// Never sent to peer replicas (the sync wire carries a tenant's number only).
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// Values of the tenant header that name it.
    #[serde(default)]
    pub header_values: Vec<String>,
    /// Its weight in the queue's fair share of tokens. Default 1.
    #[serde(default = "one")]
    pub weight: u32,
    /// The most requests it may send per interval (a token bucket of that size, refilled
    /// evenly over the interval); past it, 429 with `Retry-After`. Default: no limit.
    #[serde(default)]
    pub requests_per_interval: Option<u64>,
    /// The most tokens (prompt tokens plus `max_tokens`, when given) it may ask for per
    /// interval, likewise. Default: no limit.
    #[serde(default)]
    pub tokens_per_interval: Option<u64>,
    /// The limits' interval. Default 60,000 ms.
    #[serde(default = "minute")]
    pub interval_ms: u64,
    /// Its prefix-cache namespace: salts its requests' block hashes (vLLM's `cache_salt`, set
    /// in the body the engine gets), so that its prompts never match another tenant's blocks,
    /// in the router or in the engine. Letters, digits, `.`, `_` and `-`. A request's own
    /// `cache_salt` is joined to it (`NAMESPACE:SALT`); the salts of requests of tenants without
    /// one then start with `:` (see [`TenantsConfig::cache_salt`]). Default: none.
    #[serde(default)]
    pub cache_namespace: Option<String>,
}

fn one() -> u32 {
    1
}

fn minute() -> u64 {
    60_000
}

impl TenantsConfig {
    /// The router's id of the tenant at `index` in [`Self::tenants`] (0 is [`TenantId::OTHER`]).
    pub fn id(index: usize) -> TenantId {
        TenantId(u32::try_from(index + 1).unwrap_or(u32::MAX))
    }

    /// The name of tenant `id` (`other` for requests of no configured tenant).
    pub fn name(&self, id: TenantId) -> &str {
        (id.0 as usize)
            .checked_sub(1)
            .and_then(|i| self.tenants.get(i))
            .map_or(OTHER, |t| t.name.as_str())
    }

    /// The queue's fair-share weights: 1 for requests of no tenant, then each tenant's (none
    /// without tenants: every request is then of one tenant, of weight 1).
    pub fn fair(&self) -> FairConfig {
        if self.tenants.is_empty() {
            return FairConfig::default();
        }
        FairConfig {
            weights: std::iter::once(NonZeroU32::MIN)
                .chain(
                    self.tenants
                        .iter()
                        .map(|t| NonZeroU32::new(t.weight).unwrap_or(NonZeroU32::MIN)),
                )
                .collect(),
        }
    }

    /// The `cache_salt` a request of tenant `id` carrying `client` (its own `cache_salt`, if
    /// any) is hashed by and sent on with: the client's as it came when no tenant has a
    /// namespace; else the tenant's namespace, joined to the client's salt as
    /// `NAMESPACE:SALT` when there is one, and for a tenant without a namespace the client's
    /// salt after a `:` (none without one). A namespace has no `:`, so the text before the
    /// first `:` names the namespace: no client salt reaches a namespace that is not its
    /// tenant's.
    pub fn cache_salt(&self, id: TenantId, client: Option<&str>) -> Option<String> {
        if !self.tenants.iter().any(|t| t.cache_namespace.is_some()) {
            return client.map(str::to_owned);
        }
        let namespace = (id.0 as usize)
            .checked_sub(1)
            .and_then(|i| self.tenants.get(i))
            .and_then(|t| t.cache_namespace.as_deref());
        match (namespace, client) {
            (Some(ns), None) => Some(ns.to_owned()),
            (Some(ns), Some(salt)) => Some(format!("{ns}:{salt}")),
            (None, Some(salt)) => Some(format!(":{salt}")),
            (None, None) => None,
        }
    }

    /// Every tenant's API keys.
    pub fn api_keys(&self) -> impl Iterator<Item = &str> {
        self.tenants
            .iter()
            .flat_map(|t| t.api_keys.iter().map(String::as_str))
    }

    /// Checks names, keys, header values, weights and limits.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (key, header) in [
            ("tenant-header", &self.tenant_header),
            ("priority-header", &self.priority_header),
        ] {
            if let Some(h) = header
                && HeaderName::from_bytes(h.as_bytes()).is_err()
            {
                return Err(invalid(key, format!("{h:?} is not a header name")));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        let mut keys = std::collections::BTreeSet::new();
        let mut values = std::collections::BTreeSet::new();
        for t in &self.tenants {
            let f = |field: &str| format!("tenant {:?}: {field}", t.name);
            if t.name.is_empty() || t.name == OTHER || t.name.len() > 64 {
                return Err(invalid(
                    "tenant: name",
                    format!(
                        "{:?}: 1 to 64 characters, and not {OTHER:?} (requests of no tenant)",
                        t.name
                    ),
                ));
            }
            if !names.insert(t.name.as_str()) {
                return Err(invalid(f("name"), "named twice"));
            }
            for k in &t.api_keys {
                if !is_token(k) {
                    return Err(invalid(f("api-keys"), TOKEN_RULE));
                }
                if !keys.insert(k.as_str()) {
                    return Err(invalid(f("api-keys"), "a key is given to two tenants"));
                }
            }
            for v in &t.header_values {
                if !is_token(v) {
                    return Err(invalid(f("header-values"), TOKEN_RULE));
                }
                if !values.insert(v.as_str()) {
                    return Err(invalid(f("header-values"), "a value is given to two tenants"));
                }
            }
            if !t.header_values.is_empty() && self.tenant_header.is_none() {
                return Err(invalid(f("header-values"), "needs tenant-header"));
            }
            if t.weight == 0 {
                return Err(invalid(f("weight"), "must be at least 1"));
            }
            if t.requests_per_interval == Some(0) || t.tokens_per_interval == Some(0) {
                return Err(invalid(
                    f("requests-per-interval"),
                    "a limit must be at least 1 (leave it out for none)",
                ));
            }
            if t.interval_ms == 0 {
                return Err(invalid(f("interval-ms"), "must be at least 1"));
            }
            if let Some(ns) = &t.cache_namespace
                && (ns.is_empty()
                    || ns.len() > 128
                    || !ns
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)))
            {
                return Err(invalid(
                    f("cache-namespace"),
                    format!("{ns:?}: 1 to 128 letters, digits, '.', '_' and '-'"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::ServeConfig;

    fn validate(text: &str) -> Result<ServeConfig, String> {
        let config = ServeConfig::from_toml_str(text).map_err(|e| e.to_string())?;
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }

    #[test]
    fn tenants_read_from_the_file_give_the_queue_its_weights() {
        let config = validate(
            r#"
            tenant-header = "x-tenant"
            priority-header = "x-priority"
            [[tenant]]
            name = "batch"
            header-values = ["batch"]
            [[tenant]]
            name = "chat"
            api-keys = ["sk-chat"]
            weight = 3
            requests-per-interval = 100
            tokens-per-interval = 50000
            interval-ms = 1000
            "#,
        )
        .unwrap();
        let t = &config.tenants;
        assert_eq!(t.tenants.len(), 2);
        let weights: Vec<u32> = t.fair().weights.iter().map(|w| w.get()).collect();
        assert_eq!(weights, [1, 1, 3]);
        assert_eq!(t.name(super::TenantsConfig::id(1)), "chat");
        assert_eq!(t.name(kvroute_core::router::TenantId::OTHER), super::OTHER);
        assert_eq!(config.validate().unwrap().fair, t.fair());
    }

    #[test]
    fn bad_tenants_are_refused_naming_what_is_wrong() {
        for (text, says) in [
            ("[[tenant]]\nname = \"a\"\ncolour = \"red\"", "colour"),
            (
                "[[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"a\"",
                "named twice",
            ),
            ("[[tenant]]\nname = \"other\"", "other"),
            ("[[tenant]]\nname = \"a\"\nweight = 0", "weight"),
            (
                "[[tenant]]\nname = \"a\"\nrequests-per-interval = 0",
                "at least 1",
            ),
            (
                "[[tenant]]\nname = \"a\"\nheader-values = [\"a\"]",
                "needs tenant-header",
            ),
            (
                "[[tenant]]\nname = \"a\"\napi-keys = [\"k\"]\n[[tenant]]\nname = \"b\"\napi-keys = [\"k\"]",
                "two tenants",
            ),
            ("priority-header = \"bad header\"", "not a header name"),
            (
                "[[tenant]]\nname = \"a\"\ncache-namespace = \"a:b\"",
                "cache-namespace",
            ),
            (
                "[[tenant]]\nname = \"a\"\ncache-namespace = \"\"",
                "cache-namespace",
            ),
        ] {
            let e = validate(text).unwrap_err();
            assert!(e.contains(says), "{text:?}: {e}");
        }
    }

    /// A namespaced tenant's salt starts with its namespace; any other request's salt cannot:
    /// it is the client's after a `:`, or none. Without namespaces salts pass as they came.
    #[test]
    fn a_namespace_salts_its_tenants_requests_and_no_other_request_can_reach_it() {
        let config = validate(
            "[[tenant]]\nname = \"a\"\ncache-namespace = \"acme\"\n\
             [[tenant]]\nname = \"b\"\n",
        )
        .unwrap();
        let t = &config.tenants;
        let (a, b, other) = (
            super::TenantsConfig::id(0),
            super::TenantsConfig::id(1),
            kvroute_core::router::TenantId::OTHER,
        );
        assert_eq!(t.cache_salt(a, None).as_deref(), Some("acme"));
        assert_eq!(t.cache_salt(a, Some("u1")).as_deref(), Some("acme:u1"));
        assert_eq!(t.cache_salt(b, None), None);
        for (id, salt) in [(b, "acme"), (other, "acme"), (b, "acme:u1"), (other, "x")] {
            let got = t.cache_salt(id, Some(salt)).unwrap();
            assert_eq!(got, format!(":{salt}"));
            assert!(!got.starts_with("acme"), "{got}");
        }
        let plain = validate("[[tenant]]\nname = \"a\"\n").unwrap().tenants;
        assert_eq!(plain.cache_salt(a, Some("s")).as_deref(), Some("s"));
        assert_eq!(plain.cache_salt(a, None), None);
    }
}
