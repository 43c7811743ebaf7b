//! Several models behind one proxy: `[[model]]` tables, and the configuration of each model's
//! stack (router, fleet, tokenizer) that [`ServeConfig::stacks`] derives from them.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ConfigError, ModelConfig, ServeConfig, WorkerConfig, invalid};

/// `e`, the error of model `name`'s configuration, naming the model.
pub(super) fn within(name: &str, e: ConfigError) -> ConfigError {
    match e {
        ConfigError::Invalid { field, message } => invalid(format!("model {name:?}: {field}"), message),
        other => invalid(format!("model {name:?}"), other.to_string()),
    }
}

/// `name` as one NATS subject token: letters, digits, `-` and `_` kept, anything else `_`.
fn subject_token(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' => c,
            _ => '_',
        })
        .collect()
}

/// One of several models the proxy serves (a `[[model]]` table): a router, fleet and
/// tokenizer of its own ([`ServeConfig::stacks`]).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ModelTable {
    /// Its name, as requests and workers' `/v1/models` name it.
    pub name: String,
    /// Its tokenizer's directory (as `model-dir`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_dir: Option<PathBuf>,
    /// Without `model-dir`, the built-in tiny tokenizer (as `approximate-tokenizer`).
    #[serde(default)]
    pub approximate_tokenizer: bool,
    /// Tokens per KV block of its engines. Default 16.
    #[serde(default = "sixteen")]
    pub block_size: u32,
    /// Its routing policy. Default: the file's `policy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// Its workers (`[[model.worker]]` tables); `[[worker]]` tables with `model = NAME` join
    /// them, and a worker naming no model is this model's if its `/v1/models` lists it.
    #[serde(default, rename = "worker", skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<WorkerConfig>,
}

fn sixteen() -> u32 {
    16
}

impl ServeConfig {
    /// The configuration of each model's stack (router, fleet, tokenizer), in order: this one
    /// without `[[model]]` tables; with them, one per table, with its name, tokenizer, block
    /// size, policy and workers (its table's, and the `[[worker]]` tables pinned to it), a sync
    /// subject prefix of its own (`PREFIX.NAME`, the name's other characters as `_`), the rest
    /// shared. Workers that name no model are not in any ([`Self::unpinned_workers`]).
    pub fn stacks(&self) -> Result<Vec<ServeConfig>, ConfigError> {
        if self.models.is_empty() {
            if let Some(w) = self
                .workers
                .iter()
                .find(|w| w.model.as_deref().is_some_and(|m| m != self.model.model_name))
            {
                return Err(invalid(
                    format!("worker {}: model", w.url),
                    format!(
                        "{:?} is not the model served ({:?}); several models are [[model]] tables",
                        w.model.as_deref().unwrap_or_default(),
                        self.model.model_name
                    ),
                ));
            }
            return Ok(vec![self.clone()]);
        }
        let names: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        for w in &self.workers {
            if let Some(m) = &w.model
                && !names.contains(&m.as_str())
            {
                return Err(invalid(
                    format!("worker {}: model", w.url),
                    format!("{m:?} is none of the [[model]] tables ({})", names.join(", ")),
                ));
            }
        }
        let mut subjects = std::collections::BTreeMap::new();
        let mut stacks = Vec::with_capacity(self.models.len());
        for table in &self.models {
            let f = |key: &str| format!("model {:?}: {key}", table.name);
            if table.name.is_empty() {
                return Err(invalid("model: name", "must not be empty"));
            }
            let subject = subject_token(&table.name);
            if let Some(other) = subjects.insert(subject.clone(), table.name.as_str()) {
                return Err(invalid(
                    f("name"),
                    format!("named twice, or as {other:?} in a sync subject ({subject})"),
                ));
            }
            let mut workers: Vec<WorkerConfig> = self
                .workers
                .iter()
                .filter(|w| w.model.as_deref() == Some(table.name.as_str()))
                .cloned()
                .collect();
            for w in &table.workers {
                if w.model.as_deref().is_some_and(|m| m != table.name) {
                    return Err(invalid(
                        format!("{}: worker {}: model", f("worker"), w.url),
                        "names another model than its table's",
                    ));
                }
                workers.push(WorkerConfig {
                    model: Some(table.name.clone()),
                    ..w.clone()
                });
            }
            let mut stack = ServeConfig {
                model: ModelConfig {
                    model_name: table.name.clone(),
                    model_dir: table.model_dir.clone(),
                    approximate_tokenizer: table.approximate_tokenizer,
                    tokenizer_cache_bytes: self.model.tokenizer_cache_bytes,
                },
                models: Vec::new(),
                workers,
                ..self.clone()
            };
            stack.routing.block_size = table.block_size;
            if let Some(policy) = &table.policy {
                stack.routing.policy = policy.clone();
            }
            stack.replicas.nats_subject_prefix = format!("{}.{subject}", self.replicas.nats_subject_prefix);
            stack
                .tokenizer()
                .map_err(|e| invalid(f("model-dir"), e.to_string()))?;
            stacks.push(stack);
        }
        Ok(stacks)
    }

    /// The `[[worker]]` tables that name no model while there are several: each is added to
    /// the model its `/v1/models` lists.
    pub fn unpinned_workers(&self) -> Vec<WorkerConfig> {
        match self.models.is_empty() {
            true => Vec::new(),
            false => self
                .workers
                .iter()
                .filter(|w| w.model.is_none())
                .cloned()
                .collect(),
        }
    }
}
