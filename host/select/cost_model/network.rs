//! The network a phase's flows cross: link classes, shared resources and
//! their capacities, and the latency and data time of one phase.

use std::collections::BTreeMap;

use super::{CostModel, CostParams};
use crate::algorithm::{Engine, FlowSet, IslandSplit, Op, Pattern, Transport};
use crate::select::topology::{components, LinkKind, PcieRelation, Topology};
use tp_allreduce_kernels::shares::{owned_count, owner_index};

/// Link classes: one latency and one bandwidth rule each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Class {
    SameDevice,
    NvLink(u32),
    NvSwitch,
    PcieSwitch,
    PcieRootComplex,
    PcieCrossSocket,
    Host,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Resource {
    PcieOut(usize),
    PcieIn(usize),
    NvOut(usize),
    NvIn(usize),
    UplinkOut(usize),
    UplinkIn(usize),
    Socket(usize, usize),
    DeviceMemory(usize),
    HostMemory,
}

#[derive(Default)]
pub(super) struct Load {
    pub bytes: f64,
    pub flows: usize,
    sources: Vec<usize>,
}

/// Per-resource loads of one phase: on the way out (`up`) and, for
/// host-staged flows, on the way back down.
#[derive(Default)]
pub(super) struct Loads {
    up: BTreeMap<Resource, Load>,
    down: BTreeMap<Resource, Load>,
    nv_cap: BTreeMap<usize, f64>,
}

pub(super) struct Flow {
    pub src: usize,
    pub dst: usize,
    pub bytes: f64,
}

pub(super) struct Phase {
    pub flows: Vec<Flow>,
    pub op: Op,
    pub pattern: Pattern,
    /// Dependent one-way latencies of the phase.
    pub hops: f64,
    /// Use the mean latency of the flows' links instead of the worst
    /// (pipelined rings: a chunk passes every edge).
    pub mean_latency: bool,
    /// Fraction of the bandwidth the kernel's own pipelining keeps (1.0
    /// but for our ring).
    pub pipeline: f64,
    /// Most bytes per second one flow reaches whatever the link (GB/s;
    /// infinite but for our ring).
    pub max_gbps: f64,
    /// SM stores or copy-engine copies (bandwidth and per-hop overhead).
    pub engine: Engine,
}

/// The structure of a rank view the model needs, precomputed.
pub(super) struct Net {
    pub n: usize,
    pub class: Vec<Vec<Class>>,
    pub device: Vec<usize>,
    pub switch: Vec<usize>,
    pub switch_size: Vec<usize>,
    pub socket: Vec<usize>,
    pub pcie_gbps: Vec<f64>,
    /// Device-memory bandwidth of each rank's GPU (GB/s).
    pub memory_gbps: Vec<f64>,
    /// How many ranks share each rank's GPU (1: it has its own).
    pub ranks_on_device: Vec<usize>,
}

impl Net {
    pub(super) fn new(view: &Topology, params: &CostParams, transport: Transport) -> Net {
        let n = view.len();
        let class = (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| match view.link(i, j) {
                        LinkKind::SameDevice => Class::SameDevice,
                        _ if transport == Transport::HostStaged => Class::Host,
                        _ if !view.pair(i, j).p2p_usable() => Class::Host,
                        LinkKind::NvLink { links } => Class::NvLink(links),
                        LinkKind::NvSwitch => Class::NvSwitch,
                        LinkKind::Pcie { relation: PcieRelation::SameSwitch } => Class::PcieSwitch,
                        LinkKind::Pcie { relation: PcieRelation::SameRootComplex } => Class::PcieRootComplex,
                        LinkKind::Pcie { relation: PcieRelation::CrossSocket } => Class::PcieCrossSocket,
                        LinkKind::None => Class::Host,
                    })
                    .collect()
            })
            .collect();
        let device = components(n, |a, b| view.link(a, b) == LinkKind::SameDevice);
        let switch = components(n, |a, b| {
            matches!(view.link(a, b), LinkKind::SameDevice | LinkKind::Pcie { relation: PcieRelation::SameSwitch })
        });
        let mut switch_size = vec![0; n];
        for r in 0..n {
            // Distinct devices behind the switch.
            let devs: Vec<usize> = (0..n).filter(|&q| switch[q] == switch[r]).map(|q| device[q]).collect();
            let mut d = devs.clone();
            d.sort_unstable();
            d.dedup();
            switch_size[r] = d.len();
        }
        let socket = components(n, |a, b| match view.link(a, b) {
            LinkKind::Pcie { relation: PcieRelation::CrossSocket } => false,
            LinkKind::None => view.gpus[a].numa_node.is_some() && view.gpus[a].numa_node == view.gpus[b].numa_node,
            _ => true,
        });
        let pcie_gbps = view.gpus.iter().map(|g| params.pcie_gbps(g.pcie_gen, g.pcie_width)).collect();
        let memory_gbps = view.gpus.iter().map(|g| params.device_memory_of(&g.model)).collect();
        let ranks_on_device = (0..n).map(|r| device.iter().filter(|&&d| d == device[r]).count()).collect();
        Net { n, class, device, switch, switch_size, socket, pcie_gbps, memory_gbps, ranks_on_device }
    }

    /// Whether two or more ranks share a GPU (and so its memory).
    pub(super) fn shares_a_device(&self) -> bool {
        self.ranks_on_device.iter().any(|&k| k > 1)
    }

    /// Ranks that share the busiest GPU with one of its ranks (0 with a GPU
    /// per rank).
    pub(super) fn further_ranks_sharing(&self) -> f64 {
        self.ranks_on_device.iter().copied().max().unwrap_or(1).saturating_sub(1) as f64
    }

    /// Local device-memory traffic of `passes` x `bytes` per rank, as the
    /// time it adds beyond `link_us` of link traffic: on GPUs of their own
    /// the ranks' memory works while the links carry the data (the larger
    /// of the two counts); ranks sharing a GPU move their peer data through
    /// that same memory (the two add up).
    pub(super) fn local_beyond(&self, passes: f64, bytes: f64, link_us: f64) -> f64 {
        let local = self.local_time(passes, bytes);
        if self.shares_a_device() {
            local
        } else {
            (local - link_us).max(0.0)
        }
    }

    /// Time (us) of `passes` x `bytes` of local device-memory traffic per
    /// rank: every rank of a GPU adds to that GPU's memory; the busiest GPU.
    pub(super) fn local_time(&self, passes: f64, bytes: f64) -> f64 {
        (0..self.n)
            .map(|r| self.ranks_on_device[r] as f64 * passes * bytes / (self.memory_gbps[r] * 1e3))
            .fold(0.0, f64::max)
    }
}

/// The flows of `set` on `n` ranks, `share` bytes per share (or per flow
/// for the flat sets). Island flows follow the ownership of
/// `tp_allreduce_kernels::shares`: member `j` of an island of `n_g` owns
/// shares `j, j + n_g, ...` of the `S` (largest island) shares.
pub(super) fn flows(set: FlowSet, n: usize, islands: Option<IslandSplit>, share: f64) -> Vec<Flow> {
    let pairs = (0..n).flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)));
    let flat = |keep: &dyn Fn(usize, usize) -> bool| -> Vec<Flow> {
        pairs.clone().filter(|&(i, j)| keep(i, j)).map(|(src, dst)| Flow { src, dst, bytes: share }).collect()
    };
    let split = islands.unwrap_or_else(|| IslandSplit::whole(n));
    let shares = split.shares() as u32;
    let owned = |r: usize| owned_count(shares, split.size(split.island_of(r)) as u32, split.index_of(r) as u32) as f64;
    match set {
        FlowSet::AllPairs => flat(&|_, _| true),
        FlowSet::RingNeighbours => flat(&|i, j| j == (i + 1) % n),
        FlowSet::IslandScatter => pairs
            .filter(|&(i, j)| split.together(i, j))
            .map(|(src, dst)| Flow { src, dst, bytes: owned(dst) * share })
            .collect(),
        FlowSet::IslandGather => pairs
            .filter(|&(i, j)| split.together(i, j))
            .map(|(src, dst)| Flow { src, dst, bytes: owned(src) * share })
            .collect(),
        FlowSet::CrossOwners => {
            let mut out = Vec::new();
            for src in 0..n {
                let (g, members) = (split.island_of(src), split.size(split.island_of(src)) as u32);
                for k in (0..shares).filter(|&k| owner_index(k, members) as usize == split.index_of(src)) {
                    for h in (0..split.count()).filter(|&h| h != g) {
                        let dst = split.member(h, owner_index(k, split.size(h) as u32) as usize);
                        out.push(Flow { src, dst, bytes: share });
                    }
                }
            }
            out
        }
    }
}

impl CostModel {
    pub(super) fn latency(&self, c: Class) -> f64 {
        let p = &self.params;
        match c {
            Class::SameDevice => p.latency_same_device_us,
            Class::NvLink(_) => p.latency_nvlink_us,
            Class::NvSwitch => p.latency_nvswitch_us,
            Class::PcieSwitch => p.latency_pcie_switch_us,
            Class::PcieRootComplex => p.latency_pcie_root_complex_us,
            Class::PcieCrossSocket => p.latency_pcie_cross_socket_us,
            Class::Host => p.latency_host_staged_us,
        }
    }

    pub(super) fn efficiency(&self, op: Op, pattern: Pattern, flows: usize) -> f64 {
        let p = &self.params;
        let read_ratio = p.simultaneous_read_efficiency / p.simultaneous_write_efficiency;
        match (op, pattern) {
            (Op::Write, _) if flows <= 1 => 1.0,
            (Op::Read, _) if flows <= 1 => p.single_read_efficiency,
            (Op::Write, Pattern::Single) => 1.0,
            (Op::Read, Pattern::Single) => p.single_read_efficiency,
            (Op::Write, Pattern::Staggered) => p.staggered_write_efficiency,
            (Op::Read, Pattern::Staggered) => p.staggered_write_efficiency * read_ratio,
            (Op::Write, Pattern::Simultaneous) => p.simultaneous_write_efficiency,
            (Op::Read, Pattern::Simultaneous) => p.simultaneous_read_efficiency,
        }
    }

    pub(super) fn nvlink_gbps(&self, c: Class) -> f64 {
        let p = &self.params;
        match c {
            Class::NvLink(links) => f64::from(links.max(1)) * p.nvlink_link_gbps * p.nvlink_efficiency,
            _ => p.nvswitch_gpu_gbps,
        }
    }

    /// Time of one phase's data movement: (ideal wire, actual). Host-staged
    /// flows cross PCIe twice (into host memory, out of it), in sequence.
    pub(super) fn data_time(&self, net: &Net, phase: &Phase) -> (f64, f64) {
        let loads = self.loads(net, phase);
        let (ideal_up, actual_up) = self.resource_time(net, phase, &loads.up, &loads.nv_cap, phase.op);
        // Staged data is read back from host memory by the receiver.
        let (ideal_down, actual_down) = self.resource_time(net, phase, &loads.down, &loads.nv_cap, Op::Read);
        (ideal_up + ideal_down, actual_up + actual_down)
    }

    /// The bytes and flows each shared resource carries in `phase`.
    fn loads(&self, net: &Net, phase: &Phase) -> Loads {
        let mut l = Loads::default();
        let add = |map: &mut BTreeMap<Resource, Load>, r: Resource, f: &Flow| {
            let l = map.entry(r).or_default();
            l.bytes += f.bytes;
            l.flows += 1;
            if !l.sources.contains(&f.src) {
                l.sources.push(f.src);
            }
        };
        for f in phase.flows.iter().filter(|f| f.bytes > 0.0) {
            let c = net.class[f.src][f.dst];
            let (ds, dd) = (net.device[f.src], net.device[f.dst]);
            let cross_socket = net.socket[f.src] != net.socket[f.dst];
            let socket = Resource::Socket(net.socket[f.src], net.socket[f.dst]);
            match c {
                Class::SameDevice => {
                    // One store (push) or one load (pull) of device memory;
                    // the other end is in the recipe's local passes.
                    add(&mut l.up, Resource::DeviceMemory(ds), f);
                }
                Class::NvLink(_) | Class::NvSwitch => {
                    l.nv_cap.insert(ds, self.nvlink_gbps(c));
                    l.nv_cap.insert(dd, self.nvlink_gbps(c));
                    add(&mut l.up, Resource::NvOut(ds), f);
                    add(&mut l.up, Resource::NvIn(dd), f);
                }
                Class::Host => {
                    add(&mut l.up, Resource::PcieOut(ds), f);
                    add(&mut l.up, Resource::HostMemory, f);
                    add(&mut l.down, Resource::HostMemory, f);
                    add(&mut l.down, Resource::PcieIn(dd), f);
                    if cross_socket {
                        add(&mut l.down, socket, f);
                    }
                }
                _ => {
                    add(&mut l.up, Resource::PcieOut(ds), f);
                    add(&mut l.up, Resource::PcieIn(dd), f);
                    if net.switch[f.src] != net.switch[f.dst] {
                        if net.switch_size[f.src] > 1 {
                            add(&mut l.up, Resource::UplinkOut(net.switch[f.src]), f);
                        }
                        if net.switch_size[f.dst] > 1 {
                            add(&mut l.up, Resource::UplinkIn(net.switch[f.dst]), f);
                        }
                    }
                    if cross_socket {
                        add(&mut l.up, socket, f);
                    }
                }
            }
        }
        l
    }

    /// (ideal wire, actual) time of the busiest resource of `map`.
    fn resource_time(
        &self,
        net: &Net,
        phase: &Phase,
        map: &BTreeMap<Resource, Load>,
        nv_cap: &BTreeMap<usize, f64>,
        op: Op,
    ) -> (f64, f64) {
        let p = &self.params;
        // Resources are keyed by device (or switch) component id; any
        // member rank of the component has the same GPU link.
        let pcie_of = |dev: usize| -> f64 {
            (0..net.n).find(|&r| net.device[r] == dev).map_or(p.pcie_gbps(0, 0), |r| net.pcie_gbps[r])
        };
        let uplink_of = |sw: usize| -> f64 {
            (0..net.n).find(|&r| net.switch[r] == sw).map_or(p.pcie_gbps(0, 0), |r| net.pcie_gbps[r])
        };
        let memory_of = |dev: usize| -> f64 {
            (0..net.n).find(|&r| net.device[r] == dev).map_or(p.device_memory_gbps, |r| net.memory_gbps[r])
        };
        let mut ideal: f64 = 0.0;
        let mut actual: f64 = 0.0;
        // Copy engines keep their own share of a PCIe link (docs/SOURCES.md [F9]).
        let engine = match phase.engine {
            Engine::Sm => 1.0,
            Engine::CopyEngine => p.copy_engine_efficiency / p.pcie_efficiency,
        };
        for (r, l) in map {
            let eff = self.efficiency(op, phase.pattern, l.flows);
            let (base, cap, counts_as_wire) = match *r {
                Resource::PcieOut(d) | Resource::PcieIn(d) => (pcie_of(d) * engine, pcie_of(d) * engine * eff, true),
                Resource::NvOut(d) | Resource::NvIn(d) => {
                    let b = nv_cap.get(&d).copied().unwrap_or(p.nvswitch_gpu_gbps);
                    (b, b * eff, true)
                }
                Resource::UplinkOut(s) | Resource::UplinkIn(s) => (uplink_of(s), uplink_of(s) * eff, false),
                Resource::Socket(..) => {
                    let cap = self.socket_gbps(phase, l, op);
                    (cap, cap, false)
                }
                Resource::DeviceMemory(d) => (memory_of(d), memory_of(d), true),
                Resource::HostMemory => (p.host_memory_gbps, p.host_memory_gbps, false),
            };
            // The per-flow ceiling of the kernel, for the flows sharing it.
            let ceiling = phase.max_gbps * l.flows.max(1) as f64;
            let (base, cap) = ((base * phase.pipeline).min(ceiling), (cap * phase.pipeline).min(ceiling));
            // bytes / (GB/s) = ns / 1000 -> us: bytes / (gbps * 1e3).
            if counts_as_wire {
                ideal = ideal.max(l.bytes / (base * 1e3));
            }
            actual = actual.max(l.bytes / (cap * 1e3));
        }
        (ideal, actual)
    }

    /// Capacity of the socket boundary for the flows of `load`: ~53 GB/s
    /// for one flow, falling towards the many-flow aggregate.
    fn socket_gbps(&self, phase: &Phase, load: &Load, op: Op) -> f64 {
        let p = &self.params;
        let concurrent = match phase.pattern {
            Pattern::Single | Pattern::Simultaneous => load.flows,
            Pattern::Staggered => load.sources.len(),
        }
        .max(1) as f64;
        let many = p.socket_many_flows_gbps;
        let cap = many + (p.socket_single_flow_gbps - many) / concurrent;
        if op == Op::Read {
            cap * p.socket_read_factor
        } else {
            cap
        }
    }

    /// Bandwidth of one flow alone between two ranks (GB/s): the slower GPU
    /// link, the socket boundary if crossed, NVLink, device memory, or
    /// NCCL's host-memory transport for staged pairs.
    pub(super) fn single_flow_gbps(&self, net: &Net, a: usize, b: usize) -> f64 {
        let p = &self.params;
        match net.class[a][b] {
            Class::SameDevice => net.memory_gbps[a],
            c @ (Class::NvLink(_) | Class::NvSwitch) => self.nvlink_gbps(c),
            Class::Host => p.nccl_host_gbps,
            _ => {
                let link = net.pcie_gbps[a].min(net.pcie_gbps[b]);
                if net.socket[a] != net.socket[b] {
                    link.min(p.socket_single_flow_gbps)
                } else {
                    link
                }
            }
        }
    }

    pub(super) fn phase_latency(&self, net: &Net, phase: &Phase, all_pairs: bool) -> f64 {
        let classes: Vec<Class> = if all_pairs {
            (0..net.n)
                .flat_map(|i| (0..net.n).filter(move |&j| j != i).map(move |j| (i, j)))
                .map(|(i, j)| net.class[i][j])
                .collect()
        } else {
            phase.flows.iter().map(|f| net.class[f.src][f.dst]).collect()
        };
        if classes.is_empty() {
            return 0.0;
        }
        let lat = if phase.mean_latency {
            classes.iter().map(|&c| self.latency(c)).sum::<f64>() / classes.len() as f64
        } else {
            classes.iter().map(|&c| self.latency(c)).fold(0.0, f64::max)
        };
        let overhead = match phase.engine {
            Engine::Sm => self.params.hop_overhead_us,
            Engine::CopyEngine => self.params.copy_engine_step_us,
        };
        phase.hops * (lat + overhead)
    }
}
