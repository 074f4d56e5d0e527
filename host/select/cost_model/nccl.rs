//! NCCL as the baseline, modelled as NCCL models itself.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::network::{Class, Flow, Net, Phase};
use super::{Breakdown, CostModel, Method, NcclTuning, Options, Prediction};
use crate::algorithm::Transport;
use crate::algorithm::{Engine, Op, Pattern};
use crate::select::topology::Topology;

/// NCCL's algorithms within one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NcclAlgo {
    Ring,
    /// Within one node NCCL's tree is a chain.
    Tree,
}

/// NCCL's protocols (LL128 is off on PCIe by default and not modelled).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NcclProto {
    Ll,
    Simple,
}

/// One NCCL (algorithm, protocol) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NcclVariant {
    pub algo: NcclAlgo,
    pub proto: NcclProto,
}

impl NcclVariant {
    pub const ALL: [NcclVariant; 4] = [
        NcclVariant { algo: NcclAlgo::Ring, proto: NcclProto::Ll },
        NcclVariant { algo: NcclAlgo::Ring, proto: NcclProto::Simple },
        NcclVariant { algo: NcclAlgo::Tree, proto: NcclProto::Ll },
        NcclVariant { algo: NcclAlgo::Tree, proto: NcclProto::Simple },
    ];
}

impl fmt::Display for NcclVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = match self.algo {
            NcclAlgo::Ring => "ring",
            NcclAlgo::Tree => "tree",
        };
        let p = match self.proto {
            NcclProto::Ll => "LL",
            NcclProto::Simple => "Simple",
        };
        write!(f, "nccl {a}/{p}")
    }
}

impl CostModel {
    /// One NCCL variant. NCCL runs over P2P when every pair has usable P2P
    /// and the transport is P2P, else through host memory (its SHM
    /// transport).
    pub fn predict_nccl(
        &self,
        view: &Topology,
        variant: NcclVariant,
        transport: Transport,
        bytes: usize,
        opts: &Options,
    ) -> Prediction {
        self.predict_nccl_passes(view, variant, transport, bytes, opts, 2.0)
    }

    /// NCCL moving `passes` times `(N-1)/N` of the message around its ring
    /// in `passes x (N-1)` steps: 2 for allreduce (reduce-scatter, then
    /// all-gather), 1 for an all-gather or reduce-scatter of `bytes` in all.
    pub(super) fn predict_nccl_passes(
        &self,
        view: &Topology,
        variant: NcclVariant,
        transport: Transport,
        bytes: usize,
        opts: &Options,
        passes: f64,
    ) -> Prediction {
        let p = &self.params;
        let n = view.len();
        let nf = n as f64;
        let s = bytes as f64;
        let transport = if view.all_p2p_usable() { transport } else { Transport::HostStaged };
        let net = Net::new(view, p, transport);
        let (base, step, fraction, wire_factor) = match variant.proto {
            NcclProto::Ll => {
                let fraction = match opts.nccl {
                    NcclTuning::Tuned => p.nccl_ll_link_fraction,
                    NcclTuning::Stock => p.nccl_ll_stock_link_fraction,
                };
                // LL sends an 8-byte line per 4 data bytes.
                (p.nccl_base_ll_us, p.nccl_step_ll_us, fraction, 2.0)
            }
            NcclProto::Simple => (p.nccl_base_simple_us, p.nccl_step_simple_us, p.nccl_simple_link_fraction, 1.0),
        };
        let eager = if opts.capturing { 0.0 } else { p.nccl_eager_extra_us };
        let mut b = Breakdown { launch_us: base + eager, ..Default::default() };
        if n > 1 {
            let per_rank = match variant.algo {
                NcclAlgo::Ring => passes * (nf - 1.0) / nf * s,
                // Chain: every rank receives and forwards S up, then S down.
                NcclAlgo::Tree => passes * s,
            } * wire_factor;
            let flows: Vec<Flow> = (0..n).map(|r| Flow { src: r, dst: (r + 1) % n, bytes: per_rank }).collect();
            // Per step: NCCL's NVLink step, else the link latency + NCCL's
            // per-step overhead; the mean over the ring's edges.
            let step_over = |c: Class| match c {
                Class::NvLink(_) | Class::NvSwitch => p.nccl_step_nvlink_us,
                Class::Host => p.nccl_host_step_us + step,
                c => self.latency(c) + step,
            };
            let edge = flows.iter().map(|f| step_over(net.class[f.src][f.dst])).sum::<f64>() / nf;
            let hops = passes * (nf - 1.0);
            b.latency_us = hops * edge;
            let link_gbps =
                flows.iter().map(|f| self.single_flow_gbps(&net, f.src, f.dst)).fold(f64::INFINITY, f64::min);
            let phase = Phase {
                flows,
                op: Op::Write,
                pattern: Pattern::Single,
                hops,
                mean_latency: true,
                pipeline: 1.0,
                max_gbps: f64::INFINITY,
                engine: Engine::Sm,
            };
            let (_, actual) = self.data_time(&net, &phase);
            let mut throughput = fraction * link_gbps;
            if variant.proto == NcclProto::Ll {
                throughput = throughput.min(p.nccl_ll_max_gbps);
            }
            b.wire_us = per_rank / (throughput * 1e3);
            b.contention_us = (actual - per_rank / (link_gbps * 1e3)).max(0.0);
            b.local_us = net.local_beyond(2.0, s, b.wire_us + b.contention_us);
        }
        Prediction { method: Method::Nccl(variant), transport, breakdown: b }
    }

    /// NCCL's all-gather or reduce-scatter moving `bytes` in all (the
    /// gathered buffer, or the one scattered): the best variant of one ring
    /// pass.
    pub fn predict_nccl_collective(&self, view: &Topology, transport: Transport, bytes: usize, opts: &Options) -> Prediction {
        NcclVariant::ALL
            .iter()
            .map(|&v| self.predict_nccl_passes(view, v, transport, bytes, opts, 1.0))
            .min_by(|a, b| a.total_us().total_cmp(&b.total_us()))
            .expect("four variants")
    }

    /// The best NCCL variant (tuned NCCL).
    pub fn predict_nccl_best(&self, view: &Topology, transport: Transport, bytes: usize, opts: &Options) -> Prediction {
        NcclVariant::ALL
            .iter()
            .map(|&v| self.predict_nccl(view, v, transport, bytes, opts))
            .min_by(|a, b| a.total_us().total_cmp(&b.total_us()))
            .expect("four variants")
    }
}
