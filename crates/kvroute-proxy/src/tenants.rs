//! A request's tenant and priority, the tenants' rate limits, and their metrics.
//!
//! * **Tenant**: the tenant whose API key the request carries (`Authorization: Bearer K`), else
//!   the one the tenant header's value names, else none ([`TenantId::OTHER`], label `other`).
//! * **Priority**: the body's `priority` (vLLM's field), else the priority header's, else 0.
//!   Clients and engines speak vLLM's convention, lower first; the router's queue the other way
//!   round ([`kvroute_core::router::RouteRequest::priority`]): [`Class::router_priority`] is the
//!   one conversion. With `forward-priority` the engine's body carries the priority (set from
//!   the header when the body had none); without it the body's is taken out, as an engine
//!   without priority scheduling refuses a non-zero one.
//! * **Limits**: a token bucket per tenant and limit ([`Bucket`], sans-IO: it is handed the
//!   time), of `requests-per-interval` requests and `tokens-per-interval` tokens, refilled
//!   evenly over `interval-ms`; a request over either is answered 429 with `Retry-After` (the
//!   seconds until it would fit), OpenAI's `rate_limit_exceeded`. Each replica keeps its own
//!   buckets.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, StatusCode};
use bytes::Bytes;
use kvroute_core::router::TenantId;
use kvroute_core::time::Timestamp;
use kvroute_http::openai::{ApiError, Parsed};
use prometheus::{GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, Opts};
use serde_json::Value;

use crate::config::{TenantConfig, TenantsConfig};
use crate::metrics::Metrics;

/// Who a request is from and how urgent it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Class {
    /// The tenant.
    pub tenant: TenantId,
    /// The priority in vLLM's convention (lower first).
    pub priority: i32,
}

impl Default for Class {
    fn default() -> Self {
        Self {
            tenant: TenantId::OTHER,
            priority: 0,
        }
    }
}

impl Class {
    /// The priority in the router queue's convention (higher first): the one conversion.
    pub fn router_priority(&self) -> i32 {
        self.priority.checked_neg().unwrap_or(i32::MAX)
    }

    /// The `priority` label: the value from -9 to 9, else `<-9` or `>9` (a bounded set).
    pub fn priority_label(&self) -> String {
        match self.priority {
            p if p < -9 => "<-9".to_owned(),
            p if p > 9 => ">9".to_owned(),
            p => p.to_string(),
        }
    }
}

/// A token bucket: `capacity` units, refilled evenly at `capacity` per `interval`; sans-IO.
#[derive(Clone, Debug)]
pub struct Bucket {
    capacity: f64,
    per_ns: f64,
    level: f64,
    last: Timestamp,
}

impl Bucket {
    /// A full bucket of `capacity` units per `interval`.
    pub fn new(capacity: u64, interval: Duration) -> Self {
        let capacity = capacity as f64;
        Self {
            capacity,
            per_ns: capacity / (interval.as_nanos().max(1) as f64),
            level: capacity,
            last: Timestamp::ZERO,
        }
    }

    fn refill(&mut self, now: Timestamp) {
        if now > self.last {
            let ns = now.saturating_since(self.last).as_nanos() as f64;
            self.level = (self.level + ns * self.per_ns).min(self.capacity);
            self.last = now;
        }
    }

    /// How long until `units` (at most the capacity: a request larger than the bucket waits
    /// for a full one) fit at `now`; zero if they fit now.
    pub fn wait(&mut self, now: Timestamp, units: u64) -> Duration {
        self.refill(now);
        let need = (units as f64).min(self.capacity);
        if self.level >= need {
            Duration::ZERO
        } else {
            Duration::from_nanos(((need - self.level) / self.per_ns).ceil() as u64)
        }
    }

    /// Takes `units` (at most the capacity), which [`Self::wait`] said fit.
    pub fn take(&mut self, units: u64) {
        self.level = (self.level - (units as f64).min(self.capacity)).max(0.0);
    }
}

/// One tenant's buckets.
#[derive(Debug)]
struct Limits {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

impl Limits {
    fn new(t: &TenantConfig) -> Self {
        let interval = Duration::from_millis(t.interval_ms);
        Self {
            requests: t.requests_per_interval.map(|n| Bucket::new(n, interval)),
            tokens: t.tokens_per_interval.map(|n| Bucket::new(n, interval)),
        }
    }

    /// Takes one request of `tokens` at `now`, or names the limit it is over and the wait.
    fn admit(&mut self, now: Timestamp, tokens: u64) -> Result<(), (&'static str, Duration)> {
        let over = [
            ("requests", &mut self.requests, 1),
            ("tokens", &mut self.tokens, tokens),
        ]
        .into_iter()
        .filter_map(|(name, bucket, units)| {
            let wait = bucket.as_mut()?.wait(now, units);
            (!wait.is_zero()).then_some((name, wait))
        })
        .max_by_key(|&(_, wait)| wait);
        if let Some(over) = over {
            return Err(over);
        }
        if let Some(b) = &mut self.requests {
            b.take(1);
        }
        if let Some(b) = &mut self.tokens {
            b.take(tokens);
        }
        Ok(())
    }
}

/// The tenants' metrics, registered in the proxy's registry.
#[derive(Debug)]
struct TenantMetrics {
    requests: IntCounterVec,
    tokens: IntCounterVec,
    rate_limited: IntCounterVec,
    queue_wait: HistogramVec,
    queued: GaugeVec,
    virtual_tokens: GaugeVec,
}

impl TenantMetrics {
    fn new(registry: &prometheus::Registry) -> Self {
        let register = |c: Box<dyn prometheus::core::Collector>| {
            if let Err(e) = registry.register(c) {
                tracing::warn!(error = %e, "a tenant metric was not registered");
            }
        };
        let counters = |name: &str, help: &str, labels: &[&str]| {
            let c =
                IntCounterVec::new(Opts::new(name, help), labels).expect("static metric options are valid");
            register(Box::new(c.clone()));
            c
        };
        let gauges = |name: &str, help: &str| {
            let g =
                GaugeVec::new(Opts::new(name, help), &["tenant"]).expect("static metric options are valid");
            register(Box::new(g.clone()));
            g
        };
        let queue_wait = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_tenant_queue_wait_seconds",
                "Time requests waited in the router's queue before their decision, by tenant and priority",
            )
            .buckets(vec![
                0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            &["tenant", "priority"],
        )
        .expect("static metric options are valid");
        register(Box::new(queue_wait.clone()));
        Self {
            requests: counters(
                "kvroute_tenant_requests_total",
                "Requests routed, by tenant and priority (vLLM's convention)",
                &["tenant", "priority"],
            ),
            tokens: counters(
                "kvroute_tenant_prompt_tokens_total",
                "Prompt tokens routed, by tenant",
                &["tenant"],
            ),
            rate_limited: counters(
                "kvroute_tenant_rate_limited_total",
                "Requests answered 429 by a tenant's limit, by tenant and limit (requests, tokens)",
                &["tenant", "limit"],
            ),
            queue_wait,
            queued: gauges(
                "kvroute_tenant_queued",
                "Requests waiting in the router's queue, by tenant",
            ),
            virtual_tokens: gauges(
                "kvroute_tenant_virtual_tokens",
                "Each tenant's virtual token counter in the queue's fair share (tokens served, this \
                 replica's and its peers', divided by the tenant's weight)",
            ),
        }
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Tenants {
    config: TenantsConfig,
    by_key: HashMap<String, TenantId>,
    by_value: HashMap<String, TenantId>,
    tenant_header: Option<HeaderName>,
    priority_header: Option<HeaderName>,
    /// One per configured tenant, in order.
    limits: Mutex<Vec<Limits>>,
    epoch: Instant,
    metrics: TenantMetrics,
}

impl Tenants {
    /// The tenants of a validated `config`, their metrics registered in `metrics`.
    pub fn new(config: &TenantsConfig, metrics: &Metrics) -> Self {
        Self::registered_in(config, metrics.registry())
    }

    /// [`Self::new`], the metrics registered in `registry` (with several models, the one the
    /// models share: a tenant's series are not a model's).
    pub fn registered_in(config: &TenantsConfig, registry: &prometheus::Registry) -> Self {
        let mut by_key = HashMap::new();
        let mut by_value = HashMap::new();
        for (i, t) in config.tenants.iter().enumerate() {
            let id = TenantsConfig::id(i);
            by_key.extend(t.api_keys.iter().map(|k| (k.clone(), id)));
            by_value.extend(t.header_values.iter().map(|v| (v.clone(), id)));
        }
        let header = |h: &Option<String>| h.as_ref().and_then(|h| HeaderName::from_bytes(h.as_bytes()).ok());
        Self {
            by_key,
            by_value,
            tenant_header: header(&config.tenant_header),
            priority_header: header(&config.priority_header),
            limits: Mutex::new(config.tenants.iter().map(Limits::new).collect()),
            epoch: Instant::now(),
            metrics: TenantMetrics::new(registry),
            config: config.clone(),
        }
    }

    /// Whether `token` is a tenant's API key.
    pub fn is_key(&self, token: &str) -> bool {
        self.by_key.contains_key(token)
    }

    /// Whether any tenant has an API key (the inference API then checks keys).
    pub fn has_keys(&self) -> bool {
        !self.by_key.is_empty()
    }

    /// The tenant's name (the `tenant` label).
    pub fn name(&self, id: TenantId) -> &str {
        self.config.name(id)
    }

    /// The tenant and priority of a request with `headers`, bearer token `token` and body
    /// `parsed`; a 400 naming the priority header if its value is not an integer.
    pub fn classify(
        &self,
        headers: &HeaderMap,
        token: Option<&str>,
        parsed: &Parsed,
    ) -> Result<Class, ApiError> {
        let by_key = token.and_then(|k| self.by_key.get(k));
        let by_value = || {
            let h = self.tenant_header.as_ref()?;
            let v = headers.get(h)?.to_str().ok()?;
            self.by_value.get(v)
        };
        let tenant = by_key.or_else(by_value).copied().unwrap_or(TenantId::OTHER);
        let priority = match (parsed.priority, &self.priority_header) {
            (Some(p), _) => p,
            (None, Some(h)) => match headers.get(h) {
                None => 0,
                Some(v) => v
                    .to_str()
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .ok_or_else(|| {
                        ApiError::bad_request("priority", format!("the {h} header must be an integer"))
                    })?,
            },
            (None, None) => 0,
        };
        Ok(Class { tenant, priority })
    }

    /// Takes a request of `class` asking for `tokens` from its tenant's limits, or answers 429
    /// with `Retry-After`.
    pub fn admit(&self, class: &Class, tokens: u64) -> Result<(), ApiError> {
        let Some(i) = (class.tenant.0 as usize).checked_sub(1) else {
            return Ok(());
        };
        let now = Timestamp::ZERO + self.epoch.elapsed();
        let result = match self.limits.lock() {
            Ok(mut limits) => limits.get_mut(i).map_or(Ok(()), |l| l.admit(now, tokens)),
            Err(_) => Ok(()),
        };
        let Err((limit, wait)) = result else {
            return Ok(());
        };
        let name = self.name(class.tenant);
        self.metrics.rate_limited.with_label_values(&[name, limit]).inc();
        let mut error = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            limit,
            "rate_limit_exceeded",
            format!("Rate limit reached for tenant {name} on {limit}: try again in {wait:.1?}."),
        );
        error.retry_after = Some(
            u32::try_from(wait.as_secs() + u64::from(wait.subsec_nanos() > 0))
                .unwrap_or(u32::MAX)
                .max(1),
        );
        Err(error)
    }

    /// Counts a routed request of `class`, of `prompt_tokens`, that waited `waited` in the queue.
    pub fn routed(&self, class: &Class, prompt_tokens: u64, waited: Duration) {
        let name = self.name(class.tenant);
        let priority = class.priority_label();
        self.metrics.requests.with_label_values(&[name, &priority]).inc();
        self.metrics
            .tokens
            .with_label_values(&[name])
            .inc_by(prompt_tokens);
        self.metrics
            .queue_wait
            .with_label_values(&[name, &priority])
            .observe(waited.as_secs_f64());
    }

    /// Sets the gauges from the router's queue (waiting per tenant) and fair share (counters).
    pub fn refresh(&self, queued: &[(TenantId, usize)], counters: &[(TenantId, f64)]) {
        self.metrics.queued.reset();
        for &(t, n) in queued {
            self.metrics
                .queued
                .with_label_values(&[self.name(t)])
                .set(n as f64);
        }
        for &(t, c) in counters {
            self.metrics
                .virtual_tokens
                .with_label_values(&[self.name(t)])
                .set(c);
        }
    }

    /// The `cache_salt` a request of `class` carrying `client` goes with
    /// ([`TenantsConfig::cache_salt`]: its tenant's namespace joined to the client's salt).
    pub fn cache_salt(&self, class: &Class, client: Option<&str>) -> Option<String> {
        self.config.cache_salt(class.tenant, client)
    }

    /// The engine's body for a request of `class`: `body` with `priority` set (with
    /// `forward-priority`, when the body has none and the class's is not 0) or taken out
    /// (without it, when the body has one), and `cache_salt` set to `salt` (the request's
    /// [`Self::cache_salt`]) when that is not the body's; unchanged otherwise.
    pub fn engine_body(
        &self,
        class: &Class,
        parsed: &Parsed,
        salt: Option<&str>,
        body: Bytes,
    ) -> Result<Bytes, ApiError> {
        let change = match (self.config.forward_priority, parsed.priority) {
            (true, None) if class.priority != 0 => Some(Some(class.priority)),
            (false, Some(_)) => Some(None),
            _ => None,
        };
        let salt = salt.filter(|s| Some(*s) != parsed.cache_salt.as_deref());
        if change.is_none() && salt.is_none() {
            return Ok(body);
        }
        let mut obj = match serde_json::from_slice(&body) {
            Ok(Value::Object(obj)) => obj,
            _ => return Err(ApiError::bad_request("body", "the body must be a JSON object")),
        };
        match change {
            Some(Some(p)) => {
                obj.insert("priority".to_owned(), Value::from(p));
            }
            Some(None) => {
                obj.remove("priority");
            }
            None => {}
        }
        if let Some(salt) = salt {
            obj.insert("cache_salt".to_owned(), Value::from(salt));
        }
        serde_json::to_vec(&obj)
            .map(Bytes::from)
            .map_err(|_| ApiError::bad_request("body", "the body must be a JSON object"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Timestamp {
        Timestamp::ZERO + Duration::from_millis(ms)
    }

    /// A bucket of 3 per second: three at once, then one each third of a second, and the
    /// wait says exactly when.
    #[test]
    fn a_bucket_admits_its_capacity_then_its_rate() {
        let mut b = Bucket::new(3, Duration::from_secs(1));
        for _ in 0..3 {
            assert_eq!(b.wait(at(0), 1), Duration::ZERO);
            b.take(1);
        }
        let wait = b.wait(at(0), 1);
        assert!(
            wait > Duration::from_millis(333) && wait <= Duration::from_millis(334),
            "{wait:?}"
        );
        assert!(!b.wait(at(300), 1).is_zero());
        assert!(b.wait(at(334), 1).is_zero());
        // More than the capacity waits for a full bucket, then empties it.
        b.take(1);
        assert!(b.wait(at(2000), 10).is_zero());
        b.take(10);
        assert!(!b.wait(at(2000), 1).is_zero());
    }

    #[test]
    fn a_request_over_either_limit_is_refused_naming_it_and_takes_nothing() {
        let tenant = TenantConfig {
            name: "a".to_owned(),
            api_keys: Vec::new(),
            header_values: Vec::new(),
            weight: 1,
            requests_per_interval: Some(2),
            tokens_per_interval: Some(100),
            interval_ms: 1000,
            cache_namespace: None,
        };
        let mut limits = Limits::new(&tenant);
        assert_eq!(limits.admit(at(0), 80), Ok(()));
        let (limit, wait) = limits.admit(at(0), 30).unwrap_err();
        assert_eq!(limit, "tokens");
        assert_eq!(wait, Duration::from_millis(100));
        // The refused request took nothing: a small one still fits both limits.
        assert_eq!(limits.admit(at(0), 20), Ok(()));
        let (limit, _) = limits.admit(at(0), 0).unwrap_err();
        assert_eq!(limit, "requests");
    }

    #[test]
    fn priorities_convert_once_and_their_labels_are_bounded() {
        let class = |priority| Class {
            tenant: TenantId::OTHER,
            priority,
        };
        assert_eq!(class(-3).router_priority(), 3);
        assert_eq!(class(i32::MIN).router_priority(), i32::MAX);
        assert!(class(1).router_priority() < class(0).router_priority());
        let labels: std::collections::BTreeSet<String> =
            (-1000..1000).map(|p| class(p).priority_label()).collect();
        assert_eq!(labels.len(), 21);
    }

    fn tenants(forward_priority: bool) -> Tenants {
        let config = TenantsConfig {
            tenant_header: Some("x-tenant".to_owned()),
            priority_header: Some("x-priority".to_owned()),
            forward_priority,
            tenants: vec![TenantConfig {
                name: "a".to_owned(),
                api_keys: vec!["sk-a".to_owned()],
                header_values: vec!["team-a".to_owned()],
                weight: 2,
                requests_per_interval: None,
                tokens_per_interval: None,
                interval_ms: 1000,
                cache_namespace: None,
            }],
        };
        Tenants::new(&config, &Metrics::new())
    }

    fn parsed(body: &str) -> Parsed {
        let model = kvroute_http::model::Model::tiny().unwrap();
        kvroute_http::openai::parse(
            kvroute_http::openai::Endpoint::Completions,
            body.as_bytes(),
            &model,
            1000,
        )
        .unwrap()
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|&(k, v)| (HeaderName::from_static(k), v.parse().unwrap()))
            .collect()
    }

    /// The key, then the header, name the tenant; the body's priority, then the header's.
    #[test]
    fn a_request_is_classed_by_key_header_and_body() {
        let t = tenants(false);
        let plain = parsed(r#"{"prompt": "hi"}"#);
        let of = |h: &[(&'static str, &str)], p: &Parsed| {
            let h = headers(h);
            let token = h
                .get("authorization")
                .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "));
            t.classify(&h, token, p)
        };
        assert_eq!(of(&[], &plain).unwrap(), Class::default());
        let a = TenantsConfig::id(0);
        assert_eq!(of(&[("authorization", "Bearer sk-a")], &plain).unwrap().tenant, a);
        assert_eq!(of(&[("x-tenant", "team-a")], &plain).unwrap().tenant, a);
        assert_eq!(
            of(&[("x-tenant", "team-b")], &plain).unwrap().tenant,
            TenantId::OTHER
        );
        assert_eq!(of(&[("x-priority", "-2")], &plain).unwrap().priority, -2);
        let body = parsed(r#"{"prompt": "hi", "priority": 3}"#);
        assert_eq!(of(&[("x-priority", "-2")], &body).unwrap().priority, 3);
        let e = of(&[("x-priority", "soon")], &plain).unwrap_err();
        assert_eq!((e.status, e.param), (StatusCode::BAD_REQUEST, Some("priority")));
    }

    /// With `forward-priority` a header's priority goes into the body; without it the body's
    /// is taken out; otherwise the body goes as it came.
    #[test]
    fn the_engine_gets_the_priority_only_when_it_schedules_by_it() {
        let field = |b: &Bytes| {
            serde_json::from_slice::<Value>(b)
                .unwrap()
                .get("priority")
                .cloned()
        };
        let high = Class {
            tenant: TenantId::OTHER,
            priority: -1,
        };
        let plain = r#"{"prompt": "hi"}"#;
        let with = r#"{"prompt": "hi", "priority": -1}"#;
        let body = |s: &str| Bytes::from(s.to_owned());
        let forwarded = tenants(true)
            .engine_body(&high, &parsed(plain), None, body(plain))
            .unwrap();
        assert_eq!(field(&forwarded), Some(Value::from(-1)));
        let kept = tenants(true)
            .engine_body(&high, &parsed(with), None, body(with))
            .unwrap();
        assert_eq!(kept, body(with));
        let stripped = tenants(false)
            .engine_body(&high, &parsed(with), None, body(with))
            .unwrap();
        assert_eq!(field(&stripped), None);
        let untouched = tenants(false)
            .engine_body(&high, &parsed(plain), None, body(plain))
            .unwrap();
        assert_eq!(untouched, body(plain));
        let salted = tenants(false)
            .engine_body(&high, &parsed(plain), Some("acme"), body(plain))
            .unwrap();
        let salt = serde_json::from_slice::<Value>(&salted).unwrap()["cache_salt"].clone();
        assert_eq!(salt, Value::from("acme"));
        let same = r#"{"prompt": "hi", "cache_salt": "acme"}"#;
        let kept = tenants(false)
            .engine_body(&high, &parsed(same), Some("acme"), body(same))
            .unwrap();
        assert_eq!(kept, body(same));
    }
}
