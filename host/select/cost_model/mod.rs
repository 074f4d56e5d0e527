//! The PCIe/NVLink cost model: a predicted time, with its breakdown, for
//! every (algorithm, transport, topology, world size, message size),
//! including NCCL (ring/tree x LL/Simple) as the baseline.
//!
//! # The model
//! An allreduce is a sequence of *phases* separated by dependencies (a flag
//! wait or a payload poll). Each phase moves a set of flows `src -> dst`
//! (bytes per ordered pair, given by the algorithm) and costs
//!
//! ```text
//!   hops x (link latency of the worst link used + hop overhead)      latency
//! + max over shared resources (bytes through it / its capacity)      wire + contention
//! ```
//!
//! plus one launch (and poll/epilogue) overhead per call and the local
//! device-memory traffic (receive buffers, reductions, copies). Resources
//! are each GPU's link in each direction (PCIe or NVLink), each PCIe
//! switch's uplink in each direction, the socket boundary in each
//! direction, device memory (ranks sharing a GPU) and host memory
//! (host-staged transport). A resource's capacity is its single-flow
//! bandwidth times an efficiency that depends on how many flows share it and
//! how (one stream at a time, staggered all-to-all, or simultaneous
//! all-to-all) and on the operation: posted writes keep more of the
//! bandwidth than non-posted reads under concurrency (docs/SOURCES.md [F6]: 25.4 vs
//! 20.6 GB/s per link with every rank driving all peers). The socket
//! boundary's capacity falls from ~53 GB/s for one flow towards ~24 GB/s
//! aggregate as flows multiply. "Wire" is the time the busiest GPU link
//! needs at single-flow bandwidth; "contention" is what the shared resources
//! and concurrency add on top.
//!
//! Bytes per rank: one-shot `(N-1)·S`; two-shot `2(N-1)/N·S` in two phases;
//! ring `2(N-1)/N·S` pipelined over `2(N-1)` dependent steps; hierarchical
//! `(m-1)/m·S` inside the island twice and `(I-1)/m·S` across islands;
//! host-staged: every flow crosses PCIe twice (up into host memory, down
//! into the receiver) with a ~14 us-class latency per hop.
//!
//! NCCL is modelled as NCCL models itself (`tuning.cc`): a base latency per
//! protocol, a per-step latency times the number of steps (`2(N-1)` for
//! ring and for the intra-node tree, which is a chain), and the bytes over
//! a protocol-limited bandwidth (LL sends a flag with every 4 data bytes:
//! twice the bytes). The baseline "NCCL" is the best variant: tuned NCCL.
//!
//! Every parameter is a named field of [`CostParams`] with its source;
//! docs/COST-MODEL.md has the table, the calibration residuals and the
//! assumptions. [`calibration_points`] and [`residuals`] reproduce the
//! residual table (a test asserts each point within ±25 %).

mod calibration;
mod fused;
mod nccl;
mod network;
mod params;
#[cfg(test)]
mod tests;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::algorithm::{self, Capabilities, CostShape, LatencyOver};
use crate::algorithm::{Algorithm, Transport};
use crate::select::topology::Topology;

pub use calibration::{calibration_points, residual_table, residuals, CalibrationPoint, Residual, Subject, Target};
pub use fused::{BLOCK_REDUCTION_US, SEPARATE_KERNEL_EAGER_US, SEPARATE_KERNEL_GRAPH_US};
pub use nccl::{NcclAlgo, NcclProto, NcclVariant};
pub use params::{CostParams, ParamRow};

use network::{flows, Net, Phase};

/// What was predicted: one of our algorithms or one NCCL variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Method {
    Ours(Algorithm),
    Nccl(NcclVariant),
}

impl Method {
    pub fn algorithm(self) -> Algorithm {
        match self {
            Method::Ours(a) => a,
            Method::Nccl(_) => Algorithm::Nccl,
        }
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Method::Ours(a) => write!(f, "{a}"),
            Method::Nccl(v) => write!(f, "{v}"),
        }
    }
}

/// Where the time goes (microseconds). `total()` is the prediction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// Launch, poll and epilogue (NCCL: its base latency).
    pub launch_us: f64,
    /// Dependent hops x (link latency + per-hop overhead).
    pub latency_us: f64,
    /// Bytes of the busiest GPU link at single-flow bandwidth (NCCL: at its
    /// protocol's throughput).
    pub wire_us: f64,
    /// What shared links, switch uplinks, the socket boundary and
    /// concurrency add on top of `wire_us`.
    pub contention_us: f64,
    /// Device-memory traffic: receive buffers, reductions, copies.
    pub local_us: f64,
}

impl Breakdown {
    pub fn total(&self) -> f64 {
        self.launch_us + self.latency_us + self.wire_us + self.contention_us + self.local_us
    }
}

impl fmt::Display for Breakdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.1} us = launch {:.1} + latency {:.1} + wire {:.1} + contention {:.1} + local {:.1}",
            self.total(),
            self.launch_us,
            self.latency_us,
            self.wire_us,
            self.contention_us,
            self.local_us
        )
    }
}

/// A prediction for one method.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    pub method: Method,
    pub transport: Transport,
    pub breakdown: Breakdown,
}

impl Prediction {
    pub fn total_us(&self) -> f64 {
        self.breakdown.total()
    }
}

/// Why an algorithm has no prediction here ("not applicable" is not an
/// error: the selection skips the candidate and may say why).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotApplicable(pub String);

impl fmt::Display for NotApplicable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which NCCL the baseline is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum NcclTuning {
    /// NCCL tuned for the machine (more channels, best protocol per size):
    /// the bar the selection must clear. docs/SOURCES.md [F11]: the 8-GPU figures.
    #[default]
    Tuned,
    /// NCCL with default settings: what the published 4-GPU comparison ran.
    Stock,
}

/// How a call runs, beyond the topology and the size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Replayed from a CUDA graph (else launched eagerly).
    pub capturing: bool,
    /// Hierarchical: consecutive islands of this many ranks.
    pub island_size: Option<usize>,
    /// The NCCL baseline.
    pub nccl: NcclTuning,
}

impl Options {
    /// Graph replay, islands as the topology derives them (if
    /// consecutive), tuned NCCL.
    pub fn for_topology(view: &Topology) -> Options {
        Options {
            capturing: true,
            island_size: view.islands().and_then(|i| i.consecutive_size()),
            nccl: NcclTuning::Tuned,
        }
    }
}

/// The model: [`CostParams`] and the prediction functions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostModel {
    pub params: CostParams,
}

impl CostModel {
    pub fn new(params: CostParams) -> CostModel {
        CostModel { params }
    }

    /// Predicted time of `algorithm` over `transport` on the rank view
    /// `view` (one entry per rank; see [`Topology::for_ranks`]) for a
    /// message of `bytes`. `Algorithm::Nccl` gives the best NCCL variant.
    pub fn predict(
        &self,
        view: &Topology,
        algorithm: Algorithm,
        transport: Transport,
        bytes: usize,
        opts: &Options,
    ) -> Result<Prediction, NotApplicable> {
        if algorithm == Algorithm::Nccl {
            return Ok(self.predict_nccl_best(view, transport, bytes, opts));
        }
        let p = &self.params;
        let n = view.len();
        if n == 0 {
            return Err(NotApplicable("empty topology".into()));
        }
        if transport == Transport::PeerToPeer && !view.all_p2p_usable() {
            return Err(NotApplicable(format!("{algorithm} over p2p needs peer access between every pair of ranks")));
        }
        let caps = Capabilities {
            world: n,
            transport,
            island_size: opts.island_size,
            one_shot_push_max_bytes: usize::MAX,
            nccl_available: true,
        };
        algorithm::availability(algorithm, &caps, None).map_err(NotApplicable)?;
        let Some(host) = algorithm::host(algorithm) else {
            return Err(NotApplicable(format!("{algorithm} has no kernel of ours")));
        };
        let recipe = host.cost(&CostShape { world: n, island_size: opts.island_size });
        let net = Net::new(view, p, transport);
        let s = bytes as f64;
        let mut b = Breakdown {
            launch_us: if opts.capturing { p.launch_graph_us } else { p.launch_eager_us },
            local_us: recipe.local_passes * s / (p.device_memory_gbps * 1e3),
            ..Default::default()
        };
        let phases: Vec<(Phase, bool)> = recipe
            .phases
            .iter()
            .map(|spec| {
                let phase = Phase {
                    flows: flows(spec.flows, n, opts.island_size.unwrap_or(n), spec.share * s),
                    op: spec.op,
                    pattern: spec.pattern,
                    hops: spec.hops + spec.read_hops * p.read_round_trip_factor,
                    mean_latency: spec.latency_over == LatencyOver::MeanFlow,
                    pipeline: if spec.ring_pipelined { p.ring_efficiency } else { 1.0 },
                };
                (phase, spec.latency_over == LatencyOver::WorstPair)
            })
            .collect();
        if host.reads_peer_inputs() && !opts.capturing {
            b.launch_us += p.eager_stage_us;
            b.local_us += 2.0 * s / (p.device_memory_gbps * 1e3);
        }
        if n > 1 {
            for (phase, all_pairs) in &phases {
                b.latency_us += self.phase_latency(&net, phase, *all_pairs);
                let (ideal, actual) = self.data_time(&net, phase);
                b.wire_us += ideal;
                b.contention_us += (actual - ideal).max(0.0);
            }
        }
        Ok(Prediction { method: Method::Ours(algorithm), transport, breakdown: b })
    }
}
