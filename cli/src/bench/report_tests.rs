//! Tests of the report's text, files and comparison (no GPU needed).
#![forbid(unsafe_code)]

use super::*;
use crate::bench::stats::{measurement, set_speedups, RowKey};
use crate::bench::Mode;
use tp_allreduce::DType;

/// A report of two sizes, `auto` and NCCL at each (NCCL 3x slower).
pub(crate) fn sample_report() -> Report {
    let mut measurements = Vec::new();
    for (bytes, ours) in [(1024usize, 5.0), (43_008, 8.5)] {
        let key =
            RowKey { bytes, dtype: DType::Bf16, selection: "auto", ran: "one-shot-push", world: 8, mode: Mode::Graph };
        let mut rows = vec![measurement(key, &mut [ours, ours * 0.9, ours * 1.2])];
        let nccl = measurement(RowKey { selection: "nccl", ran: "nccl", ..key }, &mut [ours * 3.0]);
        set_speedups(&mut rows, &nccl);
        rows.push(nccl);
        measurements.extend(rows);
    }
    Report {
        tool: "tp-allreduce bench".into(),
        date_utc: "2026-11-30T12:00:00Z".into(),
        gpu_model: "NVIDIA H200".into(),
        world: 8,
        ranks_per_gpu: 8,
        mode: "graph".into(),
        iterations: 100,
        repeats: 20,
        notes: vec!["auto selects (graph): one-shot-push".into()],
        measurements,
        launch_floor_us: Some(2.5),
        ..Report::default()
    }
}

#[test]
fn human_sizes_use_powers_of_1024() {
    assert_eq!(human_bytes(512), "512 B");
    assert_eq!(human_bytes(1024), "1 KB");
    assert_eq!(human_bytes(43_008), "42 KB");
    assert_eq!(human_bytes(1536), "1.5 KB");
    assert_eq!(human_bytes(8 << 20), "8 MB");
    assert_eq!(human_bytes(3 << 19), "1.5 MB");
}

#[test]
fn the_table_has_every_row_its_speedups_and_fits_120_columns() {
    let text = render_table(&sample_report());
    assert!(text.lines().all(|l| l.chars().count() <= 120), "{text}");
    let row = text.lines().find(|l| l.contains("42 KB") && l.contains("auto")).expect(&text);
    assert!(row.contains("8.50") && row.contains("3.00x"), "{row}");
    let nccl = text.lines().find(|l| l.contains("42 KB") && l.contains("nccl")).expect(&text);
    assert!(nccl.contains("25.50") && nccl.trim_end().ends_with('-'), "{nccl}");
    assert!(text.contains("launch floor: 2.50 us"), "{text}");
    assert!(text.contains("note: auto selects"), "{text}");
}

#[test]
fn csv_has_a_header_and_one_line_per_row() {
    let r = sample_report();
    let text = csv(&r);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + r.measurements.len());
    assert!(lines[0].starts_with("bytes,dtype,selection"));
    assert_eq!(lines[0].split(',').count(), lines[1].split(',').count());
    assert!(lines[3].starts_with("43008,bf16,auto,one-shot-push,8,graph,8.500,"), "{}", lines[3]);
    assert!(lines[3].ends_with(",3.000"), "{}", lines[3]);
    assert!(lines[4].ends_with(','), "NCCL has no speedup: {}", lines[4]);
}

#[test]
fn json_round_trips_and_a_foreign_file_is_refused() {
    let dir = std::env::temp_dir().join(format!("tp-allreduce-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("results.json");
    let r = sample_report();
    write_json(&r, &path).unwrap();
    let back = read_json(&path).unwrap();
    // Floats may differ in the last bit through JSON text.
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(1.0);
    assert_eq!(back.measurements.len(), r.measurements.len());
    for (a, b) in back.measurements.iter().zip(&r.measurements) {
        assert!(close(a.median_us, b.median_us) && close(a.busbw_gbs, b.busbw_gbs), "{a:?} vs {b:?}");
        assert_eq!((a.bytes, &a.selection, a.speedup_vs_nccl), (b.bytes, &b.selection, b.speedup_vs_nccl));
    }
    assert_eq!(
        (back.notes, back.launch_floor_us, back.date_utc),
        (r.notes.clone(), r.launch_floor_us, r.date_utc.clone())
    );
    std::fs::write(&path, "{\"not\": \"a report\"}").unwrap();
    let e = read_json(&path).unwrap_err().to_string();
    assert!(e.contains("is not a benchmark results file"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compare_gives_old_over_new_per_matching_row() {
    let old = sample_report();
    let mut new = sample_report();
    new.date_utc = "2026-12-01T12:00:00Z".into();
    for m in new.measurements.iter_mut().filter(|m| m.selection == "auto") {
        m.median_us /= 2.0;
    }
    let text = render_compare(&old, &new);
    let row = text.lines().find(|l| l.contains("42 KB") && l.contains("auto")).expect(&text);
    assert!(row.contains("8.50") && row.contains("4.25") && row.contains("2.00x"), "{row}");
    let nccl = text.lines().find(|l| l.contains("42 KB") && l.contains("nccl")).expect(&text);
    assert!(nccl.contains("1.00x"), "{nccl}");
    let mut unrelated = sample_report();
    unrelated.measurements.iter_mut().for_each(|m| m.bytes += 1);
    assert!(render_compare(&old, &unrelated).contains("no (size, selection) pair"));
}

#[test]
fn utc_dates_from_known_timestamps() {
    assert_eq!(utc_date(0), "1970-01-01T00:00:00Z");
    assert_eq!(utc_date(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(utc_date(1_700_000_000), "2023-11-14T22:13:20Z");
    assert_eq!(utc_now().len(), "2026-11-30T12:00:00Z".len());
}
