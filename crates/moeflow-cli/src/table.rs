//! Plain-text tables as the subcommands print them: a header line, then rows of cells in
//! fixed-width columns separated by a space.

/// One column: its header, its width, and whether its cells align left (else right).
#[derive(Clone, Copy, Debug)]
pub struct Column {
    name: &'static str,
    width: usize,
    left: bool,
}

/// A right-aligned column (numbers).
pub const fn right(name: &'static str, width: usize) -> Column {
    Column { name, width, left: false }
}

/// A left-aligned column (names).
pub const fn left(name: &'static str, width: usize) -> Column {
    Column { name, width, left: true }
}

/// The columns of one table.
#[derive(Clone, Debug)]
pub struct Table {
    columns: Vec<Column>,
}

impl Table {
    /// A table of `columns`, in order.
    pub fn new(columns: &[Column]) -> Self {
        Table { columns: columns.to_vec() }
    }

    /// The header line: each column's name at its width.
    pub fn header(&self) -> String {
        let names: Vec<&str> = self.columns.iter().map(|c| c.name).collect();
        self.row(&names)
    }

    /// One row: each cell at its column's width (a longer cell widens its column in this row);
    /// cells past the last column are left out, missing cells are blank.
    pub fn row<S: AsRef<str>>(&self, cells: &[S]) -> String {
        let line: Vec<String> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let cell = cells.get(i).map_or("", |s| s.as_ref());
                if c.left {
                    format!("{cell:<w$}", w = c.width)
                } else {
                    format!("{cell:>w$}", w = c.width)
                }
            })
            .collect();
        line.join(" ").trim_end().to_string()
    }
}

/// `value` with `decimals` digits after the point.
pub fn num(value: f64, decimals: usize) -> String {
    format!("{value:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_align_under_their_headers() {
        let t = Table::new(&[left("strategy", 9), right("ms", 6)]);
        assert_eq!(t.header(), "strategy      ms");
        assert_eq!(t.row(&["all2allv", &num(1.23456, 3)]), "all2allv   1.235");
        assert_eq!(t.row(&["local"]), "local");
        assert_eq!(t.header().len(), t.row(&["x", "1.000"]).len());
    }
}
