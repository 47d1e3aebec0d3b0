//! The engine's layering, checked: each module of the engine may import only modules of its own
//! layer or below, and no two modules import each other (directly or through others). The
//! compiler already keeps the engine off the terminal side (this crate cannot name the root
//! crate, nor ratatui or crossterm); this test holds the order inside the engine. Test code
//! counts too: a test that needs a higher module belongs in `tests/`. See docs/ARCHITECTURE.md.
//!
//! Every file is parsed (`syn`), and every path it names is resolved to the engine's top-level
//! module it starts in: `crate::x`, grouped `use crate::{x, y::z}`, and `super::`/`self::`
//! paths that climb out of the file's own module; `crate::x` inside macro bodies is read as text.
//! docs/ARCHITECTURE.md's diagram lists the same layers, read from its text.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use syn::visit::Visit;

/// Lowest first. A module may use modules of its own layer or of a lower one.
const LAYERS: [&[&str]; 8] = [
    &[
        "control",
        "limits",
        "budget",
        "safe_write",
        "tensors",
        "device",
        "dist",
        "end",
    ],
    &["scenario"],
    &["telemetry", "presets", "hf"],
    &["ops", "tokenizer", "record"],
    &["model", "data"],
    &["memory", "planner"],
    &["train"],
    &["checkpoint"],
];

fn layer_of(module: &str) -> usize {
    LAYERS
        .iter()
        .position(|l| l.contains(&module))
        .unwrap_or_else(|| panic!("module `{module}` is in no layer: add it to LAYERS"))
}

/// Collects the top-level engine modules named by the paths of one file.
struct Names<'a> {
    /// The module the file's items are in, from the crate root (`["train", "failures"]`).
    module: Vec<String>,
    /// The top-level modules named.
    found: &'a mut BTreeSet<String>,
}

impl Names<'_> {
    /// The top-level module a path of these segments starts in, if it leaves the file's module
    /// through `crate` or `super`.
    fn record(&mut self, segments: &[String]) {
        let Some(first) = segments.first() else {
            return;
        };
        let absolute: Vec<String> = match first.as_str() {
            "crate" => segments[1..].to_vec(),
            "super" | "self" => {
                let mut here = self.module.clone();
                let mut rest = segments;
                while let Some(s) = rest.first() {
                    match s.as_str() {
                        "super" => {
                            here.pop();
                        }
                        "self" => {}
                        _ => break,
                    }
                    rest = &rest[1..];
                }
                here.extend(rest.iter().cloned());
                here
            }
            _ => return,
        };
        if let Some(top) = absolute.first() {
            self.found.insert(top.clone());
        }
    }

    /// Every full path in a (possibly grouped) `use` tree.
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.leaf(prefix, n.ident.to_string()),
            syn::UseTree::Rename(r) => self.leaf(prefix, r.ident.to_string()),
            syn::UseTree::Glob(_) => self.record(prefix),
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| self.use_tree(prefix, t)),
        }
    }

    fn leaf(&mut self, prefix: &mut Vec<String>, name: String) {
        prefix.push(name);
        self.record(prefix);
        prefix.pop();
    }
}

impl<'ast> Visit<'ast> for Names<'_> {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        self.record(&segments);
        syn::visit::visit_path(self, path);
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        // An inline module (`mod tests { use super::*; }`) is one level deeper.
        self.module.push(item.ident.to_string());
        syn::visit::visit_item_mod(self, item);
        self.module.pop();
    }
}

/// The top-level engine modules named by `source`, a file of module `module`.
fn names_in(source: &str, module: &[&str]) -> BTreeSet<String> {
    let file = syn::parse_file(source).unwrap_or_else(|e| panic!("cannot parse {module:?}: {e}"));
    let mut found = BTreeSet::new();
    Names {
        module: module.iter().map(|s| s.to_string()).collect(),
        found: &mut found,
    }
    .visit_file(&file);
    // Macro bodies are tokens to the parser: `crate::x` written inside `format!(…)` is read as text.
    for (i, _) in source.match_indices("crate::") {
        let name: String = source[i + 7..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            found.insert(name);
        }
    }
    found
}

/// module -> the other engine modules its files name.
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
            let rel = path.strip_prefix(&root).unwrap().with_extension("");
            let mut module: Vec<String> = rel
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            if module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            if module == ["lib"] {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let module_refs: Vec<&str> = module.iter().map(String::as_str).collect();
            let top = module[0].clone();
            let used = graph.entry(top.clone()).or_default();
            used.extend(
                names_in(&text, &module_refs)
                    .into_iter()
                    .filter(|n| *n != top),
            );
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

/// The reader finds what a text search for `crate::x` misses: grouped imports, `super` paths
/// that climb to the crate root, and paths in expressions.
#[test]
fn every_kind_of_path_is_read() {
    let source = r#"
        use crate::{telemetry, train::Trainer};
        use super::super::checkpoint::Policy;
        mod tests {
            use super::super::super::memory::*;
        }
        fn f() { let _ = crate::record::Recorder::new; }
    "#;
    let names = names_in(source, &["ops", "fused"]);
    let expected: BTreeSet<String> = ["telemetry", "train", "checkpoint", "memory", "record"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(names, expected);
    // A path inside the file's own module is not an import of another module.
    assert_eq!(
        names_in("use super::half::Bf16;", &["ops", "fused"]),
        BTreeSet::from(["ops".to_string()])
    );
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

/// The layers docs/ARCHITECTURE.md lists for the engine, lowest first: each line of its
/// diagram that starts with a layer's number opens that layer, and the module names are the
/// comma-separated words outside parentheses (which describe them) up to the next layer.
fn documented_layers(architecture: &str) -> Vec<BTreeSet<String>> {
    let diagram = architecture
        .split("crates/engine  (gaccwb-engine)")
        .nth(1)
        .and_then(|rest| rest.split("\nsrc/").next())
        .expect("docs/ARCHITECTURE.md has no engine diagram");
    let mut layers: Vec<String> = Vec::new();
    for line in diagram.lines().skip(1) {
        let trimmed = line.trim_start();
        let number: String = trimmed.chars().take_while(char::is_ascii_digit).collect();
        if !number.is_empty() && trimmed[number.len()..].starts_with("  ") {
            assert_eq!(number.parse::<usize>().ok(), Some(layers.len()), "{line}");
            layers.push(trimmed[number.len()..].to_string());
        } else if let Some(layer) = layers.last_mut() {
            layer.push(' ');
            layer.push_str(trimmed);
        }
    }
    layers
        .iter()
        .map(|text| {
            let mut depth = 0usize;
            let outside: String = text
                .chars()
                .filter(|c| match c {
                    '(' => {
                        depth += 1;
                        false
                    }
                    ')' => {
                        depth = depth.saturating_sub(1);
                        false
                    }
                    _ => depth == 0,
                })
                .collect();
            outside
                .split(',')
                .map(|name| name.trim().to_string())
                .filter(|name| !name.is_empty())
                .collect()
        })
        .collect()
}

#[test]
fn the_architecture_document_lists_the_layers_this_test_holds() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/ARCHITECTURE.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let held: Vec<BTreeSet<String>> = LAYERS
        .iter()
        .map(|l| l.iter().map(|m| m.to_string()).collect())
        .collect();
    assert_eq!(
        documented_layers(&text),
        held,
        "docs/ARCHITECTURE.md's layer list differs from LAYERS"
    );
}

/// The reader of the diagram takes names across lines and leaves descriptions out, so a
/// module missing from a layer line is seen.
#[test]
fn the_layer_list_reader_sees_a_missing_module() {
    let text = "```\ncrates/engine  (gaccwb-engine)   the engine:\n  0  control (the knobs, Control),\n     limits\n  1  scenario (TOML; a, b)\nsrc/  faces\n```";
    let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        documented_layers(text),
        [set(&["control", "limits"]), set(&["scenario"])]
    );
    assert_ne!(
        documented_layers(&text.replace(",\n     limits", "")),
        [set(&["control", "limits"]), set(&["scenario"])]
    );
}
