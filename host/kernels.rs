//! The PTX that `build.rs` embedded, one per architecture, and the pure
//! rules for choosing one for a device.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::{AlgorithmId, DType};

use crate::algorithm::fused::PushRowSplit;

mod index {
    include!(concat!(env!("OUT_DIR"), "/ptx_index.rs"));
}

pub use index::{KERNEL_SOURCES_HASH, PTX_ORIGIN, PTX_RUSTC_VERSION};

/// One embedded PTX module.
#[derive(Clone, Copy, Debug)]
pub struct EmbeddedPtx {
    /// `sm_120`, `sm_90`, ...
    pub arch: &'static str,
    /// Compute capability as `major * 10 + minor` (120, 90, 89, 80).
    pub sm: u32,
    pub text: &'static str,
}

/// Every embedded PTX module, highest architecture first.
pub fn embedded() -> Vec<EmbeddedPtx> {
    let mut all: Vec<EmbeddedPtx> =
        index::EMBEDDED_PTX.iter().map(|&(arch, sm, text)| EmbeddedPtx { arch, sm, text }).collect();
    all.sort_by_key(|p| std::cmp::Reverse(p.sm));
    all
}

/// The embedded PTX for `arch` (`"sm_90"`), if built.
pub fn for_arch(arch: &str) -> Option<EmbeddedPtx> {
    embedded().into_iter().find(|p| p.arch == arch)
}

/// The PTX to load on a device of compute capability `major.minor`: the
/// highest embedded architecture not above the device's (an exact match
/// runs as compiled; a lower one is JIT-compiled by the driver, e.g. sm_90
/// PTX on an sm_100 part). `None` if the device is older than every build.
///
/// Within one major version a higher minor is not always a superset (sm_90a,
/// sm_120a features), but the plain `sm_XY` targets we emit are forward
/// compatible through PTX JIT.
pub fn choose(major: u32, minor: u32) -> Option<EmbeddedPtx> {
    let sm = major * 10 + minor;
    embedded().into_iter().find(|p| p.sm <= sm)
}

/// Entry point name of a kernel: `<algorithm>_<dtype>`.
pub fn entry_name(algorithm: AlgorithmId, dtype: DType) -> String {
    format!("{}_{}", algorithm.kernel_prefix(), dtype.name())
}

/// Entry point of the two-rank specialisation of OneShotPush:
/// `one_shot_push2_<dtype>` (same parameters as `one_shot_push_<dtype>`).
pub fn one_shot_push2_entry(dtype: DType) -> String {
    format!("{}2_{}", AlgorithmId::OneShotPush.kernel_prefix(), dtype.name())
}

/// Sentinel entries (payload carries completion: OneShotPush, TwoShotPush,
/// Hierarchical): parameters by value, any launch shape within residency.
pub fn is_sentinel_entry(name: &str) -> bool {
    AlgorithmId::ALL.iter().any(|a| a.sentinel() && name.starts_with(a.kernel_prefix()))
}

pub use tp_allreduce_kernels::ids::{max_registers, SENTINEL_MAX_REGISTERS, SENTINEL_MAX_THREADS};

/// Every sentinel entry (every dtype): every sentinel algorithm's
/// `<prefix>_<dtype>`, and the two-rank OneShotPush.
pub fn sentinel_entries() -> Vec<String> {
    DType::ALL
        .into_iter()
        .flat_map(|d| {
            let plain = AlgorithmId::ALL.into_iter().filter(|a| a.sentinel()).map(move |a| entry_name(a, d));
            plain.chain([one_shot_push2_entry(d)])
        })
        .collect()
}

/// The copy-engine ring's one-thread kernels (no dtype): the handshake
/// wait and the flag publication.
pub const COPY_ENGINE_HANDSHAKE: &str = "copy_engine_ring_handshake";
pub const COPY_ENGINE_PUBLISH: &str = "copy_engine_ring_publish";

/// Size and alignment of the one by-value parameter struct of `name`, for
/// the entries that take one (`None` for the others).
pub fn param_struct(name: &str) -> Option<(usize, usize)> {
    use std::mem::{align_of, size_of};
    use tp_allreduce_kernels::params::{CopyEngineParams, IslandPushParams, OneShotPushParams};
    let prefix = |a: AlgorithmId| name.starts_with(a.kernel_prefix());
    if prefix(AlgorithmId::OneShotPush) {
        Some((size_of::<OneShotPushParams>(), align_of::<OneShotPushParams>()))
    } else if prefix(AlgorithmId::TwoShotPush) || prefix(AlgorithmId::Hierarchical) {
        Some((size_of::<IslandPushParams>(), align_of::<IslandPushParams>()))
    } else if prefix(AlgorithmId::CopyEngineRing) && name != COPY_ENGINE_PUBLISH {
        Some((size_of::<CopyEngineParams>(), align_of::<CopyEngineParams>()))
    } else {
        None
    }
}

/// Entry of the fused (allreduce + residual add + RMSNorm) OneShotPush:
/// `fused_one_shot_push[2][_short|_wide|_wide_spread|_cluster]_<dtype>`:
/// `2` for two ranks, the suffix by packs of a row per thread (`_wide`:
/// one, two ranks only; `_wide_spread`: the same, the push spread; `_short`: two; none: four; `_cluster`: one, a row over a
/// cluster's blocks, sm_90+ only). One `FusedOneShotPushParams` by value.
pub fn fused_one_shot_push_entry(dtype: DType, two_ranks: bool, split: PushRowSplit) -> String {
    let suffix = match split {
        PushRowSplit::Wide => "_wide",
        PushRowSplit::WideSpread => "_wide_spread",
        PushRowSplit::Short => "_short",
        PushRowSplit::Long => "",
        PushRowSplit::Cluster => "_cluster",
    };
    format!("fused_one_shot_push{}{suffix}_{}", if two_ranks { "2" } else { "" }, dtype.name())
}

/// The fused OneShotPush entries with one pack per thread (blocks of up to
/// 1024 threads, the sentinel kernels' register budget).
pub fn fused_wide_entries() -> Vec<String> {
    DType::ALL
        .into_iter()
        .flat_map(|d| [PushRowSplit::Wide, PushRowSplit::WideSpread].map(|s| fused_one_shot_push_entry(d, true, s)))
        .collect()
}

/// Entry of the fused island push of `algorithm` (TwoShotPush or
/// Hierarchical): `fused_two_shot_push_<dtype>` or
/// `fused_hierarchical_<dtype>` (one `FusedIslandPushParams` by value).
pub fn fused_island_push_entry(algorithm: AlgorithmId, dtype: DType) -> String {
    format!("fused_{}_{}", algorithm.kernel_prefix(), dtype.name())
}

/// Entry of the fused OneShotPull: `fused_one_shot_pull_<dtype>`.
pub fn fused_one_shot_pull_entry(dtype: DType) -> String {
    format!("fused_one_shot_pull_{}", dtype.name())
}

/// Entry of the separate epilogue kernel of the unfused path:
/// `add_rms_norm_<dtype>`.
pub fn add_rms_norm_entry(dtype: DType) -> String {
    format!("add_rms_norm_{}", dtype.name())
}

/// The fused-epilogue entries of every dtype (launched with at most
/// `FUSED_MAX_THREADS` threads and the default register budget, except
/// the [`fused_wide_entries`]).
pub fn fused_entries() -> Vec<String> {
    DType::ALL
        .into_iter()
        .flat_map(|d| {
            [
                fused_one_shot_push_entry(d, false, PushRowSplit::Long),
                fused_one_shot_push_entry(d, true, PushRowSplit::Long),
                fused_one_shot_push_entry(d, false, PushRowSplit::Short),
                fused_one_shot_push_entry(d, true, PushRowSplit::Short),
                fused_one_shot_push_entry(d, true, PushRowSplit::Wide),
                fused_one_shot_push_entry(d, true, PushRowSplit::WideSpread),
                fused_island_push_entry(AlgorithmId::TwoShotPush, d),
                fused_island_push_entry(AlgorithmId::Hierarchical, d),
                fused_one_shot_pull_entry(d),
                add_rms_norm_entry(d),
            ]
        })
        .collect()
}

/// Lowest compute capability (`major * 10 + minor`) whose PTX has the
/// [`cluster_entries`] (thread-block clusters: sm_90).
pub const CLUSTER_MIN_SM: u32 = 90;

/// The fused OneShotPush entries that spread a row over a thread-block
/// cluster (every dtype, any world and two ranks): only in the PTX of
/// `CLUSTER_MIN_SM` and newer, launched with at most `FUSED_MAX_THREADS`
/// threads and the default register budget.
pub fn cluster_entries() -> Vec<String> {
    DType::ALL
        .into_iter()
        .flat_map(|d| [false, true].map(|two| fused_one_shot_push_entry(d, two, PushRowSplit::Cluster)))
        .collect()
}

/// Every entry the PTX of compute capability `sm` must have: the
/// [`expected_entries`], and the [`cluster_entries`] from sm_90 on.
pub fn expected_entries_for(sm: u32) -> Vec<String> {
    let mut names = expected_entries();
    if sm >= CLUSTER_MIN_SM {
        names.extend(cluster_entries());
        names.sort();
    }
    names
}

/// Names of every kernel entry the host may launch on any architecture;
/// each must be present in every embedded PTX.
pub fn expected_entries() -> Vec<String> {
    let mut names = fused_entries();
    for dtype in DType::ALL {
        for algorithm in AlgorithmId::ALL {
            names.push(entry_name(algorithm, dtype));
        }
        names.push(one_shot_push2_entry(dtype));
        names.push(format!("sum_{}", dtype.name()));
        names.push(format!("affine_{}", dtype.name()));
    }
    names.push(AlgorithmId::P2pCheck.kernel_prefix().to_string());
    names.push(COPY_ENGINE_HANDSHAKE.to_string());
    names.push(COPY_ENGINE_PUBLISH.to_string());
    names.sort();
    names
}

/// Kernels on the latency-critical path: must use no local memory (no stack
/// frame, no spills) on any architecture.
pub fn hot_entries() -> Vec<String> {
    let mut names = fused_entries();
    for dtype in DType::ALL {
        for algorithm in AlgorithmId::ALL {
            names.push(entry_name(algorithm, dtype));
        }
        names.push(one_shot_push2_entry(dtype));
    }
    names
}
