//! The layering firewall: core crates stay sans-IO.
//!
//! Core crates take time, input and randomness as arguments and never do IO themselves (see the
//! crate docs of `kvroute-core`). One way that quietly breaks is a dependency that drags in an
//! async runtime, an HTTP stack or a ZMQ binding. This test asks `cargo metadata` for the
//! resolved dependency graph of the workspace and fails, naming the path, if a core crate reaches
//! one of [`FORBIDDEN`] through its normal (non-dev, non-build) dependencies.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// The core crates of the workspace: sans-IO libraries that the live server and the simulator
/// both drive, plus the simulator and the wire codecs, which are sans-IO too (no sockets, no
/// runtime), and the planner.
const CORE_CRATES: &[&str] = &[
    "kvroute-core",
    "kvroute-engine",
    "kvroute-planner",
    "kvroute-sim",
    "kvroute-wire",
];

/// Crates no core crate may depend on, directly or through others.
const FORBIDDEN: &[&str] = &[
    "tokio",
    "hyper",
    "axum",
    "zmq",
    "zeromq",
    "tmq",
    "reqwest",
    "async-std",
];

/// One core crate reaching a forbidden crate, with the chain of package names that gets there.
#[derive(Debug, PartialEq, Eq)]
struct Violation {
    path: Vec<String>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.path.join(" -> "))
    }
}

/// Walks the resolved graph of `metadata` (the JSON of `cargo metadata --format-version 1`)
/// from every workspace member named in `core`, following normal dependencies only, and returns
/// one shortest path to every forbidden package reached. Errors if a crate of `core` is not a
/// workspace member, so that a rename cannot turn the check off silently.
fn violations(metadata: &Value, core: &[&str], forbidden: &[&str]) -> Result<Vec<Violation>, String> {
    let mut names: BTreeMap<&str, &str> = BTreeMap::new();
    for pkg in metadata["packages"]
        .as_array()
        .ok_or("metadata has no `packages`")?
    {
        let id = pkg["id"].as_str().ok_or("package without `id`")?;
        let name = pkg["name"].as_str().ok_or("package without `name`")?;
        names.insert(id, name);
    }
    let mut normal_deps: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let nodes = metadata["resolve"]["nodes"]
        .as_array()
        .ok_or("metadata has no `resolve.nodes`")?;
    for node in nodes {
        let id = node["id"].as_str().ok_or("resolve node without `id`")?;
        let mut deps = Vec::new();
        for dep in node["deps"].as_array().ok_or("resolve node without `deps`")? {
            let pkg = dep["pkg"].as_str().ok_or("dep without `pkg`")?;
            let kinds = dep["dep_kinds"].as_array().ok_or("dep without `dep_kinds`")?;
            // `kind` is null for a normal dependency, "dev" or "build" otherwise.
            if kinds.iter().any(|k| k["kind"].is_null()) {
                deps.push(pkg);
            }
        }
        normal_deps.insert(id, deps);
    }
    let members = metadata["workspace_members"]
        .as_array()
        .ok_or("metadata has no `workspace_members`")?;
    let members: Vec<&str> = members.iter().filter_map(Value::as_str).collect();

    let mut found = Vec::new();
    for &crate_name in core {
        let root = members
            .iter()
            .copied()
            .find(|id| names.get(id) == Some(&crate_name))
            .ok_or_else(|| format!("core crate {crate_name} is not a workspace member"))?;
        // Breadth-first, so each reported path is a shortest one.
        let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
        let mut seen = BTreeSet::from([root]);
        let mut queue = VecDeque::from([root]);
        while let Some(id) = queue.pop_front() {
            let name = names.get(id).copied().unwrap_or(id);
            if forbidden.contains(&name) {
                let mut path = vec![name.to_owned()];
                let mut at = id;
                while let Some(&prev) = came_from.get(at) {
                    path.push(names.get(prev).copied().unwrap_or(prev).to_owned());
                    at = prev;
                }
                path.reverse();
                found.push(Violation { path });
                // Do not walk past a forbidden crate: its own dependencies add nothing useful.
                continue;
            }
            for &dep in normal_deps.get(id).map(Vec::as_slice).unwrap_or_default() {
                if seen.insert(dep) {
                    came_from.insert(dep, id);
                    queue.push_back(dep);
                }
            }
        }
    }
    Ok(found)
}

fn cargo_metadata() -> Value {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let out = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(&manifest)
        .output()
        .unwrap_or_else(|e| panic!("running {cargo:?} metadata: {e}"));
    assert!(
        out.status.success(),
        "cargo metadata failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata printed invalid JSON")
}

#[test]
fn core_crates_reach_no_io_stack() {
    let metadata = cargo_metadata();
    let found = violations(&metadata, CORE_CRATES, FORBIDDEN).unwrap();
    let report: Vec<String> = found.iter().map(ToString::to_string).collect();
    assert!(
        report.is_empty(),
        "core crates must stay sans-IO, but these dependency paths reach a forbidden crate:\n  {}",
        report.join("\n  ")
    );
}

#[test]
fn the_graph_walked_is_the_real_one() {
    // Guards the test above against passing vacuously: the walk must see kvroute-core's actual
    // normal dependencies, and must not count its dev-dependencies.
    let metadata = cargo_metadata();
    let found = violations(&metadata, CORE_CRATES, &["xxhash-rust", "hashbrown", "proptest"]).unwrap();
    let report: BTreeSet<String> = found.iter().map(ToString::to_string).collect();
    assert!(report.contains("kvroute-core -> xxhash-rust"), "{report:?}");
    assert!(report.contains("kvroute-core -> hashbrown"), "{report:?}");
    assert!(
        !report.iter().any(|p| p.contains("proptest")),
        "dev-dependencies were walked: {report:?}"
    );
}

/// A hand-written metadata document: `kvroute-core` depends on `helper`, which depends on
/// `tokio`; `tokio` is also a dev-dependency of `kvroute-core` and a build-dependency of
/// `helper`, which must not matter; `kvroute` (not a core crate) depends on `hyper` directly.
const FAKE_METADATA: &str = r#"{
  "packages": [
    {"id": "core-id", "name": "kvroute-core"},
    {"id": "edge-id", "name": "kvroute"},
    {"id": "helper-id", "name": "helper"},
    {"id": "leaf-id", "name": "leaf"},
    {"id": "tokio-id", "name": "tokio"},
    {"id": "hyper-id", "name": "hyper"}
  ],
  "workspace_members": ["core-id", "edge-id"],
  "resolve": {
    "nodes": [
      {"id": "core-id", "deps": [
        {"name": "helper", "pkg": "helper-id", "dep_kinds": [{"kind": null, "target": null}]},
        {"name": "tokio", "pkg": "tokio-id", "dep_kinds": [{"kind": "dev", "target": null}]}
      ]},
      {"id": "edge-id", "deps": [
        {"name": "kvroute_core", "pkg": "core-id", "dep_kinds": [{"kind": null, "target": null}]},
        {"name": "hyper", "pkg": "hyper-id", "dep_kinds": [{"kind": null, "target": null}]}
      ]},
      {"id": "helper-id", "deps": [
        {"name": "leaf", "pkg": "leaf-id", "dep_kinds": [{"kind": null, "target": null}]},
        {"name": "tokio", "pkg": "tokio-id", "dep_kinds": [{"kind": "build", "target": null}]}
      ]},
      {"id": "leaf-id", "deps": [
        {"name": "tokio", "pkg": "tokio-id", "dep_kinds": [{"kind": null, "target": null}]}
      ]},
      {"id": "tokio-id", "deps": []},
      {"id": "hyper-id", "deps": [
        {"name": "tokio", "pkg": "tokio-id", "dep_kinds": [{"kind": null, "target": null}]}
      ]}
    ]
  }
}"#;

#[test]
fn negative_control_reports_a_transitive_violation() {
    let metadata: Value = serde_json::from_str(FAKE_METADATA).unwrap();
    let found = violations(&metadata, &["kvroute-core"], FORBIDDEN).unwrap();
    let report: Vec<String> = found.iter().map(ToString::to_string).collect();
    // Only the normal-dependency path counts; the dev and build edges to tokio are not walked,
    // and kvroute (an edge crate) may use hyper.
    assert_eq!(report, ["kvroute-core -> helper -> leaf -> tokio"]);
}

#[test]
fn negative_control_without_the_bad_edge_is_clean() {
    let mut metadata: Value = serde_json::from_str(FAKE_METADATA).unwrap();
    // Make leaf's tokio a dev-dependency: nothing forbidden is reachable any more.
    metadata["resolve"]["nodes"][3]["deps"][0]["dep_kinds"][0]["kind"] = Value::from("dev");
    assert_eq!(violations(&metadata, &["kvroute-core"], FORBIDDEN).unwrap(), []);
    // The edge crate is free to reach hyper, but would be flagged if it were core.
    let edge = violations(&metadata, &["kvroute"], FORBIDDEN).unwrap();
    assert_eq!(
        edge,
        [Violation {
            path: vec!["kvroute".into(), "hyper".into()]
        }]
    );
}

#[test]
fn a_missing_core_crate_is_an_error() {
    let metadata: Value = serde_json::from_str(FAKE_METADATA).unwrap();
    let err = violations(&metadata, &["kvroute-engine"], FORBIDDEN).unwrap_err();
    assert!(err.contains("kvroute-engine"), "{err}");
}
