//! Tests of the tuning table: round trips, lookup, applicability, the
//! format with launch shapes and the older format without them, malformed files.
use super::*;
use crate::select::topology::embedded;

fn meta() -> TuningMeta {
    TuningMeta::for_topology(&embedded::default_topology(), "test")
}

fn sample() -> TuningTable {
    let m = |bucket_bytes, dtype, algorithm, median_us| Measurement {
        bucket_bytes,
        dtype,
        algorithm,
        transport: Transport::PeerToPeer,
        median_us,
        shape: None,
    };
    TuningTable::from_measurements(
        meta(),
        vec![
            m(65536, DType::Bf16, Algorithm::Hierarchical, 12.4),
            m(65536, DType::Bf16, Algorithm::Nccl, 27.9),
            m(4096, DType::Bf16, Algorithm::OneShotPush, 7.5),
            m(4096, DType::Bf16, Algorithm::Nccl, 21.0),
            m(4096, DType::F32, Algorithm::TwoShotPush, 8.5),
        ],
    )
    .unwrap()
}

#[test]
fn round_trip_through_toml_and_disk() {
    let t = sample();
    assert_eq!(t.entries[0].dtype, DType::F32);
    let text = t.to_toml_string().unwrap();
    assert!(text.contains("[[entry.result]]"), "{text}");
    let back = TuningTable::from_toml_str(&text, "mem").unwrap();
    assert_eq!(back, t);
    let dir = std::env::temp_dir().join(format!("tp-allreduce-tuning-test-{}", std::process::id()));
    let path = TuningTable::default_path(&dir, &t.meta);
    t.save(&path).unwrap();
    assert_eq!(TuningTable::load(&path).unwrap(), t);
    match TuningTable::load_for(&path, &embedded::default_topology()).unwrap() {
        Loaded::Usable(u) => assert_eq!(u, t),
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn winners_and_lookup() {
    let t = sample();
    let e = t.lookup(DType::Bf16, 43008).unwrap();
    assert_eq!(e.bytes, 65536);
    assert_eq!(e.winner, Algorithm::Hierarchical);
    assert_eq!(e.median_us(Algorithm::Nccl, Transport::HostStaged), Some(27.9));
    assert_eq!(e.median_us(Algorithm::Ring, Transport::PeerToPeer), None);
    assert_eq!(t.lookup(DType::Bf16, 100).unwrap().bytes, 4096);
    assert!(t.lookup(DType::Bf16, 1 << 20).is_none());
    assert!(t.lookup(DType::F16, 4096).is_none());
    assert_eq!(t.lookup(DType::F32, 4096).unwrap().winner, Algorithm::TwoShotPush);
    let dup = TuningTable::from_measurements(
        meta(),
        vec![
            Measurement {
                bucket_bytes: 1,
                dtype: DType::F32,
                algorithm: Algorithm::Ring,
                transport: Transport::PeerToPeer,
                median_us: 1.0,
                shape: None,
            },
            Measurement {
                bucket_bytes: 1,
                dtype: DType::F32,
                algorithm: Algorithm::Ring,
                transport: Transport::PeerToPeer,
                median_us: 2.0,
                shape: None,
            },
        ],
    );
    assert!(dup.unwrap_err().to_string().contains("twice"));
}

#[test]
fn mismatched_tables_are_ignored_with_a_reason() {
    let t = sample();
    assert_eq!(t.applicability(&embedded::default_topology()), Applicability::Applies);
    let other = embedded::by_name("l40s-8x-pcie4").unwrap();
    match t.applicability(&other) {
        Applicability::Ignored(why) => assert!(why.contains("does not match"), "{why}"),
        a => panic!("{a:?}"),
    }
    let four = embedded::default_topology().for_world(4).unwrap();
    assert!(matches!(t.applicability(&four), Applicability::Ignored(_)));
    let missing = TuningTable::load_for(Path::new("/nonexistent/tuning.toml"), &other).unwrap();
    assert!(matches!(missing, Loaded::Ignored { .. }));
    let dir = std::env::temp_dir().join(format!("tp-allreduce-tuning-mismatch-{}", std::process::id()));
    let path = dir.join("t.toml");
    t.save(&path).unwrap();
    match TuningTable::load_for(&path, &other).unwrap() {
        Loaded::Ignored { reason } => assert!(reason.contains("t.toml") && reason.contains("re-run"), "{reason}"),
        l => panic!("{l:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn err(text: &str) -> String {
    TuningTable::from_toml_str(text, "bad.toml").unwrap_err().to_string()
}

fn good_text() -> String {
    sample().to_toml_string().unwrap()
}

#[test]
fn malformed_files_give_clear_errors() {
    let good = good_text();
    // Missing field: names the field.
    let no_median = good.replacen("median_us = 8.5\n", "", 1);
    let e = err(&no_median);
    assert!(e.contains("bad.toml") && e.contains("missing field `median_us`"), "{e}");
    // Bad number: names the line.
    let bad_number = good.replacen("median_us = 8.5", "median_us = \"fast\"", 1);
    let e = err(&bad_number);
    let line = bad_number.lines().position(|l| l.contains("\"fast\"")).unwrap() + 1;
    assert!(e.contains(&format!("line {line}")) && e.contains("f64"), "{e}");
    // Unknown algorithm: names the value, the line and the choices.
    let unknown = good.replacen("algorithm = \"two-shot-push\"", "algorithm = \"warp-drive\"", 1);
    let e = err(&unknown);
    let line = unknown.lines().position(|l| l.contains("warp-drive")).unwrap() + 1;
    assert!(e.contains("warp-drive") && e.contains(&format!("line {line}")) && e.contains("one-shot-push"), "{e}");
    // Negative time: names the entry and its line.
    let negative = good.replacen("median_us = 8.5", "median_us = -1.0", 1);
    let e = err(&negative);
    let line = negative.lines().position(|l| l.starts_with("[[entry]]")).unwrap() + 1;
    assert!(e.contains("entry 1") && e.contains(&format!("line {line}")) && e.contains("median_us"), "{e}");
    // Unknown dtype and transport.
    assert!(err(&good.replacen("dtype = \"f32\"", "dtype = \"f8\"", 1)).contains("unknown dtype `f8`"));
    assert!(
        err(&good.replacen("transport = \"p2p\"", "transport = \"smoke-signals\"", 1)).contains("unknown transport")
    );
    // Winner that is not the fastest.
    let e = err(&good.replacen("winner = \"hierarchical\"", "winner = \"nccl\"", 1));
    assert!(e.contains("slower than"), "{e}");
    // Unknown field, wrong format, not TOML at all.
    assert!(err(&good.replacen("world_size = 8", "world_size = 8\ncolour = \"blue\"", 1)).contains("colour"));
    assert!(err(&good.replacen("format = 2", "format = 9", 1))
        .contains("format = 9: this build reads tuning tables of format 1 and 2"));
    assert!(err("this is [not toml").contains("bad.toml"));
}

fn with_shapes() -> TuningTable {
    let m = |bucket_bytes, algorithm, median_us, shape| Measurement {
        bucket_bytes,
        dtype: DType::Bf16,
        algorithm,
        transport: Transport::PeerToPeer,
        median_us,
        shape,
    };
    TuningTable::from_measurements(
        meta(),
        vec![
            m(4096, Algorithm::OneShotPush, 2.2, Some((1, 256))),
            m(4096, Algorithm::Nccl, 6.0, None),
            m(1 << 20, Algorithm::OneShotPush, 5.1, Some((128, 512))),
            m(1 << 20, Algorithm::TwoShotPush, 9.0, None),
        ],
    )
    .unwrap()
}

#[test]
fn launch_shapes_round_trip_and_are_looked_up_per_algorithm() {
    let t = with_shapes();
    assert_eq!(t.format, FORMAT);
    let text = t.to_toml_string().unwrap();
    assert!(text.contains("format = 2") && text.contains("blocks = 128") && text.contains("threads = 512"), "{text}");
    // Results without a shape write neither field.
    assert_eq!(text.matches("blocks =").count(), 2, "{text}");
    let back = TuningTable::from_toml_str(&text, "mem").unwrap();
    assert_eq!(back, t);
    let e = back.lookup(DType::Bf16, 3000).unwrap();
    assert_eq!(e.shape_of(Algorithm::OneShotPush, Transport::PeerToPeer), Some((1, 256)));
    assert_eq!(e.shape_of(Algorithm::Nccl, Transport::PeerToPeer), None);
    assert_eq!(e.shape_of(Algorithm::OneShotPush, Transport::HostStaged), None);
    let big = back.lookup(DType::Bf16, 1 << 20).unwrap();
    assert_eq!(big.shape_of(Algorithm::OneShotPush, Transport::PeerToPeer), Some((128, 512)));
}

#[test]
fn format_1_tables_without_shapes_still_load() {
    // A table as the previous release wrote it: format 1, no shapes.
    let old = sample().to_toml_string().unwrap().replacen("format = 2", "format = 1", 1);
    assert!(!old.contains("blocks"));
    let t = TuningTable::from_toml_str(&old, "old.toml").unwrap();
    assert_eq!(t.format, FORMAT_NO_SHAPES);
    assert!(t.entries.iter().flat_map(|e| &e.results).all(|r| r.shape().is_none()));
    assert_eq!(t.lookup(DType::Bf16, 4096).unwrap().winner, Algorithm::OneShotPush);
}

#[test]
fn malformed_shapes_are_refused() {
    let good = with_shapes().to_toml_string().unwrap();
    let e = err(&good.replacen("threads = 256\n", "", 1));
    assert!(e.contains("blocks and threads come together"), "{e}");
    let e = err(&good.replacen("threads = 256", "threads = 100", 1));
    assert!(e.contains("multiple of 32"), "{e}");
    let e = err(&good.replacen("blocks = 1\n", "blocks = 0\n", 1));
    assert!(e.contains("blocks must be in"), "{e}");
}
