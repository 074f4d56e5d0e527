//! The report as text: a header, one table row per kernel, the
//! memory-ordering detail per kernel, notes, files and a summary line.
#![forbid(unsafe_code)]

use std::fmt::Write as _;

use super::ptx_text::{Access, PtxStats, Space};
use super::tools::Resources;
use super::Report;
use crate::table;

/// `a/b/c/d` for four counts.
fn slashed(values: &[u32]) -> String {
    values.iter().map(u32::to_string).collect::<Vec<_>>().join("/")
}

/// Bit widths of the load/store columns.
const WIDTHS: [u32; 4] = [128, 64, 32, 16];

/// The report as text: a header, two tables (resources and ordering; memory
/// operations) with one row per kernel, the memory-ordering detail per
/// kernel, notes, files and a summary line. No line is wider than 120.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "tp-allreduce inspect {}: PTX {}, ptxas {} ({})",
        report.arch,
        report.ptx_origin,
        report.ptxas_version.as_deref().unwrap_or("?"),
        report.ptxas.display()
    );
    out.push_str(
        "  regs, stack, spill (store/load bytes), bar: ptxas -v. Other columns: static counts in the PTX,\n  \
         callees included. acq/rel.sys: system-scope acquire/release operations; fence: sys/narrower;\n  \
         atom: atom+red; loops: natural loops (deepest nesting). * = hot kernel (no local memory allowed)\n",
    );
    out.push_str(&table::render(&resources_table(report)));
    out.push_str(
        "\n  ld.g/st.g: global loads/stores of 128/64/32/16 bits (any qualifier); gen: generic-space\n  \
         loads/stores; bar s/r: bar.sync/bar.red; gtimer: %globaltimer reads\n",
    );
    out.push_str(&table::render(&memory_table(report)));
    let paths: Vec<_> = report.kernels.iter().filter_map(|k| k.first_peer_store.map(|p| (&k.name, p))).collect();
    if !paths.is_empty() {
        out.push_str("\nsentinel kernels, entry -> first peer store (SASS, program order; LDG and BAR before it):\n");
        for (name, p) in paths {
            let _ =
                writeln!(out, "  {name}: {} instructions, {} LDG, {} BAR", p.instructions, p.global_loads, p.barriers);
        }
    }
    out.push_str("\nmemory-ordering detail (static counts by space, qualifier and width; fences; atomics):\n");
    for k in &report.kernels {
        out.push_str(&detail(&k.name, &k.ptx));
    }
    for note in &report.notes {
        let _ = writeln!(out, "note: {note}");
    }
    let _ = writeln!(out, "wrote {} files to {}", report.files.len(), report.out_dir.display());
    let _ = writeln!(out, "{}", summary(report));
    out
}

fn kernel_label(name: &str, hot: bool) -> String {
    format!("{name}{}", if hot { "*" } else { "" })
}

fn resources_table(report: &Report) -> comfy_table::Table {
    let header = ["kernel", "regs", "stack", "spill", "bar", "acq.sys", "rel.sys", "fence", "atom", "loops"];
    let mut t = table::new(header, 1..10);
    for k in &report.kernels {
        let p = &k.ptx;
        let mut row = vec![kernel_label(&k.name, k.hot)];
        row.extend(match &k.resources {
            Some(r) => [
                r.registers.to_string(),
                r.stack_frame_bytes.to_string(),
                format!("{}/{}", r.spill_store_bytes, r.spill_load_bytes),
                r.barriers.to_string(),
            ],
            None => ["?".into(), "?".into(), "?".into(), "?".into()],
        });
        row.extend([
            p.sys_acquire.to_string(),
            p.sys_release.to_string(),
            format!("{}/{}", p.sys_fences(), p.other_fences()),
            p.atomics.values().sum::<u32>().to_string(),
            format!("{}({})", p.loops, p.max_loop_depth),
        ]);
        t.add_row(row);
    }
    t
}

fn memory_table(report: &Report) -> comfy_table::Table {
    let header = ["kernel", "ld.g 128/64/32/16", "st.g 128/64/32/16", "gen ld/st", "bar s/r", "gtimer"];
    let mut t = table::new(header, 1..6);
    for k in &report.kernels {
        let p = &k.ptx;
        let loads: Vec<u32> = WIDTHS.iter().map(|&b| p.count(Access::Load, Space::Global, b)).collect();
        let stores: Vec<u32> = WIDTHS.iter().map(|&b| p.count(Access::Store, Space::Global, b)).collect();
        let barrier = |name: &str| p.barriers.get(name).copied().unwrap_or(0);
        t.add_row(vec![
            kernel_label(&k.name, k.hot),
            slashed(&loads),
            slashed(&stores),
            format!("{}/{}", p.count_space(Access::Load, Space::Generic), p.count_space(Access::Store, Space::Generic)),
            format!("{}/{}", barrier("bar.sync"), barrier("bar.red")),
            p.globaltimer_reads.to_string(),
        ]);
    }
    t
}

/// One kernel's detail: `  name:` then its counts, wrapped at 120 columns.
fn detail(name: &str, p: &PtxStats) -> String {
    let mut items: Vec<String> = p
        .memory
        .iter()
        .filter(|(op, _)| op.space != Space::Generic)
        .map(|(op, n)| format!("{}={n}", op.label()))
        .collect();
    items.extend(p.fences.iter().chain(&p.atomics).map(|(k, n)| format!("{k}={n}")));
    if !p.callees.is_empty() {
        items.push(format!("calls={}", p.callees.join(",")));
    }
    if p.indirect_calls > 0 {
        items.push(format!("indirect-calls={}", p.indirect_calls));
    }
    wrap(&format!("  {name}:"), &items, 120)
}

/// `first` then `items` separated by spaces, continued on lines indented
/// by four when a line would pass `width`.
fn wrap(first: &str, items: &[String], width: usize) -> String {
    let mut out = String::new();
    let mut line = first.to_string();
    for item in items {
        if line.len() + 1 + item.len() > width && line.trim().len() > 4 {
            out.push_str(&line);
            out.push('\n');
            line = "    ".to_string();
            line.push_str(item);
        } else {
            line.push(' ');
            line.push_str(item);
        }
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// Three lines: kernel count and register range, local-memory users, totals.
pub fn summary(report: &Report) -> String {
    let n = report.kernels.len();
    let hot = report.kernels.iter().filter(|k| k.hot).count();
    let with_res: Vec<(&str, Resources)> =
        report.kernels.iter().filter_map(|k| k.resources.map(|r| (k.name.as_str(), r))).collect();
    let max = with_res.iter().max_by_key(|(_, r)| r.registers);
    let local: Vec<&str> = with_res.iter().filter(|(_, r)| r.uses_local_memory()).map(|(n, _)| *n).collect();
    let hot_local = local.iter().filter(|name| report.kernels.iter().any(|k| k.hot && k.name == **name)).count();
    let total = |f: &dyn Fn(&PtxStats) -> u32| report.kernels.iter().map(|k| f(&k.ptx)).sum::<u32>();
    format!(
        "summary {}: {n} kernels ({hot} hot); max {} registers{};\nlocal memory (stack or spills) in {} kernels \
         ({hot_local} hot){};\n{} sys-acquire, {} sys-release, {} sys-fences, {} atomics, {} loops",
        report.arch,
        max.map(|(_, r)| r.registers).unwrap_or(0),
        max.map(|(n, _)| format!(" ({n})")).unwrap_or_default(),
        local.len(),
        if local.is_empty() { String::new() } else { format!(": {}", local.join(", ")) },
        total(&|p| p.sys_acquire),
        total(&|p| p.sys_release),
        total(&|p| p.sys_fences()),
        total(&|p| p.atomics.values().sum()),
        total(&|p| p.loops),
    )
}

#[cfg(test)]
mod tests {
    use super::wrap;

    #[test]
    fn wrapping_keeps_lines_inside_the_width() {
        let items: Vec<String> = (0..40).map(|i| format!("ld.global.acquire.sys.{i}=1")).collect();
        let text = wrap("  kernel:", &items, 120);
        assert!(text.lines().count() > 1, "{text}");
        assert!(text.lines().all(|l| l.len() <= 120), "{text}");
        assert!(text.lines().skip(1).all(|l| l.starts_with("    ")), "{text}");
        assert_eq!(text.matches('=').count(), 40);
        assert_eq!(wrap("  k:", &[], 120), "  k:\n");
    }
}
