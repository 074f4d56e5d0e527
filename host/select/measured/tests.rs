//! Tests of measured `auto` without a GPU: the cache (keys, refusals,
//! concurrent writers, unwritable directories), rank 0's decision, the
//! NCCL guard and the selection between measured buckets, fed with
//! measurements.

use std::sync::{Arc, Barrier};

use super::*;
use crate::select::selection::{Source, SelectionTable};
use crate::select::topology::embedded;

fn key() -> CacheKey {
    CacheKey {
        fingerprint: "e2c5c89df4a0737f".into(),
        gpu_model: "NVIDIA H100 80GB HBM3".into(),
        driver_version: 13000,
        kernels_hash: "96a58b29d5ff5273".into(),
        library_version: "0.1.0".into(),
        world_size: 8,
        islands: "none".into(),
        transport: "p2p".into(),
        nccl: true,
        config: "chunk=8388608".into(),
        dtype: "bf16".into(),
        sweep: "on".into(),
    }
}

fn t(bytes: usize, algorithm: Algorithm, median_us: f64) -> Timing {
    Timing { bytes, algorithm, transport: Transport::PeerToPeer, median_us, shape: None, correct: true }
}

fn table(scale: f64) -> TuningTable {
    table_from_timings(
        &key(),
        DType::Bf16,
        &[
            t(4096, Algorithm::OneShotPush, 5.0 * scale),
            t(4096, Algorithm::TwoShotPush, 7.0),
            t(4096, Algorithm::Nccl, 20.0),
            t(1 << 20, Algorithm::TwoShotPush, 60.0 * scale),
            t(1 << 20, Algorithm::Nccl, 70.0),
        ],
    )
    .unwrap()
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tp-allreduce-measured-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_table_round_trips_through_the_cache() {
    let cache = MeasuredCache { dir: temp_dir("round-trip") };
    assert_eq!(cache.read(&key()), CacheRead::Miss);
    assert!(matches!(cache.write(&key(), &table(1.0)), Ok(WriteOutcome::Written(_))));
    assert_eq!(cache.read(&key()), CacheRead::Hit(table(1.0)));
}

#[test]
fn a_table_of_any_other_key_never_applies() {
    let cache = MeasuredCache { dir: temp_dir("keys") };
    cache.write(&key(), &table(1.0)).unwrap();
    let others: Vec<(&str, CacheKey)> = vec![
        ("fingerprint", CacheKey { fingerprint: "0000000000000001".into(), ..key() }),
        ("driver_version", CacheKey { driver_version: 12080, ..key() }),
        ("kernels_hash", CacheKey { kernels_hash: "ffffffffffffffff".into(), ..key() }),
        ("world_size", CacheKey { world_size: 4, ..key() }),
        ("islands", CacheKey { islands: "0,1,2,3/4,5,6,7".into(), ..key() }),
        ("dtype", CacheKey { dtype: "f16".into(), ..key() }),
    ];
    for (field, other) in others {
        // Not found under its own name ...
        assert_eq!(cache.read(&other), CacheRead::Miss, "{field}");
        // ... and refused when the file is copied there (a foreign file).
        std::fs::copy(cache.path(&key()), cache.path(&other)).unwrap();
        match cache.read(&other) {
            CacheRead::Refused(why) => assert!(why.contains(field), "{field}: {why}"),
            got => panic!("{field}: {got:?}"),
        }
    }
}

#[test]
fn corrupt_truncated_or_foreign_files_are_refused_and_measured_again() {
    let cache = MeasuredCache { dir: temp_dir("corrupt") };
    cache.write(&key(), &table(1.0)).unwrap();
    let path = cache.path(&key());
    let whole = std::fs::read_to_string(&path).unwrap();
    let flipped = whole.replacen("\"median_us\": 5.0", "\"median_us\": 4.0", 1);
    assert_ne!(flipped, whole);
    let cases = [
        ("truncated", whole[..whole.len() * 2 / 3].to_string()),
        ("one value changed", flipped),
        ("empty", String::new()),
        ("not ours", "[meta]\nfingerprint = 1\n".to_string()),
        ("no checksum line", whole.split_once('\n').unwrap().1.to_string()),
    ];
    for (what, text) in cases {
        std::fs::write(&path, &text).unwrap();
        assert!(matches!(cache.read(&key()), CacheRead::Refused(_)), "{what}");
        // The next measurement replaces it.
        assert!(matches!(cache.write(&key(), &table(2.0)), Ok(WriteOutcome::Written(_))), "{what}");
        assert_eq!(cache.read(&key()), CacheRead::Hit(table(2.0)), "{what}");
    }
}

#[test]
fn concurrent_writers_leave_exactly_one_whole_table_and_readers_never_see_a_torn_one() {
    let cache = Arc::new(MeasuredCache { dir: temp_dir("concurrent") });
    let writers = 8;
    let start = Arc::new(Barrier::new(writers + 2));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (cache, start, done) = (cache.clone(), start.clone(), done.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut hits = 0;
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    match cache.read(&key()) {
                        CacheRead::Refused(why) => panic!("a reader saw a torn file: {why}"),
                        CacheRead::Hit(_) => hits += 1,
                        CacheRead::Miss => {}
                    }
                }
                hits
            })
        })
        .collect();
    let outcomes: Vec<WriteOutcome> = (0..writers)
        .map(|w| {
            let (cache, start) = (cache.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                cache.write(&key(), &table(1.0 + w as f64 / 10.0)).unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    done.store(true, std::sync::atomic::Ordering::Release);
    for r in readers {
        r.join().unwrap();
    }
    let written = outcomes.iter().filter(|o| matches!(o, WriteOutcome::Written(_))).count();
    assert_eq!(written, 1, "{outcomes:?}");
    let CacheRead::Hit(kept) = cache.read(&key()) else { panic!("no table") };
    assert!((0..writers).any(|w| kept == table(1.0 + w as f64 / 10.0)));
    // No temporary file is left behind.
    let leftovers: Vec<_> = std::fs::read_dir(&cache.dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn an_unwritable_cache_directory_degrades_to_measuring_with_a_warning() {
    // A directory below a regular file can never be created (even as root).
    let file = temp_dir("unwritable").join("a-file");
    std::fs::write(&file, "x").unwrap();
    let cache = MeasuredCache { dir: file.join("cache") };
    assert_eq!(cache.read(&key()), CacheRead::Miss);
    let warning = cache::store_or_warning(Some(&cache), &key(), &table(1.0)).expect("a warning");
    assert!(warning.contains("cannot cache") && warning.contains("a-file"), "{warning}");
    let warning = cache::store_or_warning(None, &key(), &table(1.0)).expect("a warning");
    assert!(warning.contains("no cache directory"), "{warning}");
    // A read-only directory (permissions bind only a user other than root).
    if !nix::unistd::geteuid().is_root() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("read-only");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        let warning = cache::store_or_warning(Some(&MeasuredCache { dir: dir.clone() }), &key(), &table(1.0));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(warning.is_some_and(|w| w.contains("cannot cache")));
    }
    // A usable one: no warning.
    let ok = MeasuredCache { dir: temp_dir("writable") };
    assert_eq!(cache::store_or_warning(Some(&ok), &key(), &table(1.0)), None);
}

#[test]
fn every_rank_adopts_rank_0s_table_even_when_its_own_numbers_differ() {
    // Rank 1 saw one-shot-push slower than two-shot-push at 4 KiB, ranks 0
    // and 2 did not.
    let built: Vec<TuningTable> = [1.0, 2.0, 1.1].into_iter().map(table).collect();
    assert_eq!(built[0].entries[0].winner, Algorithm::OneShotPush);
    assert_eq!(built[1].entries[0].winner, Algorithm::TwoShotPush);
    let gathered: Vec<Vec<u8>> = built.iter().map(|t| t.to_toml_string().unwrap().into_bytes()).collect();
    for _rank in 0..3 {
        let adopted = adopt_rank0_table(&gathered).unwrap();
        assert_eq!(adopted, built[0]);
        assert_ne!(adopted, built[1]);
    }
    // Non-zero ranks send nothing in the real exchange: the same answer.
    let sparse = vec![gathered[0].clone(), Vec::new(), Vec::new()];
    assert_eq!(adopt_rank0_table(&sparse).unwrap(), built[0]);
    assert!(adopt_rank0_table(&[b"garbage".to_vec()]).is_err());
}

fn eight_ranks() -> (Topology, Constraints) {
    let view = embedded::default_topology().for_world(8).unwrap();
    let mut c = Constraints::for_topology(&view);
    c.nccl_available = true;
    (view, c)
}

/// Two of ours that run on the 8-rank default view.
fn two_of_ours(view: &Topology, c: &Constraints) -> (Algorithm, Algorithm) {
    let ours: Vec<Algorithm> =
        Algorithm::allreduce_algorithms().filter(|a| c.available(*a, view.len(), 64 << 10).is_ok()).collect();
    assert!(ours.contains(&Algorithm::OneShotPush) && ours.contains(&Algorithm::TwoShotPush), "{ours:?}");
    (Algorithm::OneShotPush, Algorithm::TwoShotPush)
}

#[test]
fn nccl_is_selected_where_it_measured_faster() {
    let (view, c) = eight_ranks();
    let (a, b) = two_of_ours(&view, &c);
    let timings = [
        t(16 << 10, a, 8.0),
        t(16 << 10, b, 9.0),
        t(16 << 10, Algorithm::Nccl, 25.0),
        t(1 << 20, a, 90.0),
        t(1 << 20, b, 70.0),
        t(1 << 20, Algorithm::Nccl, 50.0),
        t(4 << 20, b, 200.0),
        t(4 << 20, Algorithm::Nccl, 150.0),
    ];
    let measured = table_from_timings(&key(), DType::Bf16, &timings).unwrap();
    let sel = SelectionTable::build(&CostModel::default(), Some(&measured), &view, &c);
    let at = |bytes| sel.lookup(bytes, DType::Bf16, true);
    assert_eq!(at(16 << 10).algorithm, a);
    assert_eq!(at(16 << 10).source, Source::Tuning);
    for bytes in [1 << 20, 2 << 20, 4 << 20, 16 << 20] {
        assert_eq!(at(bytes).algorithm, Algorithm::Nccl, "{bytes}: {}", at(bytes).reason);
    }
    // Without NCCL the fastest of ours.
    let no_nccl = Constraints { nccl_available: false, ..c };
    let sel = SelectionTable::build(&CostModel::default(), Some(&measured), &view, &no_nccl);
    assert_eq!(sel.lookup(1 << 20, DType::Bf16, true).algorithm, b);
}

#[test]
fn between_measured_buckets_the_measured_neighbours_decide() {
    let (view, c) = eight_ranks();
    let (a, b) = two_of_ours(&view, &c);
    // a: 10 us at 16 KiB, 50 us at 64 KiB; b: 20 us, 24 us. On the log-log
    // line a crosses b near 30 KiB: a below, b above. The upper
    // neighbour alone (64 KiB) would give b for the whole range.
    let timings = [t(16 << 10, a, 10.0), t(16 << 10, b, 20.0), t(64 << 10, a, 50.0), t(64 << 10, b, 24.0)];
    let measured = table_from_timings(&key(), DType::Bf16, &timings).unwrap();
    let us = |bytes, alg| measured.interpolated_us(DType::Bf16, bytes, alg, Transport::PeerToPeer).unwrap();
    assert!((us(32 << 10, a) - (10.0f64 * 50.0).sqrt()).abs() < 1e-9);
    assert_eq!(us(16 << 10, a), 10.0);
    assert_eq!(us(1 << 10, a), 10.0, "below the first bucket: the first");
    assert_eq!(measured.interpolated_us(DType::Bf16, 1 << 20, a, Transport::PeerToPeer), None);
    let no_nccl = Constraints { nccl_available: false, ..c };
    let sel = SelectionTable::build(&CostModel::default(), Some(&measured), &view, &no_nccl);
    let chosen = |bytes| sel.lookup(bytes, DType::Bf16, true).algorithm;
    assert_eq!(chosen(20 << 10), a);
    assert_eq!(chosen(24 << 10), a);
    assert_eq!(chosen(40 << 10), b);
    assert_eq!(chosen(60 << 10), b);
}

#[test]
fn an_algorithm_measured_auto_did_not_measure_is_not_chosen() {
    let (view, c) = eight_ranks();
    let no_nccl = Constraints { nccl_available: false, ..c };
    // Only the ring was measured (absurdly slow): a model-only table would
    // prefer anything else; the measured table keeps to its candidates.
    let measured = table_from_timings(&key(), DType::Bf16, &[t(64 << 10, Algorithm::Ring, 500.0)]).unwrap();
    let sel = SelectionTable::build(&CostModel::default(), Some(&measured), &view, &no_nccl);
    assert_eq!(sel.lookup(64 << 10, DType::Bf16, true).algorithm, Algorithm::Ring);
    let model_only = SelectionTable::build(&CostModel::default(), None, &view, &no_nccl);
    assert_ne!(model_only.lookup(64 << 10, DType::Bf16, true).algorithm, Algorithm::Ring);
}

#[test]
fn a_wrong_candidate_never_enters_the_table_and_a_swept_shape_does() {
    let mut wrong = t(4096, Algorithm::OneShotPush, 1.0);
    wrong.correct = false;
    let measured = table_from_timings(&key(), DType::Bf16, &[wrong, t(4096, Algorithm::TwoShotPush, 7.0)]).unwrap();
    assert_eq!(measured.entries[0].winner, Algorithm::TwoShotPush);
    assert_eq!(measured.entries[0].results.len(), 1);
    assert!(table_from_timings(&key(), DType::Bf16, &[wrong]).is_err());
    let shaped = Timing { shape: Some((16, 128)), ..t(4096, Algorithm::OneShotPush, 3.0) };
    let measured = table_from_timings(&key(), DType::Bf16, &[shaped]).unwrap();
    assert_eq!(measured.entries[0].shape_of(Algorithm::OneShotPush, Transport::PeerToPeer), Some((16, 128)));
}

#[test]
fn the_default_sweep_is_bounded_and_the_candidates_follow_the_model() {
    let on = Sweep::for_mode(AutoMeasure::On).unwrap();
    assert!(on.buckets.windows(2).all(|w| w[0] < w[1]) && on.buckets.contains(&(42 << 10)));
    assert!(on.buckets.len() <= 8 && on.top_k == 3 && on.budget <= Duration::from_secs(15));
    assert!(Sweep::for_mode(AutoMeasure::Off).is_none());
    assert_eq!(Sweep::for_mode(AutoMeasure::Full).unwrap().top_k, usize::MAX);
    let (view, c) = eight_ranks();
    let model = CostModel::default();
    for &bytes in &on.buckets {
        let top = candidates(&model, &view, &c, bytes, 3);
        assert_eq!(top.len(), 3, "{bytes}");
        let all = candidates(&model, &view, &c, bytes, usize::MAX);
        assert_eq!(&all[..3], &top[..], "{bytes}: the first three of the full ranking");
        let opts = Options { capturing: true, islands: c.islands, nccl: NcclTuning::Tuned };
        let us: Vec<f64> =
            all.iter().map(|a| model.predict(&view, *a, c.transport, bytes, &opts).unwrap().total_us()).collect();
        assert!(us.windows(2).all(|w| w[0] <= w[1]), "{bytes}: {us:?}");
    }
}

#[test]
fn modes_parse() {
    assert_eq!("off".parse::<AutoMeasure>().unwrap(), AutoMeasure::Off);
    assert_eq!(" FULL ".parse::<AutoMeasure>().unwrap(), AutoMeasure::Full);
    assert_eq!("on".parse::<AutoMeasure>().unwrap(), AutoMeasure::On);
    assert!("sometimes".parse::<AutoMeasure>().is_err());
    // Off until measured `auto` has run on a GPU (README, "How `auto` chooses").
    assert_eq!(AutoMeasure::default(), AutoMeasure::Off);
    assert_eq!(crate::env::parse_dtypes("bf16, f16,bf16").unwrap(), vec![DType::Bf16, DType::F16]);
    assert!(crate::env::parse_dtypes("bf16,int8").is_err());
}
