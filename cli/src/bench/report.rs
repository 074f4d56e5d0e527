//! Benchmark output: the terminal table, CSV, JSON (with the machine and
//! the command line), and `--compare`. The SVG plot is in `plot.rs`.
#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use serde::{Deserialize, Serialize};

use super::stats::Measurement;
use crate::table::{self, human_bytes};
use tp_allreduce::error::{Error, Result};

/// Everything a run produced, as written to `results.json`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub tool: String,
    pub version: String,
    pub command_line: String,
    pub date_utc: String,
    pub gpu_model: String,
    pub driver: String,
    pub nccl: Option<String>,
    pub topology_fingerprint: String,
    pub world: usize,
    pub ranks_per_gpu: usize,
    pub mode: String,
    pub iterations: usize,
    pub repeats: usize,
    pub notes: Vec<String>,
    pub measurements: Vec<Measurement>,
    /// The verify-pass scenario (122 x 42 KB bf16 + a dependent kernel).
    pub verify_pass: Vec<VerifyPass>,
    /// Single-GPU large-message efficiency, when measured.
    pub efficiency: Vec<Efficiency>,
    /// Launch floor: one tiny kernel per rank per step, all ranks' streams
    /// replaying graphs at once (what any per-call kernel costs here).
    #[serde(default)]
    pub launch_floor_us: Option<f64>,
    /// `--trace`: where each sentinel row's time goes, per rank.
    #[serde(default)]
    pub trace: Vec<super::trace::TraceSummary>,
    /// `--fused`: the layer epilogue's variants (per layer).
    #[serde(default)]
    pub fused: Vec<super::fused_epilogue::FusedRow>,
}

impl Report {
    /// The run's header (tool, version, command line, date, GPU, driver,
    /// NCCL); the results are left empty.
    pub fn for_run(tool: &str, command_line: &str, ctx: &Arc<CudaContext>) -> Report {
        Report {
            tool: tool.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            command_line: command_line.into(),
            date_utc: utc_now(),
            gpu_model: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
            driver: driver_version(),
            nccl: tp_allreduce::nccl::version(),
            ..Report::default()
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VerifyPass {
    pub selection: String,
    pub algorithm: String,
    pub allreduces: usize,
    pub bytes: usize,
    pub median_ms: f64,
    pub p10_ms: f64,
    pub p90_ms: f64,
    pub per_allreduce_us: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Efficiency {
    pub algorithm: String,
    pub world: usize,
    pub bytes: usize,
    pub median_us: f64,
    pub traffic_bytes: f64,
    pub achieved_gbs: f64,
    pub copy_gbs: f64,
    pub fraction_of_copy: f64,
}

/// The terminal table, then the scenarios and notes.
pub fn render_table(r: &Report) -> String {
    let mut out = String::new();
    let collective = r.measurements.first().map_or("allreduce", |m| m.collective.as_str());
    let _ = writeln!(
        out,
        "{} ranks on {} x {} ({} per GPU), {}, {} mode, {} {}s per sample, {} samples{}",
        r.world,
        r.world.div_ceil(r.ranks_per_gpu.max(1)),
        r.gpu_model,
        r.ranks_per_gpu,
        r.measurements.first().map(|m| m.dtype.as_str()).unwrap_or("-"),
        r.mode,
        r.iterations,
        collective,
        r.repeats,
        if collective == "allreduce" { "" } else { "; size: one rank's block" },
    );
    let header = ["size", "selection", "ran", "median us", "p10 - p90 us", "algbw GB/s", "busbw GB/s", "vs nccl"];
    let mut t = table::new(header, 3..8);
    for m in &r.measurements {
        t.add_row(vec![
            human_bytes(m.bytes),
            m.selection.clone(),
            m.algorithm.clone(),
            format!("{:.2}", m.median_us),
            format!("{:.2} - {:.2}", m.p10_us, m.p90_us),
            format!("{:.2}", m.algbw_gbs),
            format!("{:.2}", m.busbw_gbs),
            m.speedup_vs_nccl.map(|s| format!("{s:.2}x")).unwrap_or_else(|| "-".into()),
        ]);
    }
    out.push_str(&table::render(&t));
    out.push_str(&super::trace::render(&r.trace));
    out.push_str(&super::fused_epilogue::render(&r.fused));
    render_scenarios(r, &mut out);
    for n in &r.notes {
        let _ = writeln!(out, "note: {n}");
    }
    out
}

fn render_scenarios(r: &Report, out: &mut String) {
    for v in &r.verify_pass {
        let _ = writeln!(
            out,
            "\nverify pass ({} x {} allreduces + dependent kernel, one graph): {} ({})\n  \
             {:.3} ms per pass [p10 {:.3} - p90 {:.3}], {:.2} us per allreduce",
            v.allreduces,
            human_bytes(v.bytes),
            v.selection,
            v.algorithm,
            v.median_ms,
            v.p10_ms,
            v.p90_ms,
            v.per_allreduce_us
        );
    }
    for e in &r.efficiency {
        let _ = writeln!(
            out,
            "\nlarge message: {} ranks, {} {}: {:.1} us, {:.0} GB/s of device-memory traffic\n  \
             = {:.0}% of the measured copy bandwidth ({:.0} GB/s)",
            e.world,
            human_bytes(e.bytes),
            e.algorithm,
            e.median_us,
            e.achieved_gbs,
            e.fraction_of_copy * 100.0,
            e.copy_gbs
        );
    }
    if let Some(f) = r.launch_floor_us {
        let _ = writeln!(
            out,
            "\nlaunch floor: {f:.2} us per step ({} ranks' streams each replaying a graph of tiny kernels)",
            r.world
        );
    }
}

/// The CSV file's text: one line per measurement.
pub fn csv(r: &Report) -> String {
    let mut s = String::from(
        "bytes,dtype,selection,algorithm,world,mode,median_us,p10_us,p90_us,algbw_gbs,busbw_gbs,speedup_vs_nccl\n",
    );
    for m in &r.measurements {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{}",
            m.bytes,
            m.dtype,
            m.selection,
            m.algorithm,
            m.world,
            m.mode,
            m.median_us,
            m.p10_us,
            m.p90_us,
            m.algbw_gbs,
            m.busbw_gbs,
            m.speedup_vs_nccl.map(|x| format!("{x:.3}")).unwrap_or_default()
        );
    }
    s
}

pub fn write_csv(r: &Report, path: &Path) -> Result<()> {
    std::fs::write(path, csv(r)).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

pub fn write_json(r: &Report, path: &Path) -> Result<()> {
    let s = serde_json::to_string_pretty(r).map_err(|e| Error::Config(format!("encoding JSON: {e}")))?;
    std::fs::write(path, s).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

pub fn read_json(path: &Path) -> Result<Report> {
    let s = std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    serde_json::from_str(&s)
        .map_err(|e| Error::Config(format!("{} is not a benchmark results file: {e}", path.display())))
}

/// `--compare old.json`: per (size, selection) the ratio old / new median.
pub fn render_compare(old: &Report, new: &Report) -> String {
    let mut out = format!("compare: {} ({}) -> {} ({})\n", old.date_utc, old.gpu_model, new.date_utc, new.gpu_model);
    let mut t = table::new(["size", "selection", "old us", "new us", "speedup"], 2..5);
    let mut matched = 0;
    for m in &new.measurements {
        if let Some(o) = old.measurements.iter().find(|o| o.bytes == m.bytes && o.selection == m.selection) {
            matched += 1;
            t.add_row(vec![
                human_bytes(m.bytes),
                m.selection.clone(),
                format!("{:.2}", o.median_us),
                format!("{:.2}", m.median_us),
                format!("{:.2}x", o.median_us / m.median_us),
            ]);
        }
    }
    if matched == 0 {
        out.push_str("no (size, selection) pair of the new run is in the old one\n");
    } else {
        out.push_str(&table::render(&t));
    }
    out
}

/// Date and time in UTC as `YYYY-MM-DDTHH:MM:SSZ` (no date crate needed).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    utc_date(secs)
}

/// `secs` since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_date(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil-from-days (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, (rem / 60) % 60, rem % 60)
}

/// `CUDA 13.0 (driver 580.159.04)` from NVML, or `unknown`.
pub(crate) fn driver_version() -> String {
    let Ok(nvml) = nvml_wrapper::Nvml::init() else {
        return "unknown".into();
    };
    let cuda = nvml.sys_cuda_driver_version().map(|v| format!("CUDA {}.{}", v / 1000, (v % 1000) / 10));
    match (cuda, nvml.sys_driver_version()) {
        (Ok(cuda), Ok(driver)) => format!("{cuda} (driver {driver})"),
        (Ok(cuda), Err(_)) => cuda,
        (Err(_), Ok(driver)) => format!("driver {driver}"),
        (Err(_), Err(_)) => "unknown".into(),
    }
}

#[cfg(test)]
#[path = "report_tests.rs"]
pub(crate) mod tests;
