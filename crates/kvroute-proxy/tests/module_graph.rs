//! The crate's modules form layers: read from its own sources, the `crate::` paths of each
//! top-level module (its submodules' included; comments aside) name only modules that do not
//! name it back, directly or through others. A circle would mean two modules that can only be
//! understood, tested and changed together.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module of `src/` and the source of its files (`lib.rs` aside).
fn modules() -> BTreeMap<String, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules: BTreeMap<String, String> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/ is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") || path == src.join("lib.rs") {
                continue;
            }
            let relative = path.strip_prefix(&src).expect("under src/");
            let first = relative.components().next().expect("a file name");
            let name = first
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_owned();
            let text = std::fs::read_to_string(&path).expect("a source file is readable");
            modules.entry(name).or_default().push_str(&text);
        }
    }
    modules
}

/// `text` without its `//` comments (doc comments included; a `//` inside a string literal is
/// rare enough here not to matter, and would only hide an edge, never make one).
fn code(text: &str) -> String {
    text.lines()
        .map(|line| line.find("//").map_or(line, |at| &line[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn identifier(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The modules `source` names through `crate::` paths, braces of a `use` group included.
fn named(source: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = source;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            names.insert(identifier(rest).to_owned());
            continue;
        };
        // `crate::{a, b::{C, D}, e}`: the first name of each item at the group's own depth.
        let (mut depth, mut item_start) = (0usize, true);
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => item_start = true,
                c if item_start && depth == 0 && !c.is_whitespace() => {
                    names.insert(identifier(&group[i..]).to_owned());
                    item_start = false;
                }
                _ => {}
            }
        }
    }
    names
}

#[test]
fn the_modules_use_each_other_without_a_circle() {
    let modules = modules();
    assert!(modules.len() > 10, "the sources were found: {:?}", modules.keys());
    let edges: BTreeMap<&str, BTreeSet<String>> = modules
        .iter()
        .map(|(name, text)| {
            let mut to = named(&code(text));
            to.retain(|m| m != name && modules.contains_key(m));
            (name.as_str(), to)
        })
        .collect();
    // Depth-first, with the path kept: a module met again on the path closes a circle.
    fn visit<'a>(
        node: &'a str,
        edges: &'a BTreeMap<&'a str, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Result<(), String> {
        if let Some(at) = path.iter().position(|&m| m == node) {
            let mut circle = path[at..].to_vec();
            circle.push(node);
            return Err(circle.join(" -> "));
        }
        if done.contains(node) {
            return Ok(());
        }
        path.push(node);
        for next in &edges[node] {
            visit(next, edges, path, done)?;
        }
        path.pop();
        done.insert(node);
        Ok(())
    }
    let mut done = BTreeSet::new();
    for &module in edges.keys() {
        if let Err(circle) = visit(module, &edges, &mut Vec::new(), &mut done) {
            panic!("the modules use each other in a circle: {circle}\nedges: {edges:#?}");
        }
    }
}

#[test]
fn crate_paths_are_read_from_use_groups_and_inline_paths() {
    let source = "use crate::{a, b::{C, D}, e::F};\nfn f() { crate::g::h(); }\nuse crate::i::J;";
    let found: Vec<String> = named(source).into_iter().collect();
    assert_eq!(found, ["a", "b", "e", "g", "i"]);
    assert_eq!(code("x // crate::no\n// crate::nor\ny"), "x \n\ny");
}
