//! The algorithm and transport names every layer shares.

#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tp_allreduce_kernels::ids::{AlgorithmId, Collective};

use crate::error::Error;

/// The algorithms of the list (`tp_allreduce_kernels::for_each_algorithm`),
/// as the host names them, with NCCL on top.
macro_rules! algorithm_enum {
    ($($(#[$doc:meta])* $variant:ident = $id:literal, $file:ident, $name:literal, $collective:ident, $completion:ident;)*) => {
        /// An algorithm: one of ours, or NCCL's allreduce (the fallback and
        /// the baseline).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(rename_all = "kebab-case")]
        pub enum Algorithm {
            $($(#[$doc])* $variant,)*
            /// NCCL's allreduce (fallback and baseline).
            Nccl,
        }

        impl Algorithm {
            /// Every algorithm with a kernel in this crate.
            pub const OURS: [Algorithm; AlgorithmId::ALL.len()] = [$(Algorithm::$variant),*];

            pub const ALL: [Algorithm; AlgorithmId::ALL.len() + 1] = [$(Algorithm::$variant,)* Algorithm::Nccl];

            /// kebab-case name used by the CLI, env knobs, bench ids, tuning files.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Algorithm::$variant => $name,)*
                    Algorithm::Nccl => "nccl",
                }
            }

            /// The kernel family, `None` for NCCL.
            pub const fn kernel(self) -> Option<AlgorithmId> {
                match self {
                    $(Algorithm::$variant => Some(AlgorithmId::$variant),)*
                    Algorithm::Nccl => None,
                }
            }
        }
    };
}

tp_allreduce_kernels::for_each_algorithm!(algorithm_enum);

impl Algorithm {
    /// The algorithms whose bits depend on the message size for a world of
    /// three or more (the ring and the copy-engine ring cut the message into
    /// pieces summed in a rotating order, hierarchical sums island partials
    /// rounded to the element type, NCCL's order follows its protocol and
    /// channels): what `Config::batch_invariant` leaves out. One-shot and
    /// two-shot push and pull sum every element in rank order with one
    /// rounding, whatever the size, so they agree bit for bit.
    pub const BATCH_VARIANT: [Algorithm; 5] = [
        Algorithm::Ring,
        Algorithm::Hierarchical,
        Algorithm::PipelinedHierarchical,
        Algorithm::CopyEngineRing,
        Algorithm::Nccl,
    ];

    /// The allreduce algorithms of ours: what the selection chooses among,
    /// what `Comm::set_algorithm` forces.
    pub fn allreduce_algorithms() -> impl Iterator<Item = Algorithm> {
        Algorithm::OURS.into_iter().filter(|a| a.collective() == Collective::AllReduce)
    }

    /// The collective it implements (NCCL's: the allreduce).
    pub fn collective(self) -> Collective {
        crate::algorithm::host(self).map_or(Collective::AllReduce, |h| h.collective())
    }

    /// Pull algorithms read peers' *input* buffers, which therefore must be
    /// peer-visible (registered or staged). Push algorithms only write into
    /// library-owned scratch and accept any input pointer.
    pub fn reads_peer_inputs(self) -> bool {
        crate::algorithm::host(self).is_some_and(|h| h.reads_peer_inputs())
    }

    /// Whether the algorithm can run over the HostStaged transport (only
    /// the push algorithms: pull would need peers' device buffers).
    pub fn supports_host_staged(self) -> bool {
        crate::algorithm::host(self).is_some_and(|h| h.supports_host_staged())
    }

    /// Whether a fused call (`Comm::all_reduce_add_rms_norm`) runs this
    /// algorithm's fused kernel in the default configuration, as the cost
    /// model prices it (else the separate kernel after the allreduce).
    pub fn fuses_epilogue_by_default(self) -> bool {
        crate::algorithm::host(self).is_some_and(|h| h.fuses_epilogue_by_default())
    }

    /// Whether the cost model prices its phases as running side by side
    /// (`CostRecipe::overlapped`): an assumption about how the hardware
    /// overlaps them that no parameter measures.
    pub fn phases_overlap(self) -> bool {
        crate::algorithm::host(self)
            .is_some_and(|h| h.cost(&crate::algorithm::CostShape { world: 2, islands: None }).overlapped)
    }

    /// Upper bound on roundings to the element type between the exact sum
    /// and the result (f16/bf16): what tests use as tolerance.
    pub fn max_roundings(self, world: usize) -> usize {
        crate::algorithm::host(self).map_or(1, |h| h.max_roundings(world))
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let norm = s.trim().to_ascii_lowercase().replace('_', "-");
        Algorithm::ALL.into_iter().find(|a| a.name() == norm).ok_or_else(|| {
            let names: Vec<_> = Algorithm::ALL.iter().map(|a| a.name()).collect();
            Error::invalid(format!("unknown algorithm `{s}`; expected one of {}", names.join(", ")))
        })
    }
}

/// How peers' memory is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// Peer device memory over NVLink/PCIe P2P (or the same device).
    PeerToPeer,
    /// Pinned host memory mapped into every GPU: for GPUs without usable P2P.
    HostStaged,
    /// P2P inside islands, host-staged across them: where only the pairs
    /// that cross an island boundary lack P2P (two sockets). Hierarchical
    /// only: its cross-island slots live in pinned host memory.
    PerPair,
}

impl Transport {
    pub const fn name(self) -> &'static str {
        match self {
            Transport::PeerToPeer => "p2p",
            Transport::HostStaged => "host-staged",
            Transport::PerPair => "per-pair",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Transport {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "p2p" | "peer-to-peer" => Ok(Transport::PeerToPeer),
            "host-staged" | "host" => Ok(Transport::HostStaged),
            "per-pair" => Ok(Transport::PerPair),
            other => Err(Error::invalid(format!("unknown transport `{other}`; expected p2p, host-staged or per-pair"))),
        }
    }
}
