//! Checks on the embedded PTX that need no GPU: it assembles for its
//! architecture, calls nothing external, has every kernel the host launches,
//! keeps the hot kernels out of local memory, and the committed copy in
//! `kernels-rs/ptx` is current.
//!
//! A check that cannot run here says `skipped: ...` on stderr (run with
//! `--nocapture` to see it) and passes; the switch named in the message turns
//! the skip into a failure where the tool is expected (CI):
//! * `TP_ALLREDUCE_REQUIRE_PTXAS=1`: ptxas must be found (`bash .ci/tools.sh`);
//! * `TP_ALLREDUCE_REQUIRE_PTX_BUILD=1`: the PTX must have been built from
//!   source in this build (nightly + rust-src), so the committed copy can be
//!   compared byte for byte.

use std::collections::{BTreeMap, BTreeSet};
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::thread;

use tp_allreduce::kernels;
use tp_allreduce_cli::inspect::{self, Assembly};

/// `build.rs` itself, for the kernel sources hash it computes
/// (`kernel_sources_hash`, `normalize_rust`): the tests below check the code
/// the build runs, not a copy of it.
#[allow(dead_code)]
#[path = "../../build.rs"]
mod build_script;

const REQUIRE_PTXAS: &str = "TP_ALLREDUCE_REQUIRE_PTXAS";
const REQUIRE_PTX_BUILD: &str = "TP_ALLREDUCE_REQUIRE_PTX_BUILD";
const REGEN: &str = "run bash .ci/regen-ptx";

/// Reports a check that cannot run, or fails when `require_var=1`.
fn skip(why: &str, require_var: &str) {
    if env::var(require_var).as_deref() == Ok("1") {
        panic!("{why}, and {require_var}=1 requires this check to run");
    }
    crate::common::skipped(why);
}

fn ptxas() -> Option<PathBuf> {
    let found = inspect::find_tool("ptxas");
    if found.is_none() {
        skip("ptxas not found (run bash .ci/tools.sh)", REQUIRE_PTXAS);
    }
    found
}

/// ptxas's result per architecture, computed once for all tests (the
/// architectures in parallel).
fn assemblies(ptxas: &Path) -> &'static BTreeMap<&'static str, Result<Assembly, String>> {
    static CACHE: OnceLock<BTreeMap<&'static str, Result<Assembly, String>>> = OnceLock::new();
    CACHE.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ptx-checks");
        fs::create_dir_all(&dir).expect("creating the test's temporary folder");
        let jobs: Vec<_> = kernels::embedded()
            .into_iter()
            .map(|p| {
                let (dir, ptxas) = (dir.clone(), ptxas.to_path_buf());
                thread::spawn(move || {
                    let file = dir.join(format!("{}.ptx", p.arch));
                    let cubin = dir.join(format!("{}.cubin", p.arch));
                    let result = fs::write(&file, p.text)
                        .map_err(|e| format!("writing {}: {e}", file.display()))
                        .and_then(|()| inspect::assemble(&ptxas, p.arch, &file, &cubin).map_err(|e| e.to_string()));
                    (p.arch, result)
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().expect("ptxas thread panicked")).collect()
    })
}

#[test]
fn every_ptx_assembles_for_its_arch() {
    let Some(ptxas) = ptxas() else { return };
    let version = inspect::tool_version(&ptxas).unwrap_or_else(|| "?".into());
    let mut failures = Vec::new();
    for (arch, result) in assemblies(&ptxas) {
        match result {
            Ok(a) => eprintln!("{arch}: assembled by ptxas {version} ({} functions)", a.resources.len()),
            Err(e) => failures.push(format!("{arch}: {e}")),
        }
    }
    assert!(!kernels::embedded().is_empty(), "no PTX embedded at all");
    assert!(failures.is_empty(), "ptxas ({}) rejected embedded PTX:\n{}", ptxas.display(), failures.join("\n\n"));
}

#[test]
fn no_extern_functions() {
    let mut offenders = Vec::new();
    for p in kernels::embedded() {
        if p.text.contains(".extern .func") {
            offenders.push(format!("embedded {} PTX", p.arch));
        }
    }
    // The committed copies too: a crate built without nightly embeds them.
    for (arch, file) in committed_ptx_files() {
        if fs::read_to_string(&file).is_ok_and(|t| t.contains(".extern .func")) {
            offenders.push(format!("committed {arch} PTX ({})", file.display()));
        }
    }
    assert!(
        offenders.is_empty(),
        "`.extern .func` (an external call the driver cannot load, usually a panic path core did not inline) in: {}",
        offenders.join(", ")
    );
}

#[test]
fn every_expected_entry_in_every_ptx() {
    assert!(!kernels::expected_entries().is_empty());
    let clusters = kernels::cluster_entries();
    assert_eq!(clusters.len(), 2 * 3, "{clusters:?}");
    let mut missing = Vec::new();
    for p in kernels::embedded() {
        let expected = kernels::expected_entries_for(p.sm);
        let present: BTreeSet<String> = inspect::entry_names(p.text).into_iter().collect();
        // The cluster entries exist from sm_90 on, and only there (ptxas
        // rejects cluster instructions below sm_90).
        let has_clusters = clusters.iter().all(|e| present.contains(e));
        let has_any_cluster_entry = clusters.iter().any(|e| present.contains(e));
        if p.sm >= kernels::CLUSTER_MIN_SM {
            assert!(has_clusters, "{}: cluster entries missing", p.arch);
        } else {
            assert!(!has_any_cluster_entry, "{}: cluster entries below sm_90", p.arch);
        }
        let absent: Vec<&str> = expected.iter().filter(|e| !present.contains(*e)).map(String::as_str).collect();
        if !absent.is_empty() {
            missing.push(format!("{}: {}", p.arch, absent.join(", ")));
        }
        let extra: Vec<&String> = present.iter().filter(|e| !expected.contains(e)).collect();
        if !extra.is_empty() {
            eprintln!("{}: entries the host does not launch: {extra:?}", p.arch);
        }
    }
    assert!(missing.is_empty(), "kernel entries missing from the PTX:\n{}", missing.join("\n"));
}

#[test]
fn hot_kernels_use_no_local_memory() {
    let Some(ptxas) = ptxas() else { return };
    let results = assemblies(&ptxas);
    let mut hot: BTreeSet<String> = kernels::hot_entries().into_iter().collect();
    hot.extend(kernels::cluster_entries());
    let archs: Vec<&str> = kernels::embedded().iter().map(|p| p.arch).collect();
    let sm_of = |arch: &str| kernels::for_arch(arch).map_or(0, |p| p.sm);
    let mut failures = Vec::new();

    // Table: registers per kernel and arch; local memory as +stack/spill-st/spill-ld bytes.
    let mut table = format!("{:<28}", "kernel (* = hot)");
    for arch in &archs {
        table += &format!(" {arch:>14}");
    }
    table.push('\n');
    for name in kernels::expected_entries_for(u32::MAX) {
        let is_hot = hot.contains(&name);
        table += &format!("{:<28}", format!("{name}{}", if is_hot { "*" } else { "" }));
        for arch in &archs {
            if !kernels::expected_entries_for(sm_of(arch)).contains(&name) {
                table += &format!(" {:>14}", "-");
                continue;
            }
            let cell = match &results[arch] {
                Err(_) => {
                    if is_hot {
                        failures.push(format!("{arch} {name}: ptxas failed (see every_ptx_assembles_for_its_arch)"));
                    }
                    "ptxas failed".to_string()
                }
                Ok(a) => match a.resources.get(&name) {
                    None => {
                        if is_hot {
                            failures.push(format!("{arch} {name}: ptxas reported no resources for it"));
                        }
                        "?".to_string()
                    }
                    Some(r) => {
                        let local = format!("+{}/{}/{}", r.stack_frame_bytes, r.spill_store_bytes, r.spill_load_bytes);
                        if is_hot && r.uses_local_memory() {
                            failures.push(format!(
                                "{arch} {name}: {} bytes stack frame, {} bytes spill stores, {} bytes spill loads",
                                r.stack_frame_bytes, r.spill_store_bytes, r.spill_load_bytes
                            ));
                        }
                        // Sentinel kernels launch with up to 1024 threads,
                        // the others with THREADS_PER_BLOCK: more registers
                        // than the register file holds per thread at that
                        // block size would make the launch fail.
                        let budget = kernels::max_registers(&name);
                        if r.registers > budget {
                            failures.push(format!(
                                "{arch} {name}: {} registers > {budget} (its largest block cannot launch)",
                                r.registers
                            ));
                        }
                        if r.uses_local_memory() {
                            format!("{} {local}", r.registers)
                        } else {
                            r.registers.to_string()
                        }
                    }
                },
            };
            table += &format!(" {cell:>14}");
        }
        table.push('\n');
    }
    eprintln!("registers per kernel (ptxas -v; +stack/spill-store/spill-load bytes when non-zero):\n{table}");
    assert!(failures.is_empty(), "hot kernels use local memory (stack or spills):\n{}", failures.join("\n"));
}

/// `.param .align A .b8 <entry>_param_0[N]` of `entry` in `ptx`: `Some(N)`
/// when the entry takes exactly one by-value struct parameter.
fn struct_param_bytes(ptx: &str, entry: &str) -> Option<usize> {
    let start = ptx.find(&format!(".entry {entry}("))?;
    let params = &ptx[start..start + ptx[start..].find(')')?];
    let decls: Vec<&str> = params.lines().filter(|l| l.trim_start().starts_with(".param")).collect();
    let [decl] = decls.as_slice() else { return None };
    let size = decl.split('[').nth(1)?.split(']').next()?;
    decl.contains(".b8").then(|| size.trim().parse().ok()).flatten()
}

#[test]
fn by_value_entries_take_the_parameter_struct_the_host_passes() {
    let by_value: Vec<(String, usize, usize)> = kernels::expected_entries()
        .into_iter()
        .filter_map(|e| kernels::param_struct(&e).map(|(size, align)| (e, size, align)))
        .collect();
    // OneShotPush (two variants), TwoShotPush, Hierarchical,
    // PipelinedHierarchical, the copy-engine ring's step kernel,
    // AllGatherPush and ReduceScatterPush per dtype, and the ring's
    // handshake kernel.
    assert_eq!(by_value.len(), 8 * 3 + 1, "{by_value:?}");
    assert!(kernels::sentinel_entries().iter().all(|e| kernels::param_struct(e).is_some()));
    let mut failures = Vec::new();
    let mut sources: Vec<(String, String)> =
        kernels::embedded().into_iter().map(|p| (format!("embedded {}", p.arch), p.text.to_string())).collect();
    for (arch, file) in committed_ptx_files() {
        sources.push((format!("committed {arch}"), fs::read_to_string(&file).unwrap_or_default()));
    }
    for (what, text) in &sources {
        for (entry, host_size, align) in &by_value {
            match struct_param_bytes(text, entry) {
                Some(n) if n == *host_size => {}
                Some(n) => failures.push(format!("{what} {entry}: .param of {n} bytes, host passes {host_size}")),
                None => failures.push(format!("{what} {entry}: not one by-value struct parameter")),
            }
            let needle = format!(".param .align {align} .b8 {entry}_param_0[{host_size}]");
            if !text.contains(&needle) {
                failures.push(format!("{what} {entry}: no `{needle}`"));
            }
        }
        // The flag kernels keep their scalar/pointer parameters.
        assert!(struct_param_bytes(text, "ring_bf16").is_none(), "{what}");
    }
    assert!(failures.is_empty(), "host and device disagree on the parameter struct:\n{}", failures.join("\n"));
}

/// The fused push entries take `FusedOneShotPushParams` (one-shot) or
/// `FusedIslandPushParams` (two-shot, hierarchical) by value, the fused
/// pull and epilogue entries scalars.
#[test]
fn fused_entries_take_the_parameters_the_host_passes() {
    use tp_allreduce::DType;
    use tp_allreduce_kernels::ids::AlgorithmId;
    use tp_allreduce_kernels::params::{FusedIslandPushParams, FusedOneShotPushParams};
    let one_shot = (std::mem::size_of::<FusedOneShotPushParams>(), std::mem::align_of::<FusedOneShotPushParams>());
    let island = (std::mem::size_of::<FusedIslandPushParams>(), std::mem::align_of::<FusedIslandPushParams>());
    let mut failures = Vec::new();
    let mut sources: Vec<(String, String)> =
        kernels::embedded().into_iter().map(|p| (format!("embedded {}", p.arch), p.text.to_string())).collect();
    for (arch, file) in committed_ptx_files() {
        sources.push((format!("committed {arch}"), fs::read_to_string(&file).unwrap_or_default()));
    }
    // Every fused OneShotPush entry (any world or two ranks; long, short or
    // wide rows, the wide ones also with the spread push) of every dtype: 6
    // per dtype; the fused island pushes per dtype.
    let mut by_value: Vec<(String, (usize, usize))> = kernels::fused_entries()
        .into_iter()
        .filter(|e| e.starts_with("fused_one_shot_push"))
        .map(|e| (e, one_shot))
        .collect();
    assert_eq!(by_value.len(), 6 * DType::ALL.len(), "{by_value:?}");
    for dtype in DType::ALL {
        by_value.push((kernels::fused_island_push_entry(AlgorithmId::TwoShotPush, dtype), island));
        by_value.push((kernels::fused_island_push_entry(AlgorithmId::Hierarchical, dtype), island));
    }
    let clusters = kernels::cluster_entries();
    for (what, text) in &sources {
        let with_clusters = text.contains(&format!(".entry {}(", clusters[0]));
        let cluster_params = clusters.iter().filter(|_| with_clusters).map(|e| (e.clone(), one_shot));
        for (entry, (host_size, align)) in by_value.iter().cloned().chain(cluster_params) {
            let needle = format!(".param .align {align} .b8 {entry}_param_0[{host_size}]");
            if struct_param_bytes(text, &entry) != Some(host_size) || !text.contains(&needle) {
                failures.push(format!("{what} {entry}: no `{needle}`"));
            }
        }
        for dtype in DType::ALL {
            for entry in [kernels::fused_one_shot_pull_entry(dtype), kernels::add_rms_norm_entry(dtype)] {
                if struct_param_bytes(text, &entry).is_some() {
                    failures.push(format!("{what} {entry}: takes a struct, the host passes scalars"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "host and device disagree on the fused parameters:\n{}", failures.join("\n"));
}

#[test]
fn register_budgets_are_stated_per_entry_in_the_ptx() {
    for p in kernels::embedded() {
        for name in kernels::expected_entries_for(p.sm) {
            let start = p.text.find(&format!(".entry {name}(")).unwrap_or_else(|| panic!("{} {name}", p.arch));
            let body = &p.text[start..];
            let line = body.lines().find(|l| l.starts_with(".maxnreg")).unwrap_or("(none)");
            assert_eq!(line, format!(".maxnreg {}", kernels::max_registers(&name)), "{} {name}", p.arch);
        }
    }
}

// ---------------------------------------------------------------- committed PTX

fn committed_dir() -> PathBuf {
    crate::common::repo().join("kernels-rs").join("ptx")
}

/// `kernels-rs/ptx/<arch>.ptx` for every embedded architecture.
fn committed_ptx_files() -> Vec<(&'static str, PathBuf)> {
    kernels::embedded().into_iter().map(|p| (p.arch, committed_dir().join(format!("{}.ptx", p.arch)))).collect()
}

/// `key = "value"` pairs of `kernels-rs/ptx/MANIFEST`, or a failure message.
fn manifest() -> Result<BTreeMap<String, String>, String> {
    let path = committed_dir().join("MANIFEST");
    let text = fs::read_to_string(&path)
        .map_err(|e| format!("no committed PTX ({}: {e}): {REGEN} and commit kernels-rs/ptx", path.display()))?;
    Ok(text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().trim_matches('"').to_string()))
        .collect())
}

#[test]
fn committed_ptx_matches_kernel_sources() {
    let manifest = manifest().unwrap_or_else(|e| panic!("{e}"));
    let committed = manifest.get("sources_hash").map(String::as_str).unwrap_or("(none)");
    assert_eq!(
        committed,
        kernels::KERNEL_SOURCES_HASH,
        "committed PTX is stale: {REGEN} (kernels-rs/ptx/MANIFEST sources_hash = {committed}, kernels-rs sources hash = {})",
        kernels::KERNEL_SOURCES_HASH
    );
}

/// `dir/**` copied to `to` (the kernel crate, to edit a copy of it).
fn copy_tree(dir: &Path, to: &Path) {
    fs::create_dir_all(to).expect("creating a folder for the copy");
    for entry in fs::read_dir(dir).expect("reading the kernel crate") {
        let path = entry.expect("listing the kernel crate").path();
        let dest = to.join(path.file_name().expect("a file name"));
        if path.is_dir() {
            copy_tree(&path, &dest);
        } else {
            fs::copy(&path, &dest).expect("copying a kernel source");
        }
    }
}

/// The kernel sources hash (MANIFEST's `sources_hash`, the PTX cache's key)
/// ignores comments, doc comments and formatting, so a comment-only edit
/// neither makes the committed PTX stale nor rebuilds the PTX; an edit of
/// the code, or of a string literal such as an `asm!` template, changes it.
#[test]
fn kernel_sources_hash_ignores_comments_not_code() {
    let kernels = crate::common::repo().join("kernels-rs");
    let hash = build_script::kernel_sources_hash;
    assert_eq!(hash(&kernels), kernels::KERNEL_SOURCES_HASH, "build.rs hashed other sources than these");

    let copy = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-sources-hash");
    let _ = fs::remove_dir_all(&copy);
    copy_tree(&kernels.join("src"), &copy.join("src"));
    fs::copy(kernels.join("Cargo.toml"), copy.join("Cargo.toml")).expect("copying Cargo.toml");
    assert_eq!(hash(&copy), kernels::KERNEL_SOURCES_HASH);
    let file = copy.join("src/device/ptx.rs");
    let original = fs::read_to_string(&file).expect("reading the copy of device/ptx.rs");
    let hash_with = |text: &str| {
        fs::write(&file, text).expect("editing the copy");
        hash(&copy)
    };
    let template = "\"fence.acq_rel.sys;\"";
    assert!(original.contains(template), "device/ptx.rs no longer has `{template}`: pick another literal");

    let commented = format!(
        "// A new comment.\n/* A block /* nested */ comment. */\n{}\n// trailing",
        original.replace("#[inline(always)]\n", "/// A new doc comment.\n#[inline(always)] // and a note\n")
    );
    assert_eq!(hash_with(&commented), kernels::KERNEL_SOURCES_HASH, "a comment-only edit changed the hash");
    let reindented = original.replace("\n    ", "\n\t\t").replace(") -> ", ")\n    ->  ");
    assert_eq!(hash_with(&reindented), kernels::KERNEL_SOURCES_HASH, "a formatting-only edit changed the hash");

    let code = format!("{original}\npub const NEW_CONSTANT: u32 = 1;\n");
    assert_ne!(hash_with(&code), kernels::KERNEL_SOURCES_HASH, "a code edit kept the hash");
    let asm = original.replacen(template, "\"fence.acq_rel.sys; \"", 1);
    assert_ne!(hash_with(&asm), kernels::KERNEL_SOURCES_HASH, "an edit of an asm! template kept the hash");
    fs::write(&file, &original).expect("restoring the copy");
    let manifest = fs::read_to_string(copy.join("Cargo.toml")).expect("reading the copy of Cargo.toml");
    fs::write(copy.join("Cargo.toml"), format!("# A comment.\n{manifest}")).expect("editing the copy");
    assert_eq!(hash(&copy), kernels::KERNEL_SOURCES_HASH, "a comment in Cargo.toml changed the hash");
    fs::write(copy.join("Cargo.toml"), manifest.replace("edition = \"2021\"", "edition = \"2024\""))
        .expect("editing the copy");
    assert_ne!(hash(&copy), kernels::KERNEL_SOURCES_HASH, "an edit of Cargo.toml kept the hash");
}

/// What the normalization keeps apart and what it merges, token by token.
#[test]
fn kernel_source_normalization_keeps_literals_and_token_boundaries() {
    let same = |a: &str, b: &str| build_script::normalize_rust(a) == build_script::normalize_rust(b);
    // Comments of every kind and whitespace between tokens go.
    assert!(same("fn f(a: u32, b: u32) -> u32 { a + b }", "fn f(a:u32,b:u32)->u32{a+b}"));
    assert!(same("let x = 1; // one\nlet y = 2;", "let x = 1;\n\n/** doc */ let y = 2;"));
    assert!(same("/* a /* nested */ comment */ x", "x"));
    assert!(same("impl<'a> S<'a> { fn f(&'a self) {} }", "impl<'a>S<'a>{fn f(&'a self){}}"));
    // Literals stay verbatim: strings, raw strings, chars, what looks like a
    // comment inside them.
    assert!(!same(r#"asm!("add.u32 {a}, {b};")"#, r#"asm!("add.u32 {a},{b};")"#));
    assert!(!same(r##"r#"a // b"#"##, r##"r#"a "#"##));
    assert!(!same(r#"let s = "/* x */";"#, r#"let s = "";"#));
    assert!(same("let c = '\\''; let d = 2; // x", "let c='\\'';let d=2;"));
    assert!(!same("let c = '\\''; let d = 2;", "let c = '\\''; let d = 3;"));
    assert!(same(r#"let c = '"'; let d = 1;"#, r#"let c='"';let d=1;"#));
    // Where a space separates tokens it stays.
    assert!(!same("a & &b", "a && b"));
    assert!(!same("let x = r #y;", "let x = r#y;"));
    assert!(!same("pub fn f()", "pubfn f()"));
    assert!(!same("x as u8", "x asu8"));
}

#[test]
fn committed_ptx_is_identical_to_built_ptx() {
    if kernels::PTX_ORIGIN != "built" {
        skip(
            "PTX not built from source in this build (committed PTX embedded; building needs the nightly toolchain with rust-src: bash .ci/tools.sh)",
            REQUIRE_PTX_BUILD,
        );
        return;
    }
    let manifest = manifest().unwrap_or_else(|e| panic!("{e}"));
    let mut differences = Vec::new();
    for p in kernels::embedded() {
        let file = committed_dir().join(format!("{}.ptx", p.arch));
        match fs::read_to_string(&file) {
            Err(e) => differences.push(format!("{}: {e}", file.display())),
            Ok(text) if text != p.text => {
                let line = text.lines().zip(p.text.lines()).position(|(a, b)| a != b).map(|i| i + 1);
                let at = match line {
                    Some(l) => format!("first difference at line {l}"),
                    None => format!("lengths differ: {} vs {} lines", text.lines().count(), p.text.lines().count()),
                };
                differences.push(format!("{} differs from the built {} PTX ({at})", file.display(), p.arch));
            }
            Ok(_) => {}
        }
    }
    if differences.is_empty() {
        return;
    }
    let committed_rustc = manifest.get("rustc").map(String::as_str).unwrap_or("(unknown)");
    let rustc_note = if committed_rustc != kernels::PTX_RUSTC_VERSION {
        format!(
            "\nnote: the committed PTX was built by `{committed_rustc}`, this build by `{}`; a different compiler emits different PTX, so regenerate with the toolchain CI uses",
            kernels::PTX_RUSTC_VERSION
        )
    } else {
        String::new()
    };
    panic!(
        "committed PTX does not match the PTX built from these sources: {REGEN}\n{}{rustc_note}",
        differences.join("\n")
    );
}

/// Each asm block that takes the address of a named shared array
/// (`ptx::reduction_scratch`, `ptx::cluster_inbox`) declares it: an entry
/// whose code took it twice (or that LLVM duplicated) would zero one copy
/// and poll the other. Every entry declares each at most once, and each
/// cluster entry passes each cluster barrier instruction once.
#[test]
fn shared_arrays_and_cluster_barriers_appear_once_per_entry() {
    let mut failures = Vec::new();
    let mut seen_inbox = 0;
    for p in kernels::embedded() {
        for body in p.text.split("\n.visible .entry ").skip(1) {
            let name = body.split('(').next().unwrap_or("?");
            for array in ["tp_reduction_scratch[", "tp_cluster_inbox["] {
                let n = body.matches(array).count();
                if n > 1 {
                    failures.push(format!("{} {name}: {array}] declared {n} times", p.arch));
                }
                seen_inbox += (array == "tp_cluster_inbox[" && n == 1) as usize;
            }
        }
    }
    // Each cluster entry arrives at and waits on the cluster barrier
    // exactly once (`.aligned`: an instruction LLVM duplicated into
    // divergent paths would break it).
    for p in kernels::embedded().iter().filter(|p| p.sm >= kernels::CLUSTER_MIN_SM) {
        for name in kernels::cluster_entries() {
            let start = p.text.find(&format!(".entry {name}(")).unwrap_or_else(|| panic!("{} {name}", p.arch));
            let body = &p.text[start..];
            let body = &body[..body[1..].find(".entry ").map_or(body.len(), |e| e + 1)];
            for barrier in ["barrier.cluster.arrive.relaxed.aligned;", "barrier.cluster.wait.aligned;"] {
                let n = body.matches(barrier).count();
                if n != 1 {
                    failures.push(format!("{} {name}: `{barrier}` {n} times", p.arch));
                }
            }
        }
    }
    // The cluster entries of every sm_90+ PTX use the inbox.
    let cluster_ptx = kernels::embedded().iter().filter(|p| p.sm >= kernels::CLUSTER_MIN_SM).count();
    assert_eq!(seen_inbox, cluster_ptx * kernels::cluster_entries().len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Functions of a disassembly (`nvdisasm -c`): name -> instruction lines
/// (`.text.<name>:` starts a function).
fn sass_functions(sass: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in sass.lines() {
        if let Some(name) = line.strip_prefix(".text.").and_then(|l| l.strip_suffix(':')) {
            current = Some(name.to_string());
            out.entry(name.to_string()).or_default();
        } else if let (Some(name), Some(at)) = (&current, line.find("*/")) {
            let instruction = line[at + 2..].trim().trim_end_matches(';').trim();
            if line.trim_start().starts_with("/*") && !instruction.is_empty() {
                out.get_mut(name).expect("entry made above").push(instruction.to_string());
            }
        }
    }
    out
}

/// The warp-aggregated shape of an atomic add: its answer (the `ATOMG`'s
/// destination register) broadcast by a `SHFL.IDX` within the next few
/// instructions. The shuffle waits for the atomic's answer right there.
/// Returns the offending `ATOMG` lines.
fn aggregated_atomics(instructions: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for (i, ins) in instructions.iter().enumerate() {
        // A guard predicate (`@P5 `) may come first.
        let Some(at) = ins.find("ATOMG.E.ADD") else { continue };
        let operands = &ins[at..];
        // `ATOMG.E.ADD.STRONG.GPU PT, R33, desc[UR8][R10.64], R33`: the
        // destination is the second operand.
        let Some(dest) = operands.split(',').nth(1).map(str::trim) else { continue };
        let shuffled = instructions[i + 1..]
            .iter()
            .take(8)
            .any(|next| next.contains("SHFL.IDX") && next.split(',').nth(2).map(str::trim) == Some(dest));
        if shuffled {
            found.push(instructions[i].clone());
        }
    }
    found
}

#[test]
fn aggregated_atomic_detector_sees_the_shape() {
    let aggregated = [
        "VOTEU.ANY UR4, UPT, PT",
        "UPOPC UR5, UR4",
        "@P5 ATOMG.E.ADD.STRONG.GPU PT, R7, desc[UR8][R10.64], R7",
        "POPC R12, R12",
        "SHFL.IDX PT, R8, R7, R8, 0x1f",
    ]
    .map(String::from);
    assert_eq!(aggregated_atomics(&aggregated).len(), 1);
    let single = ["SEL R33, RZ, 0x1, P4", "ATOMG.E.ADD.STRONG.GPU PT, R33, desc[UR8][R10.64], R33", "BSYNC B0"]
        .map(String::from);
    assert!(aggregated_atomics(&single).is_empty());
    let sass = ".text.k:\n        /*0000*/                   ATOMG.E.ADD.STRONG.GPU PT, R1, desc[UR8][R2.64], R1 ;\n\
                /*0010*/                   SHFL.IDX PT, R3, R1, R4, 0x1f ;\n";
    assert_eq!(aggregated_atomics(&sass_functions(sass)["k"]).len(), 1);
}

/// The sentinel kernels count their block with one relaxed atomic add by
/// thread 0 whose answer is used only at the end (`sentinel::count_block`
/// / `finish_generation`). ptxas turns an atomic it cannot prove to be
/// single-lane into a warp-aggregated one whose `SHFL.IDX` waits for the
/// answer at once (thread 0 then waited out the atomic before its first
/// poll): no sentinel entry of any architecture has that shape, and each
/// has its atomic add.
#[test]
fn sentinel_atomic_is_not_warp_aggregated() {
    let Some(ptxas) = ptxas() else { return };
    let Some(nvdisasm) = inspect::find_tool("nvdisasm") else {
        skip("nvdisasm not found (run bash .ci/tools.sh)", REQUIRE_PTXAS);
        return;
    };
    // one_shot_push*, two_shot_push*, hierarchical*, fused_one_shot_push*,
    // fused_two_shot_push*, fused_hierarchical* (the pull and ring kernels
    // use flags, not the block count).
    let sentinel = |name: &str| name.contains("push") || name.contains("hierarchical");
    let mut failures = Vec::new();
    let mut checked = 0;
    for (arch, result) in assemblies(&ptxas) {
        let Ok(a) = result else { continue }; // every_ptx_assembles_for_its_arch reports it
        let sass = inspect::disassemble(&nvdisasm, &a.cubin).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let functions = sass_functions(&sass);
        let sm = kernels::for_arch(arch).map_or(0, |p| p.sm);
        for name in kernels::expected_entries_for(sm).into_iter().filter(|n| sentinel(n)) {
            let Some(body) = functions.get(&name) else {
                failures.push(format!("{arch} {name}: not in the disassembly"));
                continue;
            };
            if !body.iter().any(|i| i.contains("ATOMG.E.ADD")) {
                failures.push(format!("{arch} {name}: no atomic add (the block count)"));
            }
            for ins in aggregated_atomics(body) {
                failures.push(format!("{arch} {name}: warp-aggregated atomic `{ins}`"));
            }
            checked += 1;
        }
    }
    assert!(checked > 0, "no sentinel entry checked");
    eprintln!("sentinel entries checked for aggregated atomics: {checked}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
