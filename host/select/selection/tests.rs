//! Tests of the selection rules and the selection table.

use super::*;
use crate::select::topology::embedded;
use crate::select::tuning::{Measurement, TuningMeta};

fn sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (8..=25).map(|k| 1usize << k).collect();
    v.extend([43008, 3000, 100_000, 700_000]);
    v.sort_unstable();
    v
}

fn views() -> Vec<Topology> {
    let mut v = Vec::new();
    for name in embedded::names() {
        let t = embedded::by_name(name).unwrap();
        for world in [2, 3, 4, 6, 8] {
            if world <= t.len() {
                v.push(t.for_world(world).unwrap());
            }
        }
    }
    v
}

#[test]
fn overrides_win_in_order() {
    let view = embedded::default_topology();
    let mut c = Constraints::for_topology(&view);
    c.env_override = crate::env::parse_algorithm("ring").unwrap();
    let ch = select(&view, 8, DType::Bf16, 43008, true, &c);
    assert_eq!(ch.algorithm, Algorithm::Ring);
    assert_eq!(ch.source, Source::Override);
    assert!(ch.reason.contains("TP_ALLREDUCE_ALGORITHM"), "{}", ch.reason);
    c.communicator_override = Some(Algorithm::OneShotPull);
    let ch = select(&view, 8, DType::Bf16, 43008, true, &c);
    assert_eq!(ch.algorithm, Algorithm::OneShotPull, "forced even though slower than NCCL");
    assert!(ch.reason.contains("override"), "{}", ch.reason);
    // An override that cannot run is skipped, with the reason.
    let gpus = embedded::by_name("rtx-4090-8x-no-p2p").unwrap();
    let mut c = Constraints::for_topology(&gpus);
    c.communicator_override = Some(Algorithm::TwoShotPull);
    let ch = select(&gpus, 8, DType::Bf16, 43008, true, &c);
    assert_ne!(ch.algorithm, Algorithm::TwoShotPull);
    assert!(ch.reason.contains("not applicable"), "{}", ch.reason);
    c.env_override = Some(Algorithm::Nccl);
    assert_eq!(select(&gpus, 8, DType::Bf16, 43008, true, &c).algorithm, Algorithm::Nccl);
    assert!(crate::env::parse_algorithm("fastest").is_err());
}

#[test]
fn never_slower_than_nccl_on_pcie_with_more_than_two_ranks() {
    let model = CostModel::default();
    for view in views() {
        let c = Constraints::for_topology(&view);
        let n = view.len();
        for &bytes in &sizes() {
            for capturing in [true, false] {
                let ch = select(&view, n, DType::Bf16, bytes, capturing, &c);
                let opts = Options { capturing, islands: c.islands, nccl: NcclTuning::Tuned };
                let nccl = model.predict(&view, Algorithm::Nccl, c.transport, bytes, &opts).unwrap().total_us();
                assert!((ch.nccl_predicted_us - nccl).abs() < 1e-9);
                if ch.algorithm != Algorithm::Nccl && view.is_pcie() && n > 2 {
                    assert!(
                        ch.predicted_us < nccl,
                        "{} n={n} {bytes} B: picked {} at {:.1} us but NCCL is {:.1} us",
                        view.name,
                        ch.algorithm,
                        ch.predicted_us,
                        nccl
                    );
                }
                if ch.algorithm == Algorithm::OneShotPull && view.is_pcie() && n > 2 {
                    assert!(ch.predicted_us < nccl, "one-shot pull behind NCCL picked on {}", view.name);
                }
                // Whatever is picked is applicable.
                assert!(c.available(ch.algorithm, n, bytes).is_ok(), "{}: {}", view.name, ch);
            }
        }
    }
}

#[test]
fn one_shot_pull_is_not_picked_where_it_loses_to_nccl() {
    // The trap of docs/SOURCES.md [F4]: 8 PCIe GPUs over two sockets, 42 KB.
    let view = embedded::default_topology();
    let mut c = Constraints::for_topology(&view);
    // Even with every other algorithm of ours disabled.
    c.disabled = vec![
        Algorithm::TwoShotPull,
        Algorithm::OneShotPush,
        Algorithm::TwoShotPush,
        Algorithm::Ring,
        Algorithm::Hierarchical,
        Algorithm::PipelinedHierarchical,
    ];
    let ch = select(&view, 8, DType::Bf16, 43008, true, &c);
    assert_eq!(ch.algorithm, Algorithm::Nccl, "{ch}");
    assert!(ch.reason.contains("PCIe with 8 ranks"), "{}", ch.reason);
    // Without NCCL, the fastest of ours, and the reason says so.
    c.nccl_available = false;
    let ch = select(&view, 8, DType::Bf16, 43008, true, &c);
    assert_eq!(ch.algorithm, Algorithm::OneShotPull);
    assert!(ch.reason.contains("NCCL unavailable"), "{}", ch.reason);
}

#[test]
fn no_p2p_picks_host_staged_push_or_nccl() {
    let view = embedded::by_name("rtx-4090-8x-no-p2p").unwrap();
    let c = Constraints::for_topology(&view);
    assert_eq!(c.transport, Transport::HostStaged);
    let mut ours = 0;
    for &bytes in &sizes() {
        let ch = select(&view, 8, DType::F16, bytes, true, &c);
        assert!(
            ch.algorithm == Algorithm::Nccl
                || (ch.transport == Transport::HostStaged && ch.algorithm.supports_host_staged()),
            "{bytes}: {ch}"
        );
        ours += usize::from(ch.algorithm != Algorithm::Nccl);
    }
    assert!(ours > 0, "host-staged push should win somewhere against NCCL over host memory");
}

#[test]
fn motivating_machine_beats_nccl_at_42_kb() {
    let view = embedded::default_topology();
    let ch = select(&view, 8, DType::Bf16, 43008, true, &Constraints::for_topology(&view));
    assert_ne!(ch.algorithm, Algorithm::Nccl, "{ch}");
    assert_ne!(ch.algorithm, Algorithm::OneShotPull);
    assert!(ch.predicted_us * 1.5 < ch.nccl_predicted_us, "{ch}");
}

#[test]
fn shared_device_has_no_nccl_and_still_chooses() {
    let one = embedded::by_name("h200-8x-nvswitch").unwrap().for_ranks(&[0]).unwrap();
    let c = Constraints::for_topology(&one.for_world(4).unwrap());
    assert!(!c.nccl_available);
    let ch = select(&one, 4, DType::Bf16, 43008, true, &c);
    assert_ne!(ch.algorithm, Algorithm::Nccl, "{ch}");
    assert!(ch.reason.contains("NCCL unavailable"), "{}", ch.reason);
    let single = select(&one, 1, DType::Bf16, 4096, true, &Constraints::for_topology(&one));
    assert!(single.predicted_us.is_finite());
}

#[test]
fn tuning_measurements_replace_predictions() {
    let view = embedded::default_topology();
    let c = Constraints::for_topology(&view);
    let meta = TuningMeta::for_topology(&view, "test");
    let m = |algorithm, median_us| Measurement {
        bucket_bytes: 65536,
        dtype: DType::Bf16,
        algorithm,
        transport: Transport::PeerToPeer,
        median_us,
        shape: None,
    };
    // Measured: ring clearly beats NCCL, hierarchical is slow here.
    let table = TuningTable::from_measurements(
        meta.clone(),
        vec![
            m(Algorithm::Ring, 9.0),
            m(Algorithm::Hierarchical, 40.0),
            m(Algorithm::PipelinedHierarchical, 40.0),
            m(Algorithm::Nccl, 20.0),
        ],
    )
    .unwrap();
    let ch = select_with(&CostModel::default(), Some(&table), &view, 8, DType::Bf16, 43008, true, &c);
    assert_eq!((ch.algorithm, ch.source), (Algorithm::Ring, Source::Tuning), "{ch}");
    // Measured: everything of ours behind NCCL -> NCCL, even where the
    // model would pick ours.
    let all = [
        Algorithm::OneShotPull,
        Algorithm::TwoShotPull,
        Algorithm::OneShotPush,
        Algorithm::TwoShotPush,
        Algorithm::Ring,
        Algorithm::Hierarchical,
        Algorithm::PipelinedHierarchical,
    ];
    let mut ms: Vec<Measurement> = all.iter().map(|&a| m(a, 30.0)).collect();
    ms.push(m(Algorithm::Nccl, 25.0));
    let table = TuningTable::from_measurements(meta, ms).unwrap();
    let ch = select_with(&CostModel::default(), Some(&table), &view, 8, DType::Bf16, 43008, true, &c);
    assert_eq!(ch.algorithm, Algorithm::Nccl, "{ch}");
    assert_eq!(ch.source, Source::Tuning);
    // Past the table, where NCCL won the largest measured size: NCCL.
    let ch = select_with(&CostModel::default(), Some(&table), &view, 8, DType::Bf16, 1 << 22, true, &c);
    assert_eq!((ch.algorithm, ch.source), (Algorithm::Nccl, Source::Tuning), "{ch}");
    // Another dtype has no entries at all: the model decides.
    let ch = select_with(&CostModel::default(), Some(&table), &view, 8, DType::F32, 1 << 22, true, &c);
    assert_eq!(ch.source, Source::Model);
}

/// Issue 13 item 5, as seen on 2 H200s: the tuning table ended at
/// 16 MB with NCCL winning there, and `auto` picked one-shot-pull for
/// 32-64 MB (0.70-0.78x NCCL). Past the table the rule "never slower
/// than NCCL" must hold: NCCL where NCCL won the largest measured size.
#[test]
fn past_the_tuning_table_nccl_stays_when_it_won_the_last_bucket() {
    let view = embedded::by_name("h200-8x-nvswitch").unwrap().for_world(2).unwrap();
    let c = Constraints::for_topology(&view);
    let model = CostModel::default();
    let m = |bucket_bytes, algorithm, median_us| Measurement {
        bucket_bytes,
        dtype: DType::Bf16,
        algorithm,
        transport: Transport::PeerToPeer,
        median_us,
        shape: None,
    };
    let table = TuningTable::from_measurements(
        TuningMeta::for_topology(&view, "test"),
        vec![
            m(1 << 20, Algorithm::OneShotPull, 10.0),
            m(1 << 20, Algorithm::Nccl, 14.0),
            m(16 << 20, Algorithm::OneShotPull, 130.0),
            m(16 << 20, Algorithm::Nccl, 120.0),
        ],
    )
    .unwrap();
    for bytes in [32 << 20, 64 << 20] {
        // Precondition (what made the old selection wrong): the model
        // alone prefers one of ours at this size.
        let modelled = select_with(&model, None, &view, 2, DType::Bf16, bytes, true, &c);
        assert_ne!(modelled.algorithm, Algorithm::Nccl, "precondition: {modelled}");
        let ch = select_with(&model, Some(&table), &view, 2, DType::Bf16, bytes, true, &c);
        assert_eq!(ch.algorithm, Algorithm::Nccl, "{bytes} B: {ch}");
        assert!(ch.reason.contains("beyond the tuning table"), "{}", ch.reason);
        // The table built at init agrees.
        let built = SelectionTable::build(&model, Some(&table), &view, &c);
        assert_eq!(built.lookup(bytes, DType::Bf16, true).algorithm, Algorithm::Nccl);
    }
    // Where ours won the largest measured size, the model decides past it.
    let table = TuningTable::from_measurements(
        TuningMeta::for_topology(&view, "test"),
        vec![m(16 << 20, Algorithm::OneShotPull, 100.0), m(16 << 20, Algorithm::Nccl, 120.0)],
    )
    .unwrap();
    let ch = select_with(&model, Some(&table), &view, 2, DType::Bf16, 32 << 20, true, &c);
    assert_eq!(ch.source, Source::Model, "{ch}");
}

#[test]
fn table_uses_tuning_only_where_measured() {
    let view = embedded::default_topology();
    let c = Constraints::for_topology(&view);
    let meta = TuningMeta::for_topology(&view, "test");
    let m = |algorithm, median_us| Measurement {
        bucket_bytes: 65536,
        dtype: DType::Bf16,
        algorithm,
        transport: Transport::PeerToPeer,
        median_us,
        shape: None,
    };
    // Ring measured fastest; every other algorithm of ours measured slower,
    // so the measured bucket's choice does not depend on the model.
    let mut measured: Vec<Measurement> =
        Algorithm::OURS.iter().filter(|&&a| a != Algorithm::Ring).map(|&a| m(a, 30.0)).collect();
    measured.extend([m(Algorithm::Ring, 9.0), m(Algorithm::Nccl, 20.0)]);
    let tuning = TuningTable::from_measurements(meta, measured).unwrap();
    let model = CostModel::default();
    let table = SelectionTable::build(&model, Some(&tuning), &view, &c);
    for dtype in DType::ALL {
        for bytes in [4096, 43008, 65536, 1 << 20] {
            let direct = select_with(&model, Some(&tuning), &view, 8, dtype, bytes, true, &c);
            let i = table.bounds().partition_point(|&b| b < bytes);
            let at = table.bounds()[i];
            let expected = select_with(&model, Some(&tuning), &view, 8, dtype, at, true, &c);
            assert_eq!(table.lookup(bytes, dtype, true), &expected);
            if dtype == DType::Bf16 && bytes == 43008 {
                assert_eq!(direct.algorithm, Algorithm::Ring);
                assert_eq!(table.lookup(bytes, dtype, true).source, Source::Tuning);
            }
        }
    }
    assert_eq!(table.lookup(43008, DType::F32, true).source, Source::Model);
}

#[test]
fn table_lookup_matches_select_at_bounds() {
    let view = embedded::default_topology();
    let c = Constraints::for_topology(&view);
    let table = SelectionTable::build(&CostModel::default(), None, &view, &c);
    let bounds = table.bounds().to_vec();
    assert!(bounds.windows(2).all(|w| w[0] < w[1]));
    for (i, &b) in bounds.iter().enumerate().filter(|(_, &b)| b != usize::MAX) {
        for dtype in DType::ALL {
            let direct = select(&view, 8, dtype, b, true, &c);
            assert_eq!(table.lookup(b, dtype, true), &direct);
            // Anything in (previous bound, bound] maps to this bucket.
            let lo = if i == 0 { 0 } else { bounds[i - 1] + 1 };
            assert_eq!(table.lookup(lo, dtype, true), &direct);
        }
    }
    assert_eq!(
        table.lookup(usize::MAX, DType::F32, false).algorithm,
        table.lookup(1 << 30, DType::F32, false).algorithm
    );
    assert_eq!(table.digest(), SelectionTable::build(&CostModel::default(), None, &view, &c).digest());
    let mut forced = c.clone();
    forced.communicator_override = Some(Algorithm::Ring);
    assert_ne!(table.digest(), SelectionTable::build(&CostModel::default(), None, &view, &forced).digest());
    assert!(table.describe(DType::Bf16, true).contains("larger"));
}

#[test]
fn collective_table_takes_the_faster_of_ours_and_nccls_ring() {
    let model = CostModel::default();
    for view in views() {
        let c = Constraints::for_topology(&view);
        let table = CollectiveTable::build(&model, &view, &c);
        for collective in [Collective::AllGather, Collective::ReduceScatter] {
            for capturing in [false, true] {
                for &bytes in &sizes() {
                    let e = *table.lookup(collective, bytes, capturing).unwrap();
                    let ours = Algorithm::OURS.into_iter().find(|a| a.collective() == collective).unwrap();
                    if !c.nccl_available {
                        assert_eq!(e.algorithm, ours, "{} {bytes}: no NCCL, ours", view.name);
                    } else if e.algorithm == ours {
                        assert!(e.ours_us <= e.nccl_us * (1.0 - MODEL_MARGIN), "{} {bytes}: {e:?}", view.name);
                    } else {
                        assert_eq!(e.algorithm, Algorithm::Nccl);
                        assert!(e.ours_us.is_nan() || e.ours_us > e.nccl_us * (1.0 - MODEL_MARGIN), "{e:?}");
                    }
                }
            }
        }
        assert!(table.lookup(Collective::AllReduce, 4096, true).is_none());
    }
}

#[test]
fn collective_table_on_the_motivating_machine() {
    let view = embedded::default_topology();
    let c = Constraints::for_topology(&view);
    let table = CollectiveTable::build(&CostModel::default(), &view, &c);
    // One hop beats the ring's 2(N-1) steps on small blocks; the ring's
    // single flows across the socket boundary win on large ones.
    assert_eq!(table.lookup(Collective::AllGather, 4 << 10, true).unwrap().algorithm, Algorithm::AllGatherPush);
    assert_eq!(table.lookup(Collective::ReduceScatter, 4 << 10, true).unwrap().algorithm, Algorithm::ReduceScatterPush);
    assert_eq!(table.lookup(Collective::AllGather, 8 << 20, true).unwrap().algorithm, Algorithm::Nccl);
    let without_nccl = Constraints { nccl_available: false, ..c };
    let table = CollectiveTable::build(&CostModel::default(), &view, &without_nccl);
    assert_eq!(table.lookup(Collective::AllGather, 8 << 20, true).unwrap().algorithm, Algorithm::AllGatherPush);
    assert!(table.describe(Collective::ReduceScatter, false).contains("reduce-scatter-push"));
}
