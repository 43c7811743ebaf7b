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
    "kvroute-prefetch",
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

/// Every workspace crate, with the workspace crates it may depend on (normal dependencies). The
/// layers run one way: core crates, then the simulator and the planner, then the services (the
/// proxy and the mock, which share only `kvroute-http` and meet through wire formats), then the
/// CLI. A new crate or a new edge between workspace crates must be added here, deliberately.
const ALLOWED_EDGES: &[(&str, &[&str])] = &[
    ("kvroute-prefetch", &[]),
    ("kvroute-core", &["kvroute-prefetch"]),
    ("kvroute-engine", &["kvroute-core"]),
    ("kvroute-planner", &["kvroute-core"]),
    ("kvroute-wire", &["kvroute-core"]),
    (
        "kvroute-sim",
        &["kvroute-core", "kvroute-engine", "kvroute-planner"],
    ),
    ("kvroute-zmq", &["kvroute-core", "kvroute-wire"]),
    ("kvroute-http", &["kvroute-core"]),
    ("kvroute-testkit", &[]),
    ("kvroute-sync", &["kvroute-core"]),
    (
        "kvroute-proxy",
        &[
            "kvroute-core",
            "kvroute-http",
            "kvroute-planner",
            "kvroute-sync",
            "kvroute-wire",
            "kvroute-zmq",
        ],
    ),
    (
        "kvroute-mock",
        &[
            "kvroute-core",
            "kvroute-engine",
            "kvroute-http",
            "kvroute-wire",
            "kvroute-zmq",
        ],
    ),
    (
        "kvroute",
        &[
            "kvroute-core",
            "kvroute-engine",
            "kvroute-http",
            "kvroute-mock",
            "kvroute-planner",
            "kvroute-proxy",
            "kvroute-sim",
            "kvroute-sync",
            "kvroute-wire",
        ],
    ),
];

/// Crate pairs that must not reach each other, not even in tests: through the first crate's
/// dependencies of any kind (dev-dependencies included) and their normal dependencies, what
/// `cargo tree` and a test build of the first crate contain. The proxy knows engines only
/// through their wire formats.
const NEVER_REACHES: &[(&str, &str)] = &[
    ("kvroute-proxy", "kvroute-mock"),
    ("kvroute-proxy", "kvroute-engine"),
    ("kvroute-proxy", "kvroute-sim"),
    ("kvroute-mock", "kvroute-proxy"),
];

/// The edges between workspace members, as `(from, to, kind)` with kind `None` for a normal
/// dependency and `Some("dev")` or `Some("build")` otherwise.
fn member_edges(metadata: &Value) -> Vec<(String, String, Option<String>)> {
    let names: BTreeMap<&str, &str> = metadata["packages"]
        .as_array()
        .expect("metadata has packages")
        .iter()
        .map(|p| (p["id"].as_str().expect("id"), p["name"].as_str().expect("name")))
        .collect();
    let members: BTreeSet<&str> = metadata["workspace_members"]
        .as_array()
        .expect("metadata has workspace_members")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let mut edges = Vec::new();
    for node in metadata["resolve"]["nodes"].as_array().expect("resolve nodes") {
        let from = node["id"].as_str().expect("node id");
        if !members.contains(from) {
            continue;
        }
        for dep in node["deps"].as_array().expect("deps") {
            let to = dep["pkg"].as_str().expect("pkg");
            if !members.contains(to) {
                continue;
            }
            for kind in dep["dep_kinds"].as_array().expect("dep_kinds") {
                edges.push((
                    names[from].to_owned(),
                    names[to].to_owned(),
                    kind["kind"].as_str().map(str::to_owned),
                ));
            }
        }
    }
    edges
}

/// The normal edges between workspace crates that [`ALLOWED_EDGES`] does not allow, and the
/// members it has no row for.
fn edge_violations(edges: &[(String, String, Option<String>)], members: &[String]) -> Vec<String> {
    let table: BTreeMap<&str, &[&str]> = ALLOWED_EDGES.iter().copied().collect();
    let mut bad: Vec<String> = members
        .iter()
        .filter(|m| !table.contains_key(m.as_str()))
        .map(|m| format!("{m} has no row in ALLOWED_EDGES"))
        .collect();
    for (from, to, kind) in edges {
        if kind.is_none()
            && !table
                .get(from.as_str())
                .is_some_and(|allowed| allowed.contains(&to.as_str()))
        {
            bad.push(format!("{from} -> {to}"));
        }
    }
    bad
}

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

// A test of the build, not core code: it runs the cargo that runs it.
#[allow(clippy::disallowed_methods)]
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
fn workspace_edges_follow_the_layers() {
    let metadata = cargo_metadata();
    let edges = member_edges(&metadata);
    let members: Vec<String> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| {
            metadata["workspace_members"]
                .as_array()
                .unwrap()
                .contains(&p["id"])
        })
        .map(|p| p["name"].as_str().unwrap().to_owned())
        .collect();
    // Not vacuous: the real graph has the edges the layers are made of.
    assert!(
        edges
            .iter()
            .any(|(f, t, k)| f == "kvroute-sim" && t == "kvroute-engine" && k.is_none())
    );
    assert!(
        edges
            .iter()
            .any(|(f, t, k)| f == "kvroute-proxy" && t == "kvroute-http" && k.is_none())
    );
    let bad = edge_violations(&edges, &members);
    assert!(
        bad.is_empty(),
        "workspace edges outside ALLOWED_EDGES:\n  {}",
        bad.join("\n  ")
    );
}

#[test]
fn an_edge_outside_the_table_is_reported() {
    let members = vec![
        "kvroute-proxy".to_owned(),
        "kvroute-engine".to_owned(),
        "kvroute-new".to_owned(),
    ];
    let edges = vec![
        ("kvroute-proxy".to_owned(), "kvroute-engine".to_owned(), None),
        // A dev-dependency edge is not a layering edge.
        (
            "kvroute-engine".to_owned(),
            "kvroute-proxy".to_owned(),
            Some("dev".to_owned()),
        ),
    ];
    assert_eq!(
        edge_violations(&edges, &members),
        [
            "kvroute-new has no row in ALLOWED_EDGES",
            "kvroute-proxy -> kvroute-engine"
        ]
    );
}

#[test]
fn the_proxy_never_reaches_the_engine_or_the_mock() {
    let metadata = cargo_metadata();
    let edges = member_edges(&metadata);
    for &(from, to) in NEVER_REACHES {
        // Breadth-first: any kind of edge from the crate itself, normal edges after that.
        let mut seen = BTreeSet::from([from.to_owned()]);
        let mut queue = VecDeque::from([from.to_owned()]);
        while let Some(at) = queue.pop_front() {
            assert_ne!(at, to, "{from} reaches {to}");
            for (f, t, kind) in &edges {
                if *f == at && (at == from || kind.is_none()) && seen.insert(t.clone()) {
                    queue.push_back(t.clone());
                }
            }
        }
    }
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
