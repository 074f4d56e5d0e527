//! The copy-engine ring on the CPU: every rank's program ends with every
//! shard reduced, pieces cover the shards and fit the staging, and copies,
//! flags and step kernels match across ranks.

use tp_allreduce_kernels::layout::{ScratchConfig, ScratchLayout, MAX_RANKS};

use super::*;

/// Runs the program of every rank on the CPU with exact sums: after the
/// reduce-scatter each shard is complete on exactly one rank, after the
/// all-gather everywhere; each step's incoming shard is what the
/// previous rank sent in the same step.
#[test]
fn every_rank_ends_with_every_shard_reduced() {
    for world in 2..=8usize {
        let plans: Vec<CopyEnginePlan> = (0..world).map(|q| CopyEnginePlan::new(q, world, 1000, 1)).collect();
        // contributions[q][c]: the set of ranks summed into q's shard c.
        let mut out: Vec<Vec<u32>> = vec![vec![0; world]; world];
        for (q, row) in out.iter_mut().enumerate() {
            row[q] = 1 << q;
        }
        let input: Vec<Vec<u32>> = (0..world).map(|q| vec![1 << q; world]).collect();
        for s in 0..2 * (world - 1) {
            let sent: Vec<(usize, u32)> = (0..world)
                .map(|q| {
                    let st = plans[q].steps[s];
                    (st.send, if st.from_input { input[q][st.send] } else { out[q][st.send] })
                })
                .collect();
            for q in 0..world {
                let st = plans[q].steps[s];
                let prev = (q + world - 1) % world;
                assert_eq!(sent[prev].0, st.recv, "world {world} step {s} rank {q}");
                out[q][st.recv] =
                    if st.mode == CE_MODE_REDUCE { input[q][st.recv] | sent[prev].1 } else { sent[prev].1 };
            }
            if s == world - 2 {
                for q in 0..world {
                    assert_eq!(out[q][(q + 1) % world], (1 << world) - 1, "rank {q} owns shard q+1 after RS");
                }
            }
        }
        assert!(out.iter().flatten().all(|&v| v == (1 << world) - 1), "world {world}: {out:?}");
    }
}

#[test]
fn pieces_cover_every_shard_and_fit_the_staging() {
    for (packs, world, pieces) in [(1u64, 2usize, 1u32), (17, 3, 2), (100_003, 8, 4), (8, 8, 4)] {
        let plan = CopyEnginePlan::new(0, world, packs, pieces);
        let mut seen = vec![0u32; packs as usize];
        for c in 0..world {
            for p in 0..pieces {
                let (first, len, offset) = plan.piece(c, p);
                assert!((offset + len) * 16 <= plan.shard_bytes_max());
                for i in first..first + len {
                    seen[i as usize] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{packs} packs, {world} ranks, {pieces} pieces");
    }
    assert_eq!(CopyEnginePlan::elements(2, 3, 37, 8), (16, 21));
    assert_eq!(CopyEnginePlan::elements(4, 3, 37, 8), (32, 5));
    assert_eq!(pieces_for(1 << 20, 8), 1);
    assert_eq!(pieces_for(8 << 20, 8), 2);
    assert_eq!(pieces_for(64 << 20, 8), 4);
    assert_eq!(pieces_for(4 << 20, 2), 4);
}

fn memory(world: usize) -> RankMemory {
    let layout = ScratchLayout::new(&ScratchConfig {
        world_size: world as u32,
        max_packs: 4096,
        one_shot_push_max_packs: 16,
        ring_blocks: 1,
        ring_slots: 2,
        ring_chunk_packs: 8,
        island_sizes: [0; MAX_RANKS],
        island_count: 0,
        copy_engine_pieces: CE_MAX_PIECES,
        enable_two_shot_pull: true,
        enable_two_shot_push: true,
        enable_ring: true,
    });
    RankMemory {
        region_bases: (0..world).map(|r| 0x7000_0000_0000 + r as u64 * 0x1_0000_0000).collect(),
        scratch_offset: 0x1000,
        layout,
        local_state: 0x10_000,
        error_record: 0x20_000,
    }
}

/// Every copy lands in the slot whose step kernel reads it at the next
/// rank, with the same bytes; every published flag is one that rank
/// waits on, once; every flag waited on is published; staging stays in
/// its step's slot; the call ends with exactly one handshake.
#[test]
fn copies_flags_and_step_kernels_match_across_ranks() {
    for world in 2..=8usize {
        for count in [1u64, 9, 1000, 4096 * 8 - 3] {
            let mem = memory(world);
            let split = (world == 8).then(|| IslandSplit::consecutive(4, 8).unwrap());
            let t: Vec<CopyEngineTemplate> =
                (0..world).map(|r| CopyEngineTemplate::new(r, &mem, split, 1)).collect();
            let progs: Vec<Vec<CopyEngineOp>> =
                t.iter().map(|t| t.program((0x1_0000, 0x9_0000, count), DType::Bf16, 2, |_| (1, 256))).collect();
            for (r, prog) in progs.iter().enumerate() {
                assert_eq!(prog.first().map(|o| matches!(o, CopyEngineOp::Handshake(_))), Some(true));
                assert_eq!(prog.last(), Some(&CopyEngineOp::Join));
                let lasts =
                    prog.iter().filter(|o| matches!(o, CopyEngineOp::Step { params, .. } if params.last == 1));
                assert_eq!(lasts.count(), 1, "world {world} rank {r}");
                let copies: Vec<(u64, usize, u64)> = prog
                    .windows(2)
                    .filter_map(|w| match (w[0], w[1]) {
                        (CopyEngineOp::Copy { dst, bytes, .. }, CopyEngineOp::Publish { flag }) => {
                            Some((dst, bytes, flag))
                        }
                        _ => None,
                    })
                    .collect();
                let next = t[r].next.0 as usize;
                let waits: Vec<(u64, u64)> = progs[next]
                    .iter()
                    .filter_map(|o| match o {
                        CopyEngineOp::Step { params, .. } => Some((params.staging, params.flag)),
                        _ => None,
                    })
                    .collect();
                assert_eq!(copies.len(), waits.len(), "world {world} count {count}: rank {r} -> {next}");
                for ((dst, bytes, flag), (staging, waited)) in copies.iter().zip(&waits) {
                    assert_eq!((dst, flag), (staging, waited), "world {world} count {count} rank {r}");
                    let slot = (dst - t[next].own_staging) / t[next].slot_bytes;
                    let end = t[next].own_staging + (slot + 1) * t[next].slot_bytes;
                    assert!(dst + *bytes as u64 <= end, "a copy overruns its step's slot");
                }
            }
        }
    }
}

#[test]
fn the_ring_crosses_each_island_boundary_once_per_direction() {
    let split = IslandSplit::from_groups(&[vec![0, 2, 4, 6], vec![1, 3, 5, 7]], 8).unwrap();
    let order = ring_order(8, Some(split));
    assert_eq!(order, vec![0, 2, 4, 6, 1, 3, 5, 7]);
    let crossings = (0..8).filter(|&i| !split.together(order[i], order[(i + 1) % 8])).count();
    assert_eq!(crossings, 2);
    assert_eq!(ring_order(3, None), vec![0, 1, 2]);
}
