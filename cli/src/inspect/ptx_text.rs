//! Reading PTX text: functions, and per kernel the loads and stores by
//! space, qualifier and width, system-scope ordering operations, fences,
//! atomics, barriers, `%globaltimer` reads and loops (see `cfg.rs`).
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

use super::cfg::{BlockEnd, CfgBuilder};

/// One function of a PTX module, comments removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PtxFunction {
    pub name: String,
    /// `.entry` (a kernel) rather than `.func`.
    pub is_entry: bool,
    /// The lines of the body, from the opening `{` to the closing `}`.
    pub body: Vec<String>,
}

/// Names of the kernel entry points (`.entry NAME(`), in order of appearance.
pub fn entry_names(ptx: &str) -> Vec<String> {
    parse_functions(ptx).into_iter().filter(|f| f.is_entry).map(|f| f.name).collect()
}

/// The defined functions of a PTX module (declarations such as
/// `.extern .func f(...);` are skipped).
pub fn parse_functions(ptx: &str) -> Vec<PtxFunction> {
    enum State {
        Outside,
        Header { name: String, is_entry: bool, parens: i32 },
        Body { name: String, is_entry: bool, braces: i32, body: Vec<String> },
    }
    let mut functions = Vec::new();
    let mut state = State::Outside;
    for raw in ptx.lines() {
        let line = strip_comment(raw);
        // The part of the line still to scan for parentheses and braces.
        let mut rest: &str = line;
        if let State::Outside = state {
            match function_header(line) {
                Some((name, is_entry, after)) => {
                    rest = after;
                    state = State::Header { name, is_entry, parens: 0 };
                }
                None => continue,
            }
        }
        if let State::Header { name, is_entry, parens } = &mut state {
            let mut opened = None;
            for (i, c) in rest.char_indices() {
                match c {
                    '(' => *parens += 1,
                    ')' => *parens -= 1,
                    ';' if *parens == 0 => {
                        opened = Some(None); // a declaration: no body
                        break;
                    }
                    '{' if *parens == 0 => {
                        opened = Some(Some(i));
                        break;
                    }
                    _ => {}
                }
            }
            match opened {
                None => continue,
                Some(None) => {
                    state = State::Outside;
                    continue;
                }
                Some(Some(i)) => {
                    rest = &rest[i..];
                    state =
                        State::Body { name: std::mem::take(name), is_entry: *is_entry, braces: 0, body: Vec::new() };
                }
            }
        }
        if let State::Body { braces, body, .. } = &mut state {
            for c in rest.chars() {
                match c {
                    '{' => *braces += 1,
                    '}' => *braces -= 1,
                    _ => {}
                }
            }
            body.push(rest.to_string());
            if *braces <= 0 {
                if let State::Body { name, is_entry, body, .. } = std::mem::replace(&mut state, State::Outside) {
                    functions.push(PtxFunction { name, is_entry, body });
                }
            }
        }
    }
    functions
}

/// `.visible .entry NAME(` / `.func (.param .b32 r) NAME(`: (name, is_entry,
/// the text after the name).
fn function_header(line: &str) -> Option<(String, bool, &str)> {
    let mut offset = 0;
    let mut found = None;
    for word in line.split_whitespace() {
        let at = offset + line[offset..].find(word).unwrap_or(0);
        offset = at + word.len();
        if word == ".entry" || word == ".func" {
            found = Some((word == ".entry", offset));
            break;
        }
    }
    let (is_entry, after_keyword) = found?;
    let mut rest = line[after_keyword..].trim_start();
    if rest.starts_with('(') {
        // A `.func` return value: skip `( ... )`.
        let close = rest.find(')')?;
        rest = rest[close + 1..].trim_start();
    }
    let end = rest.find(|c: char| c == '(' || c == ';' || c.is_whitespace()).unwrap_or(rest.len());
    if end == 0 {
        return None;
    }
    Some((rest[..end].to_string(), is_entry, &rest[end..]))
}

fn strip_comment(line: &str) -> &str {
    match line.find("//") {
        Some(i) => &line[..i],
        None => line,
    }
}

/// Load or store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Access {
    Load,
    Store,
}

/// State space of a load or store. `Generic` (no space in the opcode) is a
/// plain pointer dereference in the kernel source; in these kernels it
/// normally reaches global memory too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Space {
    Global,
    Generic,
    Shared,
    Local,
}

/// One kind of load or store: access, space, qualifier and width.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MemOp {
    pub access: Access,
    pub space: Space,
    /// `weak` (no qualifier), `volatile`, `nc`, or `<sem>.<scope>` such as
    /// `relaxed.sys`, `acquire.sys`, `release.sys`.
    pub qualifier: String,
    /// Bits moved by one instruction (vector length x element width).
    pub bits: u32,
}

impl MemOp {
    /// `ld.global.acquire.sys.32`-style label (the space and order are ours,
    /// not PTX syntax).
    pub fn label(&self) -> String {
        let op = match self.access {
            Access::Load => "ld",
            Access::Store => "st",
        };
        let space = match self.space {
            Space::Global => "global",
            Space::Generic => "generic",
            Space::Shared => "shared",
            Space::Local => "local",
        };
        format!("{op}.{space}.{}.{}", self.qualifier, self.bits)
    }
}

/// What the PTX text of one function (with its callees) contains.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxStats {
    pub name: String,
    /// Loads and stores (global, generic, shared, local; not param/const).
    pub memory: BTreeMap<MemOp, u32>,
    /// `ld.acquire.sys` and `atom.{acquire,acq_rel}.sys`.
    pub sys_acquire: u32,
    /// `st.release.sys` and `atom/red.{release,acq_rel}.sys`.
    pub sys_release: u32,
    /// By opcode: `fence.acq_rel.sys`, `fence.sc.sys`, `membar.gl`, ...
    pub fences: BTreeMap<String, u32>,
    /// By `atom|red.<sem>.<scope>.<op>`, PTX defaults (relaxed, gpu) filled in.
    pub atomics: BTreeMap<String, u32>,
    /// `bar.sync`, `bar.red`, `bar.arrive`, `bar.warp.sync`
    /// (`barrier.*` counted under the `bar.*` name).
    pub barriers: BTreeMap<String, u32>,
    pub globaltimer_reads: u32,
    /// Natural loops (headers with a branch back from a block they dominate).
    pub loops: u32,
    /// Deepest loop nesting (0 without loops).
    pub max_loop_depth: u32,
    /// Functions called, directly or not (their counts are included).
    pub callees: Vec<String>,
    /// Calls through a register (callee unknown, not included).
    pub indirect_calls: u32,
}

impl PtxStats {
    /// Loads or stores of `space` and width `bits`, any qualifier.
    pub fn count(&self, access: Access, space: Space, bits: u32) -> u32 {
        self.memory
            .iter()
            .filter(|(k, _)| k.access == access && k.space == space && k.bits == bits)
            .map(|(_, n)| n)
            .sum()
    }

    /// Loads or stores of `space`, any width and qualifier.
    pub fn count_space(&self, access: Access, space: Space) -> u32 {
        self.memory.iter().filter(|(k, _)| k.access == access && k.space == space).map(|(_, n)| n).sum()
    }

    /// Fences with system scope (`fence.*.sys`, `membar.sys`).
    pub fn sys_fences(&self) -> u32 {
        self.fences.iter().filter(|(k, _)| k.split('.').any(|p| p == "sys")).map(|(_, n)| n).sum()
    }

    /// Fences of narrower scope (gpu, cta, `membar.gl`).
    pub fn other_fences(&self) -> u32 {
        self.fences.values().sum::<u32>() - self.sys_fences()
    }

    fn absorb(&mut self, other: &PtxStats) {
        for (k, n) in &other.memory {
            *self.memory.entry(k.clone()).or_default() += n;
        }
        for (mine, theirs) in [
            (&mut self.fences, &other.fences),
            (&mut self.atomics, &other.atomics),
            (&mut self.barriers, &other.barriers),
        ] {
            for (k, n) in theirs {
                *mine.entry(k.clone()).or_default() += n;
            }
        }
        self.sys_acquire += other.sys_acquire;
        self.sys_release += other.sys_release;
        self.globaltimer_reads += other.globaltimer_reads;
        self.loops += other.loops;
        self.max_loop_depth = self.max_loop_depth.max(other.max_loop_depth);
        self.indirect_calls += other.indirect_calls;
    }
}

/// Statistics of every kernel entry in `ptx`, in order of appearance; each
/// includes the `.func`s it calls.
pub fn analyze_ptx(ptx: &str) -> Vec<PtxStats> {
    let functions = parse_functions(ptx);
    let own: BTreeMap<&str, (PtxStats, Vec<String>)> =
        functions.iter().map(|f| (f.name.as_str(), analyze_function(f))).collect();
    let mut result = Vec::new();
    for f in functions.iter().filter(|f| f.is_entry) {
        let (mut stats, _) = own[f.name.as_str()].clone();
        // Every function reachable through direct calls, once each.
        let mut seen: BTreeSet<String> = BTreeSet::new();
        let mut todo: Vec<String> = own[f.name.as_str()].1.clone();
        while let Some(callee) = todo.pop() {
            if callee == f.name || !seen.insert(callee.clone()) {
                continue;
            }
            if let Some((callee_stats, callee_calls)) = own.get(callee.as_str()) {
                stats.absorb(callee_stats);
                todo.extend(callee_calls.iter().cloned());
            }
        }
        stats.callees = seen.into_iter().collect();
        result.push(stats);
    }
    result
}

/// One function's own statistics and its direct callees.
fn analyze_function(f: &PtxFunction) -> (PtxStats, Vec<String>) {
    let mut s = PtxStats { name: f.name.clone(), ..Default::default() };
    let mut calls = Vec::new();
    let mut cfg = CfgBuilder::default();
    for line in &f.body {
        for stmt in line.split(';') {
            let mut stmt = stmt.trim().trim_start_matches(['{', '}']).trim_end_matches(['{', '}']).trim();
            if let Some((label, rest)) = split_label(stmt) {
                cfg.label(label);
                stmt = rest;
            }
            if stmt.is_empty() || stmt.starts_with('.') {
                continue;
            }
            // Guard predicate `@%p1` / `@!%p1`.
            let guarded = stmt.starts_with('@');
            if guarded {
                stmt = stmt.split_once(char::is_whitespace).map(|(_, r)| r.trim_start()).unwrap_or("");
            }
            let (opcode, operands) = stmt.split_once(char::is_whitespace).unwrap_or((stmt, ""));
            let operands = operands.trim();
            if operands.contains("%globaltimer") {
                s.globaltimer_reads += 1;
            }
            let parts: Vec<&str> = opcode.split('.').collect();
            let mut end = None;
            match parts[0] {
                "ld" | "st" => count_memory(&mut s, &parts),
                "atom" | "red" => count_atomic(&mut s, &parts),
                "fence" | "membar" => *s.fences.entry(opcode.to_string()).or_default() += 1,
                "bar" | "barrier" => {
                    let kind = match parts.get(1).copied() {
                        Some("warp") => "bar.warp.sync",
                        Some("red") => "bar.red",
                        Some("arrive") => "bar.arrive",
                        Some("cluster") => "barrier.cluster",
                        _ => "bar.sync",
                    };
                    *s.barriers.entry(kind.to_string()).or_default() += 1;
                }
                "bra" => {
                    end = Some(BlockEnd::Branch { target: operands.trim_end_matches(',').trim().to_string(), guarded })
                }
                "ret" | "exit" | "trap" => end = Some(BlockEnd::Exit { guarded }),
                "call" => match callee(operands) {
                    Some(name) => calls.push(name),
                    None => s.indirect_calls += 1,
                },
                _ => {}
            }
            cfg.instruction(end);
        }
    }
    let (loops, depth) = cfg.natural_loops();
    s.loops = loops;
    s.max_loop_depth = depth;
    (s, calls)
}

/// `$L__BB0_3: rest` -> (label, rest).
fn split_label(stmt: &str) -> Option<(&str, &str)> {
    let (label, rest) = stmt.split_once(':')?;
    if rest.starts_with(':')
        || label.is_empty()
        || !label.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
    {
        return None;
    }
    Some((label, rest.trim()))
}

/// The callee of `call.uni (retval0), name, (args)`; `None` for an indirect
/// call through a register.
pub(super) fn callee(operands: &str) -> Option<String> {
    let mut rest = operands.trim();
    if rest.starts_with('(') {
        rest = rest[rest.find(')')? + 1..].trim_start().trim_start_matches(',').trim_start();
    }
    let end = rest.find(|c: char| c == ',' || c == '(' || c == ';' || c.is_whitespace()).unwrap_or(rest.len());
    let name = &rest[..end];
    (!name.is_empty() && !name.starts_with('%')).then(|| name.to_string())
}

const SEMANTICS: [&str; 6] = ["weak", "relaxed", "acquire", "release", "acq_rel", "mmio"];
const SCOPES: [&str; 4] = ["cta", "cluster", "gpu", "sys"];

/// Bits of one element: `b32` -> 32, `f16` -> 16.
fn element_bits(part: &str) -> Option<u32> {
    let mut chars = part.chars();
    match chars.next()? {
        'b' | 'u' | 's' | 'f' => chars.as_str().parse().ok(),
        _ => None,
    }
}

fn count_memory(s: &mut PtxStats, parts: &[&str]) {
    let access = if parts[0] == "ld" { Access::Load } else { Access::Store };
    let mut space = Space::Generic;
    let mut sem = None;
    let mut scope = None;
    let mut volatile = false;
    let mut nc = false;
    let mut mmio = false;
    let mut vector = 1;
    let mut bits = 0;
    for &p in &parts[1..] {
        // `shared::cta`, `L1::no_allocate`: the part before `::` decides.
        match p.split("::").next().unwrap_or(p) {
            "global" => space = Space::Global,
            "shared" => space = Space::Shared,
            "local" => space = Space::Local,
            "param" | "const" => return,
            "volatile" => volatile = true,
            "nc" => nc = true,
            "mmio" => mmio = true,
            "v2" => vector = 2,
            "v4" => vector = 4,
            "v8" => vector = 8,
            q if SEMANTICS.contains(&q) => sem = Some(q),
            q if SCOPES.contains(&q) => scope = Some(q),
            q => {
                if let Some(b) = element_bits(q) {
                    bits = b;
                }
            }
        }
    }
    let qualifier = if volatile {
        "volatile".to_string()
    } else if nc {
        "nc".to_string()
    } else {
        match (sem, scope) {
            (None | Some("weak"), _) => "weak".to_string(),
            (Some(sem), scope) => {
                let prefix = if mmio { "mmio." } else { "" };
                format!("{prefix}{sem}.{}", scope.unwrap_or("gpu"))
            }
        }
    };
    if scope == Some("sys") {
        match (access, sem) {
            (Access::Load, Some("acquire")) => s.sys_acquire += 1,
            (Access::Store, Some("release")) => s.sys_release += 1,
            _ => {}
        }
    }
    *s.memory.entry(MemOp { access, space, qualifier, bits: bits * vector }).or_default() += 1;
}

fn count_atomic(s: &mut PtxStats, parts: &[&str]) {
    let mut sem = "relaxed";
    let mut scope = "gpu";
    let mut op = "?";
    for &p in &parts[1..] {
        match p {
            q if SEMANTICS.contains(&q) => sem = q,
            q if SCOPES.contains(&q) => scope = q,
            "global" | "shared" | "noftz" => {}
            q if element_bits(q).is_some() || (q.starts_with('v') && q[1..].parse::<u32>().is_ok()) => {}
            q => {
                if op == "?" {
                    op = q;
                }
            }
        }
    }
    if scope == "sys" {
        if matches!(sem, "acquire" | "acq_rel") {
            s.sys_acquire += 1;
        }
        if matches!(sem, "release" | "acq_rel") {
            s.sys_release += 1;
        }
    }
    *s.atomics.entry(format!("{}.{sem}.{scope}.{op}", parts[0])).or_default() += 1;
}
