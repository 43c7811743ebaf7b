//! The model's text side: its tokenizer (`tokenizer.json`) and chat template
//! (`tokenizer_config.json`), read from a local directory, or the built-in tiny model.
//!
//! The proxy and the mock workers tokenize with the same [`Model`], so a prompt's blocks hash the
//! same on both sides and cached prefixes match.
//!
//! **Special tokens.** [`Model::encode`] adds what `tokenizer.json`'s post-processor adds (a
//! BOS, for Llama-style models) when asked for [`SpecialTokens::Add`], as Hugging Face's
//! `encode(text, add_special_tokens=True)` does; that is what vLLM calls for a text completion
//! (its `add_special_tokens` defaults to true there, false for chat). `tokenizer_config.json`'s
//! `add_bos_token` and `add_eos_token` are NOT applied: the fast tokenizer of the generic class
//! (`PreTrainedTokenizerFast`) ignores them as we do, and a real vLLM 0.32 run added BOS with
//! `"add_bos_token": false` in the config; but some classes (`LlamaTokenizerFast`) rewrite their
//! post-processor from them. When the config's settings disagree with the post-processor,
//! loading logs a warning and [`Model::warnings`] names it; the proxy's check against each
//! worker's `/tokenize` then tells which rule the engine follows, and completions carry the
//! proxy's token ids to the engine, so routing and engine see the same tokens either way.

use std::path::Path;

use minijinja::Environment;
use serde_json::Value as Json;
use tokenizers::pipeline::{EncodeOptions, Override, PipelineToken, PipelineTokenizer};
use tokenizers::{TruncationDirection, TruncationParams, TruncationStrategy};

use crate::chat_template::{self, ChatOptions};
use crate::prefix_cache::{AddedToken, Boundaries, ChatCache, Encoded, Lookup, TextCuts, Turn, whole_answer};

/// The built-in tiny model's `tokenizer.json`: a byte-level BPE without merges (one token per
/// byte) and three special tokens. Made by `tests/data/tiny-model/gen.py`.
pub const TINY_TOKENIZER_JSON: &str = include_str!("../tests/data/tiny-model/tokenizer.json");
/// The built-in tiny model's `tokenizer_config.json`, with a ChatML chat template.
pub const TINY_TOKENIZER_CONFIG_JSON: &str = include_str!("../tests/data/tiny-model/tokenizer_config.json");

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// `tokenizer.json` did not load.
    #[error("tokenizer.json: {0}")]
    Tokenizer(String),
    /// `tokenizer_config.json` is not JSON, or its chat template is not a string or a list of
    /// named templates.
    #[error("tokenizer_config.json: {0}")]
    Config(String),
    /// The chat template does not compile.
    #[error("chat template: {0}")]
    Template(String),
}

/// Why a prompt could not be turned into tokens. The message is meant for the client.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PromptError(pub String);

/// Whether encoding adds the special tokens of the tokenizer's post-processor (vLLM's
/// `add_special_tokens`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecialTokens {
    /// Add them (a BOS, for Llama-style tokenizers).
    Add,
    /// Add none: the text's own tokens only.
    Omit,
}

impl SpecialTokens {
    /// From a request's `add_special_tokens`.
    pub fn from_flag(add: bool) -> Self {
        if add { Self::Add } else { Self::Omit }
    }
}

/// A model's tokenizer and chat template.
pub struct Model {
    tokenizer: PipelineTokenizer,
    /// Special tokens added, and none of the file's truncation or padding: the router hashes
    /// the prompt the engine will see.
    add: EncodeOptions,
    /// As `add`, with no special tokens added.
    omit: EncodeOptions,
    vocab_size: u32,
    /// The longest token's text in characters, over the whole vocabulary (added tokens too).
    max_chars_per_token: usize,
    chat: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
    warnings: Vec<String>,
    /// `tokenizer.json`'s added tokens.
    added: Vec<AddedToken>,
    /// The added tokens a chat prompt may be cut before, and where text may be cut
    /// ([`crate::prefix_cache`]).
    boundaries: Boundaries,
    /// Where text between special tokens may be cut ([`TextCuts`]).
    text_cuts: TextCuts,
    /// Chat prompts' tokens by rendered prefix; off until [`ChatCache::set_limit`].
    chat_cache: ChatCache,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("vocab_size", &self.vocab_size)
            .field("chat_template", &self.chat.is_some())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// The built-in tiny model (embedded, so it works on a fresh clone).
    pub fn tiny() -> Result<Self, ModelError> {
        Self::from_json(TINY_TOKENIZER_JSON, Some(TINY_TOKENIZER_CONFIG_JSON))
    }

    /// Loads `dir/tokenizer.json` and, if present, `dir/tokenizer_config.json`.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
                path: path.display().to_string(),
                source,
            })
        };
        let tokenizer = read("tokenizer.json")?;
        let config = if dir.join("tokenizer_config.json").exists() {
            Some(read("tokenizer_config.json")?)
        } else {
            None
        };
        Self::from_json(&tokenizer, config.as_deref())
    }

    /// A model from the texts of `tokenizer.json` and `tokenizer_config.json`.
    ///
    /// `tokenizer.json` may be in any format version the `tokenizers` library has written: it is
    /// brought to the current one first.
    pub fn from_json(tokenizer_json: &str, config_json: Option<&str>) -> Result<Self, ModelError> {
        let mut value: Json =
            serde_json::from_str(tokenizer_json).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let vocab_size = vocab_size(&value);
        let max_chars_per_token = max_chars_per_token(&value);
        let added = added_tokens(&value);
        tokenizers::canonicalize_value(&mut value).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let text_cuts = TextCuts::for_tokenizer(&value, &added);
        let tokenizer =
            tokenizers::from_json(&value.to_string()).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let omit = EncodeOptions {
            add_special_tokens: false,
            encode_special_tokens: false,
            padding: Override::Off,
            truncation: Override::Off,
        };
        let mut model = Self {
            tokenizer,
            add: EncodeOptions {
                add_special_tokens: true,
                ..omit.clone()
            },
            omit,
            vocab_size,
            max_chars_per_token,
            chat: None,
            bos_token: String::new(),
            eos_token: String::new(),
            warnings: Vec::new(),
            added,
            boundaries: Boundaries::default(),
            text_cuts,
            chat_cache: ChatCache::default(),
        };
        let Some(config_json) = config_json else {
            return Ok(model);
        };
        let config: Json =
            serde_json::from_str(config_json).map_err(|e| ModelError::Config(e.to_string()))?;
        model.bos_token = special_token(&config["bos_token"]);
        model.eos_token = special_token(&config["eos_token"]);
        model.warnings = model.config_disagreements(&config);
        for warning in &model.warnings {
            tracing::warn!("{warning}");
        }
        let template = match &config["chat_template"] {
            Json::Null => None,
            Json::String(s) => Some(s.clone()),
            Json::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .or_else(|| list.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_owned),
            other => return Err(ModelError::Config(format!("chat_template is {other}"))),
        };
        if let Some(template) = template {
            let env =
                chat_template::environment(template).map_err(|e| ModelError::Template(e.to_string()))?;
            model.chat = Some(env);
            model.boundaries = Boundaries::new(&model.added, model.probe_render().as_deref())
                .with_text_cuts(model.text_cuts);
        }
        Ok(model)
    }

    /// The chat template rendered on a few probe conversations (those it accepts), to learn
    /// which added tokens it writes.
    fn probe_render(&self) -> Option<String> {
        let m = |role: &str| serde_json::json!({"role": role, "content": "x"});
        let probes = [
            serde_json::json!([m("system"), m("user"), m("assistant"), m("user")]),
            serde_json::json!([m("user"), m("assistant"), m("user")]),
        ];
        let rendered: Vec<String> = probes
            .iter()
            .filter_map(|messages| self.render_chat(messages, true).ok())
            .collect();
        (!rendered.is_empty()).then(|| rendered.concat())
    }

    /// The conversation cache of chat prompts' tokens (off until given a limit).
    pub fn chat_cache(&self) -> &ChatCache {
        &self.chat_cache
    }

    /// The added tokens at which a rendered chat prompt may be cut.
    pub fn chat_boundaries(&self) -> &Boundaries {
        &self.boundaries
    }

    /// Where text between special tokens may be cut and tokenized apart, exactly.
    pub fn text_cuts(&self) -> TextCuts {
        self.text_cuts
    }

    /// The token ids of a rendered chat prompt, as [`Model::encode`] gives them, through the
    /// conversation cache when it is on (and no special tokens are to be added); past `limit`
    /// tokens it may stop early with [`Encoded::TooLong`].
    pub fn encode_chat(
        &self,
        text: &str,
        special: SpecialTokens,
        limit: usize,
    ) -> Result<(Encoded, Lookup), PromptError> {
        self.encode_chat_turn(text, special, limit)
            .map(|(encoded, lookup, _)| (encoded, lookup))
    }

    /// [`Model::encode_chat`], with the prompt's place in the conversation cache when its
    /// tokens went through it ([`ChatCache::encode_turn`]), where the prompt's block hashes may
    /// be kept for its follow-ups.
    pub fn encode_chat_turn(
        &self,
        text: &str,
        special: SpecialTokens,
        limit: usize,
    ) -> Result<(Encoded, Lookup, Option<Turn>), PromptError> {
        match special {
            SpecialTokens::Omit => self.chat_cache.encode_turn(&self.boundaries, text, limit, |t| {
                self.encode(t, SpecialTokens::Omit)
            }),
            SpecialTokens::Add => {
                let (encoded, lookup) = whole_answer(self.encode(text, special)?, text, limit);
                Ok((encoded, lookup, None))
            }
        }
    }

    /// The token ids of `text`: special tokens written in the text are recognized; those of
    /// the post-processor (a BOS) are added around it if `special` says so.
    pub fn encode(&self, text: &str, special: SpecialTokens) -> Result<Vec<u32>, PromptError> {
        let options = match special {
            SpecialTokens::Add => &self.add,
            SpecialTokens::Omit => &self.omit,
        };
        let mut tokens = Vec::with_capacity(text.len() / 3 + 1);
        self.tokenizer
            .encode_into(text, options, &mut tokens)
            .map_err(|e| PromptError(format!("tokenizing the prompt: {e}")))?;
        Ok(tokens.into_iter().map(PipelineToken::id).collect())
    }

    /// The token ids of `text` cut to its last `max_length` tokens by the tokenizer's own
    /// truncation, as Hugging Face's `encode(text, truncation=True, max_length=…)` does with a
    /// left truncation side: the text's tokens are cut first and the post-processor's added
    /// after (a BOS stays first), its room taken from `max_length`.
    pub fn encode_truncated(
        &self,
        text: &str,
        special: SpecialTokens,
        max_length: usize,
    ) -> Result<Vec<u32>, PromptError> {
        let options = EncodeOptions {
            truncation: Override::With(TruncationParams {
                direction: TruncationDirection::Left,
                max_length,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
            }),
            ..match special {
                SpecialTokens::Add => self.add.clone(),
                SpecialTokens::Omit => self.omit.clone(),
            }
        };
        let mut tokens = Vec::with_capacity(max_length.min(text.len()) + 2);
        self.tokenizer
            .encode_into(text, &options, &mut tokens)
            .map_err(|e| PromptError(format!("tokenizing the prompt: {e}")))?;
        Ok(tokens.into_iter().map(PipelineToken::id).collect())
    }

    /// What loading found questionable: `tokenizer_config.json`'s `add_bos_token` or
    /// `add_eos_token` disagreeing with what `tokenizer.json`'s post-processor adds (which is
    /// what this model follows; see the module's documentation).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The disagreements [`Model::warnings`] lists.
    fn config_disagreements(&self, config: &Json) -> Vec<String> {
        let probe = "a";
        let (Ok(with), Ok(without)) = (
            self.encode(probe, SpecialTokens::Add),
            self.encode(probe, SpecialTokens::Omit),
        ) else {
            return Vec::new();
        };
        let added = |token: &str, at_start: bool| {
            let id = self.tokenizer.get_added_vocabulary().token_to_id(token);
            let extra = with.len() > without.len();
            let edge = if at_start { with.first() } else { with.last() };
            id.is_some() && extra && edge.copied() == id
        };
        let class = config["tokenizer_class"].as_str().unwrap_or("unnamed");
        let mut out = Vec::new();
        for (key, token, at_start) in [
            ("add_bos_token", &self.bos_token, true),
            ("add_eos_token", &self.eos_token, false),
        ] {
            let Some(setting) = config[key].as_bool() else {
                continue;
            };
            let adds = added(token, at_start);
            if setting != adds {
                out.push(format!(
                    "tokenizer_config.json says {key}: {setting} but tokenizer.json's post-processor {} \
                     {token:?}; kvroute follows tokenizer.json (as the generic fast tokenizer does); \
                     a {class} engine may follow the config: check the workers' /tokenize",
                    if adds { "adds" } else { "does not add" },
                ));
            }
        }
        out
    }

    /// Renders `messages` (OpenAI chat messages, content already flattened to strings) with the
    /// chat template, nothing given but `add_generation_prompt`.
    pub fn render_chat(&self, messages: &Json, add_generation_prompt: bool) -> Result<String, PromptError> {
        self.render_chat_with(
            messages,
            &ChatOptions {
                add_generation_prompt,
                ..ChatOptions::default()
            },
        )
    }

    /// Renders `messages` with the chat template as Hugging Face's `apply_chat_template` does,
    /// with the request's `options` (see the [`crate::chat_template`] module).
    pub fn render_chat_with(&self, messages: &Json, options: &ChatOptions) -> Result<String, PromptError> {
        let env = self
            .chat
            .as_ref()
            .ok_or_else(|| PromptError("the model has no chat template".to_owned()))?;
        let special = [
            ("bos_token", self.bos_token.as_str()),
            ("eos_token", self.eos_token.as_str()),
        ];
        chat_template::render(env, messages, options, &special).map_err(PromptError)
    }

    /// The text of `ids`, special tokens skipped (empty if they do not decode).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// The most characters one token's text has (vLLM's `max_chars_per_token`): a text of
    /// more than `n` times this many characters cannot fit in `n` tokens.
    pub fn max_chars_per_token(&self) -> usize {
        self.max_chars_per_token
    }

    /// One more than the highest token id, special tokens included.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// The id of the end-of-sequence token, if the model names one and it is an added token.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.tokenizer.get_added_vocabulary().token_to_id(&self.eos_token)
    }
}

/// One more than the highest id in `tokenizer.json`'s model vocabulary (a map of token to id, or
/// a Unigram list) and its added tokens.
/// The entries of `tokenizer.json`'s `added_tokens` (none if it has no such list).
fn added_entries(tokenizer: &Json) -> impl Iterator<Item = &Json> {
    tokenizer["added_tokens"].as_array().into_iter().flatten()
}

fn vocab_size(tokenizer: &Json) -> u32 {
    let model = match &tokenizer["model"]["vocab"] {
        Json::Object(vocab) => vocab.values().filter_map(Json::as_u64).max().map(|max| max + 1),
        Json::Array(list) => u64::try_from(list.len()).ok(),
        _ => None,
    };
    let added = added_entries(tokenizer)
        .filter_map(|token| token["id"].as_u64())
        .max()
        .map(|max| max + 1);
    u32::try_from(model.max(added).unwrap_or(0)).unwrap_or(u32::MAX)
}

/// The longest token's text in characters, as vLLM's `get_cached_tokenizer`
/// (`vllm/tokenizers/hf.py`) takes it: over `get_vocab()`, the model's vocabulary and the added
/// tokens, counted in Python characters (Unicode scalar values). At least 1.
fn max_chars_per_token(tokenizer: &Json) -> usize {
    let chars = |token: &str| token.chars().count();
    let model = match &tokenizer["model"]["vocab"] {
        Json::Object(vocab) => vocab.keys().map(|t| chars(t)).max(),
        // Unigram: `[token, score]` pairs.
        Json::Array(list) => list.iter().filter_map(|e| e[0].as_str()).map(chars).max(),
        _ => None,
    };
    let added = added_entries(tokenizer)
        .filter_map(|token| token["content"].as_str())
        .map(chars)
        .max();
    model.max(added).unwrap_or(0).max(1)
}

/// `tokenizer.json`'s added tokens. A flag it does not give counts as set (which keeps the token
/// from being a cut point).
fn added_tokens(tokenizer: &Json) -> Vec<AddedToken> {
    added_entries(tokenizer)
        .filter_map(|t| {
            let flag = |name: &str| t[name].as_bool().unwrap_or(true);
            Some(AddedToken {
                content: t["content"].as_str()?.to_owned(),
                id: u32::try_from(t["id"].as_u64()?).ok()?,
                normalized: flag("normalized"),
                lstrip: flag("lstrip"),
                rstrip: flag("rstrip"),
                single_word: flag("single_word"),
            })
        })
        .collect()
}

/// A special token as `tokenizer_config.json` gives it: a string or `{"content": ...}`.
fn special_token(value: &Json) -> String {
    match value {
        Json::String(s) => s.clone(),
        Json::Object(o) => o
            .get("content")
            .and_then(Json::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_model_tokenizes_bytes_and_renders_chat() {
        let model = Model::tiny().unwrap();
        let omit = SpecialTokens::Omit;
        assert_eq!(
            model.encode("ab", omit).unwrap(),
            vec![u32::from(b'a'), u32::from(b'b')]
        );
        assert_eq!(
            model.encode("ab", SpecialTokens::Add).unwrap(),
            vec![u32::from(b'a'), u32::from(b'b')],
            "no post-processor: nothing to add"
        );
        assert_eq!(model.encode("é", omit).unwrap().len(), 2);
        let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
        let text = model.render_chat(&messages, true).unwrap();
        assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        let ids = model.encode(&text, omit).unwrap();
        assert_eq!(ids[0], 257, "special tokens are recognized in the text");
        assert_eq!(model.decode(&[u32::from(b'h'), u32::from(b'i')]), "hi");
        assert_eq!(model.eos_token_id(), Some(258));
        assert_eq!(model.vocab_size(), 259);
        assert!(model.warnings().is_empty());
    }
}
