//! LoRA adapters behind the proxy. A worker's adapters are the cards of its `/v1/models` whose
//! `parent` is the model the proxy serves (vLLM lists an adapter so, with its path as `root`);
//! they are read when the worker registers (the model check's answer) and again at every
//! health probe it passes (`health::probe_all`), so an adapter a worker loads or unloads at run time
//! (vLLM's `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) is seen within one interval.
//! The router routes a request naming an adapter only among the workers serving it
//! (`Router::handle_adapters`), on block hashes salted with the adapter's name as the engine's
//! are; the proxy's `/v1/models` lists the model, then every adapter some worker serves.

use kvroute_http::net::HttpClient;
use kvroute_http::openai::types::{ModelCard, ModelList, Object};

use crate::checks::{self, Worker};
use crate::driver::{AdapterSet, Driver};

/// The adapters of `model` in a worker's model list.
pub fn adapters_of(list: &ModelList, model: &str) -> AdapterSet {
    list.data
        .iter()
        .filter(|card| card.parent.as_deref() == Some(model) && card.id != model)
        .map(|card| (card.id.clone(), card.root.clone()))
        .collect()
}

/// The proxy's `/v1/models`: the model it serves, then each adapter some worker serves, by
/// name, with its `root` and `parent` as vLLM lists them.
pub fn model_list(driver: &Driver) -> ModelList {
    let model = &driver.config.model.model_name;
    let mut list = ModelList::one(model.clone(), "kvroute");
    list.data
        .extend(driver.adapters().into_iter().map(|(name, root)| ModelCard {
            id: name,
            object: Object::Model,
            created: 0,
            owned_by: "kvroute".to_owned(),
            root,
            parent: Some(model.clone()),
        }));
    list
}

/// The one of `models` (the names the proxy serves) worker `w` joins: the model its table names
/// (`model=NAME`), the only one, or the one its `/v1/models` lists ([`model_of`]).
pub async fn model_for(
    client: &HttpClient,
    w: &crate::config::WorkerConfig,
    models: &[&str],
    timeout: std::time::Duration,
) -> Result<String, String> {
    match (&w.model, models) {
        (Some(name), _) => Ok(name.clone()),
        (None, [only]) => Ok((*only).to_owned()),
        (None, _) => model_of(client, w, models, timeout).await,
    }
}

/// Which of `models` (the names the proxy serves) a worker lists on its `/v1/models` as a base
/// model (a card without a parent): its model, when it is exactly one; else an error saying
/// why, and to pin it (`model=NAME`).
pub async fn model_of(
    client: &HttpClient,
    worker: &crate::config::WorkerConfig,
    models: &[&str],
    timeout: std::time::Duration,
) -> Result<String, String> {
    let at = Worker {
        base: worker.url.trim_end_matches('/'),
        api_key: worker.api_key.as_deref(),
    };
    let pin = "pin its model with model=NAME";
    let Some(list) = checks::models(client, at, timeout).await else {
        return Err(format!(
            "worker {}: its /v1/models could not be read to find its model; {pin}",
            worker.url
        ));
    };
    base_model_among(&list, models).map_err(|e| format!("worker {}: {e}; {pin}", worker.url))
}

/// The one of `models` that `list` serves as a base model.
fn base_model_among(list: &ModelList, models: &[&str]) -> Result<String, String> {
    let served: Vec<&str> = list
        .data
        .iter()
        .filter(|card| card.parent.is_none() && models.contains(&card.id.as_str()))
        .map(|card| card.id.as_str())
        .collect();
    match served[..] {
        [one] => Ok(one.to_owned()),
        [] => Err(format!(
            "it serves none of the models ({}), but {:?}",
            models.join(", "),
            list.data.iter().map(|c| c.id.as_str()).collect::<Vec<_>>()
        )),
        _ => Err(format!("it serves several of the models ({})", served.join(", "))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_adapters_are_the_cards_whose_parent_is_the_model() {
        let list: ModelList = serde_json::from_str(
            r#"{"object":"list","data":[
                {"id":"tiny","object":"model","created":0,"owned_by":"vllm","root":"/m/tiny","parent":null},
                {"id":"sql","object":"model","created":0,"owned_by":"vllm","root":"/a/sql","parent":"tiny"},
                {"id":"other","object":"model","created":0,"owned_by":"vllm","root":"/a/o","parent":"big"}
            ]}"#,
        )
        .unwrap();
        let adapters = adapters_of(&list, "tiny");
        assert_eq!(
            adapters.into_iter().collect::<Vec<_>>(),
            vec![("sql".to_owned(), Some("/a/sql".to_owned()))]
        );
        // A worker's model is the one base model of the proxy's it lists; an adapter's name
        // is no model.
        assert_eq!(base_model_among(&list, &["big", "tiny"]), Ok("tiny".to_owned()));
        assert!(base_model_among(&list, &["big", "sql"]).is_err());
        let two: ModelList = serde_json::from_str(
            r#"{"object":"list","data":[
                {"id":"a","object":"model","created":0,"owned_by":"vllm","root":"a","parent":null},
                {"id":"b","object":"model","created":0,"owned_by":"vllm","root":"b","parent":null}
            ]}"#,
        )
        .unwrap();
        let e = base_model_among(&two, &["a", "b"]).unwrap_err();
        assert!(e.contains("several"), "{e}");
    }
}
