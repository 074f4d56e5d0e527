//! Islands from the topology: which ranks a two-level algorithm
//! (Hierarchical) keeps together, so that only a fraction of the message
//! crosses the weakest boundary of the machine.
//!
//! [`islands_from_topology`] is pure (a rank view in, groups out):
//! * ranks sharing a GPU form one unit, and so do ranks whose GPUs are
//!   connected by NVLink or an NVSwitch: an island never splits them;
//! * the boundaries, coarsest first, are the CPU socket (cross-socket pairs
//!   and pairs without any P2P path), the PCIe root complex, the PCIe
//!   switch; the first that cuts the ranks into two or more groups of two
//!   or more (each group a clique of better links) gives the islands;
//! * unequal islands are fine (a 4+2 socket split of 6 GPUs); a machine
//!   without such a boundary (one switch, all NVLink) has none.
//!
//! `Config::islands` and `Config::island_size` (consecutive ranks) override
//! it per communicator.

#![forbid(unsafe_code)]

use super::{components, LinkKind, PcieRelation, Topology};

/// Boundaries from the coarsest, as "a pair is inside the same group when
/// its link is at least this good" (see [`LinkKind::quality`]).
const BOUNDARIES: [(&str, u32); 3] =
    [("socket", PCIE_ROOT_COMPLEX), ("root complex", PCIE_SWITCH), ("PCIe switch", UNIT)];
const PCIE_ROOT_COMPLEX: u32 = LinkKind::Pcie { relation: PcieRelation::SameRootComplex }.quality();
const PCIE_SWITCH: u32 = LinkKind::Pcie { relation: PcieRelation::SameSwitch }.quality();
/// NVLink (any lane count), NVSwitch and the same device: never split.
const UNIT: u32 = LinkKind::NvLink { links: 0 }.quality();

/// The islands of the rank view `view` (groups of ranks, each in rank
/// order, ordered by their first rank), or `None` when no boundary splits
/// it into two or more groups of two or more. Also returns the boundary's
/// name (for notes).
pub fn islands_from_topology(view: &Topology) -> Option<(Vec<Vec<usize>>, &'static str)> {
    let n = view.len();
    // Symmetric link quality; every NVLink/NVSwitch/same-device pair counts
    // as one unit, whatever its lane count.
    let q = |a: usize, b: usize| view.link(a, b).quality().min(view.link(b, a).quality()).min(UNIT);
    for (boundary, inside) in BOUNDARIES {
        let id = components(n, |a, b| q(a, b) >= inside);
        let count = id.iter().max().map_or(0, |m| m + 1);
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); count];
        for (r, &g) in id.iter().enumerate() {
            groups[g].push(r);
        }
        let cliques = groups.iter().all(|g| g.iter().all(|&a| g.iter().all(|&b| a == b || q(a, b) >= inside)));
        if groups.len() >= 2 && groups.iter().all(|g| g.len() >= 2) && cliques {
            return Some((groups, boundary));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::super::{embedded, GpuInfo, PairInfo, Topology};
    use super::*;

    /// A rank view of `devices.len()` ranks; `link(a, b)` between the
    /// devices of ranks on different GPUs.
    fn view(devices: &[usize], link: impl Fn(usize, usize) -> LinkKind) -> Topology {
        let gpus = devices
            .iter()
            .enumerate()
            .map(|(r, &d)| GpuInfo {
                index: r,
                model: "test".into(),
                compute_capability: (12, 0),
                pcie_gen: 5,
                pcie_width: 16,
                numa_node: None,
                pci_bus_id: format!("0000:{d:02x}:00.0"),
                memory_bytes: 0,
            })
            .collect();
        let pairs = devices
            .iter()
            .map(|&a| {
                devices
                    .iter()
                    .map(|&b| {
                        if a == b {
                            PairInfo::SAME_DEVICE
                        } else {
                            PairInfo { link: link(a, b), p2p_supported: true, p2p_check: None }
                        }
                    })
                    .collect()
            })
            .collect();
        let t = Topology { name: "fixture".into(), gpus, pairs, islands: None };
        t.validate().unwrap();
        t
    }

    const SOCKET: LinkKind = LinkKind::Pcie { relation: PcieRelation::CrossSocket };
    const ROOT: LinkKind = LinkKind::Pcie { relation: PcieRelation::SameRootComplex };
    const SWITCH: LinkKind = LinkKind::Pcie { relation: PcieRelation::SameSwitch };

    /// GPUs `0..sizes[0]` on socket 0, the next `sizes[1]` on socket 1, ...
    fn sockets(sizes: &[usize]) -> Topology {
        let socket_of: Vec<usize> = sizes.iter().enumerate().flat_map(|(s, &n)| std::iter::repeat_n(s, n)).collect();
        let devices: Vec<usize> = (0..socket_of.len()).collect();
        view(&devices, |a, b| if socket_of[a] == socket_of[b] { SWITCH } else { SOCKET })
    }

    fn groups(t: &Topology) -> Option<Vec<Vec<usize>>> {
        islands_from_topology(t).map(|(g, _)| g)
    }

    #[test]
    fn the_motivating_machine_splits_by_socket() {
        let t = embedded::default_topology();
        assert_eq!(islands_from_topology(&t), Some((vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]], "socket")));
    }

    #[test]
    fn unequal_socket_splits_and_world_sizes_3_to_8() {
        assert_eq!(groups(&sockets(&[4, 2])), Some(vec![vec![0, 1, 2, 3], vec![4, 5]]));
        assert_eq!(groups(&sockets(&[3, 3])), Some(vec![vec![0, 1, 2], vec![3, 4, 5]]));
        assert_eq!(groups(&sockets(&[3, 2])), Some(vec![vec![0, 1, 2], vec![3, 4]]));
        assert_eq!(groups(&sockets(&[2, 2])), Some(vec![vec![0, 1], vec![2, 3]]));
        assert_eq!(groups(&sockets(&[5, 3])), Some(vec![vec![0, 1, 2, 3, 4], vec![5, 6, 7]]));
        assert_eq!(groups(&sockets(&[3, 4])), Some(vec![vec![0, 1, 2], vec![3, 4, 5, 6]]));
        // A lone GPU on a socket is no island: no split at all.
        assert_eq!(groups(&sockets(&[2, 1])), None);
        assert_eq!(groups(&sockets(&[7, 1])), None);
        // One socket, one switch: nothing to split.
        assert_eq!(groups(&sockets(&[3])), None);
    }

    #[test]
    fn ranks_sharing_a_gpu_stay_together() {
        // 2 GPUs x 2 ranks, PCIe between the GPUs (same switch or across
        // sockets): one island per GPU.
        for link in [SWITCH, ROOT, SOCKET] {
            let t = view(&[0, 0, 1, 1], |_, _| link);
            assert_eq!(groups(&t), Some(vec![vec![0, 1], vec![2, 3]]), "{link}");
        }
        // Interleaved placement: ranks 0 and 2 on GPU 0.
        assert_eq!(groups(&view(&[0, 1, 0, 1], |_, _| SWITCH)), Some(vec![vec![0, 2], vec![1, 3]]));
        // 4 ranks on one GPU: a single unit.
        assert_eq!(groups(&view(&[0, 0, 0, 0], |_, _| SWITCH)), None);
        // 8 ranks on 2 GPUs of two sockets: 4+4.
        assert_eq!(
            groups(&view(&[0, 0, 0, 0, 1, 1, 1, 1], |_, _| SOCKET)),
            Some(vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]])
        );
        // The socket boundary wins over the GPU units inside it.
        let t = view(&[0, 0, 1, 1, 2, 2, 3, 3], |a, b| if a / 2 == b / 2 { SWITCH } else { SOCKET });
        assert_eq!(groups(&t), Some(vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]));
    }

    #[test]
    fn nvlink_connected_ranks_form_one_island() {
        assert_eq!(groups(&embedded::by_name("h200-8x-nvswitch").unwrap()), None);
        // Even with two ranks per GPU: NVLink-connected GPUs are one unit.
        assert_eq!(groups(&view(&[0, 0, 1, 1], |_, _| LinkKind::NvSwitch)), None);
        // NVLink bridge pairs on a PCIe machine: the pairs are never split,
        // the socket boundary still applies.
        let t = view(&[0, 1, 2, 3], |a, b| if a / 2 == b / 2 { LinkKind::NvLink { links: 4 } } else { SOCKET });
        assert_eq!(groups(&t), Some(vec![vec![0, 1], vec![2, 3]]));
        // A bridge pair across the boundary joins the two sides: no split.
        let t = view(&[0, 1, 2, 3], |a, b| {
            if (a, b) == (1, 2) || (a, b) == (2, 1) {
                LinkKind::NvLink { links: 4 }
            } else if a / 2 == b / 2 {
                SWITCH
            } else {
                SOCKET
            }
        });
        assert_eq!(groups(&t), None);
    }

    #[test]
    fn the_coarsest_boundary_wins_then_finer_ones() {
        // Switch pairs inside sockets: 4+4 (socket), not 2+2+2+2.
        let t = view(&[0, 1, 2, 3, 4, 5, 6, 7], |a, b| {
            if a / 2 == b / 2 {
                SWITCH
            } else if a / 4 == b / 4 {
                ROOT
            } else {
                SOCKET
            }
        });
        assert_eq!(islands_from_topology(&t).map(|(g, b)| (g.len(), b)), Some((2, "socket")));
        // One socket, two switches of two: the root-complex boundary.
        let t = view(&[0, 1, 2, 3], |a, b| if a / 2 == b / 2 { SWITCH } else { ROOT });
        assert_eq!(islands_from_topology(&t), Some((vec![vec![0, 1], vec![2, 3]], "root complex")));
        // Pairs without any P2P path count as the weakest boundary.
        let t = view(&[0, 1, 2, 3], |a, b| if a / 2 == b / 2 { SWITCH } else { LinkKind::None });
        assert_eq!(groups(&t), Some(vec![vec![0, 1], vec![2, 3]]));
        // Interleaved sockets.
        let t = view(&[0, 1, 2, 3, 4, 5, 6, 7], |a, b| if a % 2 == b % 2 { SWITCH } else { SOCKET });
        assert_eq!(groups(&t), Some(vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]));
        assert_eq!(groups(&embedded::by_name("rtx-pro-6000-4x-switch").unwrap()), None);
    }
}
