//! No import loop between modules, at module granularity: every source file
//! is a module (`comm::setup` and `comm::setup::per_pair` are two), and a
//! module depends on every other module whose items it names (`use` paths
//! and qualified paths, `crate::`, `super::`, `self::` or a child's name).
//! A module may name its own ancestors (it is part of them); any other
//! edge, to a sibling, a cousin or a submodule, is a dependency, and the
//! dependencies must not loop. Test-only code (`#[cfg(test)]` modules,
//! inline or in files) is left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A module: its path inside the crate (`["comm", "setup"]`).
type Module = Vec<String>;

/// The crates of the repository: (source directory, files that are roots
/// of binaries and are left out).
const CRATES: [(&str, &[&str]); 3] = [("host", &[]), ("kernels-rs/src", &[]), ("cli/src", &["main.rs"])];

/// Every module of the crate in `dir` with its text, test-only modules left
/// out and inline test modules cut from the text.
fn modules(dir: &str, skip: &[&str]) -> BTreeMap<Module, String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(Module, String, bool)>, skip: &[&str]) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(root, &path, out, skip);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if skip.contains(&rel.as_str()) {
                continue;
            }
            let mut parts: Vec<String> = rel.trim_end_matches(".rs").split('/').map(String::from).collect();
            let is_root_file = matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main"));
            if is_root_file {
                parts.pop();
            }
            out.push((parts, std::fs::read_to_string(&path).unwrap(), is_root_file));
        }
    }
    let root = crate::common::repo().join(dir);
    let mut files = Vec::new();
    walk(&root, &root, &mut files, skip);
    // Modules declared under `#[cfg(test)]` in their parent.
    let mut test_only: BTreeSet<Module> = BTreeSet::new();
    for (module, text, _) in &files {
        let mut cfg_test = false;
        for line in text.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix("mod ").or_else(|| line.strip_prefix("pub(crate) mod ")) {
                if cfg_test {
                    let mut child = module.clone();
                    child.push(name.trim_end_matches(';').trim().to_string());
                    test_only.insert(child);
                }
            }
            if !line.is_empty() && !line.starts_with("#[") {
                cfg_test = false;
            }
            if line.starts_with("#[cfg(test)]") {
                cfg_test = true;
            }
        }
    }
    files
        .into_iter()
        .filter(|(m, _, _)| !test_only.iter().any(|t| m.starts_with(t)))
        .map(|(m, text, _)| (m, without_inline_tests(&without_comments(&text))))
        .collect()
}

fn without_comments(text: &str) -> String {
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// `text` without its inline `#[cfg(test)] mod name { ... }` blocks.
fn without_inline_tests(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let body = trimmed.find(['{', ';']).filter(|&i| trimmed.as_bytes()[i] == b'{');
        let Some(body) = body.filter(|_| trimmed.starts_with("mod ")) else {
            rest = after;
            continue;
        };
        let open = after.len() - trimmed.len() + body;
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The paths a module's text names: each `use` tree expanded, and every
/// qualified path (`a::b::c`) of an expression or a type.
fn named_paths(text: &str) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut paths = Vec::new();
    // `use` trees, groups expanded.
    for statement in text.split(';') {
        let Some(at) = statement.find("use ") else { continue };
        let before = &statement[..at];
        if before.chars().last().is_some_and(ident) {
            continue;
        }
        let tree: String = statement[at + 4..].chars().filter(|c| !c.is_whitespace()).collect();
        expand_use(&[], &tree, &mut paths);
    }
    // Qualified paths anywhere.
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if ident(chars[i]) && (i == 0 || !(ident(chars[i - 1]) || chars[i - 1] == ':')) {
            let mut path = Vec::new();
            let mut j = i;
            loop {
                let start = j;
                while j < chars.len() && ident(chars[j]) {
                    j += 1;
                }
                path.push(chars[start..j].iter().collect::<String>());
                if j + 2 < chars.len() && chars[j] == ':' && chars[j + 1] == ':' && ident(chars[j + 2]) {
                    j += 2;
                } else {
                    break;
                }
            }
            if path.len() > 1 {
                paths.push(path);
            }
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    paths
}

/// Expands the `use` tree `tree` (no whitespace) under `prefix`.
fn expand_use(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
    let (head, group) = match tree.find('{') {
        Some(open) if tree.ends_with('}') => (&tree[..open], Some(&tree[open + 1..tree.len() - 1])),
        _ => (tree, None),
    };
    let mut path: Vec<String> = prefix.to_vec();
    path.extend(head.split("::").filter(|s| !s.is_empty()).map(|s| s.split(" as ").next().unwrap_or(s).to_string()));
    let Some(group) = group else {
        out.push(path);
        return;
    };
    // Split the group at top-level commas.
    let (mut depth, mut start) = (0, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand_use(&path, &group[start..i], out);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < group.len() {
        expand_use(&path, &group[start..], out);
    }
}

/// The module `path`, named from `from`, refers to (the longest prefix
/// that is a module), if any.
fn resolve(from: &Module, path: &[String], modules: &BTreeSet<Module>) -> Option<Module> {
    let (mut base, mut rest): (Module, &[String]) = match path.first().map(String::as_str) {
        Some("crate") => (Vec::new(), &path[1..]),
        Some("self") => (from.clone(), &path[1..]),
        Some("super") => {
            let mut base = from.clone();
            let mut rest = path;
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
            (base, rest)
        }
        // A bare path starts at a child of `from` (or names something
        // else: an extern crate, a type, a local import).
        _ => (from.clone(), path),
    };
    let mut found = None;
    while let Some(next) = rest.first() {
        base.push(next.clone());
        if !modules.contains(&base) {
            break;
        }
        found = Some(base.clone());
        rest = &rest[1..];
    }
    if found.is_none() && matches!(path.first().map(String::as_str), Some("crate" | "self" | "super")) {
        // `use super::Item` names the module `super` itself.
        base.pop();
        return modules.contains(&base).then_some(base);
    }
    found
}

/// Dependencies between the modules of the crate in `dir` (edges to a
/// module's own ancestors left out).
fn dependencies(dir: &str, skip: &[&str]) -> BTreeMap<Module, BTreeSet<Module>> {
    let texts = modules(dir, skip);
    let names: BTreeSet<Module> = texts.keys().cloned().collect();
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = names.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for (from, text) in &texts {
        for path in named_paths(text) {
            if let Some(to) = resolve(from, &path, &names) {
                if &to != from && !from.starts_with(&to) {
                    edges.get_mut(from).unwrap().insert(to);
                }
            }
        }
    }
    edges
}

/// The import loops: the strongly connected components of more than one
/// module (Tarjan), each as (one loop through it, all its modules).
fn loops(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<(Vec<Module>, Vec<Module>)> {
    struct Tarjan<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        components: Vec<Vec<Module>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a Module) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            for w in &self.edges[v] {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.stack.contains(&w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    component.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.components.push(component);
                }
            }
        }
    }
    let mut t =
        Tarjan { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), components: Vec::new() };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    // One loop through each component, for the message: a shortest way
    // back to its first module.
    t.components
        .into_iter()
        .map(|mut component| {
            component.sort();
            let members: BTreeSet<&Module> = component.iter().collect();
            let start = &component[0];
            let mut previous: BTreeMap<&Module, &Module> = BTreeMap::new();
            let mut queue = std::collections::VecDeque::from([start]);
            'search: while let Some(v) = queue.pop_front() {
                for w in edges[v].iter().filter(|w| members.contains(w)) {
                    if w == start {
                        previous.insert(start, v);
                        break 'search;
                    }
                    if !previous.contains_key(w) {
                        previous.insert(w, v);
                        queue.push_back(w);
                    }
                }
            }
            let mut cycle = vec![start.clone()];
            let mut at = previous[start];
            while at != start {
                cycle.push(at.clone());
                at = previous[at];
            }
            cycle.push(start.clone());
            cycle.reverse();
            (cycle, component)
        })
        .collect()
}

fn show(m: &Module) -> String {
    if m.is_empty() {
        "crate".to_string()
    } else {
        m.join("::")
    }
}

#[test]
fn no_import_loop_between_modules() {
    let mut found = Vec::new();
    for (dir, skip) in CRATES {
        for (cycle, tangle) in loops(&dependencies(dir, skip)) {
            let names = |ms: &[Module], sep: &str| ms.iter().map(show).collect::<Vec<_>>().join(sep);
            found.push(format!("{dir}: {} (the tangle: {})", names(&cycle, " -> "), names(&tangle, ", ")));
        }
    }
    assert!(found.is_empty(), "{} import loop(s):\n  {}", found.len(), found.join("\n  "));
}

/// The parser sees what the loops are made of: a group import, a path
/// through `super`, a child named bare, and an inline test module left out.
#[test]
fn the_module_graph_follows_use_trees_super_and_children() {
    let text = without_inline_tests(&without_comments(
        "use super::{a::{self, X}, b};\nuse crate::c::d::Y; // crate::e\nfn f() { child::g(); }\n#[cfg(test)]\nmod tests { use crate::e::Z; }\n",
    ));
    let modules: BTreeSet<Module> =
        [vec!["a"], vec!["b"], vec!["c"], vec!["c", "d"], vec!["e"], vec!["m"], vec!["m", "child"]]
            .into_iter()
            .map(|m| m.into_iter().map(String::from).collect())
            .collect();
    let from: Module = vec!["m".to_string()];
    let mut seen: BTreeSet<String> =
        named_paths(&text).iter().filter_map(|p| resolve(&from, p, &modules)).map(|m| show(&m)).collect();
    seen.remove("m");
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), ["a", "b", "c::d", "m::child"]);
}
