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
//! + flag hops x (flag + fence [+ drain of posted writes])            flag kernels only
//! + max over shared resources (bytes through it / its capacity)      wire + contention
//! ```
//!
//! plus one launch (prologue, epilogue) per call, what ranks sharing a GPU
//! add to it, and the local device-memory traffic (receive buffers,
//! reductions, copies) at the GPU model's memory bandwidth. On GPUs of
//! their own that traffic overlaps the link traffic (the larger counts);
//! ranks sharing a GPU move their peer data through the same memory (the
//! two add). Sentinel kernels (the payload is its own flag) pay no flags;
//! flag kernels pay a flag per hop, and a flag that publishes posted peer
//! writes waits for them (a system-scope release fence). Resources
//! are each GPU's link in each direction (PCIe or NVLink), each PCIe
//! switch's uplink in each direction, the socket boundary in each
//! direction, device memory (ranks sharing a GPU) and host memory
//! (host-staged transport). A resource's capacity is its single-flow
//! bandwidth times an efficiency that depends on how many flows share it and
//! how (one stream at a time, staggered all-to-all, or simultaneous
//! all-to-all) and on the operation: posted writes keep more of the
//! bandwidth than non-posted reads under concurrency (docs/SOURCES.md \[F6\]: 25.4 vs
//! 20.6 GB/s per link with every rank driving all peers). The socket
//! boundary's capacity falls from ~53 GB/s for one flow towards ~24 GB/s
//! aggregate as flows multiply. "Wire" is the time the busiest GPU link
//! needs at single-flow bandwidth; "contention" is what the shared resources
//! and concurrency add on top.
//!
//! Bytes per rank: one-shot `(N-1)·S`; two-shot `2(N-1)/N·S` in two phases;
//! ring `2(N-1)/N·S` pipelined over `2(N-1)` dependent steps (at most
//! `ring_max_gbps` per rank; the
//! copy-engine ring: the same bytes at the copy engines' rate, each step a
//! copy, a flag write and a step kernel); hierarchical (islands of any
//! shape, `S_h` = the largest island) each rank's non-owned shares inside
//! the island, its owned shares' partials to every other island's owner, its
//! owned finals to every member — `(m-1)/m·S`, `(I-1)/m·S`, `(m-1)/m·S`
//! for equal islands of `m`;
//! host-staged: every flow crosses PCIe twice (up into host memory, down
//! into the receiver), each hop a write into host memory and a polling
//! read of it.
//!
//! NCCL is modelled as NCCL models itself (`tuning.cc`): a base latency per
//! protocol, a per-step latency times the number of steps (`2(N-1)` for
//! ring and for the intra-node tree, which is a chain), and the bytes over
//! a protocol-limited bandwidth (LL sends a flag with every 4 data bytes:
//! twice the bytes, at most `nccl_ll_max_gbps`). The baseline "NCCL" is the
//! best variant: tuned NCCL.
//!
//! Every parameter is a named field of [`CostParams`] with its source;
//! docs/COST-MODEL.md has the table, the calibration residuals and the
//! assumptions. [`calibration_points`] and [`residuals`] reproduce the
//! residual table (a test holds every asserted point within [`TOLERANCE`]).

mod calibration;
mod epilogue_cost;
mod nccl;
mod network;
mod cost_params;
#[cfg(test)]
mod tests;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::algorithm::{self, Capabilities, CostRecipe, CostShape, IslandSplit, LatencyOver, Op};
use crate::algorithm::{Algorithm, Transport};
use crate::select::topology::Topology;

pub use calibration::{
    calibration_points, residual_table, residuals, CalibrationPoint, Residual, Role, Subject, Target, TOLERANCE,
};
pub use epilogue_cost::{FUSED_EPILOGUE_US, SEPARATE_KERNEL_EAGER_US, SEPARATE_KERNEL_GRAPH_US};
pub use nccl::{NcclAlgo, NcclProto, NcclVariant};
pub use cost_params::{Basis, CostParams, ParamRow};

use network::{flows, Net, Phase};

/// The wire of a prediction: its format and the data's dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireSpec {
    pub format: tp_allreduce_kernels::wire::WireFormat,
    pub dtype: tp_allreduce_kernels::ids::DType,
}

/// How the wire format changes a recipe's price: the fraction of the bytes
/// that travel (`ratio`, 1 = lossless).
#[derive(Clone, Copy, Debug, PartialEq)]
struct WireCost {
    ratio: f64,
}

impl WireCost {
    const LOSSLESS: WireCost = WireCost { ratio: 1.0 };

    fn of(wire: tp_allreduce_kernels::wire::WireFormat, dtype: tp_allreduce_kernels::ids::DType) -> WireCost {
        WireCost { ratio: wire_ratio(wire, dtype) }
    }
}

/// Bytes on the wire per byte of `dtype` data over `wire`:
/// `(1 + scale bytes / G) / element size` for the lossy wires
/// (bf16 over fp8: 1.125 / 2 = 0.5625), 1 for lossless.
pub fn wire_ratio(wire: tp_allreduce_kernels::wire::WireFormat, dtype: tp_allreduce_kernels::ids::DType) -> f64 {
    use tp_allreduce_kernels::wire::{bytes_per_group, GROUP};
    bytes_per_group(wire, dtype.size_bytes()) as f64 / (GROUP * dtype.size_bytes()) as f64
}

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
    /// Launch, prologue and epilogue, and what ranks sharing a GPU add
    /// (NCCL: its base latency).
    pub launch_us: f64,
    /// Dependent hops x (link latency + per-hop overhead).
    pub latency_us: f64,
    /// Bytes of the busiest GPU link at single-flow bandwidth (NCCL: at its
    /// protocol's throughput).
    pub wire_us: f64,
    /// What shared links, switch uplinks, the socket boundary and
    /// concurrency add on top of `wire_us`.
    pub contention_us: f64,
    /// Device-memory traffic (receive buffers, reductions, copies) beyond
    /// what the link traffic hides: on GPUs of their own the two overlap;
    /// ranks sharing a GPU add it to their peer traffic.
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
    /// the bar the selection must clear. docs/SOURCES.md \[F11\]: the 8-GPU figures.
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
    /// Hierarchical: the islands (two or more), if any.
    pub islands: Option<IslandSplit>,
    /// The NCCL baseline.
    pub nccl: NcclTuning,
}

impl Options {
    /// Graph replay, islands as the topology derives them, tuned NCCL.
    pub fn for_topology(view: &Topology) -> Options {
        Options { capturing: true, islands: view.island_split(), nccl: NcclTuning::Tuned }
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

    /// The parameters a figure of this model depends on: those whose
    /// increase by 10 % moves `figure` by more than 0.01 %. What `plan`
    /// reports as the basis of each prediction: which of them were measured
    /// on the kind of link they price, which are borrowed.
    pub fn dependencies(&self, figure: impl Fn(&CostModel) -> f64) -> Vec<ParamRow> {
        let base = figure(self);
        let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(&self.params) else {
            return Vec::new();
        };
        self.params
            .table()
            .into_iter()
            .filter(|row| {
                let mut changed = fields.clone();
                let Some(v) = changed.get(row.name).and_then(serde_json::Value::as_f64) else {
                    return false;
                };
                // An integer field (the default PCIe generation) moves by one.
                let bumped = if changed[row.name].is_u64() {
                    serde_json::json!(v as u64 + 1)
                } else {
                    serde_json::json!(v * 1.1)
                };
                changed.insert(row.name.to_string(), bumped);
                match serde_json::from_value::<CostParams>(serde_json::Value::Object(changed)) {
                    Ok(params) => (figure(&CostModel::new(params)) - base).abs() > 1e-4 * base.abs().max(1e-9),
                    Err(_) => false,
                }
            })
            .collect()
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
        self.predict_on(view, algorithm, transport, bytes, opts, WireCost::LOSSLESS)
    }

    /// [`Self::predict`] over the wire `on.format` for elements of `on.dtype`
    /// (issue 38; no kernel yet: a prediction for a design). The lossy
    /// wires are specified for two-shot push only (the accuracy bound in
    /// `tp_allreduce_kernels::wire` counts its two quantisations); other
    /// algorithms are not applicable. The phases carry
    /// `(1 + scale / G) / element size` of the bytes; each phase adds a
    /// quantise pass (read the data, write its codes) at the GPU's memory
    /// bandwidth that nothing hides (the codes must exist before they are
    /// sent). The received codes are read in place of the received
    /// elements: priced at full size, as the lossless recipe has them.
    pub fn predict_wire(
        &self,
        view: &Topology,
        algorithm: Algorithm,
        transport: Transport,
        bytes: usize,
        opts: &Options,
        on: WireSpec,
    ) -> Result<Prediction, NotApplicable> {
        let WireSpec { format: wire, dtype } = on;
        if !wire.is_lossy() {
            return self.predict(view, algorithm, transport, bytes, opts);
        }
        if algorithm != Algorithm::TwoShotPush {
            return Err(NotApplicable(format!(
                "the {} wire is specified for two-shot-push only, not {algorithm}",
                wire.name()
            )));
        }
        self.predict_on(view, algorithm, transport, bytes, opts, WireCost::of(wire, dtype))
    }

    fn predict_on(
        &self,
        view: &Topology,
        algorithm: Algorithm,
        transport: Transport,
        bytes: usize,
        opts: &Options,
        wire: WireCost,
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
            islands: opts.islands,
            one_shot_push_max_bytes: usize::MAX,
            copy_engine: !view.has_shared_device(),
            nccl_available: true,
        };
        algorithm::availability(algorithm, &caps, None).map_err(NotApplicable)?;
        let Some(host) = algorithm::host(algorithm) else {
            return Err(NotApplicable(format!("{algorithm} has no kernel of ours")));
        };
        let recipe = host.cost(&CostShape { world: n, islands: opts.islands });
        let net = Net::new(view, p, transport);
        let s = bytes as f64;
        let shared = net.further_ranks_sharing();
        let mut b = Breakdown {
            launch_us: if opts.capturing { p.launch_graph_us } else { p.launch_eager_us }
                + shared * p.shared_gpu_rank_us,
            ..Default::default()
        };
        if n > 1 {
            self.price_phases(&net, &recipe, !host.sentinel(), s * wire.ratio, opts.islands, &mut b);
        }
        b.local_us = net.local_beyond(recipe.local_passes, s, b.wire_us + b.contention_us);
        if wire.ratio < 1.0 && n > 1 {
            // One quantise pass per phase: read the data, write the codes.
            b.local_us += recipe.phases.len() as f64 * net.local_time(1.0 + wire.ratio, s);
        }
        if host.reads_peer_inputs() && !opts.capturing {
            // A copy kernel before the allreduce: nothing to overlap with.
            b.launch_us += p.eager_stage_us;
            b.local_us += net.local_time(2.0, s);
        }
        Ok(Prediction { method: Method::Ours(algorithm), transport, breakdown: b })
    }

    /// Adds the latency, wire and contention of `recipe`'s phases for a
    /// message of `s` bytes (islands of `island`); `flags`: a flag kernel.
    fn price_phases(
        &self,
        net: &Net,
        recipe: &CostRecipe,
        flags: bool,
        s: f64,
        islands: Option<IslandSplit>,
        b: &mut Breakdown,
    ) {
        let p = &self.params;
        // Overlapped phases: their flows priced together, once, after the loop.
        let mut together: Option<Phase> = None;
        for spec in &recipe.phases {
            let phase = Phase {
                flows: flows(spec.flows, net.n, islands, spec.share * s),
                op: spec.op,
                pattern: spec.pattern,
                hops: spec.hops + spec.read_hops * p.read_round_trip_factor,
                mean_latency: spec.latency_over == LatencyOver::MeanFlow,
                pipeline: if spec.ring_pipelined { p.ring_efficiency } else { 1.0 },
                max_gbps: if spec.ring_pipelined { p.ring_max_gbps } else { f64::INFINITY },
                engine: spec.engine,
            };
            b.latency_us += self.phase_latency(net, &phase, spec.latency_over == LatencyOver::WorstPair);
            // Round trips to memory the phase's threads wait for in turn.
            b.latency_us += spec.access_rounds * p.access_round_us;
            if flags {
                // Flag hops: the flag, its fence and its poll; a flag that
                // publishes posted peer writes waits for them.
                // With ranks sharing the GPU each flag's system-scope release
                // and acquire waits behind the co-resident kernels.
                let drain = if spec.op == Op::Write { p.flag_drain_us } else { 0.0 };
                let sharing = net.further_ranks_sharing() * p.shared_gpu_flag_us;
                b.latency_us += spec.hops * (p.flag_hop_us + drain + sharing);
            }
            if recipe.overlapped {
                match &mut together {
                    Some(all) => all.flows.extend(phase.flows),
                    None => together = Some(phase),
                }
                continue;
            }
            let (ideal, actual) = self.data_time(net, &phase);
            b.wire_us += ideal;
            b.contention_us += (actual - ideal).max(0.0);
        }
        if let Some(all) = together {
            let (ideal, actual) = self.data_time(net, &all);
            b.wire_us += ideal;
            b.contention_us += (actual - ideal).max(0.0);
        }
    }
}
