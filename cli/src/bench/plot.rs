//! The latency plot (`latency.svg`): median time vs message size, log-log,
//! one line per selection (NCCL dashed), drawn with plotters' SVG backend.
#![forbid(unsafe_code)]

use plotters::coord::combinators::BindKeyPoints;
use plotters::prelude::*;

use super::report::Report;
use crate::table::human_bytes;

const COLORS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// The plot as SVG text; an empty SVG when there is nothing to plot.
pub fn render_svg(r: &Report) -> String {
    let mut svg = String::new();
    let drawn = draw(r, &mut svg);
    if drawn.is_err() || svg.is_empty() {
        return "<svg xmlns=\"http://www.w3.org/2000/svg\"/>".into();
    }
    svg
}

/// Every selection, in order of first appearance.
fn series(r: &Report) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for m in &r.measurements {
        if !names.contains(&m.selection) {
            names.push(m.selection.clone());
        }
    }
    names
}

fn draw(r: &Report, svg: &mut String) -> Result<(), Box<dyn std::error::Error>> {
    let ms = &r.measurements;
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if ms.is_empty() || !ms.iter().all(|m| m.bytes > 0 && positive(m.median_us)) {
        return Err("nothing to plot".into());
    }
    let (min_b, max_b) = ms.iter().fold((f64::MAX, 0f64), |(a, b), m| (a.min(m.bytes as f64), b.max(m.bytes as f64)));
    let (min_t, max_t) = ms.iter().fold((f64::MAX, 0f64), |(a, b), m| (a.min(m.median_us), b.max(m.median_us)));
    let sizes: Vec<usize> = {
        let mut s: Vec<usize> = ms.iter().map(|m| m.bytes).collect();
        s.sort_unstable();
        s.dedup();
        s
    };
    let root = SVGBackend::with_string(svg, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "allreduce latency vs size: {} x {} ({} per GPU), {} {}",
        r.world, r.gpu_model, r.ranks_per_gpu, ms[0].dtype, r.mode
    );
    // Ticks at the measured sizes (every other one when there are many).
    let label_every = if sizes.len() > 12 { 2 } else { 1 };
    let ticks: Vec<f64> = sizes.iter().step_by(label_every).map(|&b| b as f64).collect();
    let x_range = LogCoord::from((min_b * 0.9..max_b * 1.1).log_scale()).with_key_points(ticks);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range, (min_t * 0.8..max_t * 1.25).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("message size")
        .y_desc("median us per allreduce")
        .x_label_formatter(&|b| human_bytes(*b as usize))
        .y_label_formatter(&|t| if *t >= 1.0 { format!("{t:.0}") } else { format!("{t:.2}") })
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()?;
    for (k, name) in series(r).iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let points: Vec<(f64, f64)> =
            ms.iter().filter(|m| &m.selection == name).map(|m| (m.bytes as f64, m.median_us)).collect();
        let style = color.stroke_width(2);
        let legend_style = style;
        if name == "nccl" {
            chart.draw_series(DashedLineSeries::new(points, 6, 4, style))?
        } else {
            chart.draw_series(LineSeries::new(points, style))?
        }
        .label(name.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], legend_style));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.9)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::tests::sample_report;

    #[test]
    fn every_selection_is_a_line_with_a_legend_entry() {
        let svg = render_svg(&sample_report()).replace('\n', "");
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("allreduce latency vs size: 8 x NVIDIA H200"), "{svg}");
        for label in [">auto<", ">nccl<", ">42 KB<", ">message size<"] {
            assert!(svg.contains(label), "{label} missing");
        }
        // One polyline per series plus two legend samples, at least.
        assert!(svg.matches("<polyline").count() + svg.matches("<path").count() >= 2, "{svg}");
    }

    #[test]
    fn an_empty_report_gives_an_empty_svg() {
        let mut r = sample_report();
        r.measurements.clear();
        assert_eq!(render_svg(&r), "<svg xmlns=\"http://www.w3.org/2000/svg\"/>");
        let mut r = sample_report();
        r.measurements[0].median_us = f64::NAN;
        assert_eq!(render_svg(&r), "<svg xmlns=\"http://www.w3.org/2000/svg\"/>");
    }
}
