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
//! "Built from source" means: taken from the PTX cache, which holds what the
//! nightly toolchain produced for exactly these kernel sources, or built into
//! it. Every build of this crate (any target directory, profile or feature
//! set, the Python wheel in `python/`) shares the cache, so the four nightly
//! nvptx builds (about a minute of CPU each) run once per change of the
//! kernels' code:
//! * where: `TP_ALLREDUCE_PTX_CACHE`, default `<this crate>/.cache/ptx`
//!   (git-ignored), one folder per key holding `<arch>.ptx` as rustc emitted
//!   it (~6 MB each); the nested cargo builds in a staging folder `tmp/...`
//!   that is removed afterwards;
//! * key: the kernel sources hash (below) and the nightly rustc's version;
//! * the kernel sources hash covers the kernel crate's Rust sources with
//!   comments (doc comments included) and formatting whitespace taken out
//!   (string and char literals, `asm!` templates among them, kept verbatim),
//!   its `Cargo.toml` without comment lines, and every flag and setting of the
//!   nested build; a comment-only edit keeps the hash, so neither the cache
//!   nor the committed PTX (whose `MANIFEST` records the hash) goes stale;
//! * concurrent builds: each builds in a staging folder of its own and
//!   renames each PTX file into place (atomic): a build finds a whole file or
//!   none, and two builds of one key write the same bytes.
//! * The launch bounds (`add_launch_bounds`) are added on every build, after
//!   the cache: changing them needs no nvptx build.
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
use std::time::{Duration, Instant, SystemTime};

const DEFAULT_ARCHS: &str = "sm_120,sm_90,sm_89,sm_80";
const KERNEL_FLAGS: &str = "-Zunstable-options -Cpanic=immediate-abort";
const FIX_NIGHTLY: &str = "rustup toolchain install nightly && rustup component add rust-src --toolchain nightly";
/// The nested cargo's arguments before `--target-dir`.
const CARGO_ARGS: [&str; 5] = ["rustc", "--release", "--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"];
/// The nested build's profile, as cargo environment settings.
const PROFILE: [(&str, &str); 4] = [
    ("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1"),
    ("CARGO_PROFILE_RELEASE_OPT_LEVEL", "3"),
    ("CARGO_PROFILE_RELEASE_DEBUG", "false"),
    ("CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS", "false"),
];
/// PTX ISA above the target's default where an entry needs it: the sm_90
/// cluster entries use `st.async` and `mbarrier` expect-tx (PTX 8.1; LLVM
/// emits 7.8 for sm_90 by default, 8.7 for sm_120). PTX 8.1 loads on
/// drivers of CUDA 12.1 and newer.
const PTX_ISA: [(&str, &str); 1] = [("sm_90", "target-feature=+ptx81")];
/// Cache folders (keys) kept besides the one in use: the most recently built
/// ones, and any built within the last day.
const CACHE_KEEP: usize = 8;
const CACHE_KEEP_AGE: Duration = Duration::from_secs(24 * 3600);

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels = root.join("kernels-rs");
    println!("cargo:rerun-if-changed=kernels-rs/src");
    println!("cargo:rerun-if-changed=kernels-rs/Cargo.toml");
    println!("cargo:rerun-if-changed=kernels-rs/ptx");
    for var in ["TP_ALLREDUCE_PTX_ARCHS", "TP_ALLREDUCE_BUILD_PTX", "TP_ALLREDUCE_WRITE_PTX", "TP_ALLREDUCE_PTX_CACHE"]
    {
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

    let sources_hash = kernel_sources_hash(&kernels);
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
        let cache = PtxCache::open(&root, &out, &sources_hash, &rustc_version);
        let raw = cache.get_or_build(&kernels, &archs).unwrap_or_else(|e| fail(&e));
        for (arch, file) in raw {
            let text = fs::read_to_string(&file).unwrap_or_else(|e| fail(&format!("reading {}: {e}", file.display())));
            let dest = out.join(format!("{arch}.ptx"));
            fs::write(&dest, add_launch_bounds(&text))
                .unwrap_or_else(|e| fail(&format!("writing {}: {e}", dest.display())));
            ptx.insert(arch, dest);
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
    writeln!(
        index,
        "/// \"built\" (from the kernels-rs sources by the nightly toolchain, in this build or taken from the PTX cache) or \"committed\" (kernels-rs/ptx)."
    )
    .unwrap();
    writeln!(index, "pub const PTX_ORIGIN: &str = {:?};", if build_from_source { "built" } else { "committed" })
        .unwrap();
    writeln!(index, "/// Hash of the kernels-rs sources this build saw (comments and formatting excluded).").unwrap();
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

// ---------------------------------------------------------------- PTX cache

/// The PTX cache (see the top of this file): `dir` holds the PTX of one key.
struct PtxCache {
    root: PathBuf,
    dir: PathBuf,
}

impl PtxCache {
    /// The cache for these sources and this rustc: `TP_ALLREDUCE_PTX_CACHE`,
    /// else `<crate>/.cache/ptx`; where neither can be created (a read-only
    /// checkout), one in `OUT_DIR` that serves this build directory only.
    fn open(crate_root: &Path, out: &Path, sources_hash: &str, rustc_version: &str) -> PtxCache {
        let key = format!("{sources_hash}-{}", &fnv1a(rustc_version.as_bytes())[..8]);
        let root = match env::var_os("TP_ALLREDUCE_PTX_CACHE").filter(|v| !v.is_empty()) {
            Some(dir) => PathBuf::from(dir),
            None => crate_root.join(".cache").join("ptx"),
        };
        let root = match fs::create_dir_all(root.join(&key)) {
            Ok(()) => root,
            Err(e) => {
                let fallback = out.join("ptx-cache");
                println!(
                    "cargo:warning=PTX cache {} not writable ({e}): using {} (set TP_ALLREDUCE_PTX_CACHE to share one between builds)",
                    root.display(),
                    fallback.display()
                );
                fs::create_dir_all(fallback.join(&key))
                    .unwrap_or_else(|e| fail(&format!("{}: {e}", fallback.display())));
                fallback
            }
        };
        let dir = root.join(&key);
        PtxCache { root, dir }
    }

    /// The cached PTX file of every arch in `archs`, building the missing ones.
    fn get_or_build(&self, kernels: &Path, archs: &[String]) -> Result<BTreeMap<String, PathBuf>, String> {
        let file = |arch: &str| self.dir.join(format!("{arch}.ptx"));
        let missing: Vec<&String> = archs.iter().filter(|a| !file(a).is_file()).collect();
        if !missing.is_empty() {
            // A staging folder of this build's own: the sources as cargo
            // sees them, and each arch's PTX until it is renamed into place.
            let nonce = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            let stage = self.root.join("tmp").join(format!("{}-{nonce}", std::process::id()));
            let staged = stage_sources(kernels, &stage)?;
            let started = Instant::now();
            let handles: Vec<_> = missing
                .iter()
                .map(|arch| {
                    let (arch, staged, stage) = (arch.to_string(), staged.clone(), stage.clone());
                    let target_dir = stage.join("target").join(&arch);
                    std::thread::spawn(move || {
                        let asm = stage.join(format!("{arch}.s"));
                        build_arch(&staged, &target_dir, &arch, &asm).map(|()| (arch, asm))
                    })
                })
                .collect();
            let mut result = Ok(());
            for h in handles {
                let built = h.join().map_err(|_| "PTX build thread panicked".to_string()).and_then(|r| r);
                match built {
                    // rename: a concurrent build of the same key finds
                    // either no file or a whole one.
                    Ok((arch, asm)) => {
                        let dest = file(&arch);
                        if let Err(e) = fs::rename(&asm, &dest) {
                            result = Err(format!("moving {} to {}: {e}", asm.display(), dest.display()));
                        }
                    }
                    Err(e) => result = Err(e),
                }
            }
            let _ = fs::remove_dir_all(&stage);
            result?;
            // Information, not a warning: cargo shows a build script's
            // `cargo:warning` lines again on every later build until the
            // script runs again, so "built the PTX" would be repeated while
            // nothing is built. A plain line stays in the script's output
            // file (`target/*/build/tp-allreduce-*/output`, shown with
            // `cargo build -vv`); while the nvptx builds run, cargo's own
            // progress line names `tp-allreduce(build)`.
            println!(
                "tp-allreduce build.rs: built the PTX for {} in {} s into {}",
                missing.iter().map(|a| a.as_str()).collect::<Vec<_>>().join(", "),
                started.elapsed().as_secs(),
                self.dir.display()
            );
            self.prune();
        }
        Ok(archs.iter().map(|a| (a.clone(), file(a))).collect())
    }

    /// Removes the cache folders of old keys (each one is ~25 MB) and
    /// staging folders left by killed builds: all but the `CACHE_KEEP` most
    /// recently written, unless written within `CACHE_KEEP_AGE`.
    fn prune(&self) {
        let now = SystemTime::now();
        let age = |p: &Path| {
            fs::metadata(p).and_then(|m| m.modified()).ok().and_then(|t| now.duration_since(t).ok()).unwrap_or_default()
        };
        let mut keys: Vec<(Duration, PathBuf)> = fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir() && *p != self.dir && is_key(p))
            .map(|p| (age(&p), p))
            .collect();
        keys.sort();
        for (old, path) in keys.into_iter().skip(CACHE_KEEP) {
            if old > CACHE_KEEP_AGE {
                let _ = fs::remove_dir_all(path);
            }
        }
        for stage in fs::read_dir(self.root.join("tmp")).into_iter().flatten().flatten() {
            if age(&stage.path()) > CACHE_KEEP_AGE {
                let _ = fs::remove_dir_all(stage.path());
            }
        }
    }
}

/// A cache key folder's name: `<16 hex>-<8 hex>`.
fn is_key(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name.len() == 25 && name.as_bytes()[16] == b'-' && name.chars().filter(|c| c.is_ascii_hexdigit()).count() == 24
}

/// Copies the kernel crate to `stage/kernels-rs` as a workspace of its own
/// (inside the outer workspace it would resolve the host's dependencies and
/// share its lock file); the PTX does not depend on where the sources are.
fn stage_sources(kernels: &Path, stage: &Path) -> Result<PathBuf, String> {
    let staged = stage.join("kernels-rs");
    let mut files = Vec::new();
    collect_files(&kernels.join("src"), &mut files);
    for file in files {
        let rel = file.strip_prefix(kernels).map_err(|e| e.to_string())?;
        let dest = staged.join(rel);
        fs::create_dir_all(dest.parent().unwrap()).map_err(|e| format!("{}: {e}", dest.display()))?;
        fs::copy(&file, &dest).map_err(|e| format!("{}: {e}", file.display()))?;
    }
    let manifest = fs::read_to_string(kernels.join("Cargo.toml")).map_err(|e| e.to_string())?;
    fs::write(staged.join("Cargo.toml"), format!("{manifest}\n[workspace]\n")).map_err(|e| e.to_string())?;
    Ok(staged)
}

/// The arguments after `--` of the nested `cargo rustc` for `arch` (but the
/// output file): the kernel crate's codegen settings.
fn rustc_args(arch: &str) -> Vec<String> {
    let mut args = vec!["-C".to_string(), format!("target-cpu={arch}")];
    for (_, feature) in PTX_ISA.iter().filter(|(a, _)| *a == arch) {
        args.extend(["-C".to_string(), feature.to_string()]);
    }
    args
}

/// Builds the kernel crate at `staged` for `arch`, its PTX into `asm`.
fn build_arch(staged: &Path, target_dir: &Path, arch: &str, asm: &Path) -> Result<(), String> {
    let mut cmd = nightly_command("cargo");
    cmd.current_dir(staged).args(CARGO_ARGS).arg("--target-dir").arg(target_dir).arg("--").args(rustc_args(arch));
    cmd.arg(format!("--emit=asm={}", asm.display())).env("RUSTFLAGS", KERNEL_FLAGS);
    for (key, value) in PROFILE {
        cmd.env(key, value);
    }
    let output = cmd.output().map_err(|e| format!("running nightly cargo for {arch}: {e}. Run: {FIX_NIGHTLY}"))?;
    if !output.status.success() {
        return Err(format!(
            "building kernels-rs for {arch} failed:\n{}\nIf the toolchain is missing, run: {FIX_NIGHTLY}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    if !asm.is_file() {
        return Err(format!("no PTX produced for {arch} at {}", asm.display()));
    }
    Ok(())
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

// ---------------------------------------------------------------- sources hash

/// The kernel sources hash (`kernels-rs/ptx/MANIFEST`'s `sources_hash`, the
/// PTX cache's key): FNV-1a over the normalized Rust sources of
/// `kernels/src` (paths and texts, sorted by path; see `normalize_rust`),
/// `kernels/Cargo.toml` without comment and blank lines, and the nested
/// build's settings. Comment and formatting edits keep it; code edits change
/// it.
pub fn kernel_sources_hash(kernels: &Path) -> String {
    let mut files = Vec::new();
    collect_files(&kernels.join("src"), &mut files);
    files.sort();
    let mut text = String::from("tp-allreduce kernel sources, hash scheme 2\0");
    for file in files {
        let rel = file.strip_prefix(kernels).unwrap_or(&file).to_string_lossy().replace('\\', "/");
        let source = fs::read_to_string(&file).unwrap_or_else(|e| fail(&format!("reading {}: {e}", file.display())));
        write!(text, "{rel}\0{}\0", normalize_rust(&source)).unwrap();
    }
    let manifest = fs::read_to_string(kernels.join("Cargo.toml")).unwrap_or_default();
    let manifest: Vec<&str> =
        manifest.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    write!(text, "Cargo.toml\0{}\0", manifest.join("\n")).unwrap();
    write!(text, "cargo {CARGO_ARGS:?} RUSTFLAGS={KERNEL_FLAGS:?} {PROFILE:?}").unwrap();
    for arch in DEFAULT_ARCHS.split(',') {
        write!(text, " {arch}: {:?}", rustc_args(arch)).unwrap();
    }
    fnv1a(text.as_bytes())
}

/// 64-bit FNV-1a as 16 hex digits.
fn fnv1a(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        h ^= *byte as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// A Rust source reduced to what the compiler sees: comments (`//`, nested
/// `/* */`, doc comments too) dropped, string, byte-string, raw-string and
/// char literals kept verbatim (so `asm!` templates are), and each run of
/// whitespace (a comment counts as whitespace) made one space where it
/// separates tokens that would otherwise read differently (two words; two
/// operators: `& &` is not `&&`; a word and the `#`, `"` or `'` after it:
/// `r #` is not `r#`; a literal and the word after it) and dropped
/// elsewhere. Indentation, line breaks and spaces next to brackets, commas,
/// literals or between a word and an operator do not change the result.
pub fn normalize_rust(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let word = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut out = String::with_capacity(src.len());
    let mut gap = false;
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch.is_whitespace() {
            gap = true;
            i += 1;
            continue;
        }
        if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
            gap = true;
            continue;
        }
        if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            gap = true;
            continue;
        }
        if gap {
            gap = false;
            if let Some(prev) = out.chars().next_back() {
                let neutral = |x: char| "()[]{},;\"'".contains(x);
                let space = if word(prev) {
                    word(ch) || "#\"'".contains(ch)
                } else if "\"'".contains(prev) && word(ch) {
                    true
                } else {
                    !neutral(prev) && !neutral(ch) && !word(ch)
                };
                if space {
                    out.push(' ');
                }
            }
        }
        let start = i;
        if ch == '"' {
            // A string: up to the unescaped closing quote.
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if ch == '\'' && (next == Some('\\') || c.get(i + 2) == Some(&'\'')) {
            // A char literal (`'x'`, `'\''`, `'\u{..}'`); else a lifetime.
            i += if next == Some('\\') { 3 } else { 2 };
            while i < c.len() && c[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else if word(ch) {
            while i < c.len() && word(c[i]) {
                i += 1;
            }
            // A raw string (`r"..."`, `br#"..."#`, `cr"..."`): up to the
            // quote followed by as many `#` as opened it.
            let ident: String = c[start..i].iter().collect();
            if matches!(ident.as_str(), "r" | "br" | "cr") {
                let hashes = c[i..].iter().take_while(|&&x| x == '#').count();
                if c.get(i + hashes) == Some(&'"') {
                    i += hashes + 1;
                    loop {
                        if i >= c.len() {
                            break;
                        }
                        if c[i] == '"' && c[i + 1..].iter().take(hashes).filter(|&&x| x == '#').count() == hashes {
                            i += 1 + hashes;
                            break;
                        }
                        i += 1;
                    }
                }
            }
        } else {
            i += 1;
        }
        let end = i.min(c.len());
        out.extend(&c[start..end]);
    }
    out
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
    writeln!(
        manifest,
        "# sources_hash: the kernel sources without comments and formatting, and the build flags (build.rs)."
    )
    .unwrap();
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
