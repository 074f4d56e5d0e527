//! How an algorithm describes one call to the cost model: phases of flows
//! between ranks (which pairs, what share of the message, posted writes or
//! reads, how they overlap, how many dependent hops) and the local
//! device-memory traffic. `select::cost_model` prices a recipe on a topology.

#![forbid(unsafe_code)]

/// The shape a cost recipe depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CostShape {
    pub world: usize,
    /// Hierarchical: island size (checked by [`availability`] first).
    pub island_size: Option<usize>,
}

/// Which ordered pairs of ranks exchange data in a phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowSet {
    /// Every rank to every other rank.
    AllPairs,
    /// Every rank to the next one (`r -> r+1 mod N`).
    RingNeighbours,
    /// Every rank to the other members of its island.
    WithinIslands,
    /// Every rank to the same-index member of every other island.
    AcrossIslands,
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
}

impl PhaseSpec {
    /// A phase of posted writes, one dependent hop, staggered peers.
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
        }
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
        }
    }
}

/// What the cost model prices for one algorithm call.
#[derive(Clone, Debug, PartialEq)]
pub struct CostRecipe {
    pub phases: Vec<PhaseSpec>,
    /// Device-memory traffic in multiples of the message size (receive
    /// buffers, reductions, output, re-arming).
    pub local_passes: f64,
}
