//! The admin API over the worker registry, on a listener of its own (loopback by default; a
//! bearer token when it is bound beyond loopback): nothing under `/admin` answers on the
//! inference port. It lists the workers (credentials redacted), adds, drains and removes them;
//! a change that would leave the fleet unable to serve is refused with 409 unless forced
//! (`?force=true`). The bearer-token checks here also guard the inference API's keys.
//!
//! A drain can wait (`?wait=true[&timeout_ms=N]`): it answers only once the worker has no
//! request in flight, or 504 when `timeout_ms` passes first, so a pod's pre-stop hook can let
//! the pod go after it. It is addressed by id (`/admin/workers/{id}/drain`) or by the worker's
//! URL (`/admin/drain?url=...`), which is what a pre-stop hook knows. The planner's removal
//! order (cheapest to remove first, [`crate::autoscale::removal`]) is
//! `GET /admin/planner/removal-order`.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvroute_core::ids::WorkerId;
use kvroute_core::router::WorkerRole;
use kvroute_http::openai::ApiError;
use serde_json::json;

use crate::app::{App, Stack, read_body};
use crate::config::{ConfigError, ServeConfig, WorkerConfig};
use crate::worker::StateName;

/// The admin API's routes, behind its token.
pub(crate) fn routes(app: &Arc<App>) -> axum::Router<Arc<App>> {
    axum::Router::new()
        .route("/admin/workers", get(list_workers).post(post_worker))
        .route("/admin/workers/{id}", axum::routing::delete(delete_worker))
        .route("/admin/workers/{id}/drain", post(drain_worker))
        .route("/admin/planner", get(planner_report))
        .route("/admin/drain", post(drain_by_url))
        .route("/admin/planner/removal-order", get(removal_order))
        .route_layer(middleware::from_fn_with_state(Arc::clone(app), admin_auth))
}

/// The planner's recent ticks and decisions, the workers it is starting and retiring, and
/// the counts it wants (with several models, `{"models": {NAME: report}}`, each model that has
/// a planner); 404 without a planner.
async fn planner_report(State(app): State<Arc<App>>) -> Response {
    let planned = |r: &serde_json::Value| r.get("config").is_some_and(|c| !c.is_null());
    let report = match &app.stacks[..] {
        [only] => Some(only.planner.to_json()).filter(planned),
        stacks => {
            let models: serde_json::Map<String, serde_json::Value> = stacks
                .iter()
                .map(|s| (s.name().to_owned(), s.planner.to_json()))
                .filter(|(_, r)| planned(r))
                .collect();
            (!models.is_empty()).then(|| json!({ "models": models }))
        }
    };
    match report {
        Some(report) => axum::Json(report).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            "no planner runs in this proxy (kvroute serve --planner FILE starts one)",
        )
        .into_response(),
    }
}

/// The bearer token of `headers`, if any.
pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compares secrets in time that depends on their lengths only.
pub(crate) fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A 401 in OpenAI's shape that asks for a bearer token.
pub(crate) fn unauthorized(message: &str) -> Response {
    let mut response = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        "invalid_api_key",
        message,
    )
    .into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// The admin API's token, when one is configured.
async fn admin_auth(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    match &app.driver.config.server.admin_token {
        Some(token) if !bearer(request.headers()).is_some_and(|t| same_secret(token, t)) => {
            unauthorized("the admin API needs its token (Authorization: Bearer TOKEN)")
        }
        _ => next.run(request).await,
    }
}

async fn list_workers(State(app): State<Arc<App>>) -> Response {
    let mut workers = Vec::new();
    for stack in &app.stacks {
        let mut listed = json!(stack.driver.worker_statuses());
        for w in listed.as_array_mut().into_iter().flatten() {
            // Credentials are never listed.
            if let Some(key) = w.get_mut("api-key").filter(|k| !k.is_null()) {
                *key = json!("<redacted>");
            }
            // Each worker's model, whether or not its table named one.
            if let Some(w) = w.as_object_mut() {
                w.insert("model".to_owned(), json!(stack.name()));
            }
        }
        workers.extend(listed.as_array().cloned().unwrap_or_default());
    }
    axum::Json(json!({ "workers": workers })).into_response()
}

/// An admin change to the fleet, checked before it is applied.
#[derive(Clone, Copy, Debug)]
enum FleetChange<'a> {
    /// A worker joins.
    Add(&'a WorkerConfig),
    /// A worker leaves routing (drained or removed).
    Leave(WorkerId),
}

/// Whether a fleet of workers of `roles` can serve a request: some worker decodes, and prefill
/// workers come with decode workers (the configuration's rule).
fn servable(roles: &[WorkerRole]) -> bool {
    roles.iter().any(|&r| r != WorkerRole::Prefill)
        && ServeConfig::validate_fleet(roles.iter().copied()).is_ok()
}

/// Refuses a change that would leave the fleet of `stack`'s model unable to serve (its
/// members: the workers not drained or removed, healthy or not), unless it is `forced`.
fn check_fleet(stack: &Stack, change: FleetChange<'_>, forced: bool) -> Result<(), ApiError> {
    let members: Vec<(WorkerId, WorkerRole)> = stack
        .driver
        .worker_statuses()
        .into_iter()
        .filter(|w| matches!(w.state, StateName::Ready | StateName::Unhealthy))
        .map(|w| (WorkerId(w.id), w.config.role()))
        .collect();
    let before: Vec<WorkerRole> = members.iter().map(|&(_, r)| r).collect();
    let after: Vec<WorkerRole> = match change {
        FleetChange::Add(config) => before.iter().copied().chain([config.role()]).collect(),
        FleetChange::Leave(id) => members
            .iter()
            .filter(|&&(m, _)| m != id)
            .map(|&(_, r)| r)
            .collect(),
    };
    let adding = matches!(change, FleetChange::Add(_));
    match fleet_refusal(&before, &after, adding) {
        Some(reason) if !forced => Err(ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "fleet_unservable",
            format!("refused: {reason}; repeat with ?force=true to do it anyway"),
        )),
        _ => Ok(()),
    }
}

/// Why a change from a fleet of roles `before` to one of `after` is refused, if it is: it makes
/// a serving fleet unservable, or adds a worker to a fleet that still cannot serve after it.
fn fleet_refusal(before: &[WorkerRole], after: &[WorkerRole], adding: bool) -> Option<String> {
    if servable(after) || !(servable(before) || adding) {
        return None;
    }
    Some(if after.is_empty() {
        "it would leave no worker to serve requests".to_owned()
    } else if after.iter().all(|&r| r == WorkerRole::Prefill) {
        "it would leave only prefill workers, which cannot serve a request alone".to_owned()
    } else {
        match ServeConfig::validate_fleet(after.iter().copied()) {
            Err(ConfigError::Invalid { message, .. }) => format!("it would leave a fleet where {message}"),
            _ => "it would leave a fleet that cannot serve".to_owned(),
        }
    })
}

/// Whether the admin request says `force=true` (or `force`, `force=1`).
fn forced(uri: &Uri) -> bool {
    uri.query().is_some_and(|q| {
        q.split('&')
            .any(|kv| matches!(kv, "force" | "force=true" | "force=1"))
    })
}

/// The largest body of an admin request.
const MAX_ADMIN_BODY: usize = 1 << 20;

async fn post_worker(State(app): State<Arc<App>>, request: Request) -> Response {
    let forced = forced(request.uri());
    let body = match read_body(&app.driver.config, request.into_body(), MAX_ADMIN_BODY).await {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    let config: WorkerConfig = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return ApiError::bad_request("body", format!("not a worker: {e}")).into_response(),
    };
    let stack = match app.stack_for_worker(&config).await {
        Ok(stack) => stack,
        Err(e) => return ApiError::bad_request("model", e).into_response(),
    };
    let _one_at_a_time = app.admin.lock().await;
    if let Err(refused) = check_fleet(stack, FleetChange::Add(&config), forced) {
        return refused.into_response();
    }
    match stack.fleet.add(config) {
        Ok(id) => (StatusCode::CREATED, axum::Json(json!({"id": id.0}))).into_response(),
        Err(e) => ApiError::bad_request("body", e).into_response(),
    }
}

fn unknown_worker(id: &str) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "unknown_worker",
        format!("no worker {id}"),
    )
    .into_response()
}

/// Worker `id` of an admin path, if it exists.
fn known_worker(app: &App, id: &str) -> Option<WorkerId> {
    id.parse()
        .ok()
        .map(WorkerId)
        .filter(|&w| app.stack_of_worker(w).is_some())
}

/// The value of query parameter `name` of `uri`, decoded, if it is there.
fn query_param(uri: &Uri, name: &str) -> Option<String> {
    form_urlencoded::parse(uri.query()?.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

/// How long a drain waits for its worker's requests (`?wait=true`), from `timeout_ms`; none
/// without `wait`. A `timeout_ms` that is no number is a 400.
fn drain_wait(uri: &Uri) -> Result<Option<std::time::Duration>, String> {
    let wait = query_param(uri, "wait").is_some_and(|v| matches!(v.as_str(), "" | "true" | "1"));
    let timeout_ms = match query_param(uri, "timeout_ms") {
        None => DEFAULT_DRAIN_WAIT_MS,
        Some(v) => v
            .parse()
            .map_err(|_| format!("timeout_ms={v:?} is no number of milliseconds"))?,
    };
    Ok(wait.then(|| std::time::Duration::from_millis(timeout_ms)))
}

/// How long `?wait=true` waits without `timeout_ms`: 120 s.
const DEFAULT_DRAIN_WAIT_MS: u64 = 120_000;

async fn drain_worker(State(app): State<Arc<App>>, Path(id): Path<String>, uri: Uri) -> Response {
    let found = known_worker(&app, &id);
    drain(&app, found, &id, &uri).await
}

async fn drain_by_url(State(app): State<Arc<App>>, uri: Uri) -> Response {
    let Some(url) = query_param(&uri, "url") else {
        return ApiError::bad_request("url", "name the worker: /admin/drain?url=http://host:port")
            .into_response();
    };
    let url = url.trim_end_matches('/');
    let found = app.stacks.iter().find_map(|s| s.driver.find_worker(url));
    drain(&app, found, url, &uri).await
}

/// Drains worker `found` (named `name` in answers), and with `?wait=true` answers only once it
/// has no request in flight: woken by the driver's changes (a request ending among them), not
/// by a timer; 504 if `timeout_ms` passes first.
async fn drain(app: &App, found: Option<WorkerId>, name: &str, uri: &Uri) -> Response {
    let wait = match drain_wait(uri) {
        Ok(wait) => wait,
        Err(bad) => return ApiError::bad_request("timeout_ms", bad).into_response(),
    };
    let (w, stack) = {
        // Released before waiting: other admin changes go on meanwhile.
        let _one_at_a_time = app.admin.lock().await;
        let Some((w, stack)) = found.and_then(|w| Some((w, app.stack_of_worker(w)?))) else {
            return unknown_worker(name);
        };
        if let Err(refused) = check_fleet(stack, FleetChange::Leave(w), forced(uri)) {
            return refused.into_response();
        }
        if !stack.fleet.drain(w) {
            return unknown_worker(name);
        }
        (w, stack)
    };
    let Some(patience) = wait else {
        return axum::Json(json!({"id": w.0, "draining": true})).into_response();
    };
    // Done once it is out of the draining state: drained (nothing in flight), or gone.
    let settled = |d: &crate::Driver| {
        !matches!(
            d.worker_state(w),
            Some(crate::worker::WorkerState::Draining { .. })
        )
    };
    if stack.driver.wait_until(patience, settled).await {
        return axum::Json(json!({"id": w.0, "draining": true, "drained": true})).into_response();
    }
    let in_flight = stack
        .driver
        .removal_figures()
        .into_iter()
        .find(|f| f.id == w)
        .map_or(0, |f| f.in_flight);
    ApiError::new(
        StatusCode::GATEWAY_TIMEOUT,
        "invalid_request_error",
        "drain_timeout",
        format!(
            "worker {} still has {in_flight} request(s) in flight after {} ms; it stays draining",
            w.0,
            patience.as_millis()
        ),
    )
    .into_response()
}

/// The workers, cheapest to remove first, with the figures that rank them.
async fn removal_order(State(app): State<Arc<App>>) -> Response {
    // Each model's order, one after another (ranks count within a model).
    let workers: Vec<serde_json::Value> = app
        .stacks
        .iter()
        .flat_map(|s| {
            crate::autoscale::removal::ranked(&s.driver)
                .into_iter()
                .enumerate()
                .map(|(rank, w)| (s.name(), rank, w))
        })
        .map(|(model, rank, w)| {
            json!({
                "model": model,
                "rank": rank,
                "id": w.id.0,
                "url": w.url,
                "role": w.role,
                "state": w.state,
                "cached_unique_blocks": w.cached_unique_blocks,
                "in_flight": w.in_flight,
            })
        })
        .collect();
    axum::Json(json!({ "workers": workers })).into_response()
}

async fn delete_worker(State(app): State<Arc<App>>, Path(id): Path<String>, uri: Uri) -> Response {
    let _one_at_a_time = app.admin.lock().await;
    let Some((w, stack)) = known_worker(&app, &id).and_then(|w| Some((w, app.stack_of_worker(w)?))) else {
        return unknown_worker(&id);
    };
    if let Err(refused) = check_fleet(stack, FleetChange::Leave(w), forced(&uri)) {
        return refused.into_response();
    }
    if !stack.fleet.remove(w) {
        return unknown_worker(&id);
    }
    axum::Json(json!({"id": w.0, "removed": true})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_changes_that_leave_the_fleet_unservable_are_refused() {
        use WorkerRole::{Aggregated as A, Decode as D, Prefill as P};
        // (before, after, adding, refused)
        let cases: &[(&[WorkerRole], &[WorkerRole], bool, bool)] = &[
            (&[A, A], &[A], false, false),
            (&[A], &[], false, true),
            (&[P, D], &[P], false, true),
            (&[P, D, D], &[P, D], false, false),
            (&[P, D, A], &[P, A], false, true),
            (&[A], &[A, P], true, true),
            (&[], &[P], true, true),
            (&[], &[A], true, false),
            (&[], &[D], true, false),
            (&[P], &[P, D], true, false),
            // Already unservable (forced there): taking workers out is not refused.
            (&[P], &[], false, false),
            (&[P, P], &[P], false, false),
        ];
        for &(before, after, adding, refused) in cases {
            let got = fleet_refusal(before, after, adding);
            assert_eq!(got.is_some(), refused, "{before:?} -> {after:?}: {got:?}");
        }
        assert!(
            fleet_refusal(&[P, D], &[P], false)
                .unwrap()
                .contains("only prefill")
        );
    }

    #[test]
    fn bearer_tokens_and_secrets() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer  k1 "));
        assert_eq!(bearer(&h), Some("k1"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic k1"));
        assert_eq!(bearer(&h), None);
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("abc", "abcd"));
    }

    #[test]
    fn force_is_read_from_the_query() {
        for (uri, want) in [
            ("/admin/workers/0", false),
            ("/admin/workers/0?force=true", true),
            ("/admin/workers/0?a=1&force", true),
            ("/admin/workers/0?force=false", false),
        ] {
            assert_eq!(forced(&uri.parse().unwrap()), want, "{uri}");
        }
    }

    #[test]
    fn drain_wait_and_url_are_read_from_the_query() {
        use std::time::Duration;
        // (uri, wait)
        let cases = [
            ("/admin/workers/0/drain", Some(None)),
            (
                "/admin/workers/0/drain?wait=true",
                Some(Some(DEFAULT_DRAIN_WAIT_MS)),
            ),
            ("/admin/workers/0/drain?wait=true&timeout_ms=250", Some(Some(250))),
            ("/admin/workers/0/drain?wait=false&timeout_ms=250", Some(None)),
            ("/admin/workers/0/drain?wait=true&timeout_ms=soon", None),
        ];
        for (uri, want) in cases {
            let got = drain_wait(&uri.parse().unwrap()).ok();
            assert_eq!(got, want.map(|w| w.map(Duration::from_millis)), "{uri}");
        }
        let uri: Uri = "/admin/drain?url=http%3A%2F%2F10.0.0.5%3A8000&wait=true"
            .parse()
            .unwrap();
        assert_eq!(query_param(&uri, "url").as_deref(), Some("http://10.0.0.5:8000"));
        assert_eq!(query_param(&uri, "force"), None);
    }
}
