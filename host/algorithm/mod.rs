//! The algorithms a communicator can run, and how their data travels.
//! One term per concept: these names are used by the kernels (file and entry
//! names), the selection, the cost model, the tuning table, the benchmark ids
//! and the CLI flags.
//!
//! Each algorithm owns its host side, one file each (`<file>.rs`, declared
//! from the list of algorithms, `tp_allreduce_kernels::for_each_algorithm`):
//! its `AlgorithmHost` says which collective it implements, what it
//! needs to be available, which transports it runs over, a launch's
//! capacity and default shape, the phases the cost model prices and the
//! kernel entries it launches; at init it builds its side of the rank
//! (`launch::RankAlgorithm`: parameter templates, kernels), which
//! describes each call's launches. The kernel of `<file>.rs` here is
//! `kernels-rs/src/device/<file>.rs`; its scratch region is
//! `ScratchLayout::<file>_*` in `kernels-rs/src/layout.rs`. Shared by
//! several algorithms: `island_push.rs` (TwoShotPush and Hierarchical),
//! `pull.rs` (the pull algorithms' launches), `epilogue.rs` (the fused
//! epilogue's rules), `launch.rs` (what the call pipeline and an algorithm
//! exchange), `entries.rs` (every kernel entry, for loading and checking).
//!
//! [`availability`] is the one rule that says whether an algorithm can run:
//! the communicator (before a call), the selection (before choosing) and
//! the cost model (before predicting) all ask it.

#![forbid(unsafe_code)]

mod cost;
pub mod entries;
pub mod epilogue;
mod island_push;
mod islands;
pub(crate) mod launch;
pub(crate) mod names;
mod pull;
mod rank_memory;

/// One module per algorithm of the list
/// (`tp_allreduce_kernels::for_each_algorithm`): `algorithm/<file>.rs`,
/// whose unit struct named like the algorithm is its [`AlgorithmHost`];
/// and [`host`], which finds it.
macro_rules! algorithm_hosts {
    ($($(#[$doc:meta])* $variant:ident = $id:literal, $file:ident, $name:literal, $collective:ident, $completion:ident;)*) => {
        $(mod $file;)*

        /// The host side of `algorithm`, `None` for NCCL (no kernel of ours).
        pub(crate) fn host(algorithm: Algorithm) -> Option<&'static dyn AlgorithmHost> {
            match algorithm {
                $(Algorithm::$variant => Some(&$file::$variant),)*
                Algorithm::Nccl => None,
            }
        }
    };
}
tp_allreduce_kernels::for_each_algorithm!(algorithm_hosts);

use tp_allreduce_kernels::ids::{AlgorithmId, Collective, DType};
use tp_allreduce_kernels::layout::{ScratchLayout, THREADS_PER_BLOCK};

pub use copy_engine_ring::{pieces_for, CopyEnginePlan, CE_MAX_PIECES};
pub use cost::{CostRecipe, CostShape, Engine, FlowSet, LatencyOver, Op, Pattern, PhaseSpec};
pub use islands::IslandSplit;
pub use names::{Algorithm, Transport};
pub(crate) use rank_memory::{CrossRegions, RankMemory, CROSS_SLOTS_OFFSET};

use crate::error::Result;
use launch::{entry_name, RankAlgorithm, RankSetup};

/// Everything of one algorithm's host side.
pub(crate) trait AlgorithmHost: Sync {
    /// The algorithm's id in the list (kernel prefix, collective, how its
    /// kernels complete).
    fn kernel(&self) -> AlgorithmId;

    /// The collective it implements, from the list of algorithms.
    fn collective(&self) -> Collective {
        self.kernel().collective().unwrap_or(Collective::AllReduce)
    }

    /// Sentinel kernels take their parameters by value and run with any
    /// launch shape (grid-stride loops); the others take a `DeviceHandle`
    /// pointer and scalars and run blocks of `THREADS_PER_BLOCK` threads.
    /// From the list of algorithms (`ids::Completion::Payload`).
    fn sentinel(&self) -> bool {
        self.kernel().sentinel()
    }

    /// Pull algorithms read peers' *input* buffers, which therefore must be
    /// peer-visible (registered or staged). Push algorithms only write into
    /// library-owned scratch and accept any input pointer.
    fn reads_peer_inputs(&self) -> bool {
        false
    }

    /// A pull algorithm that writes its output while peers still read its
    /// input: a call whose output is its input reads a staged copy.
    fn stages_in_place(&self) -> bool {
        false
    }

    /// Whether it can run over pinned host memory (no peer device access).
    fn supports_host_staged(&self) -> bool;

    /// Whether it can run with P2P inside islands and host staging across
    /// them (`Transport::PerPair`): only an algorithm whose cross-island
    /// traffic has a receive region of its own in host memory.
    fn supports_per_pair(&self) -> bool {
        false
    }

    /// Upper bound on roundings to the element type between the exact sum
    /// and the result (f16/bf16): what tests use as tolerance.
    fn max_roundings(&self, _world: usize) -> usize {
        1
    }

    /// What this algorithm needs beyond the transport (islands, a size
    /// limit), `Err(why)` when `caps` lack it. `bytes`: the message size
    /// when the question is about one size (the selection), `None` for "at
    /// all" (the communicator splits long messages into launches).
    fn requirement(&self, _caps: &Capabilities, _bytes: Option<usize>) -> Result<(), String> {
        Ok(())
    }

    /// Packs one launch handles; longer messages are split.
    fn launch_capacity_packs(&self, geometry: &Geometry) -> u64 {
        geometry.layout.max_packs
    }

    /// The launch shape `(blocks, threads)` of one launch over `packs`
    /// packs (for sentinel kernels the default rule, used when neither a
    /// configured nor a tuned shape applies); 0 blocks: it does not fit.
    fn launch_shape(&self, geometry: &Geometry, packs: u64) -> (u32, u32);

    /// The phases the cost model prices for `shape`.
    fn cost(&self, shape: &CostShape) -> CostRecipe;

    /// Device-memory bytes one rank moves for an `s`-byte allreduce of `n`
    /// ranks when all ranks are on one GPU (every peer access is local
    /// memory): the definition `bench --efficiency` divides by. (The cost
    /// model prices the same
    /// traffic differently: its `local_passes` plus the same-device flows,
    /// each a read and a write.)
    fn single_gpu_traffic_per_rank(&self, n: f64, s: f64) -> f64;

    /// Whether a fused call runs its fused kernel in the default
    /// configuration (what the cost model prices; else the separate
    /// `add_rms_norm` kernel after the allreduce).
    fn fuses_epilogue_by_default(&self) -> bool {
        false
    }

    /// The kernel entries of its plain calls, every dtype
    /// (`<file>_<dtype>` unless it launches more).
    fn entries(&self) -> Vec<String> {
        DType::ALL.into_iter().map(|d| entry_name(self.kernel(), d)).collect()
    }

    /// Entries it launches besides the calls' kernels (not on the latency
    /// path: no local-memory check).
    fn helper_entries(&self) -> Vec<String> {
        Vec::new()
    }

    /// The entries of its fused epilogue variant, every dtype, in the PTX
    /// of compute capability `sm` (`None`: those every architecture has).
    fn fused_entries(&self, _sm: Option<u32>) -> Vec<String> {
        Vec::new()
    }

    /// Size and alignment of the one by-value parameter struct of its
    /// plain entry `name`, for the entries that take one.
    fn param_struct(&self, _name: &str) -> Option<(usize, usize)> {
        None
    }

    /// Its side of one rank (parameter templates, kernels), built once at
    /// init; `None` where the communicator cannot run it (the availability
    /// rule says why).
    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>>;
}

/// Device-memory traffic of one allreduce, all ranks together, when every
/// rank is on the same GPU (`AlgorithmHost::single_gpu_traffic_per_rank`);
/// NCCL counted as a ring (scatter, reduce, gather: 6 bytes per byte).
pub fn single_gpu_traffic_bytes(algorithm: Algorithm, world: usize, bytes: usize) -> f64 {
    let (n, s) = (world as f64, bytes as f64);
    let per_rank = match host(algorithm) {
        Some(h) => h.single_gpu_traffic_per_rank(n, s),
        None => 6.0 * s,
    };
    per_rank * n
}

/// Every algorithm's side of one rank, built at init.
pub(crate) struct RankAlgorithms(Vec<(Algorithm, Box<dyn RankAlgorithm>)>);

impl RankAlgorithms {
    /// Prepares every algorithm of ours for the rank described by `rank`.
    pub fn prepare(rank: &RankSetup<'_>) -> Result<RankAlgorithms> {
        let mut prepared = Vec::new();
        for algorithm in Algorithm::OURS {
            if let Some(side) = host(algorithm).map(|h| h.prepare(rank)).transpose()?.flatten() {
                prepared.push((algorithm, side));
            }
        }
        Ok(RankAlgorithms(prepared))
    }

    /// `algorithm`'s side of the rank, if it was prepared.
    pub fn get(&self, algorithm: Algorithm) -> Option<&dyn RankAlgorithm> {
        self.0.iter().find(|(a, _)| *a == algorithm).map(|(_, side)| side.as_ref())
    }
}

/// What a communicator, real or modelled, offers: the input of
/// [`availability`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    pub world: usize,
    pub transport: Transport,
    /// Hierarchical: the islands (two or more), if any.
    pub islands: Option<IslandSplit>,
    /// One-shot push handles messages up to this size (0: disabled).
    pub one_shot_push_max_bytes: usize,
    /// The copy-engine ring has staging (pieces per shard > 0).
    pub copy_engine: bool,
    /// An NCCL communicator exists (NCCL loaded, ranks on distinct GPUs).
    pub nccl_available: bool,
}

/// The one rule: `Ok` when `algorithm` can run under `caps` (for a message
/// of `bytes`, when given), else why not.
pub fn availability(algorithm: Algorithm, caps: &Capabilities, bytes: Option<usize>) -> Result<(), String> {
    let Some(h) = host(algorithm) else {
        return if caps.nccl_available { Ok(()) } else { Err("NCCL is not available".into()) };
    };
    if caps.transport == Transport::HostStaged && !h.supports_host_staged() {
        return Err(format!("{algorithm} cannot run host-staged (no usable P2P)"));
    }
    if caps.transport == Transport::PerPair && !h.supports_per_pair() {
        return Err(format!(
            "{algorithm} needs P2P between every pair; here only ranks inside an island have it (per-pair transport)"
        ));
    }
    h.requirement(caps, bytes)
}

/// What a launch's grid and capacity depend on: the communicator's scratch
/// layout and block limits (set at init).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub world: u32,
    pub layout: ScratchLayout,
    pub pull_max_blocks: u32,
    pub ring_blocks: u32,
    /// Resident blocks of a sentinel kernel per block size.
    pub sentinel_resident: ResidentBlocks,
}

/// Blocks of a sentinel kernel that stay resident on a rank's GPU together
/// with the other ranks sharing it, per block size (a multiple of 32 up to
/// 1024). Keeping a launch within it guarantees progress: every block that
/// waits for a peer's packs is running, and so is every block of the peer
/// that sends them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ResidentBlocks(pub [u32; 32]);

impl ResidentBlocks {
    /// The cap for `threads`-thread blocks (0 for an unsupported size).
    pub(crate) fn cap(&self, threads: u32) -> u32 {
        if threads == 0 || threads % 32 != 0 || threads > 1024 {
            return 0;
        }
        self.0[(threads / 32 - 1) as usize]
    }
}

impl Geometry {
    pub(crate) const THREADS: u64 = THREADS_PER_BLOCK as u64;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(transport: Transport, island_size: Option<usize>) -> Capabilities {
        let islands = island_size.and_then(|m| IslandSplit::consecutive(m, 8).ok());
        Capabilities {
            world: 8,
            transport,
            islands,
            one_shot_push_max_bytes: 512 << 10,
            copy_engine: true,
            nccl_available: true,
        }
    }

    #[test]
    fn every_kernel_algorithm_has_a_host_side_with_its_own_kernel() {
        for a in Algorithm::OURS {
            let h = host(a).unwrap_or_else(|| panic!("{a} has no host side"));
            assert_eq!(h.kernel().kernel_prefix(), a.name().replace('-', "_"), "{a}");
        }
        assert!(host(Algorithm::Nccl).is_none());
    }

    #[test]
    fn pull_algorithms_and_the_copy_engine_ring_need_peer_to_peer() {
        let staged = caps(Transport::HostStaged, Some(4));
        for a in Algorithm::OURS {
            let r = availability(a, &staged, None);
            let p2p_only = host(a).unwrap().reads_peer_inputs() || a == Algorithm::CopyEngineRing;
            assert_eq!(r.is_ok(), !p2p_only, "{a}: {r:?}");
        }
        assert!(availability(Algorithm::OneShotPull, &caps(Transport::PeerToPeer, None), None).is_ok());
        // Per-pair transport (P2P inside islands only): the hierarchical ones alone.
        let per_pair = caps(Transport::PerPair, Some(4));
        for a in Algorithm::OURS {
            let hierarchical = matches!(a, Algorithm::Hierarchical | Algorithm::PipelinedHierarchical);
            assert_eq!(availability(a, &per_pair, None).is_ok(), hierarchical, "{a}");
        }
        assert!(availability(Algorithm::Nccl, &per_pair, None).is_ok());
    }

    #[test]
    fn hierarchical_needs_islands_that_split_the_world() {
        let p2p = |m| caps(Transport::PeerToPeer, m);
        assert!(availability(Algorithm::Hierarchical, &p2p(Some(4)), None).is_ok());
        assert!(availability(Algorithm::Hierarchical, &p2p(Some(2)), None).is_ok());
        for bad in [None, Some(3), Some(8), Some(1)] {
            let e = availability(Algorithm::Hierarchical, &p2p(bad), None).unwrap_err();
            assert!(e.contains("hierarchical") || e.contains("island"), "{bad:?}: {e}");
        }
        // Unequal islands: 3+5 of 8.
        let mut c = p2p(None);
        c.islands = Some(IslandSplit::from_groups(&[vec![0, 1, 2], vec![3, 4, 5, 6, 7]], 8).unwrap());
        assert!(availability(Algorithm::Hierarchical, &c, None).is_ok());
    }

    #[test]
    fn one_shot_push_size_limit_applies_per_size_only() {
        let c = caps(Transport::PeerToPeer, None);
        assert!(availability(Algorithm::OneShotPush, &c, Some(512 << 10)).is_ok());
        assert!(availability(Algorithm::OneShotPush, &c, Some((512 << 10) + 16)).is_err());
        assert!(availability(Algorithm::OneShotPush, &c, None).is_ok());
        let off = Capabilities { one_shot_push_max_bytes: 0, ..c };
        assert!(availability(Algorithm::OneShotPush, &off, None).is_err());
    }

    #[test]
    fn nccl_is_available_only_with_a_communicator() {
        let mut c = caps(Transport::PeerToPeer, None);
        assert!(availability(Algorithm::Nccl, &c, None).is_ok());
        c.nccl_available = false;
        assert!(availability(Algorithm::Nccl, &c, Some(1)).is_err());
    }

    #[test]
    fn recipes_move_the_bytes_the_algorithms_move() {
        // Per-rank bytes sent, as a multiple of S, for N = 8, islands 4+4
        // (every rank owns one of the four shares).
        let islands = IslandSplit::consecutive(4, 8).ok();
        let shape = CostShape { world: 8, islands };
        let sent = |a: Algorithm| -> f64 {
            host(a)
                .unwrap()
                .cost(&shape)
                .phases
                .iter()
                .map(|p| {
                    let peers = match p.flows {
                        FlowSet::AllPairs => 7.0,
                        FlowSet::RingNeighbours => 1.0,
                        FlowSet::IslandScatter | FlowSet::IslandGather => 3.0,
                        FlowSet::CrossOwners => 1.0,
                    };
                    peers * p.share
                })
                .sum()
        };
        let close = |x: f64, y: f64| (x - y).abs() < 1e-9;
        assert!(close(sent(Algorithm::OneShotPush), 7.0));
        assert!(close(sent(Algorithm::OneShotPull), 7.0));
        assert!(close(sent(Algorithm::TwoShotPush), 2.0 * 7.0 / 8.0));
        assert!(close(sent(Algorithm::TwoShotPull), 2.0 * 7.0 / 8.0));
        assert!(close(sent(Algorithm::Ring), 2.0 * 7.0 / 8.0));
        assert!(close(sent(Algorithm::CopyEngineRing), 2.0 * 7.0 / 8.0));
        // Hierarchical: (m-1)/m twice inside the island, 1/m across.
        assert!(close(sent(Algorithm::Hierarchical), 2.0 * 3.0 / 4.0 + 1.0 / 4.0));
    }
}
