//! The external CUDA tools `inspect` runs: finding them, `ptxas -v` (and
//! its log, parsed per function), and disassembly to SASS.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use tp_allreduce::error::{Error, Result};

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

/// The repository this crate was built in (the parent of `cli/`).
fn repo() -> &'static Path {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest)
}

/// Locates a CUDA tool (`ptxas`, `nvdisasm`, `cuobjdump`), in order:
/// 1. the environment variable [`tool_env_var`] (when set and non-empty it is
///    the only place looked at: an explicit choice that points nowhere is
///    reported as "not found", not silently replaced by another tool);
/// 2. `<repo>/.cache/cuda-tools/bin/<tool>` (what `.ci/tools.sh` installs;
///    `<repo>` is the repository this crate was built in);
/// 3. each directory of `PATH`.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    if let Some(value) = env::var_os(tool_env_var(name)).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(value);
        return path.is_file().then_some(path);
    }
    let cached = repo().join(TOOLS_DIR).join(name);
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
        None => format!("{var} is not set, not in {}/{TOOLS_DIR}, not on PATH", repo().display()),
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
