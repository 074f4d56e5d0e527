//! What the kernels compile to: `tp-allreduce inspect`.
//!
//! For one architecture this writes the embedded PTX to an output folder,
//! assembles it with `ptxas -v` (registers, spills, stack frame, barriers per
//! kernel), disassembles the cubin to SASS when `nvdisasm` or `cuobjdump` is
//! available, and counts in the PTX text what matters for the memory-ordering
//! contract: global loads and stores by width and qualifier, system-scope
//! acquire/release operations, fences, atomics, block barriers, `%globaltimer`
//! reads and loops.
//!
//! Design decisions:
//! * The PTX is read line by line with plain string handling (no regex, no
//!   PTX grammar): LLVM's NVPTX output is regular, one instruction per line,
//!   and inline asm arrives as written in `kernels-rs/src/device/ptx.rs`.
//!   Anything not recognised is simply not counted.
//! * Counts are static (instructions in the text, not executions). A kernel's
//!   counts include every `.func` it calls, directly or not, once each.
//! * Loops are natural loops of the function's control-flow graph: a block
//!   that some block it dominates branches back to. Simply counting branches
//!   to an earlier label over-counts: LLVM places cold blocks (timeouts, error
//!   records) after the loop and jumps back to a merge point.
//! * Tools are external programs found at run time ([`find_tool`]); nothing
//!   here needs a GPU or a CUDA driver.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};
use crate::kernels;

/// The architecture `inspect` looks at when none is given.
pub const DEFAULT_ARCH: &str = "sm_120";

/// Where `.ci/tools.sh` installs the CUDA tools, relative to the repository.
pub const TOOLS_DIR: &str = ".cache/cuda-tools/bin";

/// How to get the tools, for error messages and skip notices.
pub const INSTALL_HINT: &str =
    "run `bash .ci/tools.sh` (installs ptxas and nvdisasm from NVIDIA's PyPI wheels into .cache/cuda-tools/bin)";

// ---------------------------------------------------------------- tools

/// The environment variable that overrides where `tool` is found:
/// `TP_ALLREDUCE_PTXAS`, `TP_ALLREDUCE_NVDISASM`, `TP_ALLREDUCE_CUOBJDUMP`.
pub fn tool_env_var(tool: &str) -> String {
    format!("TP_ALLREDUCE_{}", tool.to_ascii_uppercase())
}

/// Locates a CUDA tool (`ptxas`, `nvdisasm`, `cuobjdump`), in order:
/// 1. the environment variable [`tool_env_var`] (when set and non-empty it is
///    the only place looked at: an explicit choice that points nowhere is
///    reported as "not found", not silently replaced by another tool);
/// 2. `<repo>/.cache/cuda-tools/bin/<tool>` (what `.ci/tools.sh` installs;
///    `<repo>` is the directory this crate was built from);
/// 3. each directory of `PATH`.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    if let Some(value) = env::var_os(tool_env_var(name)).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(value);
        return path.is_file().then_some(path);
    }
    let cached = Path::new(env!("CARGO_MANIFEST_DIR")).join(TOOLS_DIR).join(name);
    if cached.is_file() {
        return Some(cached);
    }
    let path = env::var_os("PATH")?;
    env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file())
}

/// [`find_tool`]`("ptxas")`, or an error that says how to install it.
pub fn require_ptxas() -> Result<PathBuf> {
    if let Some(path) = find_tool("ptxas") {
        return Ok(path);
    }
    let var = tool_env_var("ptxas");
    let looked = match env::var_os(&var).filter(|v| !v.is_empty()) {
        Some(v) => format!(
            "{var} is set to {}, which is not a file; when set it is the only place looked at",
            Path::new(&v).display()
        ),
        None => format!("{var} is not set, not in {}/{TOOLS_DIR}, not on PATH", env!("CARGO_MANIFEST_DIR")),
    };
    Err(Error::Config(format!(
        "ptxas not found ({looked}). To install it, {INSTALL_HINT}; or set {var} to a ptxas from CUDA 12.8 or newer"
    )))
}

/// The tool's version line (`Cuda compilation tools, release 13.0, V13.0.88`
/// gives `V13.0.88`), if it runs.
pub fn tool_version(tool: &Path) -> Option<String> {
    let out = Command::new(tool).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("release"))?;
    line.split_whitespace().last().map(str::to_string)
}

// ---------------------------------------------------------------- ptxas -v

/// Per-function resource use, as `ptxas -v` reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub registers: u32,
    pub stack_frame_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    /// Named barriers (`bar.sync N`) the function uses.
    pub barriers: u32,
    /// Static shared memory.
    pub shared_bytes: u32,
}

impl Resources {
    /// True when the function touches local memory (stack or spills).
    pub fn uses_local_memory(&self) -> bool {
        self.stack_frame_bytes != 0 || self.spill_store_bytes != 0 || self.spill_load_bytes != 0
    }
}

/// Parses the `ptxas -v` log into resources per function name.
///
/// ```text
/// ptxas info    : Compiling entry function 'sum_f32' for 'sm_120'
/// ptxas info    : Function properties for sum_f32
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 16 registers, used 1 barriers, 380 bytes cmem[0]
/// ```
/// The stack line belongs to the function named by the last "Function
/// properties for"; the "Used" line to the one named by the last "Compiling".
pub fn parse_ptxas_log(log: &str) -> BTreeMap<String, Resources> {
    let mut map: BTreeMap<String, Resources> = BTreeMap::new();
    let mut compiling: Option<String> = None;
    let mut properties: Option<String> = None;
    for line in log.lines() {
        let text = line.trim_start_matches("ptxas info").trim().trim_start_matches(':').trim();
        if let Some(rest) =
            text.strip_prefix("Compiling entry function ").or_else(|| text.strip_prefix("Compiling function "))
        {
            compiling = quoted(rest).map(str::to_string);
        } else if let Some(name) = text.strip_prefix("Function properties for ") {
            properties = Some(name.trim().to_string());
        } else if text.contains("bytes stack frame") {
            if let Some(name) = &properties {
                let r = map.entry(name.clone()).or_default();
                r.stack_frame_bytes = number_before(text, "bytes stack frame").unwrap_or(0);
                r.spill_store_bytes = number_before(text, "bytes spill stores").unwrap_or(0);
                r.spill_load_bytes = number_before(text, "bytes spill loads").unwrap_or(0);
            }
        } else if text.starts_with("Used ") {
            if let Some(name) = &compiling {
                let r = map.entry(name.clone()).or_default();
                r.registers = number_before(text, "registers").unwrap_or(0);
                r.barriers = number_before(text, "barriers").unwrap_or(0);
                r.shared_bytes = number_before(text, "bytes smem").unwrap_or(0);
            }
        }
    }
    map
}

/// `'name'` -> `name`.
fn quoted(s: &str) -> Option<&str> {
    let start = s.find('\'')? + 1;
    let len = s[start..].find('\'')?;
    Some(&s[start..start + len])
}

/// The integer just before `unit` in `text` (`"16 registers"`).
fn number_before(text: &str, unit: &str) -> Option<u32> {
    let at = text.find(unit)?;
    text[..at].split_whitespace().last()?.parse().ok()
}

/// The result of assembling one PTX file.
#[derive(Clone, Debug)]
pub struct Assembly {
    pub arch: String,
    pub cubin: PathBuf,
    /// ptxas's `-v` output (stdout and stderr).
    pub log: String,
    pub resources: BTreeMap<String, Resources>,
}

/// Runs `ptxas -arch=<arch> -v <ptx_file> -o <cubin>`. A rejected PTX is an
/// error carrying ptxas's messages.
pub fn assemble(ptxas: &Path, arch: &str, ptx_file: &Path, cubin: &Path) -> Result<Assembly> {
    let out = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg(ptx_file)
        .arg("-o")
        .arg(cubin)
        .output()
        .map_err(|e| Error::io(format!("running {}", ptxas.display()), e))?;
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(Error::Config(format!(
            "ptxas -arch={arch} rejected {} ({}): a kernels-rs bug, or a ptxas older than the PTX ISA version needs\n{}",
            ptx_file.display(),
            out.status,
            log.trim_end()
        )));
    }
    Ok(Assembly { arch: arch.to_string(), cubin: cubin.to_path_buf(), resources: parse_ptxas_log(&log), log })
}

/// A disassembler for cubins: `nvdisasm` preferred, else `cuobjdump`.
pub fn find_disassembler() -> Option<PathBuf> {
    find_tool("nvdisasm").or_else(|| find_tool("cuobjdump"))
}

/// SASS of a cubin: `nvdisasm -c cubin`, or `cuobjdump -sass cubin` when the
/// tool's name says cuobjdump.
pub fn disassemble(tool: &Path, cubin: &Path) -> Result<String> {
    let is_cuobjdump = tool.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.contains("cuobjdump"));
    let flag = if is_cuobjdump { "-sass" } else { "-c" };
    let out = Command::new(tool)
        .arg(flag)
        .arg(cubin)
        .output()
        .map_err(|e| Error::io(format!("running {}", tool.display()), e))?;
    if !out.status.success() {
        return Err(Error::Config(format!(
            "{} {flag} {} failed ({}): {}",
            tool.display(),
            cubin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim_end()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Splits a disassembly into (function, text) pieces: nvdisasm starts each
/// with `//----- .text.NAME ----`, cuobjdump with `Function : NAME`.
pub fn split_sass(sass: &str) -> Vec<(String, String)> {
    let mut pieces: Vec<(String, String)> = Vec::new();
    for line in sass.lines() {
        let t = line.trim();
        let start = if t.starts_with("//--") {
            t.split_whitespace().find_map(|w| w.strip_prefix(".text.")).map(str::to_string)
        } else {
            t.strip_prefix("Function : ").map(|n| n.trim().to_string())
        };
        if let Some(name) = start {
            pieces.push((name, String::new()));
        }
        if let Some((_, text)) = pieces.last_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    pieces
}

// ---------------------------------------------------------------- PTX text

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

/// How a basic block ends.
#[derive(Clone, Debug)]
enum BlockEnd {
    /// Falls through to the next block (the next one starts at a label).
    Fall,
    Branch {
        target: String,
        guarded: bool,
    },
    /// `ret`, `exit`, `trap`.
    Exit {
        guarded: bool,
    },
}

/// Basic blocks of one function, built one statement at a time, for loop
/// detection.
#[derive(Default)]
struct CfgBuilder {
    /// How each block ends; block 0 is the entry.
    ends: Vec<BlockEnd>,
    labels: BTreeMap<String, usize>,
    /// The last block has no instruction yet (a label may share it).
    last_empty: bool,
    /// The last block ended with a branch or exit: the next statement opens one.
    last_closed: bool,
}

impl CfgBuilder {
    fn open(&mut self) {
        self.ends.push(BlockEnd::Fall);
        self.last_empty = true;
        self.last_closed = false;
    }

    fn label(&mut self, name: &str) {
        if self.ends.is_empty() || self.last_closed || !self.last_empty {
            self.open();
        }
        self.labels.insert(name.to_string(), self.ends.len() - 1);
    }

    fn instruction(&mut self, end: Option<BlockEnd>) {
        if self.ends.is_empty() || self.last_closed {
            self.open();
        }
        self.last_empty = false;
        if let Some(end) = end {
            *self.ends.last_mut().expect("a block is open") = end;
            self.last_closed = true;
        }
    }

    fn successors(&self) -> Vec<Vec<usize>> {
        let n = self.ends.len();
        let next = |i: usize| if i + 1 < n { vec![i + 1] } else { vec![] };
        self.ends
            .iter()
            .enumerate()
            .map(|(i, end)| match end {
                BlockEnd::Fall => next(i),
                BlockEnd::Exit { guarded } => {
                    if *guarded {
                        next(i)
                    } else {
                        vec![]
                    }
                }
                BlockEnd::Branch { target, guarded } => {
                    let mut succ: Vec<usize> = self.labels.get(target).copied().into_iter().collect();
                    if *guarded {
                        succ.extend(next(i));
                    }
                    succ
                }
            })
            .collect()
    }

    /// (number of natural loops, deepest nesting). A natural loop is a block
    /// `h` with a branch back to it from a block it dominates; its body is
    /// every block that reaches such a latch without passing through `h`.
    /// Loops sharing a header count once; irreducible cycles (a jump back to
    /// a block that does not dominate the jump) are not loops.
    fn natural_loops(&self) -> (u32, u32) {
        let succ = self.successors();
        let n = succ.len();
        if n == 0 {
            return (0, 0);
        }
        // Reverse postorder of the blocks reachable from the entry.
        let mut order = Vec::with_capacity(n);
        let mut visited = vec![false; n];
        let mut stack = vec![(0usize, 0usize)];
        visited[0] = true;
        while let Some((b, i)) = stack.pop() {
            if i < succ[b].len() {
                stack.push((b, i + 1));
                let s = succ[b][i];
                if !visited[s] {
                    visited[s] = true;
                    stack.push((s, 0));
                }
            } else {
                order.push(b);
            }
        }
        order.reverse();
        let mut rank = vec![usize::MAX; n];
        for (r, &b) in order.iter().enumerate() {
            rank[b] = r;
        }
        let mut preds = vec![Vec::new(); n];
        for &b in &order {
            for &s in &succ[b] {
                preds[s].push(b);
            }
        }
        // Immediate dominators (Cooper, Harvey & Kennedy's iterative method).
        let mut idom: Vec<Option<usize>> = vec![None; n];
        idom[0] = Some(0);
        let mut changed = true;
        while changed {
            changed = false;
            for &b in &order[1..] {
                let mut new: Option<usize> = None;
                for &p in &preds[b] {
                    if idom[p].is_none() {
                        continue;
                    }
                    new = Some(match new {
                        None => p,
                        Some(mut a) => {
                            let mut c = p;
                            while a != c {
                                while rank[a] > rank[c] {
                                    a = idom[a].expect("processed");
                                }
                                while rank[c] > rank[a] {
                                    c = idom[c].expect("processed");
                                }
                            }
                            a
                        }
                    });
                }
                if new.is_some() && idom[b] != new {
                    idom[b] = new;
                    changed = true;
                }
            }
        }
        let dominates = |h: usize, mut b: usize| loop {
            if b == h {
                return true;
            }
            match idom[b] {
                Some(d) if d != b => b = d,
                _ => return false,
            }
        };
        // Loop bodies, by header.
        let mut bodies: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
        for &u in &order {
            for &h in &succ[u] {
                if dominates(h, u) {
                    let body = bodies.entry(h).or_insert_with(|| BTreeSet::from([h]));
                    let mut todo = vec![u];
                    while let Some(b) = todo.pop() {
                        if body.insert(b) {
                            todo.extend(preds[b].iter().copied());
                        }
                    }
                }
            }
        }
        let depth =
            bodies.keys().map(|h| bodies.values().filter(|body| body.contains(h)).count() as u32).max().unwrap_or(0);
        (bodies.len() as u32, depth)
    }
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
fn callee(operands: &str) -> Option<String> {
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

// ---------------------------------------------------------------- the report

/// One kernel entry: ptxas's resources and the PTX statistics.
#[derive(Clone, Debug)]
pub struct KernelReport {
    pub name: String,
    /// On the latency-critical path ([`crate::kernels::hot_entries`]).
    pub hot: bool,
    /// `None` when ptxas did not report the function.
    pub resources: Option<Resources>,
    pub ptx: PtxStats,
}

/// What [`inspect`] found for one architecture.
#[derive(Clone, Debug)]
pub struct Report {
    pub arch: String,
    /// `built` or `committed` ([`crate::kernels::PTX_ORIGIN`]).
    pub ptx_origin: &'static str,
    pub ptxas: PathBuf,
    pub ptxas_version: Option<String>,
    /// The disassembler used, if one was found.
    pub disassembler: Option<PathBuf>,
    pub kernels: Vec<KernelReport>,
    pub out_dir: PathBuf,
    /// Files written, in order.
    pub files: Vec<PathBuf>,
    /// Things the reader should know (no disassembler, unreported kernels).
    pub notes: Vec<String>,
}

/// Inspects the embedded PTX of `arch` and writes into `out_dir`:
/// `<arch>.ptx`, `<arch>.cubin`, `<arch>.ptxas.txt` (the `-v` log), and when
/// a disassembler is found `<arch>.sass` plus `sass-<arch>/<kernel>.sass`
/// (both removed first, so no stale SASS survives a run without one).
pub fn inspect(arch: &str, out_dir: &Path) -> Result<Report> {
    let embedded = kernels::for_arch(arch).ok_or_else(|| {
        let built: Vec<&str> = kernels::embedded().iter().map(|p| p.arch).collect();
        Error::invalid(format!("no embedded PTX for `{arch}`; this build has {}", built.join(", ")))
    })?;
    let ptxas = require_ptxas()?;
    fs::create_dir_all(out_dir).map_err(|e| Error::io(format!("creating {}", out_dir.display()), e))?;
    let mut files = Vec::new();
    let mut notes = Vec::new();

    let ptx_file = out_dir.join(format!("{arch}.ptx"));
    write_file(&ptx_file, embedded.text, &mut files)?;
    let cubin = out_dir.join(format!("{arch}.cubin"));
    let assembly = assemble(&ptxas, arch, &ptx_file, &cubin)?;
    files.push(cubin.clone());
    write_file(&out_dir.join(format!("{arch}.ptxas.txt")), &assembly.log, &mut files)?;

    // SASS from an earlier run would no longer match this PTX: drop it first
    // (only the files this function writes).
    let sass_file = out_dir.join(format!("{arch}.sass"));
    let sass_dir = out_dir.join(format!("sass-{arch}"));
    if sass_file.exists() {
        fs::remove_file(&sass_file).map_err(|e| Error::io(format!("removing {}", sass_file.display()), e))?;
    }
    if sass_dir.exists() {
        fs::remove_dir_all(&sass_dir).map_err(|e| Error::io(format!("removing {}", sass_dir.display()), e))?;
    }
    let disassembler = find_disassembler();
    match &disassembler {
        Some(tool) => {
            let sass = disassemble(tool, &cubin)?;
            write_file(&sass_file, &sass, &mut files)?;
            fs::create_dir_all(&sass_dir).map_err(|e| Error::io(format!("creating {}", sass_dir.display()), e))?;
            for (name, text) in split_sass(&sass) {
                write_file(&sass_dir.join(format!("{name}.sass")), &text, &mut files)?;
            }
        }
        None => notes.push(format!(
            "no SASS: neither nvdisasm nor cuobjdump found (set {} or {INSTALL_HINT})",
            tool_env_var("nvdisasm")
        )),
    }

    let hot: BTreeSet<String> = kernels::hot_entries().into_iter().collect();
    let kernels: Vec<KernelReport> = analyze_ptx(embedded.text)
        .into_iter()
        .map(|stats| KernelReport {
            name: stats.name.clone(),
            hot: hot.contains(&stats.name),
            resources: assembly.resources.get(&stats.name).copied(),
            ptx: stats,
        })
        .collect();
    for k in kernels.iter().filter(|k| k.resources.is_none()) {
        notes.push(format!("ptxas reported no resources for {}", k.name));
    }
    Ok(Report {
        arch: arch.to_string(),
        ptx_origin: kernels::PTX_ORIGIN,
        ptxas_version: tool_version(&ptxas),
        ptxas,
        disassembler,
        kernels,
        out_dir: out_dir.to_path_buf(),
        files,
        notes,
    })
}

fn write_file(path: &Path, text: &str, files: &mut Vec<PathBuf>) -> Result<()> {
    fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    files.push(path.to_path_buf());
    Ok(())
}

/// `a/b/c/d` for four counts.
fn slashed(values: &[u32]) -> String {
    values.iter().map(u32::to_string).collect::<Vec<_>>().join("/")
}

/// `k=v k=v` for a map of counts.
fn pairs<K: AsRef<str>>(items: impl IntoIterator<Item = (K, u32)>) -> String {
    items.into_iter().map(|(k, n)| format!("{}={n}", k.as_ref())).collect::<Vec<_>>().join(" ")
}

/// The report as text: a header, one table row per kernel, the
/// memory-ordering detail per kernel, notes, files and a summary line.
pub fn render(report: &Report) -> String {
    const WIDTHS: [u32; 4] = [128, 64, 32, 16];
    let mut out = String::new();
    let _ = writeln!(
        out,
        "tp-allreduce inspect {}: PTX {}, ptxas {} ({})",
        report.arch,
        report.ptx_origin,
        report.ptxas_version.as_deref().unwrap_or("?"),
        report.ptxas.display()
    );
    let _ = writeln!(
        out,
        "  regs, stack, spill (store/load bytes), bar: ptxas -v. Other columns: static counts in the PTX, callees included.\n  \
         ld.g/st.g: global loads/stores of 128/64/32/16 bits (any qualifier); gen: generic-space loads/stores;\n  \
         acq/rel.sys: system-scope acquire/release operations; fence: sys/narrower; atom: atom+red; bar: bar.sync/bar.red;\n  \
         gtimer: %globaltimer reads; loops: natural loops (deepest nesting). * = hot kernel (no local memory allowed)"
    );
    let header = [
        "kernel",
        "regs",
        "stack",
        "spill",
        "bar",
        "ld.g 128/64/32/16",
        "st.g 128/64/32/16",
        "gen ld/st",
        "acq.sys",
        "rel.sys",
        "fence",
        "atom",
        "bar s/r",
        "gtimer",
        "loops",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for k in &report.kernels {
        let p = &k.ptx;
        let (regs, stack, spill, bar) = match &k.resources {
            Some(r) => (
                r.registers.to_string(),
                r.stack_frame_bytes.to_string(),
                format!("{}/{}", r.spill_store_bytes, r.spill_load_bytes),
                r.barriers.to_string(),
            ),
            None => ("?".into(), "?".into(), "?".into(), "?".into()),
        };
        let loads: Vec<u32> = WIDTHS.iter().map(|&b| p.count(Access::Load, Space::Global, b)).collect();
        let stores: Vec<u32> = WIDTHS.iter().map(|&b| p.count(Access::Store, Space::Global, b)).collect();
        let barrier = |name: &str| p.barriers.get(name).copied().unwrap_or(0);
        rows.push(vec![
            format!("{}{}", k.name, if k.hot { "*" } else { "" }),
            regs,
            stack,
            spill,
            bar,
            slashed(&loads),
            slashed(&stores),
            format!("{}/{}", p.count_space(Access::Load, Space::Generic), p.count_space(Access::Store, Space::Generic)),
            p.sys_acquire.to_string(),
            p.sys_release.to_string(),
            format!("{}/{}", p.sys_fences(), p.other_fences()),
            p.atomics.values().sum::<u32>().to_string(),
            format!("{}/{}", barrier("bar.sync"), barrier("bar.red")),
            p.globaltimer_reads.to_string(),
            format!("{}({})", p.loops, p.max_loop_depth),
        ]);
    }
    let widths: Vec<usize> = (0..header.len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
    for (i, row) in rows.iter().enumerate() {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            if c == 0 {
                let _ = write!(line, "{cell:<w$}", w = widths[c]);
            } else {
                let _ = write!(line, "  {cell:>w$}", w = widths[c]);
            }
        }
        let _ = writeln!(out, "{line}");
        if i == 0 {
            let _ = writeln!(out, "{}", "-".repeat(line.len()));
        }
    }

    let _ = writeln!(out, "\nmemory-ordering detail (static counts by space, qualifier and width; fences; atomics):");
    for k in &report.kernels {
        let p = &k.ptx;
        let mut line = format!("  {}:", k.name);
        let memory =
            pairs(p.memory.iter().filter(|(op, _)| op.space != Space::Generic).map(|(op, n)| (op.label(), *n)));
        for text in
            [memory, pairs(p.fences.iter().map(|(k, n)| (k, *n))), pairs(p.atomics.iter().map(|(k, n)| (k, *n)))]
        {
            if !text.is_empty() {
                let _ = write!(line, " {text}");
            }
        }
        if !p.callees.is_empty() {
            let _ = write!(line, " calls={}", p.callees.join(","));
        }
        if p.indirect_calls > 0 {
            let _ = write!(line, " indirect-calls={}", p.indirect_calls);
        }
        let _ = writeln!(out, "{line}");
    }

    for note in &report.notes {
        let _ = writeln!(out, "note: {note}");
    }
    let _ = writeln!(out, "wrote {} files to {}", report.files.len(), report.out_dir.display());
    let _ = writeln!(out, "{}", summary(report));
    out
}

/// One line: kernel count, register range, local-memory users, totals.
pub fn summary(report: &Report) -> String {
    let n = report.kernels.len();
    let hot = report.kernels.iter().filter(|k| k.hot).count();
    let with_res: Vec<(&str, Resources)> =
        report.kernels.iter().filter_map(|k| k.resources.map(|r| (k.name.as_str(), r))).collect();
    let max = with_res.iter().max_by_key(|(_, r)| r.registers);
    let local: Vec<&str> = with_res.iter().filter(|(_, r)| r.uses_local_memory()).map(|(n, _)| *n).collect();
    let hot_local = local.iter().filter(|name| report.kernels.iter().any(|k| k.hot && k.name == **name)).count();
    let total = |f: &dyn Fn(&PtxStats) -> u32| report.kernels.iter().map(|k| f(&k.ptx)).sum::<u32>();
    format!(
        "summary {}: {n} kernels ({hot} hot); max {} registers{}; local memory (stack or spills) in {} kernels ({hot_local} hot){}; \
         {} sys-acquire, {} sys-release, {} sys-fences, {} atomics, {} loops",
        report.arch,
        max.map(|(_, r)| r.registers).unwrap_or(0),
        max.map(|(n, _)| format!(" ({n})")).unwrap_or_default(),
        local.len(),
        if local.is_empty() { String::new() } else { format!(": {}", local.join(", ")) },
        total(&|p| p.sys_acquire),
        total(&|p| p.sys_release),
        total(&|p| p.sys_fences()),
        total(&|p| p.atomics.values().sum()),
        total(&|p| p.loops),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTXAS_LOG: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'two_shot_push_f32' for 'sm_120'
ptxas info    : Function properties for two_shot_push_f32
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 48 registers, used 1 barriers
ptxas info    : Compile time = 64.164 ms
ptxas info    : Function properties for helper
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'sum_f32' for 'sm_80'
ptxas info    : Function properties for sum_f32
    24 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 37 registers, 1024 bytes smem, 380 bytes cmem[0]
";

    #[test]
    fn ptxas_log_is_parsed_per_function() {
        let m = parse_ptxas_log(PTXAS_LOG);
        assert_eq!(m["two_shot_push_f32"], Resources { registers: 48, barriers: 1, ..Default::default() });
        assert_eq!(
            m["sum_f32"],
            Resources { registers: 37, stack_frame_bytes: 24, shared_bytes: 1024, ..Default::default() }
        );
        assert!(m["sum_f32"].uses_local_memory());
        assert_eq!(
            m["helper"],
            Resources { stack_frame_bytes: 16, spill_store_bytes: 8, spill_load_bytes: 4, ..Default::default() }
        );
    }

    const PTX: &str = r#"
//
// Generated by LLVM NVPTX Back-End
//
.version 8.7
.target sm_120
.address_size 64

	// .globl	helper
.visible .func  (.param .b32 func_retval0) helper(
	.param .b64 helper_param_0
)
{
	.reg .b32 	%r<2>;
	ld.param.b64 	%rd1, [helper_param_0];
	// begin inline asm
	fence.acq_rel.sys;
	// end inline asm
	ld.global.b8 	%rs1, [%rd1];
	st.param.b32 	[func_retval0], %r1;
	ret;
}
.extern .func  (.param .b32 func_retval0) vprintf(
	.param .b64 vprintf_param_0
);
	// .globl	k1
.visible .entry k1(
	.param .u64 .ptr .align 1 k1_param_0,
	.param .u32 k1_param_1
)
{
	.reg .pred 	%p<6>;
	ld.param.b64 	%rd6, [k1_param_0];
	ld.global.v4.b32 	{%r5, %r6, %r7, %r8}, [%rd1+288]; // a comment with { brace
	// begin inline asm
	ld.volatile.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd2];
	// end inline asm
	ld.relaxed.sys.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd2];
	ld.global.v2.b64 	{%rd3, %rd4}, [%rd1];
	ld.global.b64 	%rd7, [%rd1+144];
	ld.global.v2.b32 	{%r1, %r2}, [%rd1];
	ld.acquire.sys.global.u32 %r9, [%rd11];
	ld.global.u16 %rs1, [%rd12];
	ld.global.nc.f32 %f1, [%rd12];
	ld.v2.b32 	{%r4, %r5}, [%rd14+24];
	st.b32 	[%rd28], %r7;
	st.global.v4.b32 [%rd9], {%r1, %r2, %r3, %r4};
	st.release.sys.global.u32 [%rd10], %r6;
	st.relaxed.sys.global.v4.b32 [%rd10], {%r1, %r2, %r3, %r4};
	st.shared::cta.b32 [%rd10], %r6;
	atom.relaxed.gpu.global.cas.b32 %r1, [%rd1], %r2, %r3;
	atom.acq_rel.sys.global.add.u32 %r1, [%rd1], %r2;
	red.release.sys.global.add.u32 [%rd1], %r2;
	atom.global.add.u32 %r1, [%rd1], %r2;
	fence.sc.sys;
	fence.acq_rel.gpu;
	membar.gl;
	bar.sync 	0;
	barrier.sync 0;
	{ .reg .pred %p_in, %p_out;
setp.ne.u32 %p_in, %r242, 0;
bar.red.or.pred %p_out, 0, %p_in;
selp.u32 %r32, 1, 0, %p_out; }
	mov.u64 %rd142, %globaltimer;
	{ // callseq 0, 0
	.param .b64 param0;
	call.uni (retval0), helper, (param0);
	}
	call.uni (retval0), %rd99, (param0), prototype_0;
$L__BB0_1:
	add.s32 %r1, %r1, 1;
$L__BB0_2:
	add.s32 %r1, %r1, 1;
	@%p1 bra 	$L__BB0_2;
	@!%p2 bra 	$L__BB0_1;
	bra.uni 	$L__BB0_9;
$L__BB0_3:
	@%p3 bra $L__BB0_3;
$L__BB0_9:
	@%p1 bra 	$L__BB0_1;
	ret;
}
	// .globl	k2
.visible .entry k2()
{
	ret;
}
"#;

    #[test]
    fn functions_and_entries_are_found() {
        let functions = parse_functions(PTX);
        let names: Vec<(&str, bool)> = functions.iter().map(|f| (f.name.as_str(), f.is_entry)).collect();
        assert_eq!(names, [("helper", false), ("k1", true), ("k2", true)]);
        assert_eq!(entry_names(PTX), ["k1", "k2"]);
        // The body of k1 runs to its own closing brace, not an inner one.
        assert!(functions[1].body.iter().any(|l| l.contains("ret")));
        assert!(functions[1].body.iter().any(|l| l.contains("$L__BB0_9")));
    }

    fn op(access: Access, space: Space, qualifier: &str, bits: u32) -> MemOp {
        MemOp { access, space, qualifier: qualifier.to_string(), bits }
    }

    #[test]
    fn loads_and_stores_by_space_qualifier_and_width() {
        let stats = analyze_ptx(PTX);
        let k1 = &stats[0];
        use Access::*;
        use Space::*;
        let expect = [
            (op(Load, Global, "weak", 128), 2), // v4.b32 + v2.b64
            (op(Load, Global, "volatile", 128), 1),
            (op(Load, Global, "relaxed.sys", 128), 1),
            (op(Load, Global, "weak", 64), 2), // b64 + v2.b32
            (op(Load, Global, "acquire.sys", 32), 1),
            (op(Load, Global, "weak", 16), 1),
            (op(Load, Global, "nc", 32), 1),
            (op(Load, Global, "weak", 8), 1), // from helper
            (op(Load, Generic, "weak", 64), 1),
            (op(Store, Generic, "weak", 32), 1),
            (op(Store, Global, "weak", 128), 1),
            (op(Store, Global, "release.sys", 32), 1),
            (op(Store, Global, "relaxed.sys", 128), 1),
            (op(Store, Shared, "weak", 32), 1),
        ];
        let expected: BTreeMap<MemOp, u32> = expect.iter().cloned().collect();
        assert_eq!(k1.memory, expected);
        assert_eq!(k1.count(Load, Global, 128), 4);
        assert_eq!(k1.count(Load, Global, 64), 2);
        assert_eq!(k1.count_space(Store, Global), 3);
        assert_eq!(op(Load, Global, "acquire.sys", 32).label(), "ld.global.acquire.sys.32");
    }

    #[test]
    fn ordering_operations_are_counted() {
        let k1 = &analyze_ptx(PTX)[0];
        // ld.acquire.sys + atom.acq_rel.sys
        assert_eq!(k1.sys_acquire, 2);
        // st.release.sys + atom.acq_rel.sys + red.release.sys
        assert_eq!(k1.sys_release, 3);
        let fences: Vec<(&str, u32)> = k1.fences.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert_eq!(fences, [("fence.acq_rel.gpu", 1), ("fence.acq_rel.sys", 1), ("fence.sc.sys", 1), ("membar.gl", 1)]);
        assert_eq!((k1.sys_fences(), k1.other_fences()), (2, 2));
        let atomics: Vec<(&str, u32)> = k1.atomics.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert_eq!(
            atomics,
            [
                ("atom.acq_rel.sys.add", 1),
                ("atom.relaxed.gpu.add", 1),
                ("atom.relaxed.gpu.cas", 1),
                ("red.release.sys.add", 1)
            ]
        );
        let barriers: Vec<(&str, u32)> = k1.barriers.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert_eq!(barriers, [("bar.red", 1), ("bar.sync", 2)]);
        assert_eq!(k1.globaltimer_reads, 1);
        assert_eq!(k1.callees, ["helper"]);
        assert_eq!(k1.indirect_calls, 1);
    }

    #[test]
    fn loops_and_nesting() {
        let stats = analyze_ptx(PTX);
        let k1 = &stats[0];
        // BB0_1 (outer, two latches) contains BB0_2 (a self loop). BB0_3 is
        // unreachable (nothing branches to it), so its self loop does not count.
        assert_eq!((k1.loops, k1.max_loop_depth), (2, 2));
        let k2 = &stats[1];
        assert_eq!((k2.loops, k2.max_loop_depth), (0, 0));
        assert!(k2.memory.is_empty());
    }

    #[test]
    fn sequential_loops_are_not_nested() {
        let ptx = ".visible .entry k()\n{\n$A:\n\t@%p1 bra $A;\n$B:\n\tbra.uni $C;\n$C:\n\t@%p2 bra $B;\n\tret;\n}\n";
        let k = &analyze_ptx(ptx)[0];
        assert_eq!((k.loops, k.max_loop_depth), (2, 1));
    }

    #[test]
    fn a_jump_back_to_a_merge_point_is_not_a_loop() {
        // LLVM layout: a cold block placed after the merge point jumps back to it.
        let ptx = ".visible .entry k()\n{\n\t@%p1 bra $COLD;\n$MERGE:\n\tret;\n$COLD:\n\tst.global.u32 [%rd1], %r1;\n\tbra.uni $MERGE;\n}\n";
        let k = &analyze_ptx(ptx)[0];
        assert_eq!((k.loops, k.max_loop_depth), (0, 0));
    }

    #[test]
    fn a_spin_loop_inside_a_grid_stride_loop() {
        // Outer loop $OUT; inner spin $SPIN with a timeout exit to a cold block
        // placed after the outer latch, which jumps back into the outer body.
        let ptx = "\
.visible .entry k()
{
$OUT:
\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];
$SPIN:
\tld.acquire.sys.global.u32 %r5, [%rd2];
\tmov.u64 %rd3, %globaltimer;
\t@%p1 bra $TIMEOUT;
\t@%p2 bra $SPIN;
$NEXT:
\t@%p3 bra $OUT;
\tret;
$TIMEOUT:
\tst.global.u32 [%rd4], %r6;
\tbra.uni $NEXT;
}
";
        let k = &analyze_ptx(ptx)[0];
        assert_eq!((k.loops, k.max_loop_depth), (2, 2));
        assert_eq!((k.sys_acquire, k.globaltimer_reads), (1, 1));
    }

    #[test]
    fn declarations_are_not_functions() {
        let ptx = ".extern .func foo(\n\t.param .b32 a\n);\n.visible .entry k(\n\t.param .b32 a\n)\n{\n\tret;\n}\n";
        let f = parse_functions(ptx);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].name, "k");
    }

    #[test]
    fn sass_is_split_per_function() {
        let nv = "\t.target\tsm_120\n//--------------------- .text.k1   --------------------------\n  /*0000*/ EXIT ;\n//--------------------- .text.k2   -----\n  /*0000*/ RET ;\n";
        let pieces = split_sass(nv);
        assert_eq!(pieces.len(), 2);
        assert_eq!(pieces[0].0, "k1");
        assert!(pieces[0].1.contains("EXIT") && !pieces[0].1.contains("RET"));
        let cuobj = "\tcode for sm_90\n\t\tFunction : k1\n\t/*0000*/ EXIT ;\n\t\tFunction : k2\n\t/*0000*/ RET ;\n";
        let names: Vec<String> = split_sass(cuobj).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["k1", "k2"]);
    }

    #[test]
    fn callee_names() {
        assert_eq!(callee("(retval0), helper, (param0)").as_deref(), Some("helper"));
        assert_eq!(callee("helper, (param0);").as_deref(), Some("helper"));
        assert_eq!(callee("(retval0), %rd9, (param0), prototype_0"), None);
    }

    #[test]
    fn tool_env_var_names() {
        assert_eq!(tool_env_var("ptxas"), "TP_ALLREDUCE_PTXAS");
        assert_eq!(tool_env_var("nvdisasm"), "TP_ALLREDUCE_NVDISASM");
    }
}
