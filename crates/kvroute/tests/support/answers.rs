//! A client for the proxy's inference port that reads what the router predicted (the debug
//! headers) beside what the engine reported (its usage). Included with `#[path]`.

#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_http::net::{HttpClient, client};
use kvroute_http::openai::types::ModelList;
use kvroute_proxy::ProxyHandle;
use kvroute_proxy::observed::{PREDICTED_HEADER, WORKER_HEADER};
use kvroute_testkit::PATIENCE;
use serde_json::Value;

/// What one completion came back with.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub worker: Option<u64>,
    pub predicted: Option<u32>,
    pub reported: u32,
    pub body: String,
}

/// The proxy's inference port.
pub struct Proxy {
    base: String,
    http: HttpClient,
}

impl Proxy {
    pub fn new(p: &ProxyHandle) -> Self {
        Self {
            base: p.url(),
            http: client(Duration::from_secs(5)),
        }
    }

    pub async fn complete(&self, body: Value, headers: &[(&str, &str)]) -> Answer {
        self.generate("/v1/completions", body, headers).await
    }

    /// A generation request to `path` (a completion or a chat); the engine's reported cached
    /// tokens read from its usage.
    pub async fn generate(&self, path: &str, body: Value, headers: &[(&str, &str)]) -> Answer {
        let mut req =
            hyper::Request::post(format!("{}{path}", self.base)).header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
            .unwrap();
        let resp = self.http.request(req).await.unwrap();
        let status = resp.status().as_u16();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .map(|v| v.to_str().unwrap().parse::<u64>().unwrap())
        };
        let (worker, predicted) = (header(WORKER_HEADER), header(PREDICTED_HEADER).map(|p| p as u32));
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&bytes).into_owned();
        let reported = match status {
            200 => {
                let v: Value = serde_json::from_slice(&bytes).unwrap();
                let cached = &v["usage"]["prompt_tokens_details"]["cached_tokens"];
                cached.as_u64().map_or(0, |c| c as u32)
            }
            _ => 0,
        };
        Answer {
            status,
            worker,
            predicted,
            reported,
            body,
        }
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let req = hyper::Request::get(format!("{}{path}", self.base))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = self.http.request(req).await.unwrap();
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The ids on the proxy's `/v1/models`, with each one's parent.
    pub async fn models(&self) -> Vec<(String, Option<String>)> {
        let list: ModelList = serde_json::from_str(&self.get("/v1/models").await.1).unwrap();
        list.data.into_iter().map(|c| (c.id, c.parent)).collect()
    }

    /// Waits until the proxy's `/v1/models` lists `id` (or, `listed` false, does not).
    pub async fn until_listed(&self, id: &str, listed: bool) {
        let what = format!("{id} listed should be {listed}");
        self.until_models(&what, |models| models.iter().any(|(m, _)| m == id) == listed)
            .await;
    }

    /// Waits until the proxy's `/v1/models` (ids with their parents) is `done`, failing with
    /// `what` and the last list after [`PATIENCE`].
    pub async fn until_models(&self, what: &str, done: impl Fn(&[(String, Option<String>)]) -> bool) {
        let deadline = std::time::Instant::now() + PATIENCE;
        loop {
            let models = self.models().await;
            if done(&models) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "{what}: {models:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
