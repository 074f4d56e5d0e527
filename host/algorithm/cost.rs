//! How an algorithm describes one call to the cost model: phases of flows
//! between ranks (which pairs, what share of the message, posted writes or
//! reads, how they overlap, how many dependent hops) and the local
//! device-memory traffic. `select::cost_model` prices a recipe on a topology.

#![forbid(unsafe_code)]

use super::IslandSplit;

/// The shape a cost recipe depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CostShape {
    pub world: usize,
    /// Hierarchical: the islands (checked by [`availability`](super::availability) first).
    pub islands: Option<IslandSplit>,
}

/// Which ordered pairs of ranks exchange data in a phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowSet {
    /// Every rank to every other rank.
    AllPairs,
    /// Every rank to the next one (`r -> r+1 mod N`).
    RingNeighbours,
    /// Island reduce-scatter: every rank to every other member of its
    /// island, the shares that member owns (`share` per owned share).
    IslandScatter,
    /// Island all-gather: every rank to every other member of its island,
    /// the shares it owns.
    IslandGather,
    /// Cross-island exchange: every rank, for each share it owns, to that
    /// share's owner in every other island.
    CrossOwners,
}

/// What moves a phase's bytes and what a dependent hop costs beyond the
/// link latency.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// SM loads/stores; a hop adds the poll/flag overhead (`hop_overhead_us`).
    Sm,
    /// Copy-engine peer copies (`copy_engine_efficiency` of the link); a hop
    /// adds a copy, a flag write and a step kernel (`copy_engine_step_us`).
    CopyEngine,
}

/// The memory operation that moves a phase's data over the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Posted stores to peer memory.
    Write,
    /// Non-posted loads from peer memory.
    Read,
}

/// How the flows of a phase overlap in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// One stream per link and direction (ring neighbours).
    Single,
    /// Every rank drives every peer, one peer at a time.
    Staggered,
    /// Every rank drives every peer at once.
    Simultaneous,
}

/// Which links' latencies a phase's dependent hops pay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatencyOver {
    /// The worst link the phase's flows use.
    WorstFlow,
    /// The mean over the phase's flows (pipelined rings: a chunk passes
    /// every edge).
    MeanFlow,
    /// The worst link between any two ranks (barriers touch every pair).
    WorstPair,
}

/// One phase of an algorithm, as the cost model prices it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PhaseSpec {
    pub flows: FlowSet,
    /// Bytes per flow as a fraction of the message size.
    pub share: f64,
    pub op: Op,
    pub pattern: Pattern,
    /// Dependent one-way latencies (flag or payload hops).
    pub hops: f64,
    /// Dependent non-posted reads, each `read_round_trip_factor` latencies.
    pub read_hops: f64,
    pub latency_over: LatencyOver,
    /// Throughput limited by the ring's chunked FIFO pipeline.
    pub ring_pipelined: bool,
    pub engine: Engine,
    /// Dependent memory round trips a thread makes in this phase beyond
    /// the poll its hop includes: input loads that must return before
    /// their peer stores, further groups of receive slots polled one group
    /// after the other. Each costs `access_round_us` (a kernel fact: how
    /// many peer slots it loads or polls back to back).
    pub access_rounds: f64,
}

impl PhaseSpec {
    /// A phase of posted writes, one dependent hop, staggered peers. With
    /// payload completion (every push algorithm) the hop is the data itself.
    pub(crate) const fn staggered_writes(flows: FlowSet, share: f64) -> PhaseSpec {
        PhaseSpec {
            flows,
            share,
            op: Op::Write,
            pattern: Pattern::Staggered,
            hops: 1.0,
            read_hops: 0.0,
            latency_over: LatencyOver::WorstFlow,
            ring_pipelined: false,
            engine: Engine::Sm,
            access_rounds: 0.0,
        }
    }

    /// This phase with `rounds` dependent memory round trips beyond its
    /// hop's poll (see [`PhaseSpec::access_rounds`]).
    pub(crate) const fn with_access_rounds(self, rounds: f64) -> PhaseSpec {
        PhaseSpec { access_rounds: rounds, ..self }
    }

    /// A phase of simultaneous peer reads between barriers.
    pub(crate) const fn barrier_reads(share: f64, hops: f64, read_hops: f64) -> PhaseSpec {
        PhaseSpec {
            flows: FlowSet::AllPairs,
            share,
            op: Op::Read,
            pattern: Pattern::Simultaneous,
            hops,
            read_hops,
            latency_over: LatencyOver::WorstPair,
            ring_pipelined: false,
            engine: Engine::Sm,
            access_rounds: 0.0,
        }
    }
}

/// Round trips to poll (or load) `slots` slots in groups of `group`, one
/// group after the other.
pub(crate) fn access_groups(slots: usize, group: usize) -> f64 {
    slots.div_ceil(group.max(1)) as f64
}

/// What the cost model prices for one algorithm call.
#[derive(Clone, Debug, PartialEq)]
pub struct CostRecipe {
    pub phases: Vec<PhaseSpec>,
    /// Device-memory traffic in multiples of the message size (receive
    /// buffers, reductions, output, re-arming).
    pub local_passes: f64,
    /// The phases run side by side (groups of blocks, one per phase), not
    /// one after the other: each still pays its hops and access rounds (the
    /// first pack passes every phase), but their bytes share the links at
    /// once, priced as one phase that carries every phase's flows.
    pub overlapped: bool,
}
