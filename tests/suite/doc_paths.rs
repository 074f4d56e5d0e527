//! Every repository path the documentation names exists: a renamed or
//! removed file fails here, naming the document and the stale path.
//!
//! What counts as a path (in backticks, or in a fenced block, token by
//! token): a word with a known extension (`comm/call/fused_calls.rs`,
//! `epilogue.rs`), or one whose first part is a top-level directory of the
//! repository (`host/comm`), or, outside fenced blocks, one ending in `/`.
//! It exists when a file or directory of the repository is that path or
//! ends with `/` + that path, so the docs may name a file relative to its
//! crate (`comm/call/mod.rs`). A bare file name counts only with a source
//! extension (`.rs`, `.py`, `.sh`, `.cu`, `.cuh`, `.md`): names of output
//! files (`results.json`, `tuning.toml`) are not in the repository.
//! Relative Markdown links (`[x](docs/RESULTS.md#anchor)`) must resolve
//! from the document's own folder. Left out: URLs, absolute paths (`/tmp`),
//! placeholders and globs (`<file>.rs`, `sm_XX`, `*.ptx`, `$OUT/...`),
//! paths under the directories the root `.gitignore` names (`.cache/`,
//! `results/`), and docs/SOURCES.md, whose paths are files of the other
//! projects it cites.

use std::collections::BTreeSet;
use std::path::Path;

const EXTENSIONS: &[&str] =
    &["rs", "md", "sh", "py", "toml", "txt", "json", "cu", "cuh", "ptx", "pth", "lock", "cfg", "yml", "yaml"];
const BARE_NAME_EXTENSIONS: &[&str] = &["rs", "py", "sh", "cu", "cuh", "md"];
/// Directory names never walked, wherever they are (build outputs, caches).
const SKIPPED_DIRS: &[&str] = &[".git", "target", "dist", "__pycache__", ".pytest_cache", ".venv", "node_modules"];
/// Documents whose paths are not this repository's.
const NOT_SCANNED: &[&str] = &["docs/SOURCES.md"];

struct Tree {
    /// Every file and directory, relative to the root, `/`-separated.
    entries: BTreeSet<String>,
    top_dirs: BTreeSet<String>,
    ignored_roots: Vec<String>,
}

impl Tree {
    fn load(root: &Path) -> Tree {
        let ignored_roots: Vec<String> = std::fs::read_to_string(root.join(".gitignore"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().strip_prefix('/'))
            .map(|l| l.trim_end_matches('/').to_string())
            .collect();
        let mut entries = BTreeSet::new();
        let mut stack = vec![String::new()];
        while let Some(dir) = stack.pop() {
            let read = std::fs::read_dir(root.join(&dir)).unwrap_or_else(|e| panic!("reading {dir:?}: {e}"));
            for entry in read.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let rel = if dir.is_empty() { name.clone() } else { format!("{dir}/{name}") };
                let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
                if is_dir {
                    if SKIPPED_DIRS.contains(&name.as_str()) || ignored_roots.contains(&rel) {
                        continue;
                    }
                    stack.push(rel.clone());
                }
                entries.insert(rel);
            }
        }
        let top_dirs = entries.iter().filter(|e| !e.contains('/') && root.join(e).is_dir()).cloned().collect();
        Tree { entries, top_dirs, ignored_roots }
    }

    fn has_suffix(&self, path: &str) -> bool {
        let path = path.trim_end_matches('/');
        let tail = format!("/{path}");
        self.entries.iter().any(|e| e == path || e.ends_with(&tail))
    }

    fn is_ignored(&self, path: &str) -> bool {
        self.ignored_roots.iter().any(|i| path == i || path.starts_with(&format!("{i}/")))
    }
}

fn extension(path: &str) -> Option<&str> {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.rsplit_once('.').map(|(_, ext)| ext).filter(|_| !name.starts_with('.') || name.matches('.').count() > 1)
}

/// The path a token names, if it names one (see the module doc).
fn candidate(token: &str, tree: &Tree, in_fence: bool) -> Option<String> {
    let token = token.trim_start_matches(['(', '\'', '"']).trim_end_matches([')', ',', ';', ':', '.', '\'', '"']);
    // `file.rs:120` and `file.rs:120-140` name lines of a file.
    let token = match token.rsplit_once(':') {
        Some((path, lines)) if !lines.is_empty() && lines.chars().all(|c| c.is_ascii_digit() || c == '-') => path,
        _ => token,
    };
    if token.is_empty()
        || token.contains("://")
        || token.contains("XX")
        || token.contains("...")
        || token.starts_with(['/', '-', '~'])
        || token.contains(['$', '<', '>', '*', '{', '}', '=', '|', '[', ']', '@', '%'])
    {
        return None;
    }
    if tree.is_ignored(token) {
        return None;
    }
    let ext = extension(token).filter(|e| EXTENSIONS.contains(e));
    let named = if token.contains('/') {
        let first = token.split('/').next().unwrap_or("");
        ext.is_some() || tree.top_dirs.contains(first) || (!in_fence && token.ends_with('/'))
    } else {
        ext.is_some_and(|e| BARE_NAME_EXTENSIONS.contains(&e))
    };
    named.then(|| token.to_string())
}

/// The repository paths one document names, with the line of each.
fn named_paths(text: &str, tree: &Tree) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut in_fence = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        let spans: Vec<&str> = if in_fence { vec![line] } else { line.split('`').skip(1).step_by(2).collect() };
        for span in spans {
            for token in span.split_whitespace() {
                if let Some(path) = candidate(token, tree, in_fence) {
                    found.push((n + 1, path));
                }
            }
        }
    }
    found
}

/// Relative link targets of one document: `](target)` outside backticks.
fn link_targets(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut in_fence = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let plain: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        for piece in plain.split("](").skip(1) {
            let Some(target) = piece.split(')').next() else { continue };
            let target = target.split('#').next().unwrap_or("").trim();
            if target.is_empty() || target.contains(':') || target.starts_with('/') {
                continue;
            }
            found.push((n + 1, target.to_string()));
        }
    }
    found
}

fn missing_paths(root: &Path) -> Vec<String> {
    let tree = Tree::load(root);
    let docs: Vec<&String> =
        tree.entries.iter().filter(|e| e.ends_with(".md") && !NOT_SCANNED.contains(&e.as_str())).collect();
    assert!(docs.iter().any(|d| *d == "README.md"), "the scan found no README.md under {}", root.display());
    let mut missing = Vec::new();
    for doc in docs {
        let text = std::fs::read_to_string(root.join(doc)).unwrap_or_else(|e| panic!("reading {doc}: {e}"));
        for (line, path) in named_paths(&text, &tree) {
            if !tree.has_suffix(&path) {
                missing.push(format!("{doc}:{line}: `{path}`"));
            }
        }
        let folder = Path::new(doc.as_str()).parent().unwrap_or(Path::new(""));
        for (line, target) in link_targets(&text) {
            if !root.join(folder).join(&target).exists() {
                missing.push(format!("{doc}:{line}: link ({target})"));
            }
        }
    }
    missing
}

#[test]
fn every_repository_path_the_docs_name_exists() {
    let missing = missing_paths(crate::common::repo());
    assert!(missing.is_empty(), "the docs name {} path(s) that do not exist:\n{}", missing.len(), missing.join("\n"));
}

#[test]
fn the_doc_path_scan_finds_paths_and_leaves_out_non_paths() {
    let tree = Tree::load(crate::common::repo());
    let text = "see `host/comm/call/fused_calls.rs:12`, `cost_model/params.rs` and `no_such.rs`;\n\
                `bash .ci/main.sh` writes `results.json` under `$OUT/x.json`, `/tmp/y.rs`, `<file>.rs`, `.cache/ptx/`\n\
                ```\n  cli/src/bench/ gone/ host/nothing_here\n```\n";
    let paths: Vec<String> = named_paths(text, &tree).into_iter().map(|(_, p)| p).collect();
    assert_eq!(
        paths,
        [
            "host/comm/call/fused_calls.rs",
            "cost_model/params.rs",
            "no_such.rs",
            ".ci/main.sh",
            "cli/src/bench/",
            "host/nothing_here"
        ]
    );
    let missing: Vec<&String> = paths.iter().filter(|p| !tree.has_suffix(p)).collect();
    assert_eq!(missing, ["cost_model/params.rs", "no_such.rs", "host/nothing_here"]);
    let links: Vec<String> =
        link_targets("[a](docs/RESULTS.md#x) [b](https://host/page) `[c](d)`").into_iter().map(|(_, t)| t).collect();
    assert_eq!(links, ["docs/RESULTS.md"]);
}
