//! LoRA adapters as vLLM serves them (`vllm/entrypoints/openai/serving_models.py`): started
//! with some (`--lora-modules name=path`, [`MockConfig::lora_modules`]), loaded and unloaded at
//! run time (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`, which vLLM offers with
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; the mock always does), listed on `/v1/models` after the
//! base model with their path as `root` and the base model as `parent`. A request naming an
//! adapter runs under it: its blocks are hashed with the adapter's name, and its KV events carry
//! it as `lora_name`. A request naming neither the base model nor a loaded adapter is vLLM's 404.
//!
//! [`MockConfig::lora_modules`]: crate::MockConfig::lora_modules

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvroute_http::openai::types::{ErrorResponse, ModelCard, ModelList, Object};
use serde_json::Value;

use crate::handlers::MockWorkerState;
use crate::vllm::Refusal;

/// A LoRA adapter: its name and the path it was loaded from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraModule {
    /// The name requests use as `model`.
    pub name: String,
    /// Where it was loaded from (`root` on `/v1/models`); the mock reads nothing there.
    pub path: String,
}

impl std::str::FromStr for LoraModule {
    type Err = String;

    /// vLLM's `--lora-modules` form, `name=path`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('=') {
            Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok(Self {
                name: name.to_owned(),
                path: path.to_owned(),
            }),
            _ => Err(format!("a LoRA module is `name=path`, got {s:?}")),
        }
    }
}

/// The adapters a worker has loaded, in the order they were loaded.
#[derive(Debug, Default)]
pub(crate) struct Loaded(Mutex<Vec<LoraModule>>);

impl Loaded {
    pub(crate) fn new(modules: &[LoraModule]) -> Self {
        Self(Mutex::new(modules.to_vec()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<LoraModule>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `name` is loaded.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.lock().iter().any(|m| m.name == name)
    }

    /// `/v1/models`: the base model, then each adapter with `parent` the base model.
    pub(crate) fn model_list(&self, model_name: &str) -> ModelList {
        let card = |id: &str, root: &str, parent: Option<&str>| ModelCard {
            id: id.to_owned(),
            object: Object::Model,
            created: 0,
            owned_by: "kvroute-mock".to_owned(),
            root: Some(root.to_owned()),
            parent: parent.map(str::to_owned),
        };
        let mut data = vec![card(model_name, model_name, None)];
        data.extend(
            self.lock()
                .iter()
                .map(|m| card(&m.name, &m.path, Some(model_name))),
        );
        ModelList {
            object: Object::List,
            data,
        }
    }
}

/// vLLM's error of these endpoints: `type` as vLLM names it, `code` the status.
fn refusal(status: StatusCode, kind: &str, message: String) -> Response {
    let mut body = ErrorResponse::vllm(status.as_u16(), message, None);
    body.error.kind = kind.to_owned();
    (status, axum::Json(body)).into_response()
}

fn field<'a>(body: &'a Value, name: &str) -> Option<&'a str> {
    body.get(name).and_then(Value::as_str).filter(|s| !s.is_empty())
}

/// `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}`.
pub(crate) async fn load(State(w): State<Arc<MockWorkerState>>, body: axum::body::Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or_default();
    let (Some(name), Some(path)) = (field(&body, "lora_name"), field(&body, "lora_path")) else {
        return refusal(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "Both 'lora_name' and 'lora_path' must be provided.".to_owned(),
        );
    };
    let mut loaded = w.adapters.lock();
    if loaded.iter().any(|m| m.name == name) {
        return refusal(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            format!("The lora adapter '{name}' has already been loaded."),
        );
    }
    loaded.push(LoraModule {
        name: name.to_owned(),
        path: path.to_owned(),
    });
    format!("Success: LoRA adapter '{name}' added successfully.").into_response()
}

/// `POST /v1/unload_lora_adapter` `{"lora_name"}`.
pub(crate) async fn unload(State(w): State<Arc<MockWorkerState>>, body: axum::body::Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or_default();
    let Some(name) = field(&body, "lora_name") else {
        return refusal(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "either 'lora_name' and 'lora_int_id' needs to be provided.".to_owned(),
        );
    };
    let mut loaded = w.adapters.lock();
    let before = loaded.len();
    loaded.retain(|m| m.name != name);
    if loaded.len() == before {
        return refusal(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The lora adapter '{name}' cannot be found."),
        );
    }
    format!("Success: LoRA adapter '{name}' removed successfully.").into_response()
}

/// The adapter a request body names, if it names one, or vLLM's 404 for a model it does not
/// serve (neither the base model nor a loaded adapter).
pub(crate) fn requested(body: &Value, model_name: &str, loaded: &Loaded) -> Result<Option<String>, Refusal> {
    match body.get("model").and_then(Value::as_str) {
        Some(model) if model != model_name => {
            if loaded.contains(model) {
                Ok(Some(model.to_owned()))
            } else {
                Err(Refusal::new(
                    StatusCode::NOT_FOUND,
                    format!("The model `{model}` does not exist."),
                    Some("model"),
                ))
            }
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_modules_parse_as_vllm_takes_them() {
        let m: LoraModule = "sql=/adapters/sql".parse().unwrap();
        assert_eq!((m.name.as_str(), m.path.as_str()), ("sql", "/adapters/sql"));
        assert!("sql".parse::<LoraModule>().is_err());
        assert!("=x".parse::<LoraModule>().is_err());
    }

    #[test]
    fn adapters_are_listed_after_the_base_model_with_their_parent() {
        let loaded = Loaded::new(&["a=/p/a".parse().unwrap()]);
        let list = loaded.model_list("tiny");
        let ids: Vec<(&str, Option<&str>, Option<&str>)> = list
            .data
            .iter()
            .map(|c| (c.id.as_str(), c.root.as_deref(), c.parent.as_deref()))
            .collect();
        assert_eq!(
            ids,
            [("tiny", Some("tiny"), None), ("a", Some("/p/a"), Some("tiny"))]
        );
        let body = |m: &str| serde_json::json!({ "model": m });
        assert_eq!(
            requested(&body("a"), "tiny", &loaded).ok(),
            Some(Some("a".to_owned()))
        );
        assert_eq!(requested(&body("tiny"), "tiny", &loaded).ok(), Some(None));
        let refused = requested(&body("b"), "tiny", &loaded).err().map(|r| r.status);
        assert_eq!(refused, Some(StatusCode::NOT_FOUND));
    }
}
