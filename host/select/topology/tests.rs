//! Topologies on the CPU: the fingerprint, islands from the links, rank
//! views, validation.

use super::*;

#[test]
fn fingerprint_known_value_for_the_motivating_machine() {
    let t = embedded::default_topology();
    // Pinned: a change here invalidates every tuning table in the field.
    // Update only together with a version bump of `fingerprint_text`.
    assert_eq!(t.fingerprint(), "e2c5c89df4a0737f");
    assert_eq!(t.fingerprint().len(), 16);
}

#[test]
fn fingerprint_stable_across_clones_and_serde_round_trips() {
    for name in embedded::names() {
        let t = embedded::by_name(name).unwrap();
        let json = t.to_json().unwrap();
        let back = Topology::from_json(&json).unwrap();
        assert_eq!(back, t, "{name}: JSON round trip");
        assert_eq!(back.fingerprint(), t.fingerprint(), "{name}");
        assert_eq!(t.clone().fingerprint(), t.fingerprint(), "{name}");
        let toml_text = toml::to_string(&t).unwrap();
        let from_toml: Topology = toml::from_str(&toml_text).unwrap();
        assert_eq!(from_toml.fingerprint(), t.fingerprint(), "{name}: TOML round trip");
    }
}

#[test]
fn fingerprint_ignores_bus_ids_names_and_checks() {
    let t = embedded::default_topology();
    let mut u = t.clone();
    u.name = "renamed".into();
    for g in &mut u.gpus {
        g.pci_bus_id = format!("0001:{}", &g.pci_bus_id[5..]);
        g.numa_node = None;
    }
    u.set_p2p_check(0, 1, false);
    assert_eq!(u.fingerprint(), t.fingerprint());
}

#[test]
fn fingerprint_changes_when_a_link_or_gpu_changes() {
    let t = embedded::default_topology();
    let mut u = t.clone();
    u.pairs[0][5].link = LinkKind::Pcie { relation: PcieRelation::SameRootComplex };
    u.pairs[5][0].link = LinkKind::Pcie { relation: PcieRelation::SameRootComplex };
    assert_ne!(u.fingerprint(), t.fingerprint());
    let mut v = t.clone();
    v.pairs[2][3].p2p_supported = false;
    assert_ne!(v.fingerprint(), t.fingerprint());
    let mut w = t.clone();
    w.gpus[7].pcie_gen = 4;
    assert_ne!(w.fingerprint(), t.fingerprint());
    let four = t.for_world(4).unwrap();
    assert_ne!(four.fingerprint(), t.fingerprint());
    // Every embedded topology is distinct.
    let mut prints: Vec<String> =
        embedded::names().iter().map(|n| embedded::by_name(n).unwrap().fingerprint()).collect();
    prints.sort();
    prints.dedup();
    assert_eq!(prints.len(), embedded::names().len());
}

#[test]
fn islands_derived_from_links() {
    let t = embedded::default_topology();
    let derived = t.derive_islands().expect("4+4 split by socket");
    assert_eq!(derived.groups, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(derived.consecutive_size(), Some(4));
    assert!(embedded::by_name("rtx-pro-6000-4x-switch").unwrap().derive_islands().is_none());
    assert!(embedded::by_name("h200-8x-nvswitch").unwrap().derive_islands().is_none());
    // Interleaved sockets: derived, but not consecutive.
    let mut x = t.clone();
    x.islands = None;
    let perm = [0usize, 4, 1, 5, 2, 6, 3, 7];
    x.pairs = perm.iter().map(|&a| perm.iter().map(|&b| t.pairs[a][b]).collect()).collect();
    let i = x.derive_islands().unwrap();
    assert_eq!(i.groups, vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
    assert_eq!(i.consecutive_size(), None);
}

#[test]
fn coarsest_island_level_wins() {
    // Pairs behind switches inside sockets: 2+2+2+2 and 4+4 both qualify.
    let mut t = embedded::default_topology();
    t.islands = None;
    for i in 0..8 {
        for j in 0..8 {
            if i != j && i / 4 == j / 4 && i / 2 != j / 2 {
                t.pairs[i][j].link = LinkKind::Pcie { relation: PcieRelation::SameRootComplex };
            }
        }
    }
    assert_eq!(t.derive_islands().unwrap().groups, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
}

#[test]
fn rank_views() {
    let t = embedded::default_topology();
    let shared = t.for_ranks(&[0, 0, 0, 0]).unwrap();
    assert_eq!(shared.len(), 4);
    assert!(shared.has_shared_device());
    assert!(!shared.is_pcie());
    assert!(shared.islands().is_none());
    let split = t.for_ranks(&[0, 1, 4, 5]).unwrap();
    assert_eq!(split.islands().unwrap().groups, vec![vec![0, 1], vec![2, 3]]);
    assert!(t.for_ranks(&[0, 9]).is_err());
    let one = embedded::by_name("h200-8x-nvswitch").unwrap().for_ranks(&[0]).unwrap();
    let four_on_one = one.for_world(4).unwrap();
    assert_eq!(four_on_one.len(), 4);
    assert!(four_on_one.pairs.iter().flatten().all(|p| p.link == LinkKind::SameDevice));
    four_on_one.validate().unwrap();
}

#[test]
fn validation_names_the_problem() {
    let mut t = embedded::default_topology();
    t.pairs[1][2].link = LinkKind::NvSwitch;
    let e = t.validate().unwrap_err().to_string();
    assert!(e.contains("(1,2)"), "{e}");
    let mut u = embedded::default_topology();
    u.pairs.pop();
    assert!(u.validate().unwrap_err().to_string().contains("8x8"));
}
