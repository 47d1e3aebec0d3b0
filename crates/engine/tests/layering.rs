//! The engine's layering, checked: each module of the engine may import only modules of its own
//! layer or below, and no two modules import each other (directly or through others). The
//! compiler already keeps the engine off the terminal side (this crate cannot name the root
//! crate, nor ratatui or crossterm); this test holds the order inside the engine. Test code
//! counts too: a test that needs a higher module belongs in `tests/`. See docs/ARCHITECTURE.md.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Lowest first. A module may use modules of its own layer or of a lower one.
const LAYERS: [&[&str]; 8] = [
    &[
        "control",
        "limits",
        "budget",
        "safe_write",
        "tensors",
        "device",
        "end",
    ],
    &["scenario"],
    &["telemetry", "presets"],
    &["ops", "tokenizer", "record"],
    &["model", "data"],
    &["memory"],
    &["train"],
    &["checkpoint"],
];

fn layer_of(module: &str) -> usize {
    LAYERS
        .iter()
        .position(|l| l.contains(&module))
        .unwrap_or_else(|| panic!("module `{module}` is in no layer: add it to LAYERS"))
}

/// module -> the engine modules its files name through `crate::`.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let module = rel
                .split('/')
                .next()
                .unwrap()
                .trim_end_matches(".rs")
                .to_string();
            if module == "lib" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let used = graph.entry(module.clone()).or_default();
            for (i, _) in text.match_indices("crate::") {
                let name: String = text[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    used.insert(name);
                }
            }
        }
    }
    graph
}

#[test]
fn engine_modules_import_only_their_layer_or_below() {
    let mut wrong = Vec::new();
    for (module, used) in imports() {
        for dep in used {
            if layer_of(&dep) > layer_of(&module) {
                wrong.push(format!("{module} -> {dep}"));
            }
        }
    }
    assert!(wrong.is_empty(), "imports upward: {wrong:?}");
}

#[test]
fn engine_modules_have_no_import_cycle() {
    let graph = imports();
    // Depth-first search for a back edge.
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|n| n == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, &graph, &mut Vec::new(), &mut done) {
            panic!("import cycle: {}", cycle.join(" -> "));
        }
    }
}
