//! Tests of the cost model.

use super::*;
use crate::select::topology::embedded;

fn sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (0..=24).map(|k| 1usize << k).collect();
    v.push(43008);
    v.push(3000);
    v.sort_unstable();
    v
}

#[test]
fn calibration_within_25_percent() {
    let model = CostModel::default();
    let table = residual_table(&model);
    for r in residuals(&model) {
        assert!(
            r.relative.abs() <= 0.25,
            "{} {:?} {} B: model {:.2} vs target {:.2} ({:+.1} %)\n{table}",
            r.point.topology,
            r.point.subject,
            r.point.bytes,
            r.predicted,
            r.target,
            100.0 * r.relative
        );
    }
}

#[test]
fn monotone_in_bytes_for_every_algorithm_and_topology() {
    let model = CostModel::default();
    for name in embedded::names() {
        let topo = embedded::by_name(name).unwrap();
        for world in [2, 4, 8] {
            let view = topo.for_world(world).unwrap();
            for capturing in [true, false] {
                let opts = Options { capturing, ..Options::for_topology(&view) };
                for transport in [Transport::PeerToPeer, Transport::HostStaged] {
                    for a in Algorithm::ALL {
                        let mut last = 0.0;
                        for &bytes in &sizes() {
                            let Ok(p) = model.predict(&view, a, transport, bytes, &opts) else {
                                continue;
                            };
                            let t = p.total_us();
                            assert!(t.is_finite() && t > 0.0, "{name} {world} {a} {bytes}: {t}");
                            assert!(
                                t >= last - 1e-9,
                                "{name} world {world} {a} {transport}: {bytes} B gives {t} < {last}"
                            );
                            last = t;
                        }
                    }
                    for v in NcclVariant::ALL {
                        let mut last = 0.0;
                        for &bytes in &sizes() {
                            let t = model.predict_nccl(&view, v, transport, bytes, &opts).total_us();
                            assert!(t >= last - 1e-9, "{name} {v}: {bytes} B");
                            last = t;
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn breakdown_adds_up_and_is_non_negative() {
    let model = CostModel::default();
    let view = embedded::default_topology();
    let opts = Options::for_topology(&view);
    for a in Algorithm::ALL {
        let p = model.predict(&view, a, Transport::PeerToPeer, 43008, &opts).unwrap();
        let b = p.breakdown;
        for part in [b.launch_us, b.latency_us, b.wire_us, b.contention_us, b.local_us] {
            assert!(part >= 0.0, "{a}: {b}");
        }
        assert!((b.total() - p.total_us()).abs() < 1e-12);
    }
}

#[test]
fn bytes_moved_follow_the_algorithms() {
    // Wire time on a uniform switch (no socket, no uplink): one-shot
    // sends (N-1)·S per rank, two-shot 2(N-1)/N·S: ratio N/2.
    let model = CostModel::default();
    let view = embedded::by_name("rtx-pro-6000-4x-switch").unwrap();
    let opts = Options::for_topology(&view);
    let s = 1 << 20;
    let one = model.predict(&view, Algorithm::OneShotPush, Transport::PeerToPeer, s, &opts).unwrap().breakdown.wire_us;
    let two = model.predict(&view, Algorithm::TwoShotPush, Transport::PeerToPeer, s, &opts).unwrap().breakdown.wire_us;
    assert!((one / two - 2.0).abs() < 1e-9, "{one} {two}");
    let ring = model.predict(&view, Algorithm::Ring, Transport::PeerToPeer, s, &opts).unwrap().breakdown.wire_us;
    // Same bytes as two-shot, at the ring pipeline's efficiency.
    let eff = model.params.ring_efficiency;
    assert!((ring * eff - two).abs() < 1e-9, "{ring} {two}");
}

#[test]
fn reads_suffer_more_than_writes_and_the_socket_is_the_weak_link() {
    let model = CostModel::default();
    let view = embedded::default_topology();
    let opts = Options::for_topology(&view);
    let s = 43008;
    let pull = model.predict(&view, Algorithm::OneShotPull, Transport::PeerToPeer, s, &opts).unwrap();
    let push = model.predict(&view, Algorithm::OneShotPush, Transport::PeerToPeer, s, &opts).unwrap();
    assert!(pull.breakdown.contention_us > push.breakdown.contention_us);
    let flat = model.predict(&view, Algorithm::TwoShotPush, Transport::PeerToPeer, s, &opts).unwrap();
    let hier = model.predict(&view, Algorithm::Hierarchical, Transport::PeerToPeer, s, &opts).unwrap();
    assert!(hier.breakdown.contention_us < flat.breakdown.contention_us, "{} vs {}", hier.breakdown, flat.breakdown);
}

#[test]
fn host_staged_pays_the_host_latency() {
    let model = CostModel::default();
    let view = embedded::by_name("rtx-4090-8x-no-p2p").unwrap();
    let opts = Options::for_topology(&view);
    let push = model.predict(&view, Algorithm::OneShotPush, Transport::HostStaged, 4096, &opts).unwrap();
    assert!(push.breakdown.latency_us >= model.params.latency_host_staged_us);
    assert!(model.predict(&view, Algorithm::OneShotPull, Transport::HostStaged, 4096, &opts).is_err());
    assert!(model.predict(&view, Algorithm::OneShotPush, Transport::PeerToPeer, 4096, &opts).is_err());
    let nccl = model.predict_nccl_best(&view, Transport::HostStaged, 4096, &opts);
    assert_eq!(nccl.transport, Transport::HostStaged);
}

#[test]
fn parameter_table_is_complete_and_documented() {
    let p = CostParams::default();
    let rows = p.table();
    let json = serde_json::to_value(&p).unwrap();
    let fields = json.as_object().unwrap();
    assert_eq!(rows.len(), fields.len(), "every field has a table row");
    let doc = include_str!("../../../docs/COST-MODEL.md");
    assert!(
        doc.contains(&p.markdown_table()),
        "docs/COST-MODEL.md: parameter table out of date:\n{}",
        p.markdown_table()
    );
    let residuals = residual_table(&CostModel::default());
    assert!(doc.contains(&residuals), "docs/COST-MODEL.md: residual table out of date:\n{residuals}");
    for r in &rows {
        assert!(fields.contains_key(r.name), "{} is not a field", r.name);
        assert!(doc.contains(&format!("`{}`", r.name)), "docs/COST-MODEL.md does not list `{}`", r.name);
    }
}

/// Issue 15: the new recipes on the 8x RTX PRO 6000 (4+4 islands from the
/// topology): payload completion costs one hop per phase (two-shot push 2,
/// hierarchical 3: switch, socket, switch); the copy-engine ring pays its
/// step per hop and moves the ring's bytes at the copy engines' rate; with
/// the per-pair transport the cross-island hop goes through host memory.
#[test]
fn island_push_and_copy_engine_ring_recipes() {
    let model = CostModel::default();
    let p = &model.params;
    let view = embedded::default_topology();
    let opts = Options::for_topology(&view);
    assert_eq!(opts.islands.map(|i| i.groups()), Some(vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]));
    let predict = |a: Algorithm, t: Transport, view: &Topology, bytes: usize| {
        model.predict(view, a, t, bytes, &Options::for_topology(view)).unwrap().breakdown
    };
    let switch = p.latency_pcie_switch_us + p.hop_overhead_us;
    let socket = p.latency_pcie_cross_socket_us + p.hop_overhead_us;
    let two = predict(Algorithm::TwoShotPush, Transport::PeerToPeer, &view, 43008);
    assert!((two.latency_us - 2.0 * socket).abs() < 1e-9, "{two}");
    let hier = predict(Algorithm::Hierarchical, Transport::PeerToPeer, &view, 43008);
    assert!((hier.latency_us - (2.0 * switch + socket)).abs() < 1e-9, "{hier}");
    assert!(hier.total() < two.total(), "hierarchical {hier} vs two-shot {two}");
    // Copy-engine ring: 14 steps, each its step overhead + a mean edge
    // latency; at 8 MiB its data time follows copy_engine_efficiency.
    let ce = predict(Algorithm::CopyEngineRing, Transport::PeerToPeer, &view, 8 << 20);
    let ring = predict(Algorithm::Ring, Transport::PeerToPeer, &view, 8 << 20);
    assert!(ce.latency_us > 14.0 * p.copy_engine_step_us, "{ce}");
    let wire =
        2.0 * 7.0 / 8.0 * (8 << 20) as f64 / (CostParams::pcie_lane_gbps(5) * 16.0 * p.copy_engine_efficiency * 1e3);
    assert!((ce.wire_us - wire).abs() / wire < 1e-6, "{ce} vs {wire}");
    assert!(ce.total() < ring.total(), "copy-engine ring {ce} vs SM ring {ring} at 8 MiB");
    // Per pair: no P2P across the sockets; hierarchical still runs, its
    // cross hop through host memory, and nothing else of ours does.
    let mut split = view.clone();
    for a in 0..8 {
        for b in 0..8 {
            if a / 4 != b / 4 {
                split.pairs[a][b].p2p_supported = false;
            }
        }
    }
    let c = crate::select::selection::Constraints::for_topology(&split);
    assert_eq!(c.transport, Transport::PerPair);
    let per_pair = predict(Algorithm::Hierarchical, Transport::PerPair, &split, 43008);
    let host = p.latency_host_staged_us + p.hop_overhead_us;
    assert!((per_pair.latency_us - (2.0 * switch + host)).abs() < 1e-9, "{per_pair}");
    for a in [Algorithm::OneShotPush, Algorithm::TwoShotPush, Algorithm::CopyEngineRing] {
        assert!(c.available(a, 8, 43008).is_err(), "{a}");
    }
    assert!(c.available(Algorithm::Hierarchical, 8, 43008).is_ok());
}
