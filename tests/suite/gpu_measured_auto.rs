//! Measured `auto` at communicator start (`select::measured`,
//! `comm/measure.rs`) on ranks that share one GPU (2, 4, 8 ranks of one
//! process): the cold start measures within 15 s and prints how long it
//! took, every rank holds rank 0's table, calls are right with the
//! measured selection, a second start loads the table from the cache, and
//! loading takes at most 0.2 s. The rest of the suite turns measurement
//! off (`common::gpu` sets TP_ALLREDUCE_AUTO_MEASURE=off); these tests
//! turn it on through `Config`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tp_allreduce::{AutoMeasure, Comm, Config, DType, SelectionSource};

use crate::common::{self, Case};

const COLD_LIMIT: Duration = Duration::from_secs(15);
const WARM_LIMIT: Duration = Duration::from_millis(200);

fn cache_dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tp-allreduce-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn config(dir: &Path, mode: AutoMeasure) -> Config {
    Config {
        auto_measure: Some(mode),
        measure_dtypes: vec![DType::Bf16],
        measure_cache_dir: Some(dir.to_path_buf()),
        ..Config::default()
    }
}

/// Collective `measure_selection(&[dtype])` on every rank of an in-process
/// group (one thread per rank); the slowest rank's time.
fn measure_all(comms: &mut [Comm], dtype: DType) -> Duration {
    let started = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.iter_mut().map(|c| s.spawn(move || c.measure_selection(&[dtype]))).collect();
        for (r, h) in handles.into_iter().enumerate() {
            h.join().expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: measure_selection: {e}"));
        }
    });
    started.elapsed()
}

fn measured_auto_on_one_gpu(test: &str, world: usize) {
    let Some(ctx) = common::gpu(test) else { return };
    let _lock = common::gpu_lock();
    let dir = cache_dir(test);

    // Cold: construction measures.
    let started = Instant::now();
    let comms = Comm::from_streams(common::streams(&ctx, world), config(&dir, AutoMeasure::On)).expect("group");
    let cold = started.elapsed();
    let baseline_started = Instant::now();
    let off = Comm::from_streams(common::streams(&ctx, world), config(&dir, AutoMeasure::Off)).expect("group");
    let construction = baseline_started.elapsed();
    drop(off);
    eprintln!(
        "{test}: {world} ranks on one GPU: cold start {:.2} s (construction alone {:.2} s)",
        cold.as_secs_f64(),
        construction.as_secs_f64()
    );
    for c in &comms {
        assert_eq!(c.selection_source(), &SelectionSource::Measured(vec![DType::Bf16]), "rank {}", c.rank());
    }
    let table = comms[0].measured_table().expect("a measured table").clone();
    assert!(table.meta.candidates_only && !table.entries.is_empty());
    for c in &comms {
        assert_eq!(c.measured_table(), Some(&table), "rank {} holds another table than rank 0", c.rank());
    }
    eprintln!("{test}: bf16 graph selection: {}", comms[0].selection().describe(DType::Bf16, true));
    assert!(cold.saturating_sub(construction) <= COLD_LIMIT, "cold measurement took {cold:?} (limit {COLD_LIMIT:?})");

    // Calls are right with the measured selection.
    let mut rng = common::rng(test);
    for bytes in [4 << 10, 42 << 10, 1 << 20] {
        let count = bytes / 2;
        let algorithm = comms[0].plan_call(bytes, DType::Bf16, false, false).algorithm;
        common::run_case::<half::bf16>(&comms, &mut rng, Case { algorithm, count, offset: 0, in_place: false })
            .unwrap_or_else(|e| panic!("{bytes} bytes over {algorithm}: {e}"));
    }
    drop(comms);
    let files: Vec<_> = std::fs::read_dir(&dir).expect("the cache directory").filter_map(|e| e.ok()).collect();
    assert!(files.iter().any(|f| f.file_name().to_string_lossy().ends_with(".json")), "no cached table");

    // Warm: a second start loads the same table.
    let started = Instant::now();
    let mut comms = Comm::from_streams(common::streams(&ctx, world), config(&dir, AutoMeasure::On)).expect("group");
    let warm_construction = started.elapsed();
    assert_eq!(comms[0].measured_table(), Some(&table), "the second start did not load the cached table");
    // Loading alone (the same collective step on a live communicator).
    let warm = measure_all(&mut comms, DType::Bf16);
    eprintln!(
        "{test}: warm start {:.3} s (loading the table {:.3} s)",
        warm_construction.as_secs_f64(),
        warm.as_secs_f64()
    );
    assert!(warm <= WARM_LIMIT, "loading the cached table took {warm:?} (limit {WARM_LIMIT:?})");
    assert_eq!(comms[0].measured_table(), Some(&table));
    drop(comms);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn measured_auto_2_ranks_on_one_gpu() {
    measured_auto_on_one_gpu("measured_auto_2_ranks_on_one_gpu", 2);
}

#[test]
fn measured_auto_4_ranks_on_one_gpu() {
    measured_auto_on_one_gpu("measured_auto_4_ranks_on_one_gpu", 4);
}

#[test]
fn measured_auto_8_ranks_on_one_gpu() {
    measured_auto_on_one_gpu("measured_auto_8_ranks_on_one_gpu", 8);
}

/// A corrupt cached table is refused (one WARNING) and measured again;
/// `Off` measures nothing.
#[test]
fn measured_auto_replaces_a_corrupt_cached_table_and_off_measures_nothing() {
    let test = "measured_auto_replaces_a_corrupt_cached_table_and_off_measures_nothing";
    let Some(ctx) = common::gpu(test) else { return };
    let _lock = common::gpu_lock();
    let dir = cache_dir(test);
    let off = Comm::from_streams(common::streams(&ctx, 2), config(&dir, AutoMeasure::Off)).expect("group");
    assert_eq!(off[0].selection_source(), &SelectionSource::Model);
    assert!(off[0].measured_table().is_none());
    assert!(!dir.exists(), "Off wrote a cache");
    drop(off);
    let comms = Comm::from_streams(common::streams(&ctx, 2), config(&dir, AutoMeasure::On)).expect("group");
    let first = comms[0].measured_table().expect("measured").clone();
    drop(comms);
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|f| f.file_name().to_string_lossy().ends_with(".json"));
    let path = file.expect("a cached table").path();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    let comms = Comm::from_streams(common::streams(&ctx, 2), config(&dir, AutoMeasure::On)).expect("group");
    assert!(comms[0].measured_table().is_some());
    assert_eq!(first.meta.world_size, 2);
    let rewritten = std::fs::read_to_string(&path).unwrap();
    assert_ne!(rewritten, text[..text.len() / 2], "the corrupt table was not replaced");
    drop(comms);
    let _ = std::fs::remove_dir_all(&dir);
}
