//! Tests that need no GPU: shared layouts, partition math, configuration
//! and argument validation, naming, PTX choice, error messages.

use rand::{Rng, SeedableRng};
use tp_allreduce::{Algorithm, Config, DType, Transport};
use tp_allreduce_kernels::ids::{AlgorithmId, DeviceErrorCode, Phase};
use tp_allreduce_kernels::layout::{ErrorRecord, ScratchConfig, ScratchLayout, MAX_RANKS, PACK_BYTES};
use tp_allreduce_kernels::partition::{elems_in_pack, even_part, packs_for, push_grid, seq_geq};

fn scratch_config(world: u32, islands: &[u32]) -> ScratchConfig {
    let mut island_sizes = [0u32; MAX_RANKS];
    island_sizes[..islands.len()].copy_from_slice(islands);
    ScratchConfig {
        world_size: world,
        max_packs: (8 << 20) / 16,
        one_shot_push_max_packs: (512 << 10) / 16,
        ring_blocks: 4,
        ring_slots: 4,
        ring_chunk_packs: 4096,
        island_sizes,
        island_count: islands.len() as u32,
        copy_engine_pieces: 4,
        enable_two_shot_pull: true,
        enable_two_shot_push: true,
        enable_ring: true,
    }
}

#[test]
fn scratch_regions_are_disjoint_aligned_and_cover_their_largest_index() {
    for world in 2..=8u32 {
        let shapes: Vec<Vec<u32>> = vec![vec![], vec![world / 2, world - world / 2], vec![1, world - 1]];
        for islands in shapes {
            let cfg = scratch_config(world, &islands);
            let l = ScratchLayout::new(&cfg);
            let regions = [
                ("pull", l.two_shot_pull_offset, l.one_shot_push_offset),
                ("oneshot", l.one_shot_push_offset, l.two_shot_push_offset),
                ("push2", l.two_shot_push_offset, l.hierarchical_offset),
                ("hier", l.hierarchical_offset, l.ring_offset),
                ("ring", l.ring_offset, l.copy_engine_offset),
                ("ce staging", l.copy_engine_offset, l.copy_engine_flags_offset),
                ("ce flags", l.copy_engine_flags_offset, l.copy_engine_handshake_offset),
                ("ce handshake", l.copy_engine_handshake_offset, l.total_bytes),
            ];
            for (name, start, end) in regions {
                assert!(start <= end, "{name}: {start} > {end}");
                assert_eq!(start % 128, 0, "{name} not aligned");
            }
            // The last pack of each region lies inside it.
            let pk = PACK_BYTES as u64;
            // OneShotPush: half 1, slot world-2, last pack.
            let last_oneshot = l.one_shot_push_half_bytes
                + l.one_shot_push_slot_offset(world - 2)
                + (l.one_shot_push_max_packs - 1) * pk;
            assert!(last_oneshot + pk <= l.two_shot_push_offset);
            assert_eq!(l.one_shot_push_half_bytes, (world as u64 - 1) * cfg.one_shot_push_max_packs * pk);
            // TwoShotPush: 2 (world - 1) slots of a share per half, two halves.
            assert!(l.two_shot_push_share_packs * world as u64 >= cfg.max_packs);
            assert_eq!(l.two_shot_push_half_bytes, 2 * (world as u64 - 1) * l.two_shot_push_share_packs * pk);
            assert!(l.two_shot_push_offset + 2 * l.two_shot_push_half_bytes <= l.hierarchical_offset);
            // Hierarchical: only a supported split of two or more islands.
            let supported = islands.len() >= 2
                && islands.iter().all(|&n| n >= 1)
                && islands.iter().max().unwrap().div_ceil(*islands.iter().min().unwrap()) <= 4;
            if supported {
                assert_eq!(l.island_count, islands.len() as u32, "{islands:?}");
                assert!(l.hierarchical_share_packs * l.island_shares as u64 >= cfg.max_packs);
                assert!(l.hierarchical_offset + 2 * l.hierarchical_half_bytes <= l.ring_offset);
            } else {
                assert_eq!((l.island_count, l.hierarchical_half_bytes), (0, 0), "{islands:?}");
            }
            let last_ring = l.ring_slot_offset(l.ring_blocks - 1, l.ring_slots - 1) + l.ring_chunk_packs * pk;
            assert!(last_ring <= l.copy_engine_offset);
            // Copy-engine ring: a slot per step holds a whole shard; one
            // flag line per (step, piece).
            let steps = 2 * (world - 1);
            assert!(l.copy_engine_slot_bytes >= cfg.max_packs.div_ceil(world as u64) * pk);
            assert!(l.copy_engine_slot_offset(steps - 1) + l.copy_engine_slot_bytes <= l.copy_engine_flags_offset);
            assert!(l.copy_engine_flag_offset(steps - 1, 3) + 128 <= l.copy_engine_handshake_offset);
        }
    }
}

#[test]
fn hierarchical_needs_a_supported_split() {
    let l = ScratchLayout::new(&scratch_config(6, &[]));
    assert_eq!(l.island_count, 0, "no islands");
    let l = ScratchLayout::new(&scratch_config(8, &[2, 2, 2, 2]));
    assert_eq!((l.island_count, l.island_shares), (4, 2));
    let l = ScratchLayout::new(&scratch_config(6, &[4, 2]));
    assert_eq!((l.island_count, l.island_shares), (2, 4), "unequal islands");
    let l = ScratchLayout::new(&scratch_config(8, &[7, 1]));
    assert_eq!(l.island_count, 0, "the lone rank would own 7 shares");
    let l = ScratchLayout::new(&scratch_config(8, &[2, 2, 2, 1, 1]));
    assert_eq!(l.island_count, 0, "more than four islands");
}

#[test]
fn even_parts_cover_every_item_exactly_once() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    for _ in 0..2000 {
        let total = rng.gen_range(0..100_000u64);
        let parts = rng.gen_range(1..300u64);
        let mut next = 0;
        for i in 0..parts {
            let (start, len) = even_part(total, parts, i);
            if len > 0 {
                assert_eq!(start, next, "total {total} parts {parts} part {i}");
                next = start + len;
            }
            assert!(len <= total.div_ceil(parts));
        }
        assert_eq!(next, total, "total {total} parts {parts}");
    }
}

#[test]
fn packs_and_tails() {
    assert_eq!(packs_for(1, DType::Bf16), 1);
    assert_eq!(packs_for(8, DType::Bf16), 1);
    assert_eq!(packs_for(9, DType::Bf16), 2);
    assert_eq!(packs_for(5, DType::F32), 2);
    assert_eq!(elems_in_pack(9, 8, 1), 1);
    assert_eq!(elems_in_pack(9, 8, 0), 8);
    assert_eq!(elems_in_pack(9, 8, 2), 0);
    assert_eq!(elems_in_pack(16, 8, 1), 8);
}

#[test]
fn epoch_comparison_survives_wraparound() {
    assert!(seq_geq(5, 5));
    assert!(seq_geq(6, 5));
    assert!(!seq_geq(4, 5));
    assert!(seq_geq(0, u32::MAX), "0 follows u32::MAX");
    assert!(seq_geq(2, u32::MAX - 1));
    assert!(!seq_geq(u32::MAX, 0));
    // A counter incremented 2^32 + 3 times still compares right locally.
    let mut e: u32 = u32::MAX - 2;
    for _ in 0..10 {
        let next = e.wrapping_add(1);
        assert!(seq_geq(next, e) && !seq_geq(e, next));
        e = next;
    }
}

#[test]
fn push_grid_respects_stripes() {
    // 1000 packs, stripes of 300: at least 4 blocks needed.
    assert_eq!(push_grid(1000, 512, 300, 4), 4);
    assert_eq!(push_grid(1000, 512, 300, 3), 0, "does not fit");
    assert_eq!(push_grid(10, 512, 300, 4), 1);
    assert_eq!(push_grid(0, 512, 300, 4), 1);
    assert_eq!(push_grid(3000, 512, 1000, 8), 6);
}

#[test]
fn names_round_trip() {
    for a in Algorithm::ALL {
        assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
    }
    assert!("two_shot_push".parse::<Algorithm>().is_ok());
    let e = "fastest".parse::<Algorithm>().unwrap_err().to_string();
    assert!(e.contains("one-shot-push"), "{e}");
    assert_eq!("host-staged".parse::<Transport>().unwrap(), Transport::HostStaged);
    assert!("carrier-pigeon".parse::<Transport>().is_err());
    for a in Algorithm::OURS {
        let id = a.kernel().unwrap();
        assert_eq!(AlgorithmId::from_u32(id as u32), Some(id));
    }
}

#[test]
fn config_validation_names_the_field() {
    assert!(Config::default().validate().is_ok());
    for (cfg, field) in [
        (Config { push_blocks: 0, ..Config::default() }, "push_blocks"),
        (Config { pull_max_blocks: 10_000, ..Config::default() }, "pull_max_blocks"),
        (Config { max_chunk_bytes: 1000, ..Config::default() }, "max_chunk_bytes"),
        (Config { ring_chunk_bytes: 17, ..Config::default() }, "ring_chunk_bytes"),
        (
            Config {
                timeout: std::time::Duration::ZERO,
                launch_timeout: std::time::Duration::ZERO,
                ..Config::default()
            },
            "timeouts",
        ),
    ] {
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
}

#[test]
fn ptx_choice_follows_compute_capability() {
    let pick = |ma, mi| tp_allreduce::kernels::choose(ma, mi).map(|p| p.arch);
    assert_eq!(pick(12, 0), Some("sm_120"));
    assert_eq!(pick(12, 1), Some("sm_120"));
    assert_eq!(pick(10, 0), Some("sm_90"), "Blackwell datacenter JIT-compiles the sm_90 PTX");
    assert_eq!(pick(9, 0), Some("sm_90"));
    assert_eq!(pick(8, 9), Some("sm_89"));
    assert_eq!(pick(8, 6), Some("sm_80"));
    assert_eq!(pick(7, 5), None);
    let entries = tp_allreduce::kernels::expected_entries();
    // Every algorithm's kernel, the two-rank OneShotPush, sum and affine,
    // the ten fused-epilogue entries (six fused OneShotPush: any world or
    // two ranks with long or short rows, two ranks with wide rows, pushed by
    // their rows or spread; fused TwoShotPush and Hierarchical; fused
    // OneShotPull; add_rms_norm), per dtype; the P2P check; the copy-engine
    // ring's handshake and publish.
    assert_eq!(entries.len(), AlgorithmId::ALL.len() * 3 + 3 * 3 + 10 * 3 + 1 + 2);
}

#[test]
fn timeout_error_names_both_ranks_and_the_phase() {
    let rec = ErrorRecord {
        published: 1,
        code: DeviceErrorCode::Timeout as u32,
        algorithm: AlgorithmId::TwoShotPush as u32,
        phase: Phase::PushScatter as u32,
        rank: 2,
        peer: 5,
        block: 1,
        epoch: 77,
        expected: 77,
        observed: 76,
        waited_ns: 5_000_000_000,
        _pad: [0; 4],
    };
    let e = tp_allreduce::error::DeviceFailure::from_record(&rec).into_error();
    let msg = e.to_string();
    assert!(matches!(e, tp_allreduce::Error::Timeout(_)));
    for needle in ["rank 2", "rank 5", "push reduce-scatter", "two_shot_push", "5000.0 ms"] {
        assert!(msg.contains(needle), "missing {needle:?} in {msg}");
    }
}

#[test]
fn without_a_driver_init_fails_cleanly() {
    if tp_allreduce::driver::driver_available() {
        // Not a GPU requirement: visible, and never a failure.
        crate::common::skipped(
            "a driver is present; the no-driver path runs where there is none (without_a_driver_init_fails_cleanly)",
        );
        return;
    }
    let e = tp_allreduce::driver::require_driver().unwrap_err();
    assert!(matches!(e, tp_allreduce::Error::NoDriver(_)), "{e}");
    assert_eq!(tp_allreduce::driver::device_count(), 0);
}

#[test]
fn ring_slots_must_be_a_power_of_two() {
    // The ring indexes its FIFO with a wrapping u32 message counter modulo
    // ring_slots: only a power of two keeps the sequence across the wrap.
    for slots in [1u32, 2, 4, 8, 64] {
        assert!(Config { ring_slots: slots, ..Config::default() }.validate().is_ok(), "{slots}");
    }
    for slots in [0u32, 3, 5, 6, 12] {
        let e = Config { ring_slots: slots, ..Config::default() }.validate().unwrap_err().to_string();
        assert!(e.contains("ring_slots must be a power of two") && e.contains(&slots.to_string()), "{e}");
    }
    // Why: 2^32 % 3 != 0, so slot `n % 3` repeats at the wrap (u32::MAX and
    // 0, consecutive messages, both give slot 0); `n % 4` does not.
    let slot = |n: u32, k: u32| n % k;
    assert_eq!(slot(u32::MAX, 3), slot(0, 3));
    assert_ne!(slot(u32::MAX, 4), slot(0, 4));
}

#[test]
fn launch_shapes_parse_and_validate() {
    use tp_allreduce::env::{check_launch_shape, parse_launch_shape};
    assert_eq!(parse_launch_shape("64x512"), Ok((64, 512)));
    assert_eq!(parse_launch_shape(" 1X32 "), Ok((1, 32)));
    for bad in ["64", "x512", "64x", "0x256", "4x100", "4x2048", "4x0", "ax256"] {
        assert!(parse_launch_shape(bad).is_err(), "{bad}");
    }
    assert!(check_launch_shape((128, 1024)).is_ok());
    let e = Config { launch_shape: Some((4, 48)), ..Config::default() }.validate().unwrap_err().to_string();
    assert!(e.contains("launch_shape") && e.contains("multiple of 32"), "{e}");
}

#[test]
fn one_shot_push_capacity_follows_the_world_size() {
    let c = Config::default();
    assert_eq!(c.one_shot_push_max_bytes, Config::ONE_SHOT_PUSH_AUTO);
    assert_eq!(c.one_shot_push_capacity(2), 8 << 20);
    assert_eq!(c.one_shot_push_capacity(8), (8 << 20) / 7 / 16 * 16);
    for w in 2..=8 {
        let cap = c.one_shot_push_capacity(w);
        assert_eq!(cap % 16, 0);
        // Two halves of world-1 copies: at most 16 MiB of receive region.
        assert!(2 * (w - 1) * cap <= 16 << 20, "world {w}");
    }
    let fixed = Config { one_shot_push_max_bytes: 16 << 10, ..Config::default() };
    assert_eq!(fixed.one_shot_push_capacity(8), 16 << 10);
    assert!(Config { one_shot_push_max_bytes: 100, ..Config::default() }.validate().is_err());
}

/// Rust sources under `dir`, as (path relative to the repository, text).
fn sources(dir: &str) -> Vec<(String, String)> {
    fn walk(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(root, &path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                out.push((rel, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    let root = crate::common::repo();
    let mut out = Vec::new();
    walk(root, &root.join(dir), &mut out);
    out.sort();
    out
}

/// `unsafe` only in the driver, the call paths (allreduce and the
/// fused epilogue), shared memory and NCCL. The crate denies it and exactly
/// these files allow it back.
#[test]
fn unsafe_is_allowed_only_in_the_listed_rooms() {
    let lib = std::fs::read_to_string(crate::common::repo().join("host/lib.rs")).unwrap();
    assert!(lib.contains("#![deny(unsafe_code)]"), "host/lib.rs must deny unsafe code crate-wide");
    let allowed: Vec<String> = sources("host")
        .into_iter()
        .filter(|(_, text)| text.contains("#![allow(unsafe_code)]"))
        .map(|(path, _)| path)
        .collect();
    assert_eq!(allowed, ["host/comm/call/mod.rs", "host/comm/shm.rs", "host/driver.rs", "host/nccl.rs"]);
    // No per-item escape hatch either.
    for (path, text) in sources("host") {
        assert!(!text.contains("#[allow(unsafe_code)]"), "{path} allows unsafe code on an item");
    }
}
