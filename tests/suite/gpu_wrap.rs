//! Protocol counters across the u32 wrap (issue 13 item 1): every counter
//! (OneShotPush generation, per-block epochs and flags, ring message
//! counters) starts at `0xFFFF_FF00` through `Config::test_initial_counter`,
//! and thousands of calls per algorithm cross 2^32, every result checked
//! against the f64 reference (fresh random inputs, poisoned outputs, ranks
//! bitwise equal). 2 ranks (hierarchical: 4 ranks in islands of 2), one per
//! GPU when two GPUs are visible, else sharing GPU 0.
//!
//! On the old OneShotPush (`slot = epoch % 3`, re-arm `(epoch + 2) % 3`)
//! the same seed fails within the first 260 calls: at epoch 0xFFFFFFFE the
//! kernel re-arms slot 0, which a fast peer already writes for epoch
//! 0xFFFFFFFF (→ `Error::Timeout`), and epoch 0 reuses slot 0 without a
//! re-arm (→ the peer's previous payload is summed: a wrong result).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use rand::rngs::StdRng;
use rand::Rng;
use tp_allreduce::driver;
use tp_allreduce::{Algorithm, Comm, Config};

use crate::common::{self, TestElem};

/// Counters start 256 calls before the wrap.
const SEED: u32 = 0xFFFF_FF00;
/// Calls per algorithm, issued in batches (one host check per batch).
const CALLS: usize = 2048;
const BATCH: usize = 64;
/// Largest message of a call (elements of the largest type's size).
const MAX_BYTES: usize = 48 << 10;

/// GPU of each rank: one per GPU when two are visible.
fn contexts(first: &Arc<CudaContext>, world: usize) -> Vec<Arc<CudaContext>> {
    let second = if driver::device_count() >= 2 {
        let c = CudaContext::new(1).expect("CudaContext::new(1)");
        // SAFETY: as for device 0 (common::gpu): explicit stream ordering.
        unsafe { c.disable_event_tracking() };
        c
    } else {
        first.clone()
    };
    (0..world).map(|r| if r < world / 2 { first.clone() } else { second.clone() }).collect()
}

/// One batch of `BATCH` calls of random sizes on every rank; checks all.
/// Returns the element counts of the calls. Buffers go through each rank's
/// own stream (cudarc binds the rank's context), so ranks may sit on
/// different GPUs.
fn batch<T: TestElem + bytemuck::Pod>(
    comms: &[Comm],
    rng: &mut StdRng,
    algorithm: Algorithm,
) -> Result<Vec<usize>, String> {
    let world = comms.len();
    let elem = std::mem::size_of::<T>();
    let counts: Vec<usize> = (0..BATCH).map(|_| rng.gen_range(1..=MAX_BYTES / elem)).collect();
    let offsets: Vec<usize> = counts.iter().scan(0, |o, &n| Some(std::mem::replace(o, *o + n))).collect();
    let total: usize = counts.iter().sum();
    let inputs: Vec<Vec<T>> = (0..world).map(|_| common::random_vec::<T>(rng, total)).collect();
    let mut poison: Vec<T> = vec![T::zeroed(); total];
    bytemuck::cast_slice_mut::<T, u8>(&mut poison).fill(common::POISON);
    let mut ins = Vec::new();
    let mut outs = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        let s = c.stream();
        ins.push(s.clone_htod(&inputs[r]).map_err(|e| format!("rank {r}: htod: {e:?}"))?);
        outs.push(s.clone_htod(&poison).map_err(|e| format!("rank {r}: htod: {e:?}"))?);
    }
    for (&n, &at) in counts.iter().zip(&offsets) {
        for (r, c) in comms.iter().enumerate() {
            let s = c.stream();
            let (src, dst) = (common::ptr_of(&s, &ins[r], at), common::ptr_of(&s, &outs[r], at));
            // SAFETY: both views lie inside live buffers of `total` elements
            // on the rank's stream.
            unsafe { c.all_reduce_raw(src, dst, n, T::DTYPE, s.cu_stream()) }.map_err(|e| format!("rank {r}: {e}"))?;
        }
    }
    let mut results = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        c.synchronize().map_err(|e| format!("rank {r}: {e}"))?;
        results.push(c.stream().clone_dtoh(&outs[r]).map_err(|e| format!("rank {r}: dtoh: {e:?}"))?);
    }
    for (k, (&n, &at)) in counts.iter().zip(&offsets).enumerate() {
        let call_inputs: Vec<Vec<T>> = inputs.iter().map(|v| v[at..at + n].to_vec()).collect();
        for (r, out) in results.iter().enumerate() {
            common::check_sum(&call_inputs, &out[at..at + n], algorithm.max_roundings(world))
                .map_err(|e| format!("call {k} ({n} elements), rank {r}: {e}"))?;
            if common::bits(&out[at..at + n]) != common::bits(&results[0][at..at + n]) {
                return Err(format!("call {k} ({n} elements): rank {r} differs bitwise from rank 0"));
            }
        }
    }
    Ok(counts)
}

/// Which of `Comm::test_counters` an algorithm advances (`None`: the
/// copy-engine ring counts nothing: binary flags and a handshake).
fn counter_of(algorithm: Algorithm) -> Option<usize> {
    match algorithm {
        Algorithm::OneShotPush => Some(0),
        Algorithm::OneShotPull | Algorithm::TwoShotPull => Some(1),
        Algorithm::TwoShotPush => Some(2),
        // PipelinedHierarchical shares Hierarchical's region and generation.
        Algorithm::Hierarchical | Algorithm::PipelinedHierarchical => Some(3),
        Algorithm::CopyEngineRing => None,
        _ => Some(4),
    }
}

#[test]
fn protocol_counters_cross_the_u32_wrap_every_algorithm() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("protocol_counters_cross_the_u32_wrap_every_algorithm") else { return };
    let mut rng = common::rng("protocol_counters_cross_the_u32_wrap_every_algorithm");
    let config = Config {
        timeout: Duration::from_secs(3),
        launch_timeout: Duration::from_secs(3),
        test_initial_counter: Some(SEED),
        // Several launches per call for the larger messages.
        one_shot_push_max_bytes: 16 << 10,
        ring_chunk_bytes: 4 << 10,
        ..Config::default()
    };
    let mut failures = Vec::new();
    for algorithm in Algorithm::allreduce_algorithms() {
        // The copy-engine ring needs a GPU per rank: with one GPU it is
        // skipped, visibly, and the other algorithms still run.
        if algorithm == Algorithm::CopyEngineRing && driver::device_count() < 2 {
            common::skipped(&format!(
                "{algorithm} needs 2 GPUs (protocol_counters_cross_the_u32_wrap_every_algorithm)"
            ));
            continue;
        }
        let hierarchical = matches!(algorithm, Algorithm::Hierarchical | Algorithm::PipelinedHierarchical);
        let (world, islands) = if hierarchical { (4, Some(2)) } else { (2, None) };
        let streams = contexts(&ctx, world).iter().map(|c| c.new_stream().expect("stream")).collect();
        let mut comms = Comm::from_streams(streams, Config { island_size: islands, ..config.clone() }).expect("init");
        for c in comms.iter_mut() {
            c.set_algorithm(Some(algorithm)).expect("available");
        }
        let counter = counter_of(algorithm);
        let before = counter.map_or(SEED, |k| comms[0].test_counters().expect("counters")[k]);
        assert_eq!(before, SEED, "{algorithm}: the test hook did not seed the counter");
        for b in 0..CALLS / BATCH {
            let outcome = match b % 3 {
                0 => batch::<half::bf16>(&comms, &mut rng, algorithm),
                1 => batch::<f32>(&comms, &mut rng, algorithm),
                _ => batch::<half::f16>(&comms, &mut rng, algorithm),
            };
            if let Err(e) = outcome {
                failures.push(format!("{algorithm} (world {world}), batch {b}: {e}"));
                break;
            }
        }
        let Some(counter) = counter else {
            eprintln!("{algorithm}: {CALLS} calls (no counter: binary flags)");
            continue;
        };
        let after = comms[0].test_counters().expect("counters")[counter];
        // Wrapped: past 2^32, i.e. below the seed (and not stuck at it).
        if !(after < SEED && after > 0) {
            failures.push(format!("{algorithm}: counter went from {before:#x} to {after:#x}, not across the wrap"));
        }
        eprintln!("{algorithm}: {CALLS} calls, counter {before:#x} -> {after:#x}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// OneShotPush advances its generation exactly once per launch, on every
/// rank, across the wrap: a call of `b` bytes is `ceil(b / capacity)`
/// launches.
#[test]
fn one_shot_push_generation_counts_launches_across_the_wrap() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("one_shot_push_generation_counts_launches_across_the_wrap") else { return };
    let mut rng = common::rng("one_shot_push_generation_counts_launches_across_the_wrap");
    let capacity = 16usize << 10;
    let config = Config {
        timeout: Duration::from_secs(3),
        launch_timeout: Duration::from_secs(3),
        test_initial_counter: Some(SEED),
        one_shot_push_max_bytes: capacity,
        algorithm: Some(Algorithm::OneShotPush),
        ..Config::default()
    };
    let streams = contexts(&ctx, 2).iter().map(|c| c.new_stream().expect("stream")).collect();
    let comms = Comm::from_streams(streams, config).expect("init");
    let mut launches = 0u32;
    for _ in 0..8 {
        let counts = batch::<f32>(&comms, &mut rng, Algorithm::OneShotPush).expect("batch");
        launches += counts.iter().map(|&n| (n * 4).div_ceil(capacity) as u32).sum::<u32>();
    }
    assert!(launches > 256, "only {launches} launches: the wrap was not crossed");
    for (r, c) in comms.iter().enumerate() {
        let generation = c.test_counters().expect("counters")[0];
        assert_eq!(generation, SEED.wrapping_add(launches), "rank {r}: {launches} launches from {SEED:#x}");
    }
}
