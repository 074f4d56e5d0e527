//! A topology for people: the GPUs (with the ranks placed on each) and the
//! link matrix between them, as tables of at most 120 columns. Used by
//! `plan` and `topo`.
#![forbid(unsafe_code)]

use std::fmt::Write as _;

use crate::table;
use tp_allreduce::select::topology::{LinkKind, PcieRelation, Topology};

/// Short code of a link, as `nvidia-smi topo -m` writes it.
pub fn link_code(link: LinkKind) -> String {
    match link {
        LinkKind::SameDevice => "X".into(),
        LinkKind::NvLink { links } => format!("NV{links}"),
        LinkKind::NvSwitch => "NVS".into(),
        LinkKind::Pcie { relation: PcieRelation::SameSwitch } => "PIX".into(),
        LinkKind::Pcie { relation: PcieRelation::SameRootComplex } => "PHB".into(),
        LinkKind::Pcie { relation: PcieRelation::CrossSocket } => "SYS".into(),
        LinkKind::None => "-".into(),
    }
}

/// The legend of [`link_code`] (and `*` for pairs without usable P2P).
pub const LINK_LEGEND: &str = "X same GPU, NVn NVLink x n, NVS NVSwitch, PIX same PCIe switch, \
PHB same root complex,\nSYS across sockets, - no path; * no usable P2P";

/// The GPUs of `machine` that `devices` (the GPU of each rank) use, each
/// once with its ranks, then the links between them.
pub fn render(machine: &Topology, devices: &[usize]) -> String {
    let mut used: Vec<usize> = devices.to_vec();
    used.sort_unstable();
    used.dedup();
    let mut out = String::new();
    let _ = writeln!(out, "topology: {} ({} GPUs, fingerprint {})", machine.name, machine.len(), machine.fingerprint());
    let mut gpus = table::new(["gpu", "model", "sm", "PCIe", "NUMA", "bus", "GiB", "ranks"], [6]);
    for &g in &used {
        let info = &machine.gpus[g];
        let ranks: Vec<String> =
            devices.iter().enumerate().filter(|(_, &d)| d == g).map(|(r, _)| r.to_string()).collect();
        gpus.add_row(vec![
            g.to_string(),
            info.model.clone(),
            format!("{}{}", info.compute_capability.0, info.compute_capability.1),
            format!("gen{} x{}", info.pcie_gen, info.pcie_width),
            info.numa_node.map_or("-".to_string(), |n| n.to_string()),
            info.pci_bus_id.clone(),
            (info.memory_bytes >> 30).to_string(),
            ranks.join(","),
        ]);
    }
    out.push_str(&table::render(&gpus));
    if used.len() > 1 {
        let header = std::iter::once("link".to_string()).chain(used.iter().map(|g| g.to_string()));
        let mut links = table::new(header, 1..used.len() + 1);
        for &i in &used {
            let row = used.iter().map(|&j| {
                let p = machine.pair(i, j);
                format!("{}{}", link_code(p.link), if i == j || p.p2p_usable() { "" } else { "*" })
            });
            links.add_row(std::iter::once(i.to_string()).chain(row).collect::<Vec<_>>());
        }
        out.push_str(&table::render(&links));
        let _ = writeln!(out, "{LINK_LEGEND}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_allreduce::select::topology::embedded;

    #[test]
    fn every_gpu_once_with_its_ranks_and_narrow_lines() {
        let t = embedded::default_topology();
        let text = render(&t, &[0, 0, 1, 1]);
        assert!(text.lines().all(|l| l.chars().count() <= 120), "{text}");
        let gpu_rows: Vec<&str> = text.lines().filter(|l| l.contains("RTX PRO 6000")).collect();
        assert_eq!(gpu_rows.len(), 2, "{text}");
        assert!(gpu_rows[0].trim_end().ends_with("0,1") && gpu_rows[1].trim_end().ends_with("2,3"), "{text}");
        assert!(text.contains("PIX"), "{text}");
        let all = render(&t, &(0..8).collect::<Vec<_>>());
        assert!(all.contains("SYS"), "GPUs 3 and 4 are across sockets:\n{all}");
        assert!(all.lines().all(|l| l.chars().count() <= 120), "{all}");
        let no_p2p = render(&embedded::by_name("rtx-4090-8x-no-p2p").unwrap(), &[0, 1]);
        assert!(no_p2p.contains("-*"), "{no_p2p}");
    }
}
