//! Layered options: a TOML file (`--config FILE`) first, then the flags over it.
//!
//! A command's options are one struct that derives clap's `Args` and serde's `Serialize` and
//! `Deserialize`, with `Option` fields, kebab-case keys (the long flag names) and unknown keys
//! denied. [`layered`] reads the file into that struct (so a bad key or value is named with its
//! line), turns file and flags into TOML tables (an absent option has no key), lays the flags'
//! keys over the file's, and reads the result back: the flags win, key by key.

use std::path::Path;

use anyhow::Context;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The options of `file` (if any) with the options set in `flags` over them.
pub fn layered<T: Serialize + DeserializeOwned>(file: Option<&Path>, flags: &T) -> anyhow::Result<T> {
    let mut table = match file {
        None => toml::Table::new(),
        Some(path) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let options: T = parse(&text).with_context(|| format!("--config {}", path.display()))?;
            to_table(&options)?
        }
    };
    table.extend(to_table(flags)?);
    Ok(toml::Value::Table(table).try_into()?)
}

/// `text` as a `T`, or a one-line error naming the line and key.
pub fn parse<T: DeserializeOwned>(text: &str) -> anyhow::Result<T> {
    let at = |e: &toml::de::Error| {
        let line = e.span().map_or(0, |s| text[..s.start].matches('\n').count() + 1);
        format!("line {line}")
    };
    let de = toml::Deserializer::parse(text).map_err(|e| anyhow::anyhow!("{}: {}", at(&e), e.message()))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let key = e.path().to_string();
        let inner = e.into_inner();
        match key.as_str() {
            // An unknown key's message names it; the path is its table.
            "." => anyhow::anyhow!("{}: {}", at(&inner), inner.message()),
            _ => anyhow::anyhow!("{}: key `{key}`: {}", at(&inner), inner.message()),
        }
    })
}

/// `value`'s set options as a TOML table (an option that is `None` has no key).
pub fn to_table<T: Serialize>(value: &T) -> anyhow::Result<toml::Table> {
    match toml::Value::try_from(value).context("the options as TOML")? {
        toml::Value::Table(t) => Ok(t),
        other => anyhow::bail!("the options are a {}, not a table", other.type_str()),
    }
}

/// A flag's value: a whole number of at least 1.
pub fn count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A flag's value: a finite number above 0.
pub fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a positive number")),
        Err(e) => Err(e.to_string()),
    }
}
