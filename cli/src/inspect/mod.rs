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

mod cfg;
pub mod ptx_text;
pub mod render;
pub mod sass;
pub mod tools;

pub use ptx_text::{analyze_ptx, entry_names, parse_functions, Access, MemOp, PtxFunction, PtxStats, Space};
pub use render::{render, summary};
pub use tools::{
    assemble, disassemble, find_disassembler, find_tool, parse_ptxas_log, require_ptxas, split_sass, tool_env_var,
    tool_version, Assembly, Resources, DEFAULT_ARCH, INSTALL_HINT, TOOLS_DIR,
};

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use tp_allreduce::error::{Error, Result};
use tp_allreduce::kernels;

/// One kernel entry: ptxas's resources and the PTX statistics.
#[derive(Clone, Debug)]
pub struct KernelReport {
    pub name: String,
    /// On the latency-critical path ([`tp_allreduce::kernels::hot_entries`]).
    pub hot: bool,
    /// `None` when ptxas did not report the function.
    pub resources: Option<Resources>,
    pub ptx: PtxStats,
    /// Sentinel kernels with SASS: the path to the first peer store.
    pub first_peer_store: Option<sass::FirstPeerStore>,
}

/// What [`inspect`] found for one architecture.
#[derive(Clone, Debug)]
pub struct Report {
    pub arch: String,
    /// `built` or `committed` ([`tp_allreduce::kernels::PTX_ORIGIN`]).
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
    let mut per_kernel_sass = Vec::new();
    match &disassembler {
        Some(tool) => {
            let sass = disassemble(tool, &cubin)?;
            write_file(&sass_file, &sass, &mut files)?;
            fs::create_dir_all(&sass_dir).map_err(|e| Error::io(format!("creating {}", sass_dir.display()), e))?;
            per_kernel_sass = split_sass(&sass);
            for (name, text) in &per_kernel_sass {
                write_file(&sass_dir.join(format!("{name}.sass")), text, &mut files)?;
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
            first_peer_store: per_kernel_sass
                .iter()
                .find(|(n, _)| *n == stats.name && kernels::is_sentinel_entry(n))
                .and_then(|(_, text)| sass::first_peer_store(text)),
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

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
