use super::*;
use crate::config::TransportPreference;

const AUTO: TransportPreference = TransportPreference::Auto;
const FORCE_P2P: TransportPreference = TransportPreference::Force(Transport::PeerToPeer);
const FORCE_HOST: TransportPreference = TransportPreference::Force(Transport::HostStaged);

fn problem(rank: usize, peer: usize) -> TransportProblem {
    TransportProblem { rank, peer, what: "opening a peer's memory handle failed".into() }
}

#[test]
fn no_problem_keeps_the_transport() {
    for preference in [AUTO, FORCE_P2P, FORCE_HOST] {
        for step in [Step::Map, Step::Check] {
            assert!(matches!(verdict(preference, Transport::PeerToPeer, step, &[]), Verdict::Keep));
        }
    }
}

#[test]
fn a_failed_import_under_auto_falls_back_on_every_rank() {
    // The problems are all-gathered, so every rank evaluates the same list.
    let all = [problem(1, 0)];
    for _rank in 0..2 {
        match verdict(AUTO, Transport::PeerToPeer, Step::Map, &all) {
            Verdict::FallBack(why) => {
                assert!(why.contains("mapping the peers' regions failed"), "{why}");
                assert!(why.contains("rank 1 <- rank 0"), "{why}");
                assert!(why.contains("host-staged"), "{why}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_failed_import_with_p2p_forced_fails_naming_the_pair() {
    match verdict(FORCE_P2P, Transport::PeerToPeer, Step::Map, &[problem(1, 0), problem(2, 0)]) {
        Verdict::Fail(Error::Ipc(msg)) => {
            assert!(msg.contains("rank 1 could not map the region of rank 0"), "{msg}");
            assert!(msg.contains("rank 2 <- rank 0"), "every pair is listed: {msg}");
            assert!(msg.contains("forced"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn host_staging_that_fails_too_is_an_error() {
    match verdict(AUTO, Transport::HostStaged, Step::Map, &[problem(0, 1)]) {
        Verdict::Fail(Error::Ipc(msg)) => assert!(msg.contains("host-staged"), "{msg}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_failed_check_falls_back_under_auto_and_fails_when_forced() {
    let bad = [TransportProblem { rank: 3, peer: 1, what: "7/4096 words written by rank 1 arrived wrong".into() }];
    assert!(matches!(verdict(AUTO, Transport::PeerToPeer, Step::Check, &bad), Verdict::FallBack(_)));
    match verdict(FORCE_P2P, Transport::PeerToPeer, Step::Check, &bad) {
        Verdict::Fail(Error::P2pCheck { rank: 3, peer: 1, what }) => assert!(what.contains("7/4096"), "{what}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(verdict(FORCE_HOST, Transport::HostStaged, Step::Check, &bad), Verdict::Fail(_)));
}

#[test]
fn the_first_transport_follows_reachability_and_preference() {
    assert_eq!(initial_transport(AUTO, &[], None).unwrap().0, Transport::PeerToPeer);
    let (t, why) = initial_transport(AUTO, &[(0, 1)], None).unwrap();
    assert_eq!(t, Transport::HostStaged);
    assert!(why.contains("[(0, 1)]"), "{why}");
    assert!(matches!(initial_transport(FORCE_P2P, &[(1, 0)], None), Err(Error::Unsupported(_))));
    assert_eq!(initial_transport(FORCE_HOST, &[], None).unwrap().0, Transport::HostStaged);
    assert_eq!(initial_transport(FORCE_P2P, &[], None).unwrap().0, Transport::PeerToPeer);
}

/// When only pairs across islands lack P2P: P2P inside
/// islands and host staging across them (per pair); a pair inside an island
/// without P2P, or no islands, still means host staging for everyone.
#[test]
fn per_pair_transport_when_only_cross_island_pairs_lack_p2p() {
    let split = IslandSplit::consecutive(2, 4).ok();
    let across: Vec<(usize, usize)> =
        (0..4).flat_map(|a| (0..4).map(move |b| (a, b))).filter(|(a, b)| a / 2 != b / 2).collect();
    let (t, why) = initial_transport(AUTO, &across, split).unwrap();
    assert_eq!(t, Transport::PerPair);
    assert!(why.contains("across islands"), "{why}");
    // One pair inside an island without P2P: everyone host-staged.
    let mut inside = across.clone();
    inside.push((0, 1));
    assert_eq!(initial_transport(AUTO, &inside, split).unwrap().0, Transport::HostStaged);
    assert_eq!(initial_transport(AUTO, &across, None).unwrap().0, Transport::HostStaged);
    // Everything reachable: plain P2P even with islands.
    assert_eq!(initial_transport(AUTO, &[], split).unwrap().0, Transport::PeerToPeer);
    // Forced per-pair needs islands that fit.
    let per_pair = TransportPreference::Force(Transport::PerPair);
    assert_eq!(initial_transport(per_pair, &across, split).unwrap().0, Transport::PerPair);
    assert_eq!(initial_transport(per_pair, &[], split).unwrap().0, Transport::PerPair);
    assert!(matches!(initial_transport(per_pair, &inside, split), Err(Error::Unsupported(_))));
    assert!(matches!(initial_transport(per_pair, &[], None), Err(Error::Unsupported(_))));
    // Unequal islands: 3+2 with the socket pairs cut.
    let unequal = IslandSplit::from_groups(&[vec![0, 1, 2], vec![3, 4]], 5).ok();
    let cut: Vec<(usize, usize)> =
        (0..5).flat_map(|a| (0..5).map(move |b| (a, b))).filter(|&(a, b)| (a < 3) != (b < 3)).collect();
    assert_eq!(initial_transport(AUTO, &cut, unequal).unwrap().0, Transport::PerPair);
    // A failed check on the per-pair transport falls back under Auto.
    let bad = [problem(0, 1)];
    assert!(matches!(verdict(AUTO, Transport::PerPair, Step::Check, &bad), Verdict::FallBack(_)));
}

#[test]
fn island_tables_of_the_handle() {
    let l = island_layout(5, IslandSplit::consecutive(4, 8).ok());
    assert_eq!((l.island_size, l.island_count, l.my_island, l.my_index), (4, 2, 1, 1));
    assert_eq!(l.members[1][..4], [4, 5, 6, 7]);
    let unequal = island_layout(4, IslandSplit::from_groups(&[vec![0, 2, 4], vec![1, 3]], 5).ok());
    assert_eq!((unequal.island_size, unequal.island_count, unequal.my_island, unequal.my_index), (0, 2, 0, 2));
    assert_eq!(island_layout(0, None).island_count, 0);
    let config = Config { island_size: Some(4), ..Config::default() };
    assert!(island_split(6, &config).is_err());
    let config = Config { islands: Some(vec![vec![0, 1, 2], vec![3, 4]]), island_size: Some(4), ..Config::default() };
    assert_eq!(island_split(5, &config).unwrap().map(|s| s.count()), Some(2), "explicit islands win");
}

#[test]
fn relaxed_ordering_is_read_from_the_driver_parameters() {
    let on = "EnableMSI: 1\nEnablePCIERelaxedOrderingMode: 1\nRegisterPCIDriver: 1\n";
    let why = relaxed_ordering_in(on).expect("set");
    assert!(why.contains("EnablePCIERelaxedOrderingMode: 1"), "{why}");
    assert!(relaxed_ordering_in("EnablePCIERelaxedOrderingMode: 0\n").is_none());
    assert!(relaxed_ordering_in("EnableMSI: 1\n").is_none(), "absent: the driver's default, 0");
}
