//! Every kernel entry the host may launch, from each algorithm's host side
//! (its plain entries, helpers and fused variant) and the library's own
//! (`add_rms_norm`, `sum`, `affine`, the transfer check): what the PTX of
//! each architecture must have, which entries are on the latency path, and
//! the register budgets and parameter structs the PTX checks compare.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::{AlgorithmId, DType, WIDE_ENTRY_MARK};

pub use super::copy_engine_ring::{COPY_ENGINE_HANDSHAKE, COPY_ENGINE_PUBLISH};
pub use super::island_push::fused_entry as fused_island_push_entry;
pub use super::launch::entry_name;
pub use super::one_shot_pull::fused_entry as fused_one_shot_pull_entry;
pub use super::one_shot_push::{fused_entry as fused_one_shot_push_entry, two_ranks_entry as one_shot_push2_entry};
use super::{host, Algorithm};
pub use crate::embedded_ptx::CLUSTER_MIN_SM;
pub use tp_allreduce_kernels::ids::{max_registers, SENTINEL_MAX_REGISTERS, SENTINEL_MAX_THREADS};

/// Entry of the separate epilogue kernel of the unfused path:
/// `add_rms_norm_<dtype>`.
pub fn add_rms_norm_entry(dtype: DType) -> String {
    format!("add_rms_norm_{}", dtype.name())
}

fn hosts() -> impl Iterator<Item = &'static dyn super::AlgorithmHost> {
    Algorithm::OURS.into_iter().filter_map(host)
}

/// Sentinel entries (payload carries completion: OneShotPush, TwoShotPush,
/// Hierarchical): parameters by value, any launch shape within residency.
pub fn is_sentinel_entry(name: &str) -> bool {
    AlgorithmId::ALL.iter().any(|a| a.sentinel() && name.starts_with(a.kernel_prefix()))
}

/// Every sentinel entry (every dtype): every sentinel algorithm's plain
/// entries (OneShotPush's two-rank ones included).
pub fn sentinel_entries() -> Vec<String> {
    hosts().filter(|h| h.sentinel()).flat_map(|h| h.entries()).collect()
}

/// Size and alignment of the one by-value parameter struct of `name`, for
/// the plain entries that take one (`None` for the others).
pub fn param_struct(name: &str) -> Option<(usize, usize)> {
    hosts().find_map(|h| h.param_struct(name))
}

/// The fused-epilogue entries of every dtype that every architecture has
/// (launched with at most `FUSED_MAX_THREADS` threads and the default
/// register budget, except the [`fused_wide_entries`]), and the separate
/// `add_rms_norm` kernel.
pub fn fused_entries() -> Vec<String> {
    let mut names: Vec<String> = hosts().flat_map(|h| h.fused_entries(None)).collect();
    names.extend(DType::ALL.into_iter().map(add_rms_norm_entry));
    names
}

/// The fused entries with one pack of a row per thread (blocks of up to
/// 1024 threads, the sentinel kernels' register budget).
pub fn fused_wide_entries() -> Vec<String> {
    fused_entries().into_iter().filter(|n| n.contains(WIDE_ENTRY_MARK)).collect()
}

/// Every entry the PTX of compute capability `sm` must have.
pub fn expected_entries_for(sm: u32) -> Vec<String> {
    entries_for(Some(sm))
}

/// Every entry the PTX of compute capability `sm` must have (`None`: every
/// architecture).
fn entries_for(sm: Option<u32>) -> Vec<String> {
    let mut names = Vec::new();
    for h in hosts() {
        names.extend(h.entries());
        names.extend(h.helper_entries());
        names.extend(h.fused_entries(sm));
    }
    for dtype in DType::ALL {
        names.push(add_rms_norm_entry(dtype));
        names.push(format!("sum_{}", dtype.name()));
        names.push(format!("affine_{}", dtype.name()));
    }
    names.push(AlgorithmId::P2pCheck.kernel_prefix().to_string());
    names.sort();
    names
}

/// Names of every kernel entry the host may launch on any architecture;
/// each must be present in every embedded PTX.
pub fn expected_entries() -> Vec<String> {
    entries_for(None)
}

/// The entries only the PTX of `CLUSTER_MIN_SM` and newer has (the fused
/// OneShotPush over thread-block clusters), launched with at most
/// `FUSED_MAX_THREADS` threads and the default register budget.
pub fn cluster_entries() -> Vec<String> {
    let every = expected_entries();
    expected_entries_for(CLUSTER_MIN_SM).into_iter().filter(|n| !every.contains(n)).collect()
}

/// Kernels on the latency-critical path: must use no local memory (no stack
/// frame, no spills) on any architecture.
pub fn hot_entries() -> Vec<String> {
    let mut names = fused_entries();
    names.extend(hosts().flat_map(|h| h.entries()));
    names
}

#[cfg(test)]
mod tests {
    use std::mem::size_of;

    use tp_allreduce_kernels::params::{FusedIslandPushParams, FusedOneShotPushParams};

    use super::*;
    use crate::driver::entry_signatures;

    /// What every launch checks at run time holds for every entry of every
    /// embedded PTX: the arguments the host passes have the sizes the
    /// entry's parameters declare (a struct by value, or these scalars).
    #[test]
    fn the_host_passes_what_every_entry_declares() {
        let scalars = |name: &str| -> Option<Vec<u32>> {
            let starts = |p: &str| name.starts_with(p);
            Some(match () {
                _ if starts("one_shot_pull_") || starts("two_shot_pull_") => vec![8; 5],
                _ if starts("ring_") => vec![8; 4],
                _ if starts("fused_one_shot_pull_") => [vec![8; 7], vec![4; 4]].concat(),
                _ if starts("add_rms_norm_") => [vec![8; 5], vec![4; 4]].concat(),
                _ if starts("sum_") => vec![8, 4, 8, 8],
                _ if starts("affine_") => vec![8, 8, 8, 4, 4],
                _ if name == "p2p_check" => vec![8, 4],
                _ if name == COPY_ENGINE_PUBLISH => vec![8],
                _ => return None,
            })
        };
        for p in crate::embedded_ptx::embedded() {
            let declared = entry_signatures(p.text).unwrap();
            for name in expected_entries_for(p.sm) {
                let expected = match (param_struct(&name), scalars(&name)) {
                    (Some((size, _)), _) => vec![size as u32],
                    (None, Some(sizes)) => sizes,
                    _ if name.starts_with("fused_one_shot_push") => vec![size_of::<FusedOneShotPushParams>() as u32],
                    _ if name.starts_with("fused_") => vec![size_of::<FusedIslandPushParams>() as u32],
                    _ => panic!("{name}: no argument list known"),
                };
                let signature = declared.iter().find(|(n, _)| *n == name).map(|(_, s)| s.sizes().to_vec());
                assert_eq!(signature, Some(expected), "{} {name}", p.arch);
            }
        }
    }
}
