//! A chat request as vLLM 0.32 hands it to the chat template: the conversation rebuilt as
//! vLLM rebuilds it, and what else the template is given ([`ChatOptions`]). Both were read from
//! vLLM's source and checked on the engine (`tests/chat_templates.rs`).

use serde_json::{Map, Value};

use crate::chat_template::ChatOptions;

use super::{ApiError, Prompt};

/// What a chat request gives its template besides its messages, as vLLM 0.32 hands it to
/// `apply_chat_template` (`ChatCompletionRequest.build_chat_params`, `online_renderer.py`):
/// `chat_template_kwargs`, overridden by the request's own `add_generation_prompt`,
/// `continue_final_message`, `documents` and `reasoning_effort` (when given); `tools` as their
/// request model writes them back (`ChatCompletionToolsParam.model_dump()`).
pub(super) fn chat_options(obj: &Map<String, Value>) -> Result<ChatOptions, ApiError> {
    let flag = |name: &str| obj.get(name).and_then(Value::as_bool);
    let add_generation_prompt = flag("add_generation_prompt").unwrap_or(true);
    let continue_final_message = flag("continue_final_message").unwrap_or(false);
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::bad_request(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    let mut kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(kwargs)) => kwargs.clone(),
        Some(_) => {
            return Err(ApiError::bad_request(
                "chat_template_kwargs",
                "`chat_template_kwargs` must be an object",
            ));
        }
    };
    // vLLM passes `reasoning_effort` to the template, and as `enable_thinking` (unless the
    // kwargs set it) for templates that wait to be asked.
    if let Some(effort) = obj.get("reasoning_effort").filter(|v| !v.is_null()) {
        if !kwargs.contains_key("enable_thinking") {
            kwargs.insert("enable_thinking".to_owned(), Value::Bool(effort != "none"));
        }
        kwargs.insert("reasoning_effort".to_owned(), effort.clone());
    }
    let documents = match obj.get("documents") {
        None | Some(Value::Null) => kwargs.remove("documents"),
        Some(docs @ Value::Array(_)) => Some(docs.clone()),
        Some(_) => {
            return Err(ApiError::bad_request("documents", "`documents` must be a list"));
        }
    };
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(tools)) => Some(Value::Array(tools.iter().map(tool).collect::<Result<_, _>>()?)),
        Some(_) => return Err(ApiError::bad_request("tools", "`tools` must be a list")),
    };
    Ok(ChatOptions {
        add_generation_prompt,
        continue_final_message,
        tools,
        documents,
        kwargs,
    })
}

/// A tool as vLLM's request model writes it back for the template
/// (`ChatCompletionToolsParam.model_dump()`, checked on vLLM 0.32): `type`, then `function`
/// with `name`, `description` and `parameters` (`null` when left out), then `strict` and
/// `defer_loading` only when given; other keys dropped. A `defer_loading` on the tool is
/// copied into its function when the function has none, and kept on the tool.
fn tool(given: &Value) -> Result<Value, ApiError> {
    let bad = |m: &str| ApiError::bad_request("tools", m.to_owned());
    let function = given
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("each of `tools` must have a `function` object"))?;
    let name = function
        .get("name")
        .filter(|n| n.is_string())
        .ok_or_else(|| bad("each tool's function must have a `name` string"))?;
    let given_or_null = |key: &str| function.get(key).cloned().unwrap_or(Value::Null);
    let outer_defer = given.get("defer_loading").filter(|v| !v.is_null());
    let mut f = Map::new();
    f.insert("name".to_owned(), name.clone());
    f.insert("description".to_owned(), given_or_null("description"));
    f.insert("parameters".to_owned(), given_or_null("parameters"));
    if let Some(strict) = function.get("strict").filter(|v| !v.is_null()) {
        f.insert("strict".to_owned(), strict.clone());
    }
    if let Some(defer) = function
        .get("defer_loading")
        .filter(|v| !v.is_null())
        .or(outer_defer)
    {
        f.insert("defer_loading".to_owned(), defer.clone());
    }
    let mut t = Map::new();
    t.insert("type".to_owned(), Value::from("function"));
    t.insert("function".to_owned(), Value::Object(f));
    if let Some(defer) = outer_defer {
        t.insert("defer_loading".to_owned(), defer.clone());
    }
    Ok(Value::Object(t))
}

/// An assistant message's tool calls as vLLM gives them to the template: each with its keys in
/// the order of OpenAI's request model (`id`, `function`, `type`, then any others, as pydantic
/// validates them), the function's `arguments` before its `name` and parsed from the JSON
/// string OpenAI's clients send (`_postprocess_messages`: not JSON, or not an object, is `{}`).
fn tool_calls(calls: Vec<Value>) -> Result<Value, ApiError> {
    let bad = || {
        ApiError::bad_request(
            "messages",
            "chat completions only support assistant tool_calls of type 'function'.",
        )
    };
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let Value::Object(mut call) = call else {
            return Err(bad());
        };
        if call.get("type").is_some_and(|t| t != "function") {
            return Err(bad());
        }
        let Some(Value::Object(mut function)) = call.remove("function") else {
            return Err(bad());
        };
        let arguments = match function.remove("arguments") {
            Some(Value::Object(a)) => Value::Object(a),
            Some(Value::String(s)) => match serde_json::from_str(&s) {
                Ok(Value::Object(a)) => Value::Object(a),
                _ => Value::Object(Map::new()),
            },
            _ => Value::Object(Map::new()),
        };
        let mut f = Map::new();
        f.insert("arguments".to_owned(), arguments);
        f.extend(function.remove("name").map(|n| ("name".to_owned(), n)));
        f.extend(function);
        let mut c = Map::new();
        c.extend(call.remove("id").map(|id| ("id".to_owned(), id)));
        c.insert("function".to_owned(), Value::Object(f));
        c.extend(call.remove("type").map(|t| ("type".to_owned(), t)));
        c.extend(call);
        out.push(Value::Object(c));
    }
    Ok(Value::Array(out))
}

/// The conversation as vLLM 0.32 gives it to the template (`renderers/chat_utils.py`,
/// `_parse_chat_message_content`; seen through its `/tokenize`): each message rebuilt as `role`,
/// `content` (`null` as `""`, text parts joined by newlines), then an assistant's `tool_calls`
/// ([`tool_calls`]) and `reasoning` (twice, as `reasoning` and `reasoning_content`), a tool's
/// `tool_call_id`, and a string `name` and `task`; other keys are dropped. Values are moved,
/// not copied.
pub(super) fn chat_prompt(messages: Option<Value>, options: ChatOptions) -> Result<Prompt, ApiError> {
    let bad = |m: String| ApiError::bad_request("messages", m);
    let Some(Value::Array(mut messages)) = messages else {
        return Err(bad("`messages` must be a list of messages".to_owned()));
    };
    if messages.is_empty() {
        return Err(bad("`messages` is empty".to_owned()));
    }
    for (i, m) in messages.iter_mut().enumerate() {
        let Value::Object(given) = m else {
            return Err(bad(format!("messages[{i}] is not an object")));
        };
        let mut given = std::mem::take(given);
        let Some(Value::String(role)) = given.remove("role") else {
            return Err(bad(format!("messages[{i}].role must be a string")));
        };
        let content = match given.remove("content") {
            Some(Value::String(text)) => text,
            None | Some(Value::Null) => String::new(),
            Some(Value::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, part) in parts.into_iter().enumerate() {
                    match part {
                        Value::Object(mut p) if p.get("type").and_then(Value::as_str) == Some("text") => {
                            match p.remove("text") {
                                Some(Value::String(t)) => texts.push(t),
                                _ => return Err(bad(format!("messages[{i}].content[{j}] has no text"))),
                            }
                        }
                        _ => {
                            return Err(bad(format!(
                                "messages[{i}].content[{j}]: only text parts are supported"
                            )));
                        }
                    }
                }
                texts.join("\n")
            }
            Some(_) => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or a list of parts"
                )));
            }
        };
        let mut out = Map::new();
        let role_is = |r: &str| role == r;
        let (assistant, tool) = (role_is("assistant"), role_is("tool"));
        out.insert("role".to_owned(), Value::String(role));
        out.insert("content".to_owned(), Value::String(content));
        if assistant {
            match given.remove("tool_calls") {
                None | Some(Value::Null) => {}
                Some(Value::Array(calls)) if calls.is_empty() => {}
                Some(Value::Array(calls)) => {
                    out.insert("tool_calls".to_owned(), tool_calls(calls)?);
                }
                Some(_) => return Err(bad(format!("messages[{i}].tool_calls must be a list"))),
            }
            if let Some(reasoning) = given.remove("reasoning").filter(|r| !r.is_null()) {
                out.insert("reasoning".to_owned(), reasoning.clone());
                out.insert("reasoning_content".to_owned(), reasoning);
            }
        }
        if tool && let Some(id) = given.remove("tool_call_id") {
            out.insert("tool_call_id".to_owned(), id);
        }
        for key in ["name", "task"] {
            if let Some(v @ Value::String(_)) = given.remove(key) {
                out.insert(key.to_owned(), v);
            }
        }
        *m = Value::Object(out);
    }
    Ok(Prompt::Chat {
        messages: Value::Array(messages),
        options: Box::new(options),
    })
}
