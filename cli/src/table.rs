//! The one look of every table the CLI prints (comfy-table): ASCII, no
//! outer border, at most [`MAX_WIDTH`] columns (long cells wrap).
#![forbid(unsafe_code)]

use comfy_table::{presets, CellAlignment, ContentArrangement, Table, TableComponent};

/// Widest line a table may print.
pub const MAX_WIDTH: u16 = 120;

/// A table with `header`; the `numeric` columns are right-aligned.
pub fn new<S: ToString>(header: impl IntoIterator<Item = S>, numeric: impl IntoIterator<Item = usize>) -> Table {
    let header: Vec<String> = header.into_iter().map(|h| h.to_string()).collect();
    let mut table = Table::new();
    table.load_preset(presets::ASCII_NO_BORDERS).set_content_arrangement(ContentArrangement::Dynamic);
    // A rule under the header only, none between rows.
    for between_rows in
        [TableComponent::HorizontalLines, TableComponent::MiddleIntersections, TableComponent::LeftBorderIntersections]
    {
        table.remove_style(between_rows);
    }
    table.remove_style(TableComponent::RightBorderIntersections);
    table.set_width(MAX_WIDTH).set_header(header);
    for c in numeric {
        if let Some(column) = table.column_mut(c) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    table
}

/// The table's text, one `\n`-terminated line per row, trailing blanks cut.
pub fn render(table: &Table) -> String {
    table.lines().map(|l| format!("{}\n", l.trim_end())).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_cells_wrap_inside_the_width() {
        let mut t = new(["name", "value"], [1]);
        t.add_row(vec!["x".repeat(300), "1".into()]);
        t.add_row(vec!["short".to_string(), "12345".into()]);
        let text = render(&t);
        assert!(text.lines().all(|l| l.chars().count() <= MAX_WIDTH as usize), "{text}");
        assert!(text.contains("12345"));
        // Right-aligned numbers: "1" ends where "12345" ends.
        let end = |needle: &str| {
            let line = text.lines().find(|l| l.trim_end().ends_with(needle)).unwrap();
            line.trim_end().len()
        };
        assert_eq!(end(" 1"), end("12345"), "{text}");
    }
}
