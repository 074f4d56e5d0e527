//! Named topologies for modelling without the hardware
//! (`tp-allreduce plan --topology NAME`).
//!
//! Each entry says where its figures come from. What a description fixes is
//! the *structure* (GPU model, PCIe generation and width, which pairs share
//! a switch, a root complex or only the socket link, P2P support); the
//! bandwidth and latency *per link class* live in one place, the cost
//! model's parameter table ([`crate::select::cost_model::CostParams`]). Bus ids are
//! synthetic (they are not part of the fingerprint).
//!
//! | name | GPUs | structure | source / assumption |
//! |---|---|---|---|
//! | `rtx-pro-6000-8x-pcie5-2socket` | 8x RTX PRO 6000 Blackwell, sm_120, 96 GB, Gen5 x16 | 4+4 over two CPU sockets, full P2P | docs/SOURCES.md [F1, F9] (the motivating machine). *Assumed*: the four GPUs of a socket sit below one Gen5 switch (SOURCES.md \[F4\] speaks of traffic "through switches and root complexes"); server edition name |
//! | `rtx-pro-6000-4x-switch` | 4x RTX PRO 6000 Blackwell | one PCIe Gen5 switch, full P2P | docs/SOURCES.md \[F16\]: the published one-shot push vs NCCL figures (4 GPUs "behind switches"); *assumed* a single switch |
//! | `l40s-8x-pcie4` | 8x L40S, sm_89, 48 GB, Gen4 x16 | two switches of two GPUs per socket, two sockets, full P2P | NVIDIA L40S datasheet (Gen4 x16, 48 GB, no NVLink). *Assumed* switch layout (a common 4U 8-GPU design) |
//! | `rtx-4090-8x-no-p2p` | 8x GeForce RTX 4090, sm_89, 24 GB, Gen4 x16 | 4+4 over two sockets, **no P2P** | GeForce 40-series drivers do not expose PCIe P2P; host-staged push or NCCL (over host memory) only. Socket split *assumed* |
//! | `h200-8x-nvswitch` | 8x H200 SXM, sm_90, 141 GB HBM3e, Gen5 x16 host link | NVSwitch, 18 NVLink 4 links per GPU | NVIDIA H200 datasheet (NVLink 900 GB/s bidirectional per GPU) |

#![forbid(unsafe_code)]

use super::{GpuInfo, Islands, LinkKind, PairInfo, PcieRelation, Topology};
use crate::error::{Error, Result};

/// Name of the default topology: the machine that motivated this library.
pub const DEFAULT: &str = "rtx-pro-6000-8x-pcie5-2socket";

const NAMES: [&str; 5] = [
    "rtx-pro-6000-8x-pcie5-2socket",
    "rtx-pro-6000-4x-switch",
    "l40s-8x-pcie4",
    "rtx-4090-8x-no-p2p",
    "h200-8x-nvswitch",
];

const GIB: u64 = 1 << 30;
const RTX_PRO_6000: &str = "NVIDIA RTX PRO 6000 Blackwell Server Edition";

/// Every embedded name.
pub fn names() -> &'static [&'static str] {
    &NAMES
}

/// The embedded topology called `name`.
pub fn by_name(name: &str) -> Result<Topology> {
    let t = match name.trim() {
        "rtx-pro-6000-8x-pcie5-2socket" => rtx_pro_6000_8x_pcie5_2socket(),
        "rtx-pro-6000-4x-switch" => rtx_pro_6000_4x_switch(),
        "l40s-8x-pcie4" => l40s_8x_pcie4(),
        "rtx-4090-8x-no-p2p" => rtx_4090_8x_no_p2p(),
        "h200-8x-nvswitch" => h200_8x_nvswitch(),
        other => {
            return Err(Error::Config(format!("unknown topology `{other}`; embedded topologies: {}", NAMES.join(", "))))
        }
    };
    debug_assert!(t.validate().is_ok(), "embedded topology {name} is invalid");
    Ok(t)
}

/// The embedded topology named by `TP_ALLREDUCE_TOPOLOGY`, if set; an
/// unknown name is an error that lists the embedded ones.
pub fn from_env() -> Result<Option<Topology>> {
    crate::env::topology_name()
        .map(|name| by_name(&name).map_err(|e| Error::Config(format!("{}: {e}", crate::env::TOPOLOGY))))
        .transpose()
}

/// The motivating machine ([`DEFAULT`]).
pub fn default_topology() -> Topology {
    rtx_pro_6000_8x_pcie5_2socket()
}

struct GpuSpec {
    model: &'static str,
    cc: (u32, u32),
    gen: u32,
    memory_gib: u64,
}

fn gpus(spec: &GpuSpec, n: usize, per_socket: usize) -> Vec<GpuInfo> {
    (0..n)
        .map(|i| {
            let socket = i / per_socket;
            GpuInfo {
                index: i,
                model: spec.model.to_string(),
                compute_capability: spec.cc,
                pcie_gen: spec.gen,
                pcie_width: 16,
                numa_node: Some(socket as u32),
                // Synthetic: socket 0 buses from 0x18, socket 1 from 0x98.
                pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + 0x80 * socket + 0x10 * (i % per_socket)),
                memory_bytes: spec.memory_gib * GIB,
            }
        })
        .collect()
}

fn matrix(n: usize, link: impl Fn(usize, usize) -> (LinkKind, bool)) -> Vec<Vec<PairInfo>> {
    (0..n)
        .map(|i| {
            (0..n)
                .map(|j| {
                    if i == j {
                        PairInfo::SAME_DEVICE
                    } else {
                        let (link, p2p_supported) = link(i, j);
                        PairInfo { link, p2p_supported, p2p_check: None }
                    }
                })
                .collect()
        })
        .collect()
}

fn pcie(relation: PcieRelation) -> (LinkKind, bool) {
    (LinkKind::Pcie { relation }, true)
}

fn halves(n: usize) -> Islands {
    Islands { groups: vec![(0..n / 2).collect(), (n / 2..n).collect()] }
}

fn rtx_pro_6000_8x_pcie5_2socket() -> Topology {
    let spec = GpuSpec { model: RTX_PRO_6000, cc: (12, 0), gen: 5, memory_gib: 96 };
    Topology {
        name: "rtx-pro-6000-8x-pcie5-2socket".into(),
        gpus: gpus(&spec, 8, 4),
        pairs: matrix(8, |i, j| {
            pcie(if i / 4 == j / 4 { PcieRelation::SameSwitch } else { PcieRelation::CrossSocket })
        }),
        islands: Some(halves(8)),
    }
}

fn rtx_pro_6000_4x_switch() -> Topology {
    let spec = GpuSpec { model: RTX_PRO_6000, cc: (12, 0), gen: 5, memory_gib: 96 };
    Topology {
        name: "rtx-pro-6000-4x-switch".into(),
        gpus: gpus(&spec, 4, 4),
        pairs: matrix(4, |_, _| pcie(PcieRelation::SameSwitch)),
        islands: None,
    }
}

fn l40s_8x_pcie4() -> Topology {
    let spec = GpuSpec { model: "NVIDIA L40S", cc: (8, 9), gen: 4, memory_gib: 48 };
    Topology {
        name: "l40s-8x-pcie4".into(),
        gpus: gpus(&spec, 8, 4),
        pairs: matrix(8, |i, j| {
            pcie(if i / 2 == j / 2 {
                PcieRelation::SameSwitch
            } else if i / 4 == j / 4 {
                PcieRelation::SameRootComplex
            } else {
                PcieRelation::CrossSocket
            })
        }),
        // Derived from the links (coarsest level: the sockets).
        islands: None,
    }
}

fn rtx_4090_8x_no_p2p() -> Topology {
    let spec = GpuSpec { model: "NVIDIA GeForce RTX 4090", cc: (8, 9), gen: 4, memory_gib: 24 };
    Topology {
        name: "rtx-4090-8x-no-p2p".into(),
        gpus: gpus(&spec, 8, 4),
        pairs: matrix(8, |_, _| (LinkKind::None, false)),
        // Without P2P every link is "none"; the split comes from the sockets.
        islands: Some(halves(8)),
    }
}

fn h200_8x_nvswitch() -> Topology {
    let spec = GpuSpec { model: "NVIDIA H200", cc: (9, 0), gen: 5, memory_gib: 141 };
    Topology {
        name: "h200-8x-nvswitch".into(),
        gpus: gpus(&spec, 8, 4),
        pairs: matrix(8, |_, _| (LinkKind::NvSwitch, true)),
        islands: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_resolves_and_validates() {
        for name in names() {
            let t = by_name(name).unwrap();
            assert_eq!(&t.name, name);
            t.validate().unwrap();
        }
        assert_eq!(default_topology().name, DEFAULT);
        let e = by_name("dgx-9000").unwrap_err().to_string();
        assert!(e.contains("rtx-pro-6000-8x-pcie5-2socket"), "{e}");
    }

    #[test]
    fn structure_matches_the_table() {
        let t = default_topology();
        assert_eq!(t.gpus[0].compute_capability, (12, 0));
        assert!(t.all_p2p_usable());
        assert_eq!(t.link(1, 2), LinkKind::Pcie { relation: PcieRelation::SameSwitch });
        assert_eq!(t.link(3, 4), LinkKind::Pcie { relation: PcieRelation::CrossSocket });
        let g = by_name("rtx-4090-8x-no-p2p").unwrap();
        assert!(!g.all_p2p_usable());
        assert!(g.is_pcie());
        let h = by_name("h200-8x-nvswitch").unwrap();
        assert!(!h.is_pcie());
        let l = by_name("l40s-8x-pcie4").unwrap();
        assert_eq!(l.islands().unwrap().consecutive_size(), Some(4));
    }
}
