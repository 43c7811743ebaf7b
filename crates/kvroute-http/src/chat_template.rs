//! Chat templates rendered as Hugging Face's `apply_chat_template` renders them
//! (`transformers/utils/chat_template_utils.py`), which is what vLLM calls: the proxy must
//! render a conversation to the very text the engine renders, or no prefix it predicts is one
//! the engine cached.
//!
//! Hugging Face's Jinja2 environment differs from minijinja's defaults in what templates
//! notice (and defines `raise_exception` and `strftime_now`): it trims a block's newline and the spaces before a block (`trim_blocks`,
//! `lstrip_blocks`), its `tojson` is Python's `json.dumps` (`", "` and `": "` between items,
//! non-ASCII kept, `indent`, `separators` and `sort_keys` taken), maps keep their insertion order,
//! and Python's string and dict methods work (`.strip()`, `.startswith()`, `.items()`:
//! minijinja-contrib's `pycompat`). The template is given the request's `tools` and `documents`
//! (`none` when absent, as Hugging Face passes them), its `chat_template_kwargs`, and
//! `continue_final_message` is Hugging Face's: the final message is rendered open, cut where
//! its content ends. Checked against Hugging Face's own rendering of the same conversations
//! (`tests/data/chat-templates`, `tests/chat_templates.rs`).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

/// What a chat request gives its template besides its messages: the arguments vLLM hands
/// `apply_chat_template`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatOptions {
    /// End with the assistant's header, ready for its answer.
    pub add_generation_prompt: bool,
    /// Leave the final message open, to be continued (`continue_final_message`).
    pub continue_final_message: bool,
    /// The request's `tools`, as given.
    pub tools: Option<Json>,
    /// The request's `documents`, as given.
    pub documents: Option<Json>,
    /// The request's `chat_template_kwargs`: more variables for the template.
    pub kwargs: serde_json::Map<String, Json>,
}

/// The marker Hugging Face appends to the final message to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// An environment holding `template` as "chat", set up as Hugging Face's.
pub(crate) fn environment(template: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", |message: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_function("strftime_now", strftime_now);
    env.add_template_owned("chat", template)?;
    Ok(env)
}

/// Renders `messages` (their content flattened to strings) with the environment's template.
pub(crate) fn render(
    env: &Environment<'static>,
    messages: &Json,
    options: &ChatOptions,
    special: &[(&str, &str)],
) -> Result<String, String> {
    let template = env
        .get_template("chat")
        .map_err(|e| format!("chat template: {e}"))?;
    // Only a conversation to be continued is copied (its final message marked).
    let marked;
    let messages = if options.continue_final_message {
        let mut copy = messages.clone();
        let content = copy
            .as_array_mut()
            .and_then(|m| m.last_mut())
            .and_then(|m| m.get_mut("content"))
            .and_then(|c| match c {
                Json::String(s) => Some(s),
                _ => None,
            })
            .ok_or("continue_final_message is set but the final message has no \"content\" to continue!")?;
        content.push_str(CONTINUE_TAG);
        marked = copy;
        &marked
    } else {
        messages
    };
    let mut context: Vec<(String, Value)> = special
        .iter()
        .map(|&(name, token)| (name.to_owned(), Value::from(token)))
        .collect();
    context.extend(
        options
            .kwargs
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v))),
    );
    context.extend([
        ("messages".to_owned(), Value::from_serialize(messages)),
        ("tools".to_owned(), Value::from_serialize(&options.tools)),
        ("documents".to_owned(), Value::from_serialize(&options.documents)),
        (
            "add_generation_prompt".to_owned(),
            Value::from(options.add_generation_prompt),
        ),
    ]);
    let context: Value = context.into_iter().collect();
    let rendered = template
        .render(context)
        .map_err(|e| format!("rendering the chat template: {e}"))?;
    if !options.continue_final_message {
        return Ok(rendered);
    }
    // Hugging Face: cut at the last marker, and where the template trimmed the space after the
    // content, at the content's trimmed end.
    let Some(at) = rendered.rfind(CONTINUE_TAG.trim()) else {
        return Err(
            "continue_final_message is set but the final message does not appear in the chat after \
             applying the chat template"
                .to_owned(),
        );
    };
    Ok(if rendered[at..].starts_with(CONTINUE_TAG) {
        rendered[..at].to_owned()
    } else {
        rendered[..at].trim_end().to_owned()
    })
}

/// Hugging Face's `strftime_now(format)`: `datetime.now().strftime(format)`, the local time in
/// Python's (C's) `strftime` codes. Llama 3.x templates write today's date into the system
/// header with it; an engine and a proxy whose clocks agree render the same text.
fn strftime_now(format: String) -> Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} is not a strftime format"),
        )
    })?;
    Ok(out)
}

/// Hugging Face's `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, the keyword arguments taken.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => " ".repeat(
                usize::try_from(v.clone())
                    .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("tojson: indent {v}")))?,
            ),
        }),
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let dumps = Dumps {
        indent,
        item,
        key,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dumps.write(&value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` settings.
struct Dumps {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl Dumps {
    fn write(&self, value: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => match (i128::try_from(value.clone()), f64::try_from(value.clone())) {
                (Ok(n), _) => out.push_str(&n.to_string()),
                (_, Ok(x)) => out.push_str(&python_float(x)),
                _ => out.push_str(&value.to_string()),
            },
            ValueKind::String => self.string(value.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container(('[', ']'), items.len(), depth, out, |i, out| {
                    self.write(&items[i], depth + 1, out)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.container(('{', '}'), keys.len(), depth, out, |i, out| {
                    let key = &keys[i];
                    match key.as_str() {
                        Some(s) => self.string(s, out),
                        None => self.string(&key.to_string(), out),
                    }
                    out.push_str(&self.key);
                    self.write(&value.get_item(key)?, depth + 1, out)
                })?;
            }
            _ => self.string(&value.to_string(), out),
        }
        Ok(())
    }

    /// A list or a map of `len` items written by `item`, between `brackets`.
    fn container(
        &self,
        brackets: (char, char),
        len: usize,
        depth: usize,
        out: &mut String,
        mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(brackets.0);
        if len == 0 {
            out.push(brackets.1);
            return Ok(());
        }
        let newline = |out: &mut String, depth: usize| {
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(depth));
            }
        };
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item);
            }
            newline(out, depth + 1);
            item(i, out)?;
        }
        newline(out, depth);
        out.push(brackets.1);
        Ok(())
    }

    /// A JSON string as Python writes it: `"`, `\` and control characters escaped, and with
    /// `ensure_ascii` every non-ASCII character as `\uXXXX` (surrogate pairs past the BMP).
    fn string(&self, s: &str, out: &mut String) {
        let escaped = serde_json::to_string(s).unwrap_or_default();
        if !self.ensure_ascii {
            out.push_str(&escaped);
            return;
        }
        for c in escaped.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
}

/// A float as Python's `repr` writes it: a whole number keeps `.0`; exponents from `1e16` up
/// and below `1e-4`, with a sign and at least two digits.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_owned();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let magnitude = x.abs();
    if x != 0.0 && !(1e-4..1e16).contains(&magnitude) {
        let s = format!("{x:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let s = format!("{x}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps(template: &str, value: Json) -> String {
        let env = environment(template.to_owned()).unwrap();
        env.get_template("chat")
            .unwrap()
            .render(minijinja::context! { x => Value::from_serialize(&value) })
            .unwrap()
    }

    /// Today's date as Python writes it (`datetime.now().strftime("%d %b %Y")`, the Llama 3.x
    /// template's call), and an unknown code refused rather than written.
    #[test]
    fn strftime_now_writes_todays_date() {
        let env = environment("{{ strftime_now('%d %b %Y') }}".to_owned()).unwrap();
        let got = env.get_template("chat").unwrap().render(()).unwrap();
        assert_eq!(got, chrono::Local::now().format("%d %b %Y").to_string());
        assert_eq!(got.len(), 11, "{got}");
        let env = environment("{{ strftime_now('%Q') }}".to_owned()).unwrap();
        assert!(env.get_template("chat").unwrap().render(()).is_err());
    }

    /// Python's `json.dumps` on the same values (`python3 -c 'import json; ...'`).
    #[test]
    fn tojson_writes_what_python_writes() {
        let value = serde_json::json!({"b": [1, 2.5, null, true], "a": "é\"\n", "c": {}, "d": []});
        assert_eq!(
            dumps("{{ x | tojson }}", value.clone()),
            r#"{"b": [1, 2.5, null, true], "a": "é\"\n", "c": {}, "d": []}"#
        );
        assert_eq!(
            dumps("{{ x | tojson(indent=2) }}", value.clone()),
            "{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": \"é\\\"\\n\",\n  \"c\": {},\n  \"d\": []\n}"
        );
        assert_eq!(
            dumps(
                "{{ x | tojson(sort_keys=true, separators=(',', ':')) }}",
                value.clone()
            ),
            r#"{"a":"é\"\n","b":[1,2.5,null,true],"c":{},"d":[]}"#
        );
        assert_eq!(
            dumps("{{ x | tojson(ensure_ascii=true) }}", serde_json::json!("é😀<")),
            r#""\u00e9\ud83d\ude00<""#
        );
        for (x, python) in [
            (1.0, "1.0"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (-2.0, "-2.0"),
        ] {
            assert_eq!(python_float(x), python, "{x}");
        }
    }
}
