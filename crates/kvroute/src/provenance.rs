//! Where a report came from: the kvroute version and commit, the resolved configuration, the
//! seed, and the trace's name and SHA-256, written beside the report so that a JSON file says
//! how to make it again.

use std::collections::BTreeMap;
use std::path::Path;

use kvroute_sim::Report;
use serde::Serialize;
use serde::ser::SerializeMap;
use sha2::{Digest, Sha256};

/// What made a report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Provenance {
    /// The kvroute version (`CARGO_PKG_VERSION`).
    pub kvroute_version: &'static str,
    /// The commit the binary was built from, when the build could ask git.
    pub git_commit: Option<&'static str>,
    /// The configuration after the file and the flags were merged (unset options: null, their
    /// default).
    pub config: serde_json::Value,
    /// The seed of the router and the simulator.
    pub seed: u64,
    /// The trace; null for a generated workload.
    pub trace: Option<TraceFile>,
    /// For each policy run, by its spec as given: the `kvroute serve` flags of the same router
    /// (`kvroute_core::router::RouterSpec`). Absent when empty.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub serve_flags: BTreeMap<String, String>,
}

/// A trace: its name and the SHA-256 of its bytes (as stored, gzip'd or not).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceFile {
    /// The path given, or `built-in:` and the embedded file's name.
    pub name: String,
    /// Lowercase hex.
    pub sha256: String,
}

impl TraceFile {
    /// The file at `path`, whose contents are `bytes`.
    pub fn new(path: &Path, bytes: &[u8]) -> Self {
        Self {
            name: path.display().to_string(),
            sha256: sha256_hex(bytes),
        }
    }

    /// The built-in example trace.
    pub fn builtin() -> Self {
        Self {
            name: "built-in:mooncake_conversation_2000.jsonl.gz".to_owned(),
            sha256: sha256_hex(kvroute_sim::EXAMPLE_MOONCAKE_GZ),
        }
    }
}

impl Provenance {
    /// The provenance of a run of `config` with `seed` on `trace`.
    pub fn new(config: &impl Serialize, seed: u64, trace: Option<&TraceFile>) -> anyhow::Result<Self> {
        Ok(Self {
            kvroute_version: env!("CARGO_PKG_VERSION"),
            git_commit: option_env!("KVROUTE_GIT_COMMIT"),
            config: serde_json::to_value(config)?,
            seed,
            trace: trace.cloned(),
            serve_flags: BTreeMap::new(),
        })
    }
}

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A report file: one report's keys (several reports: each under its name), then `provenance`.
pub struct ReportFile<'a> {
    /// The reports, by policy name.
    pub reports: &'a [(&'a str, &'a Report)],
    /// What made them.
    pub provenance: &'a Provenance,
}

impl Serialize for ReportFile<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        if let [(_, only)] = self.reports {
            for (k, v) in only.entries() {
                map.serialize_entry(k, v)?;
            }
        } else {
            for (name, report) in self.reports {
                map.serialize_entry(name, report)?;
            }
        }
        map.serialize_entry("provenance", self.provenance)?;
        map.end()
    }
}
