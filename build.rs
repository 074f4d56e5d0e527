//! Compiles `kernels-rs` to one PTX file per GPU architecture and embeds them.
//!
//! * Architectures: `TP_ALLREDUCE_PTX_ARCHS` (comma separated), default
//!   `sm_120,sm_90,sm_89,sm_80`.
//! * Source of the PTX, `TP_ALLREDUCE_BUILD_PTX`:
//!   - unset: build from source when the nightly toolchain with `rust-src` is
//!     installed, otherwise use the PTX committed in `kernels-rs/ptx/` (so a
//!     crate depending on tp-allreduce builds on stable Rust alone);
//!   - `1`: always build from source; fail with the command to run when
//!     nightly or rust-src is missing;
//!   - `0`: always use the committed PTX.
//! * `TP_ALLREDUCE_WRITE_PTX=1` (with a source build) refreshes the
//!   committed PTX and `kernels-rs/ptx/MANIFEST` (see `.ci/regen-ptx`).
//!
//! The nested cargo gets its own target directory (reusing the outer one
//! deadlocks on cargo's build lock) and a clean environment (the outer
//! cargo's RUSTFLAGS/RUSTC/target settings must not leak into it).

use std::collections::BTreeMap;
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEFAULT_ARCHS: &str = "sm_120,sm_90,sm_89,sm_80";
const KERNEL_FLAGS: &str = "-Zunstable-options -Cpanic=immediate-abort";
const FIX_NIGHTLY: &str = "rustup toolchain install nightly && rustup component add rust-src --toolchain nightly";

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels = root.join("kernels-rs");
    println!("cargo:rerun-if-changed=kernels-rs/src");
    println!("cargo:rerun-if-changed=kernels-rs/Cargo.toml");
    println!("cargo:rerun-if-changed=kernels-rs/ptx");
    for var in ["TP_ALLREDUCE_PTX_ARCHS", "TP_ALLREDUCE_BUILD_PTX", "TP_ALLREDUCE_WRITE_PTX"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let archs: Vec<String> = env::var("TP_ALLREDUCE_PTX_ARCHS")
        .unwrap_or_else(|_| DEFAULT_ARCHS.to_string())
        .split(',')
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .collect();
    for arch in &archs {
        let ok = arch.strip_prefix("sm_").and_then(|n| n.parse::<u32>().ok()).is_some_and(|n| n >= 80);
        if !ok {
            fail(&format!(
                "TP_ALLREDUCE_PTX_ARCHS: `{arch}` is not a supported architecture (sm_80 or newer, e.g. sm_120)"
            ));
        }
    }

    let sources_hash = hash_sources(&kernels);
    let mode = env::var("TP_ALLREDUCE_BUILD_PTX").unwrap_or_default();
    let nightly = nightly_status();
    let build_from_source = match mode.as_str() {
        "1" | "always" => {
            if let Err(why) = &nightly {
                fail(&format!(
                    "TP_ALLREDUCE_BUILD_PTX=1 needs the nightly toolchain with rust-src: {why}.\n  Run: {FIX_NIGHTLY}"
                ));
            }
            true
        }
        "0" | "never" => false,
        "" => nightly.is_ok(),
        other => fail(&format!("TP_ALLREDUCE_BUILD_PTX={other}: expected 1 or 0")),
    };

    let mut ptx: BTreeMap<String, PathBuf> = BTreeMap::new();
    let rustc_version;
    if build_from_source {
        rustc_version = nightly.clone().unwrap_or_default();
        let staged = stage_sources(&kernels, &out).unwrap_or_else(|e| fail(&e));
        let handles: Vec<_> = archs
            .iter()
            .map(|arch| {
                let arch = arch.clone();
                let kernels = staged.clone();
                let out = out.clone();
                std::thread::spawn(move || build_arch(&kernels, &out, &arch).map(|p| (arch, p)))
            })
            .collect();
        for h in handles {
            match h.join().expect("PTX build thread panicked") {
                Ok((arch, path)) => {
                    ptx.insert(arch, path);
                }
                Err(e) => fail(&e),
            }
        }
        if env::var("TP_ALLREDUCE_WRITE_PTX").as_deref() == Ok("1") {
            write_committed(&kernels, &ptx, &sources_hash, &rustc_version);
        }
    } else {
        rustc_version = String::new();
        for arch in &archs {
            let path = kernels.join("ptx").join(format!("{arch}.ptx"));
            if !path.exists() {
                fail(&format!(
                    "no committed PTX for {arch} at {} and PTX is not being built from source.\n  Install the kernel toolchain ({FIX_NIGHTLY}) and build again, or drop {arch} from TP_ALLREDUCE_PTX_ARCHS.",
                    path.display()
                ));
            }
            ptx.insert(arch.clone(), path);
        }
    }

    for (arch, path) in &ptx {
        let text = fs::read_to_string(path).unwrap_or_else(|e| fail(&format!("reading {}: {e}", path.display())));
        if text.contains(".extern .func") {
            fail(&format!(
                "PTX for {arch} references an external function (`.extern .func`), which the driver cannot load. A kernel calls something core did not inline (often a panic path): {}",
                path.display()
            ));
        }
    }

    // The generated index: (arch, sm number, PTX text) per architecture.
    let mut index = String::new();
    writeln!(index, "/// PTX per architecture: (name, compute capability as major*10+minor, text).").unwrap();
    writeln!(index, "pub const EMBEDDED_PTX: &[(&str, u32, &str)] = &[").unwrap();
    for (arch, path) in &ptx {
        let sm: u32 = arch[3..].parse().unwrap();
        writeln!(index, "    ({arch:?}, {sm}, include_str!({:?})),", path.display().to_string()).unwrap();
    }
    writeln!(index, "];").unwrap();
    writeln!(index, "/// \"built\" (from kernels-rs sources in this build) or \"committed\" (kernels-rs/ptx).")
        .unwrap();
    writeln!(index, "pub const PTX_ORIGIN: &str = {:?};", if build_from_source { "built" } else { "committed" })
        .unwrap();
    writeln!(index, "/// Hash of the kernels-rs sources this build saw.").unwrap();
    writeln!(index, "pub const KERNEL_SOURCES_HASH: &str = {sources_hash:?};").unwrap();
    writeln!(index, "/// rustc that built the PTX (empty when committed PTX is used).").unwrap();
    writeln!(index, "pub const PTX_RUSTC_VERSION: &str = {rustc_version:?};").unwrap();
    fs::write(out.join("ptx_index.rs"), index).expect("writing ptx_index.rs");
}

fn fail(msg: &str) -> ! {
    eprintln!("\nerror: tp-allreduce build: {msg}\n");
    std::process::exit(1);
}

/// A `Command` for the nightly toolchain, stripped of the outer cargo's
/// settings.
fn nightly_command(program: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", program]);
    for (key, _) in env::vars() {
        let leak = key.starts_with("CARGO_") && key != "CARGO_HOME"
            || key.starts_with("RUSTC")
            || key.starts_with("RUSTDOC")
            || key == "RUSTFLAGS"
            || key == "RUSTUP_TOOLCHAIN"
            || key == "TARGET"
            || key == "HOST"
            || key == "OUT_DIR";
        if leak {
            cmd.env_remove(&key);
        }
    }
    cmd
}

/// `Ok(rustc version)` when nightly and its rust-src are installed.
fn nightly_status() -> Result<String, String> {
    let version = nightly_command("rustc").arg("--version").output().map_err(|e| format!("cannot run rustup ({e})"))?;
    if !version.status.success() {
        return Err("the nightly toolchain is not installed".into());
    }
    let sysroot = nightly_command("rustc")
        .args(["--print", "sysroot"])
        .output()
        .map_err(|e| format!("cannot run nightly rustc ({e})"))?;
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_string();
    let core_src = Path::new(&sysroot).join("lib/rustlib/src/rust/library/core");
    if !core_src.exists() {
        return Err("the nightly rust-src component is missing".into());
    }
    Ok(String::from_utf8_lossy(&version.stdout).trim().to_string())
}

/// Copies the kernel crate to `out/kernels-rs-src` as a workspace of its own
/// (inside the outer workspace it would resolve the host's dependencies and
/// share its lock file); the PTX does not depend on where the sources are.
fn stage_sources(kernels: &Path, out: &Path) -> Result<PathBuf, String> {
    let staged = out.join("kernels-rs-src");
    if staged.exists() {
        fs::remove_dir_all(&staged).map_err(|e| format!("{}: {e}", staged.display()))?;
    }
    let mut files = Vec::new();
    collect_files(&kernels.join("src"), &mut files);
    for file in files {
        let rel = file.strip_prefix(kernels).map_err(|e| e.to_string())?;
        let dest = staged.join(rel);
        fs::create_dir_all(dest.parent().unwrap()).map_err(|e| e.to_string())?;
        fs::copy(&file, &dest).map_err(|e| format!("{}: {e}", file.display()))?;
    }
    let manifest = fs::read_to_string(kernels.join("Cargo.toml")).map_err(|e| e.to_string())?;
    fs::write(staged.join("Cargo.toml"), format!("{manifest}\n[workspace]\n")).map_err(|e| e.to_string())?;
    Ok(staged)
}

/// PTX ISA above the target's default where an entry needs it: the sm_90
/// cluster entries use `st.async` and `mbarrier` expect-tx (PTX 8.1; LLVM
/// emits 7.8 for sm_90 by default, 8.7 for sm_120). PTX 8.1 loads on
/// drivers of CUDA 12.1 and newer.
fn ptx_isa_flags(arch: &str) -> &'static [&'static str] {
    if arch == "sm_90" {
        &["-C", "target-feature=+ptx81"]
    } else {
        &[]
    }
}

fn build_arch(staged: &Path, out: &Path, arch: &str) -> Result<PathBuf, String> {
    let target_dir = out.join("ptx-target").join(arch);
    let output = nightly_command("cargo")
        .current_dir(staged)
        .args(["rustc", "--release", "--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core", "--target-dir"])
        .arg(&target_dir)
        .args(["--", "-C", &format!("target-cpu={arch}"), "--emit=asm"])
        .args(ptx_isa_flags(arch))
        .env("RUSTFLAGS", KERNEL_FLAGS)
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "3")
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS", "false")
        .output()
        .map_err(|e| format!("running nightly cargo for {arch}: {e}. Run: {FIX_NIGHTLY}"))?;
    if !output.status.success() {
        return Err(format!(
            "building kernels-rs for {arch} failed:\n{}\nIf the toolchain is missing, run: {FIX_NIGHTLY}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let deps = target_dir.join("nvptx64-nvidia-cuda/release/deps");
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in fs::read_dir(&deps).map_err(|e| format!("{}: {e}", deps.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("tp_allreduce_kernels") && name.ends_with(".s") {
            let modified = fs::metadata(&path).and_then(|m| m.modified()).map_err(|e| e.to_string())?;
            if newest.as_ref().is_none_or(|(t, _)| modified > *t) {
                newest = Some((modified, path));
            }
        }
    }
    let (_, asm) = newest.ok_or_else(|| format!("no PTX produced for {arch} in {}", deps.display()))?;
    let text = fs::read_to_string(&asm).map_err(|e| format!("reading PTX for {arch}: {e}"))?;
    let dest = out.join(format!("{arch}.ptx"));
    fs::write(&dest, add_launch_bounds(&text)).map_err(|e| format!("writing PTX for {arch}: {e}"))?;
    Ok(dest)
}

/// Register budget per entry, stated here because Rust has no launch-bounds
/// attribute: `.maxnreg N` between each entry's parameter list and its body
/// makes ptxas stay within it (spilling if it must, which the PTX tests
/// reject) instead of producing a kernel that fails to launch. The budget
/// of an entry is `tp_allreduce_kernels::ids::max_registers`, from the list
/// of algorithms (the host reads the same function): 64 registers for the
/// kernels that launch with any block size up to 1024 threads (the
/// sentinel and copy-engine ring kernels, the fused `*_wide_<dt>` entries),
/// 128 for the others, which launch with `THREADS_PER_BLOCK` (512) threads.
/// (`.maxntid 512,1,1` made ptxas pick 64 registers for some of them and
/// spill.)
fn add_launch_bounds(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 4096);
    let mut entry: Option<String> = None;
    for line in ptx.lines() {
        if let Some(rest) = line.strip_prefix(".visible .entry ").or_else(|| line.strip_prefix(".entry ")) {
            entry = Some(rest.split('(').next().unwrap_or("").trim().to_string());
        }
        out.push_str(line);
        out.push('\n');
        if line.trim_start().starts_with(')') {
            if let Some(name) = entry.take() {
                out.push_str(&format!(".maxnreg {}\n", tp_allreduce_kernels::ids::max_registers(&name)));
            }
        }
    }
    out
}

/// FNV-1a over the kernel crate's sources (paths and contents, sorted).
fn hash_sources(kernels: &Path) -> String {
    let mut files = Vec::new();
    collect_files(&kernels.join("src"), &mut files);
    files.push(kernels.join("Cargo.toml"));
    files.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for f in files {
        let rel = f.strip_prefix(kernels).unwrap_or(&f).to_string_lossy().replace('\\', "/");
        let data = fs::read(&f).unwrap_or_default();
        for byte in rel.as_bytes().iter().chain([0u8].iter()).chain(data.iter()) {
            h ^= *byte as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

fn collect_files(dir: &Path, files: &mut Vec<PathBuf>) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                collect_files(&path, files);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
}

fn write_committed(kernels: &Path, ptx: &BTreeMap<String, PathBuf>, sources_hash: &str, rustc: &str) {
    let dir = kernels.join("ptx");
    fs::create_dir_all(&dir).expect("creating kernels-rs/ptx");
    let mut manifest = String::new();
    writeln!(manifest, "# Written by `bash .ci/regen-ptx`; checked by the test suite.").unwrap();
    writeln!(manifest, "sources_hash = {sources_hash:?}").unwrap();
    writeln!(manifest, "rustc = {rustc:?}").unwrap();
    writeln!(manifest, "flags = {KERNEL_FLAGS:?}").unwrap();
    let archs: Vec<&str> = ptx.keys().map(|s| s.as_str()).collect();
    writeln!(manifest, "archs = {archs:?}").unwrap();
    for (arch, path) in ptx {
        fs::copy(path, dir.join(format!("{arch}.ptx"))).expect("copying PTX into kernels-rs/ptx");
    }
    fs::write(dir.join("MANIFEST"), manifest).expect("writing kernels-rs/ptx/MANIFEST");
}
