//! Benchmark output: the terminal table, CSV, JSON (with the machine and
//! the command line), an SVG plot of latency vs size, and `--compare`.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::Measurement;
use crate::error::{Error, Result};

/// Everything a run produced, as written to `results.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
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
}

#[derive(Clone, Debug, Serialize, Deserialize)]
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

#[derive(Clone, Debug, Serialize, Deserialize)]
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

/// `1 KB`, `42 KB`, `8 MB` (powers of 1024, like NCCL's tests).
pub fn human_bytes(b: usize) -> String {
    if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{} MB", b >> 20)
    } else if b >= 1 << 20 {
        format!("{:.1} MB", b as f64 / (1 << 20) as f64)
    } else if b >= 1024 && b % 1024 == 0 {
        format!("{} KB", b >> 10)
    } else if b >= 1024 {
        format!("{:.1} KB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// The terminal table.
pub fn render_table(r: &Report) -> String {
    let mut out = String::new();
    writeln!(
        out,
        "{} x {} ({} rank(s) per GPU), {}, {} mode, {} allreduces per sample, {} samples",
        r.world,
        r.gpu_model,
        r.ranks_per_gpu,
        r.measurements.first().map(|m| m.dtype.as_str()).unwrap_or("-"),
        r.mode,
        r.iterations,
        r.repeats
    )
    .unwrap();
    writeln!(
        out,
        "{:>9}  {:<14} {:<14} {:>9} {:>19} {:>9} {:>9} {:>8}",
        "size", "selection", "ran", "us med", "[p10 - p90]", "algbw", "busbw", "vs nccl"
    )
    .unwrap();
    writeln!(out, "{:>9}  {:<14} {:<14} {:>9} {:>19} {:>9} {:>9} {:>8}", "", "", "", "", "", "GB/s", "GB/s", "")
        .unwrap();
    let mut last = 0;
    for m in &r.measurements {
        if m.bytes != last && last != 0 {
            writeln!(out).unwrap();
        }
        last = m.bytes;
        writeln!(
            out,
            "{:>9}  {:<14} {:<14} {:>9.2} {:>19} {:>9.2} {:>9.2} {:>8}",
            human_bytes(m.bytes),
            m.selection,
            m.algorithm,
            m.median_us,
            format!("[{:.2} - {:.2}]", m.p10_us, m.p90_us),
            m.algbw_gbs,
            m.busbw_gbs,
            m.speedup_vs_nccl.map(|s| format!("{s:.2}x")).unwrap_or_else(|| "-".into())
        )
        .unwrap();
    }
    for v in &r.verify_pass {
        writeln!(
            out,
            "\nverify pass ({} x {} allreduces + dependent kernel, one graph): {:<6} ({}) {:.3} ms per pass [{:.3} - {:.3}], {:.2} us per allreduce",
            v.allreduces,
            human_bytes(v.bytes),
            v.selection,
            v.algorithm,
            v.median_ms,
            v.p10_ms,
            v.p90_ms,
            v.per_allreduce_us
        )
        .unwrap();
    }
    for e in &r.efficiency {
        writeln!(
            out,
            "\nlarge message: {} ranks, {} {}: {:.1} us, {:.0} GB/s of device-memory traffic = {:.0}% of the measured copy bandwidth ({:.0} GB/s)",
            e.world,
            human_bytes(e.bytes),
            e.algorithm,
            e.median_us,
            e.achieved_gbs,
            e.fraction_of_copy * 100.0,
            e.copy_gbs
        )
        .unwrap();
    }
    if let Some(f) = r.launch_floor_us {
        writeln!(
            out,
            "\nlaunch floor: {f:.2} us per step ({} ranks' streams each replaying a graph of tiny kernels)",
            r.world
        )
        .unwrap();
    }
    for n in &r.notes {
        writeln!(out, "note: {n}").unwrap();
    }
    out
}

pub fn write_csv(r: &Report, path: &Path) -> Result<()> {
    let mut s = String::from(
        "bytes,dtype,selection,algorithm,world,mode,median_us,p10_us,p90_us,algbw_gbs,busbw_gbs,speedup_vs_nccl\n",
    );
    for m in &r.measurements {
        writeln!(
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
        )
        .unwrap();
    }
    std::fs::write(path, s).map_err(|e| Error::io(format!("writing {}", path.display()), e))
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

/// Latency vs size, log-log, one line per selection.
pub fn render_svg(r: &Report) -> String {
    let (w, h) = (900.0f64, 560.0f64);
    let (left, right, top, bottom) = (80.0, 190.0, 40.0, 60.0);
    let ms = &r.measurements;
    let mut series: Vec<String> = Vec::new();
    for m in ms {
        if !series.contains(&m.selection) {
            series.push(m.selection.clone());
        }
    }
    let (min_b, max_b) = ms.iter().fold((f64::MAX, 0f64), |(a, b), m| (a.min(m.bytes as f64), b.max(m.bytes as f64)));
    let (min_t, max_t) = ms.iter().fold((f64::MAX, 0f64), |(a, b), m| (a.min(m.median_us), b.max(m.median_us)));
    if ms.is_empty() || min_b <= 0.0 || min_t <= 0.0 {
        return "<svg xmlns=\"http://www.w3.org/2000/svg\"/>".into();
    }
    let (lx0, lx1) = (min_b.log10(), max_b.log10().max(min_b.log10() + 1e-9));
    let (ly0, ly1) = ((min_t * 0.8).log10().floor(), (max_t * 1.25).log10().ceil());
    let x = |b: f64| left + (b.log10() - lx0) / (lx1 - lx0) * (w - left - right);
    let y = |t: f64| h - bottom - (t.log10() - ly0) / (ly1 - ly0) * (h - top - bottom);
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
    let mut s = String::new();
    writeln!(s, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">").unwrap();
    writeln!(s, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>").unwrap();
    writeln!(
        s,
        "<text x=\"{}\" y=\"22\" font-size=\"14\">allreduce latency vs size: {} x {} ({} per GPU), {} {}</text>",
        left,
        r.world,
        xml(&r.gpu_model),
        r.ranks_per_gpu,
        ms[0].dtype,
        r.mode
    )
    .unwrap();
    // Axes and grid.
    let mut dec = ly0;
    while dec <= ly1 {
        let t = 10f64.powf(dec);
        writeln!(s, "<line x1=\"{left}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>", w - right, y(t), y(t))
            .unwrap();
        writeln!(s, "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{} us</text>", left - 6.0, y(t) + 4.0, fmt_num(t))
            .unwrap();
        dec += 1.0;
    }
    let mut sizes: Vec<usize> = ms.iter().map(|m| m.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for (i, b) in sizes.iter().enumerate() {
        if sizes.len() > 12 && i % 2 == 1 {
            continue;
        }
        let xb = x(*b as f64);
        writeln!(s, "<line x1=\"{xb:.1}\" x2=\"{xb:.1}\" y1=\"{top}\" y2=\"{}\" stroke=\"#eee\"/>", h - bottom)
            .unwrap();
        writeln!(
            s,
            "<text x=\"{xb:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            h - bottom + 16.0,
            human_bytes(*b)
        )
        .unwrap();
    }
    writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">message size</text>",
        (left + w - right) / 2.0,
        h - 18.0
    )
    .unwrap();
    for (k, name) in series.iter().enumerate() {
        let color = colors[k % colors.len()];
        let pts: Vec<String> = ms
            .iter()
            .filter(|m| &m.selection == name)
            .map(|m| format!("{:.1},{:.1}", x(m.bytes as f64), y(m.median_us)))
            .collect();
        let dash = if name == "nccl" { " stroke-dasharray=\"6 4\"" } else { "" };
        writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{dash} points=\"{}\"/>",
            pts.join(" ")
        )
        .unwrap();
        let ly = top + 20.0 + 18.0 * k as f64;
        writeln!(
            s,
            "<line x1=\"{}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>",
            w - right + 12.0,
            w - right + 40.0
        )
        .unwrap();
        writeln!(s, "<text x=\"{}\" y=\"{}\">{}</text>", w - right + 46.0, ly + 4.0, xml(name)).unwrap();
    }
    writeln!(s, "</svg>").unwrap();
    s
}

fn fmt_num(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// `--compare old.json`: per (size, selection) the ratio old / new median.
pub fn render_compare(old: &Report, new: &Report) -> String {
    let mut out = String::new();
    writeln!(out, "compare: {} ({}) -> {} ({})", old.date_utc, old.gpu_model, new.date_utc, new.gpu_model).unwrap();
    writeln!(out, "{:>9}  {:<14} {:>10} {:>10} {:>8}", "size", "selection", "old us", "new us", "speedup").unwrap();
    for m in &new.measurements {
        if let Some(o) = old.measurements.iter().find(|o| o.bytes == m.bytes && o.selection == m.selection) {
            writeln!(
                out,
                "{:>9}  {:<14} {:>10.2} {:>10.2} {:>7.2}x",
                human_bytes(m.bytes),
                m.selection,
                o.median_us,
                m.median_us,
                o.median_us / m.median_us
            )
            .unwrap();
        }
    }
    out
}
