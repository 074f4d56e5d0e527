//! Every environment variable the project reads, declared in one place:
//! [`VARS`] (name, meaning, default) is the table, and the typed getters
//! below are the only library code that reads them. This module is a leaf:
//! it knows names, values and parsing, nothing of the communicator (the
//! [`Config`](crate::config::Config) reads it, never the other way round).
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `TP_ALLREDUCE_ALGORITHM` | force an algorithm for every call: `one-shot-pull`, `two-shot-pull`, `one-shot-push`, `two-shot-push`, `ring`, `hierarchical`, `copy-engine-ring`, `nccl`; `auto` = the selection | `auto` |
//! | `TP_ALLREDUCE_TOPOLOGY` | model with this embedded topology instead of discovering the machine (communicators and `plan`) | discovery |
//! | `TP_ALLREDUCE_TUNING_FILE` | tuning table to load (TOML, see `select::tuning`) | `$XDG_CACHE_HOME/tp-allreduce/tuning-<fingerprint>-w<world>.toml` |
//! | `TP_ALLREDUCE_AUTO_MEASURE` | measured `auto` at communicator start: `off` (the cost model, or a `tune` table), `on` (bounded sweep, cached), `full` (every algorithm at every `tune` size) | `off` (until measured `auto` has run on a GPU) |
//! | `TP_ALLREDUCE_MEASURE_DTYPES` | dtypes measured at communicator start, by `,` (`bf16,f16`) | `bf16` |
//! | `TP_ALLREDUCE_CACHE_DIR` | where measured tables are cached | `$XDG_CACHE_HOME/tp-allreduce`, else `~/.cache/tp-allreduce` |
//! | `TP_ALLREDUCE_TRANSPORT` | force the transport: `p2p`, `host-staged` or `per-pair` (P2P inside islands, host-staged across) | auto (P2P if every pair passes the check) |
//! | `TP_ALLREDUCE_TIMEOUT_MS` | bound of a device-side wait on a peer that already started the call, in ms | `5000` |
//! | `TP_ALLREDUCE_LAUNCH_TIMEOUT_MS` | bound of a device-side wait on a peer that has not shown the call yet, in ms | `60000` (at least the timeout) |
//! | `TP_ALLREDUCE_ISLAND_SIZE` | ranks per island for `hierarchical` (consecutive ranks) | from the topology |
//! | `TP_ALLREDUCE_ISLANDS` | the islands for `hierarchical`, any shape: ranks by `,`, islands by `/` (`0,1,2/3,4`) | from the topology |
//! | `TP_ALLREDUCE_PUSH_BLOCKS` | no effect any more (two-shot-push and hierarchical run with any launch shape); still validated | `16` |
//! | `TP_ALLREDUCE_SHAPE` | launch shape `BLOCKSxTHREADS` of every sentinel launch (one-shot-push, two-shot-push, hierarchical; overrides tuning and the default rule) | tuning table, else the default rule |
//! | `TP_ALLREDUCE_ONE_SHOT_PUSH_TP2` | `1`/`0`: use the two-rank specialisation of one-shot-push at 2 ranks | `1` |
//! | `TP_ALLREDUCE_FUSED_ISLAND_KERNELS` | `1`/`0`: fused calls over two-shot-push / hierarchical run their fused kernels (else the allreduce + the separate kernel) | `0` |
//! | `TP_ALLREDUCE_FUSED_CLUSTERS` | `1`/`0`: fused one-shot-push calls over a few long rows spread each row over a thread-block cluster (sm_90+) | `1` |
//! | `TP_ALLREDUCE_FUSED_SPREAD_PUSH` | `1`/`0`: fused one-shot-push calls of a block per row over two or more rows spread their push over more blocks than rows (outputs apart from the input) | `1` |
//! | `TP_ALLREDUCE_CE_PUBLISH` | how the copy-engine ring raises its flags: `memop` (`cuStreamWriteValue32`, where the device supports stream memory operations) or `kernel` (a one-thread kernel) | `memop` where supported |
//! | `TP_ALLREDUCE_BATCH_INVARIANT` | `1`: results independent of message size and batch shape (rank-order sums with one rounding only: one-/two-shot push and pull; fused calls on the fused one-shot push without clusters) | `0` |
//! | `TP_ALLREDUCE_WIRE` | wire format of the push algorithms: `lossless`, `fp8` (e4m3, one f32 scale per 32 elements) or `int8`; the lossy ones have no kernel yet, and a communicator refuses them (`Error::Unsupported`) | `lossless` |
//! | `TP_ALLREDUCE_WIRE_MIN_BYTES` | with a lossy wire, messages below this many bytes stay lossless; unset: where the cost model predicts the compressed wire pays | the cost model |
//! | `TP_ALLREDUCE_TRACE` | `1`: one-shot-push launches record timestamps (`bench --trace`) | `0` |
//! | `TP_ALLREDUCE_RANK` | rank of a process started by `tp-allreduce launch` | set by the launcher |
//! | `TP_ALLREDUCE_WORLD_SIZE` | world size of a launched process | set by the launcher |
//! | `TP_ALLREDUCE_ID` | rendezvous id of a launched process | set by the launcher |
//! | `TP_ALLREDUCE_DEVICE` | CUDA ordinal a launched process should use | `0` |
//! | `TP_ALLREDUCE_PTXAS` | path of `ptxas` for `inspect` and the PTX tests | `.cache/cuda-tools/bin`, then `PATH` |
//! | `TP_ALLREDUCE_NVDISASM` | path of `nvdisasm` for `inspect` | as above |
//! | `TP_ALLREDUCE_CUOBJDUMP` | path of `cuobjdump` for `inspect` | as above |
//! | `TP_ALLREDUCE_LOG` | the `tp-allreduce` tool's stderr log filter, `RUST_LOG`'s simple form (`debug`, `tp_allreduce::comm=debug,warn`); `RUST_LOG` when unset | INFO from tp-allreduce, WARN from the rest |
//! | `TP_ALLREDUCE_TEST_SEED` | seed of the randomized tests and `selftest` | fresh per run |
//! | `TP_ALLREDUCE_BUILD_PTX` | build time: `1` forces building PTX from source (fails without nightly) | source if possible, else committed PTX |
//! | `TP_ALLREDUCE_PTX_ARCHS` | build time: architectures to build | `sm_120,sm_90,sm_89,sm_80` |
//! | `TP_ALLREDUCE_WRITE_PTX` | build time: also write the built PTX to this folder | unset |

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use crate::algorithm::names::{Algorithm, Transport};
use crate::error::{Error, Result};

/// One declared environment variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvVar {
    pub name: &'static str,
    pub meaning: &'static str,
    pub default: &'static str,
}

pub const ALGORITHM: &str = "TP_ALLREDUCE_ALGORITHM";
pub const TOPOLOGY: &str = "TP_ALLREDUCE_TOPOLOGY";
pub const TUNING_FILE: &str = "TP_ALLREDUCE_TUNING_FILE";
pub const TRANSPORT: &str = "TP_ALLREDUCE_TRANSPORT";
pub const AUTO_MEASURE: &str = "TP_ALLREDUCE_AUTO_MEASURE";
pub const MEASURE_DTYPES: &str = "TP_ALLREDUCE_MEASURE_DTYPES";
pub const CACHE_DIR: &str = "TP_ALLREDUCE_CACHE_DIR";
pub const TIMEOUT_MS: &str = "TP_ALLREDUCE_TIMEOUT_MS";
pub const LAUNCH_TIMEOUT_MS: &str = "TP_ALLREDUCE_LAUNCH_TIMEOUT_MS";
pub const ISLAND_SIZE: &str = "TP_ALLREDUCE_ISLAND_SIZE";
pub const ISLANDS: &str = "TP_ALLREDUCE_ISLANDS";
pub const CE_PUBLISH: &str = "TP_ALLREDUCE_CE_PUBLISH";
pub const PUSH_BLOCKS: &str = "TP_ALLREDUCE_PUSH_BLOCKS";
pub const SHAPE: &str = "TP_ALLREDUCE_SHAPE";
pub const ONE_SHOT_PUSH_TP2: &str = "TP_ALLREDUCE_ONE_SHOT_PUSH_TP2";
pub const FUSED_ISLAND_KERNELS: &str = "TP_ALLREDUCE_FUSED_ISLAND_KERNELS";
pub const FUSED_CLUSTERS: &str = "TP_ALLREDUCE_FUSED_CLUSTERS";
pub const FUSED_SPREAD_PUSH: &str = "TP_ALLREDUCE_FUSED_SPREAD_PUSH";
pub const TRACE: &str = "TP_ALLREDUCE_TRACE";
pub const WIRE: &str = "TP_ALLREDUCE_WIRE";
pub const WIRE_MIN_BYTES: &str = "TP_ALLREDUCE_WIRE_MIN_BYTES";
pub const BATCH_INVARIANT: &str = "TP_ALLREDUCE_BATCH_INVARIANT";
pub const RANK: &str = "TP_ALLREDUCE_RANK";
pub const WORLD_SIZE: &str = "TP_ALLREDUCE_WORLD_SIZE";
pub const ID: &str = "TP_ALLREDUCE_ID";
pub const DEVICE: &str = "TP_ALLREDUCE_DEVICE";
pub const TEST_SEED: &str = "TP_ALLREDUCE_TEST_SEED";

/// The table of every variable (the module docs render the same table).
pub const VARS: &[EnvVar] = &[
    EnvVar {
        name: ALGORITHM,
        meaning: "force an algorithm for every call (one-shot-pull, two-shot-pull, one-shot-push, two-shot-push, ring, hierarchical, nccl); auto = the selection",
        default: "auto",
    },
    EnvVar {
        name: TOPOLOGY,
        meaning: "model with this embedded topology instead of discovering the machine",
        default: "discovery",
    },
    EnvVar {
        name: TUNING_FILE,
        meaning: "tuning table to load (TOML)",
        default: "$XDG_CACHE_HOME/tp-allreduce/tuning-<fingerprint>-w<world>.toml",
    },
    EnvVar {
        name: AUTO_MEASURE,
        meaning: "measured auto at communicator start: off (model or tune table), on (bounded sweep, cached), full",
        default: "off",
    },
    EnvVar { name: MEASURE_DTYPES, meaning: "dtypes measured at communicator start, by `,`", default: "bf16" },
    EnvVar {
        name: CACHE_DIR,
        meaning: "where measured tables are cached",
        default: "$XDG_CACHE_HOME/tp-allreduce, else ~/.cache/tp-allreduce",
    },
    EnvVar { name: TRANSPORT, meaning: "force the transport: p2p, host-staged or per-pair", default: "auto" },
    EnvVar {
        name: TIMEOUT_MS,
        meaning: "bound of a device-side wait on a peer that already started the call, in ms",
        default: "5000",
    },
    EnvVar {
        name: LAUNCH_TIMEOUT_MS,
        meaning: "bound of a device-side wait on a peer that has not shown the call yet, in ms",
        default: "60000 (at least the timeout)",
    },
    EnvVar { name: ISLAND_SIZE, meaning: "ranks per island for hierarchical", default: "from the topology" },
    EnvVar {
        name: CE_PUBLISH,
        meaning: "copy-engine ring flag publication: memop (cuStreamWriteValue32) or kernel",
        default: "memop where supported",
    },
    EnvVar {
        name: ISLANDS,
        meaning: "the islands for hierarchical, ranks by `,`, islands by `/` (0,1,2/3,4)",
        default: "from the topology",
    },
    EnvVar {
        name: PUSH_BLOCKS,
        meaning: "no effect any more (two-shot-push and hierarchical run with any launch shape)",
        default: "16",
    },
    EnvVar {
        name: SHAPE,
        meaning: "launch shape BLOCKSxTHREADS of every one-shot-push launch",
        default: "tuning table, else the default rule",
    },
    EnvVar {
        name: ONE_SHOT_PUSH_TP2,
        meaning: "1/0: use the two-rank specialisation of one-shot-push at 2 ranks",
        default: "1",
    },
    EnvVar {
        name: FUSED_ISLAND_KERNELS,
        meaning: "1/0: fused calls over two-shot-push / hierarchical run their fused kernels",
        default: "0",
    },
    EnvVar {
        name: FUSED_CLUSTERS,
        meaning: "1/0: fused one-shot-push calls over a few long rows spread each row over a thread-block cluster",
        default: "1",
    },
    EnvVar {
        name: BATCH_INVARIANT,
        meaning: "1: results independent of message size and batch shape (rank-order sums with one rounding only)",
        default: "0",
    },
    EnvVar {
        name: FUSED_SPREAD_PUSH,
        meaning: "1/0: fused one-shot-push calls of a block per row spread their push over more blocks than rows",
        default: "1",
    },
    EnvVar { name: TRACE, meaning: "1: one-shot-push launches record timestamps", default: "0" },
    EnvVar { name: RANK, meaning: "rank of a process started by `tp-allreduce launch`", default: "set by the launcher" },
    EnvVar { name: WORLD_SIZE, meaning: "world size of a launched process", default: "set by the launcher" },
    EnvVar { name: ID, meaning: "rendezvous id of a launched process", default: "set by the launcher" },
    EnvVar { name: DEVICE, meaning: "CUDA ordinal a launched process should use", default: "0" },
    EnvVar {
        name: "TP_ALLREDUCE_PTXAS",
        meaning: "path of ptxas for inspect and the PTX tests",
        default: ".cache/cuda-tools/bin, then PATH",
    },
    EnvVar { name: "TP_ALLREDUCE_NVDISASM", meaning: "path of nvdisasm for inspect", default: "as above" },
    EnvVar { name: "TP_ALLREDUCE_CUOBJDUMP", meaning: "path of cuobjdump for inspect", default: "as above" },
    EnvVar {
        name: "TP_ALLREDUCE_LOG",
        meaning: "the tp-allreduce tool's stderr log filter, RUST_LOG's simple form (debug, tp_allreduce::comm=debug,warn); RUST_LOG when unset",
        default: "INFO from tp-allreduce, WARN from the rest",
    },
    EnvVar {
        name: WIRE,
        meaning: "wire format of the push algorithms: lossless, fp8 or int8 (lossy: no kernel yet, refused)",
        default: "lossless",
    },
    EnvVar {
        name: WIRE_MIN_BYTES,
        meaning: "with a lossy wire, messages below this many bytes stay lossless",
        default: "the cost model",
    },
    EnvVar { name: TEST_SEED, meaning: "seed of the randomized tests and selftest", default: "fresh per run" },
    EnvVar {
        name: "TP_ALLREDUCE_BUILD_PTX",
        meaning: "build time: 1 forces building PTX from source",
        default: "source if possible, else committed PTX",
    },
    EnvVar {
        name: "TP_ALLREDUCE_PTX_ARCHS",
        meaning: "build time: architectures to build",
        default: "sm_120,sm_90,sm_89,sm_80",
    },
    EnvVar { name: "TP_ALLREDUCE_WRITE_PTX", meaning: "build time: also write the built PTX here", default: "unset" },
];

/// The value of `name`, `None` when unset or blank.
pub fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| Error::Config(format!("{name}={value}: not a valid value")))
}

/// Parses a `TP_ALLREDUCE_ALGORITHM` value: `None` for `auto` (or empty).
pub fn parse_algorithm(value: &str) -> Result<Option<Algorithm>> {
    let v = value.trim();
    if v.is_empty() || v.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    v.parse::<Algorithm>().map(Some).map_err(|e| Error::Config(format!("{ALGORITHM}={value}: {e} (or auto)")))
}

/// The algorithm forced by `TP_ALLREDUCE_ALGORITHM`, if any.
pub fn algorithm() -> Result<Option<Algorithm>> {
    var(ALGORITHM).map_or(Ok(None), |v| parse_algorithm(&v))
}

/// The embedded topology name given by `TP_ALLREDUCE_TOPOLOGY`, if any
/// (resolved and validated by `select::topology::embedded::by_name`).
pub fn topology_name() -> Option<String> {
    var(TOPOLOGY)
}

/// The transport forced by `TP_ALLREDUCE_TRANSPORT`, if any.
pub fn transport() -> Result<Option<Transport>> {
    var(TRANSPORT).map(|v| v.parse().map_err(|e: Error| Error::Config(format!("{TRANSPORT}: {e}")))).transpose()
}

/// `TP_ALLREDUCE_TIMEOUT_MS`, if set.
pub fn timeout() -> Result<Option<Duration>> {
    var(TIMEOUT_MS).map(|v| parse(TIMEOUT_MS, &v).map(Duration::from_millis)).transpose()
}

/// `TP_ALLREDUCE_LAUNCH_TIMEOUT_MS`, if set.
pub fn launch_timeout() -> Result<Option<Duration>> {
    var(LAUNCH_TIMEOUT_MS).map(|v| parse(LAUNCH_TIMEOUT_MS, &v).map(Duration::from_millis)).transpose()
}

/// `TP_ALLREDUCE_ISLAND_SIZE`, if set.
pub fn island_size() -> Result<Option<usize>> {
    var(ISLAND_SIZE).map(|v| parse(ISLAND_SIZE, &v)).transpose()
}

/// `TP_ALLREDUCE_CE_PUBLISH`: `Some(true)` for `kernel`, `Some(false)`
/// for `memop`, `None` when unset.
pub fn ce_publish_with_kernel() -> Result<Option<bool>> {
    var(CE_PUBLISH)
        .map(|v| match v.trim() {
            "kernel" => Ok(true),
            "memop" => Ok(false),
            other => Err(Error::Config(format!("{CE_PUBLISH}: `{other}`; expected memop or kernel"))),
        })
        .transpose()
}

/// `TP_ALLREDUCE_ISLANDS` (`0,1,2/3,4`), if set.
pub fn islands() -> Result<Option<Vec<Vec<usize>>>> {
    var(ISLANDS).map(|v| parse_islands(&v).map_err(|e| Error::Config(format!("{ISLANDS}: {e}")))).transpose()
}

/// `0,1,2/3,4` -> `[[0, 1, 2], [3, 4]]`.
pub fn parse_islands(text: &str) -> std::result::Result<Vec<Vec<usize>>, String> {
    text.split('/')
        .map(|group| {
            group
                .split(',')
                .map(|r| r.trim().parse::<usize>().map_err(|_| format!("`{}` is not a rank in `{text}`", r.trim())))
                .collect()
        })
        .collect()
}

/// `TP_ALLREDUCE_PUSH_BLOCKS`, if set.
pub fn push_blocks() -> Result<Option<u32>> {
    var(PUSH_BLOCKS).map(|v| parse(PUSH_BLOCKS, &v)).transpose()
}

/// `TP_ALLREDUCE_SHAPE` (`BLOCKSxTHREADS`), if set.
pub fn launch_shape() -> Result<Option<(u32, u32)>> {
    var(SHAPE).map(|v| parse_launch_shape(&v).map_err(|e| Error::Config(format!("{SHAPE}: {e}")))).transpose()
}

fn flag(name: &str) -> Result<Option<bool>> {
    var(name)
        .map(|v| match v.trim() {
            "1" | "true" | "on" | "yes" => Ok(true),
            "0" | "false" | "off" | "no" => Ok(false),
            other => Err(Error::Config(format!("{name}={other}: expected 1 or 0"))),
        })
        .transpose()
}

/// `TP_ALLREDUCE_ONE_SHOT_PUSH_TP2`, if set.
pub fn one_shot_push_tp2() -> Result<Option<bool>> {
    flag(ONE_SHOT_PUSH_TP2)
}

/// `TP_ALLREDUCE_FUSED_ISLAND_KERNELS`, if set.
pub fn fused_island_kernels() -> Result<Option<bool>> {
    flag(FUSED_ISLAND_KERNELS)
}

/// `TP_ALLREDUCE_FUSED_CLUSTERS`, if set.
pub fn fused_clusters() -> Result<Option<bool>> {
    flag(FUSED_CLUSTERS)
}

/// `TP_ALLREDUCE_BATCH_INVARIANT`, if set.
pub fn batch_invariant() -> Result<Option<bool>> {
    flag(BATCH_INVARIANT)
}

/// `TP_ALLREDUCE_FUSED_SPREAD_PUSH`, if set.
pub fn fused_spread_push() -> Result<Option<bool>> {
    flag(FUSED_SPREAD_PUSH)
}

/// `TP_ALLREDUCE_TRACE`, if set.
pub fn trace() -> Result<Option<bool>> {
    flag(TRACE)
}

/// `TP_ALLREDUCE_WIRE`, if set.
pub fn wire() -> Result<Option<crate::wire::WireFormat>> {
    var(WIRE).map(|v| crate::wire::parse_wire(&v).map_err(|e| Error::Config(format!("{WIRE}: {e}")))).transpose()
}

/// `TP_ALLREDUCE_WIRE_MIN_BYTES`, if set.
pub fn wire_min_bytes() -> Result<Option<usize>> {
    var(WIRE_MIN_BYTES).map(|v| parse(WIRE_MIN_BYTES, &v)).transpose()
}

/// `TP_ALLREDUCE_TEST_SEED`, if set to a number.
pub fn test_seed() -> Option<u64> {
    var(TEST_SEED).and_then(|s| s.trim().parse().ok())
}

/// A number from the launcher's contract (`TP_ALLREDUCE_RANK` ...).
pub fn launched_number(name: &str) -> Result<Option<usize>> {
    var(name).map(|v| parse(name, &v)).transpose()
}

/// Where to look for the tuning table of a rank view with this
/// fingerprint and world size.
pub fn tuning_file(fingerprint: &str, world: usize) -> Option<PathBuf> {
    if let Some(p) = var(TUNING_FILE) {
        return Some(PathBuf::from(p));
    }
    let base =
        var("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("tp-allreduce").join(format!("tuning-{fingerprint}-w{world}.toml")))
}

/// `TP_ALLREDUCE_AUTO_MEASURE`, if set.
pub fn auto_measure() -> Result<Option<crate::select::measured::mode::AutoMeasure>> {
    var(AUTO_MEASURE)
        .map(|v| v.parse().map_err(|why| Error::invalid(format!("{AUTO_MEASURE}: {why}"))))
        .transpose()
}

/// `TP_ALLREDUCE_MEASURE_DTYPES`, if set.
pub fn measure_dtypes() -> Result<Option<Vec<tp_allreduce_kernels::ids::DType>>> {
    var(MEASURE_DTYPES).map(|v| parse_dtypes(&v).map_err(|why| Error::invalid(format!("{MEASURE_DTYPES}: {why}")))).transpose()
}

/// Parses `bf16,f16` (no duplicates, at least one).
pub fn parse_dtypes(text: &str) -> std::result::Result<Vec<tp_allreduce_kernels::ids::DType>, String> {
    use tp_allreduce_kernels::ids::DType;
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let d = DType::ALL
            .into_iter()
            .find(|d| d.name() == part.to_ascii_lowercase())
            .ok_or_else(|| format!("`{part}` is not a dtype (f32, f16, bf16)"))?;
        if !out.contains(&d) {
            out.push(d);
        }
    }
    if out.is_empty() {
        return Err(format!("`{text}`: no dtype"));
    }
    Ok(out)
}

/// The measured tables' directory: `TP_ALLREDUCE_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/tp-allreduce`, else `~/.cache/tp-allreduce`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = var(CACHE_DIR).filter(|p| !p.trim().is_empty()) {
        return Some(PathBuf::from(p));
    }
    let base =
        var("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("tp-allreduce"))
}

/// Whether `(blocks, threads)` is a launch shape a sentinel kernel accepts
/// (residency is checked per communicator, at the call).
pub fn check_launch_shape((blocks, threads): (u32, u32)) -> std::result::Result<(), String> {
    if threads == 0 || threads > 1024 || threads % 32 != 0 {
        return Err(format!("{blocks}x{threads}: threads must be a multiple of 32 in 32..=1024"));
    }
    if blocks == 0 || blocks > 65_535 {
        return Err(format!("{blocks}x{threads}: blocks must be in 1..=65535"));
    }
    Ok(())
}

/// Parses a launch shape `BxT` (`64x512`).
pub fn parse_launch_shape(text: &str) -> std::result::Result<(u32, u32), String> {
    let (b, t) =
        text.trim().split_once(['x', 'X']).ok_or_else(|| format!("`{text}`: expected BLOCKSxTHREADS, e.g. 64x512"))?;
    let blocks = b.trim().parse().map_err(|_| format!("`{text}`: `{b}` is not a block count"))?;
    let threads = t.trim().parse().map_err(|_| format!("`{text}`: `{t}` is not a thread count"))?;
    check_launch_shape((blocks, threads))?;
    Ok((blocks, threads))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithm_values_parse() {
        assert_eq!(parse_algorithm("auto").unwrap(), None);
        assert_eq!(parse_algorithm(" ").unwrap(), None);
        assert_eq!(parse_algorithm("hierarchical").unwrap(), Some(Algorithm::Hierarchical));
        assert_eq!(parse_algorithm("ONE_SHOT_PUSH").unwrap(), Some(Algorithm::OneShotPush));
        assert_eq!(parse_algorithm("nccl").unwrap(), Some(Algorithm::Nccl));
        let e = parse_algorithm("fastest").unwrap_err().to_string();
        assert!(e.contains(ALGORITHM) && e.contains("fastest") && e.contains("two-shot-pull"), "{e}");
    }

    #[test]
    fn island_lists_parse() {
        assert_eq!(parse_islands("0,1,2/3,4").unwrap(), vec![vec![0, 1, 2], vec![3, 4]]);
        assert_eq!(parse_islands(" 0 , 2 / 1,3 ").unwrap(), vec![vec![0, 2], vec![1, 3]]);
        assert!(parse_islands("0,1/x").unwrap_err().contains("`x`"));
        assert!(parse_islands("0,,1").is_err());
    }

    #[test]
    fn every_var_is_in_the_doc_table() {
        let doc = include_str!("env.rs");
        for v in VARS {
            assert!(v.name.starts_with("TP_ALLREDUCE_"));
            assert!(doc.contains(&format!("| `{}` |", v.name)), "{} missing from the module docs", v.name);
        }
    }
}
