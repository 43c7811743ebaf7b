//! A small CSV reader (RFC 4180: quoted fields, doubled quotes, CRLF) whose errors name the
//! file, the line and the column.

use std::collections::BTreeMap;

use anyhow::{Context, bail};

/// A CSV file read whole: its header and its rows.
#[derive(Debug)]
pub struct Table {
    /// What the file is called in messages.
    pub name: String,
    columns: BTreeMap<String, usize>,
    rows: Vec<(usize, Vec<String>)>,
}

/// One row of a [`Table`], with its line number for messages.
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    table: &'a Table,
    line: usize,
    cells: &'a [String],
}

/// Splits CSV text into records of fields, each with the line it starts on.
fn records(text: &str) -> anyhow::Result<Vec<(usize, Vec<String>)>> {
    let mut out = Vec::new();
    let mut fields = Vec::new();
    let mut field = String::new();
    let (mut line, mut start, mut quoted, mut was_quoted) = (1usize, 1usize, false, false);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if quoted {
            match c {
                '"' if chars.peek() == Some(&'"') => {
                    chars.next();
                    field.push('"');
                }
                '"' => quoted = false,
                '\n' => {
                    line += 1;
                    field.push(c);
                }
                _ => field.push(c),
            }
            continue;
        }
        match c {
            '"' if field.is_empty() && !was_quoted => {
                quoted = true;
                was_quoted = true;
            }
            ',' => {
                fields.push(std::mem::take(&mut field));
                was_quoted = false;
            }
            '\r' => {}
            '\n' => {
                fields.push(std::mem::take(&mut field));
                was_quoted = false;
                if !(fields.len() == 1 && fields[0].is_empty()) {
                    out.push((start, std::mem::take(&mut fields)));
                }
                fields.clear();
                line += 1;
                start = line;
            }
            _ => field.push(c),
        }
    }
    if quoted {
        bail!("line {start}: a quoted field is not closed");
    }
    if !field.is_empty() || !fields.is_empty() {
        fields.push(field);
        out.push((start, fields));
    }
    Ok(out)
}

impl Table {
    /// Parses `text`, the file `name`; every row must have the header's number of fields.
    pub fn parse(name: &str, text: &str) -> anyhow::Result<Self> {
        let mut records = records(text).with_context(|| name.to_owned())?.into_iter();
        let Some((_, header)) = records.next() else {
            bail!("{name}: empty, expected a header line");
        };
        let mut columns = BTreeMap::new();
        for (i, h) in header.iter().enumerate() {
            if columns.insert(h.trim().to_owned(), i).is_some() {
                bail!("{name}: column {:?} appears twice in the header", h.trim());
            }
        }
        let mut rows = Vec::new();
        for (line, cells) in records {
            if cells.len() != header.len() {
                bail!(
                    "{name} line {line}: {} fields where the header has {}",
                    cells.len(),
                    header.len()
                );
            }
            rows.push((line, cells));
        }
        Ok(Self {
            name: name.to_owned(),
            columns,
            rows,
        })
    }

    /// Refuses the table unless it has every column in `needed`.
    pub fn require(&self, needed: &[&str]) -> anyhow::Result<()> {
        for c in needed {
            if !self.columns.contains_key(*c) {
                bail!("{}: no column {c:?} in the header", self.name);
            }
        }
        Ok(())
    }

    /// The rows.
    pub fn rows(&self) -> impl Iterator<Item = Row<'_>> {
        self.rows.iter().map(|(line, cells)| Row {
            table: self,
            line: *line,
            cells,
        })
    }
}

impl<'a> Row<'a> {
    /// Where this row is, for messages: `file line N`.
    pub fn at(&self) -> String {
        format!("{} line {}", self.table.name, self.line)
    }

    /// The cell of `column`, trimmed; `None` when the column is absent or the cell empty.
    pub fn get(&self, column: &str) -> Option<&'a str> {
        let i = *self.table.columns.get(column)?;
        let cell = self.cells.get(i)?.trim();
        (!cell.is_empty()).then_some(cell)
    }

    /// The cell of `column`, which must be there.
    pub fn text(&self, column: &str) -> anyhow::Result<&'a str> {
        self.get(column)
            .with_context(|| format!("{}: {column} is empty", self.at()))
    }

    /// The cell of `column` as a number, if there.
    pub fn f64_opt(&self, column: &str) -> anyhow::Result<Option<f64>> {
        let Some(cell) = self.get(column) else {
            return Ok(None);
        };
        match cell.parse::<f64>() {
            Ok(x) if x.is_finite() => Ok(Some(x)),
            _ => bail!("{}: {column} {cell:?} is not a number", self.at()),
        }
    }

    /// The cell of `column` as a number, which must be there.
    pub fn f64(&self, column: &str) -> anyhow::Result<f64> {
        self.f64_opt(column)?
            .with_context(|| format!("{}: {column} is empty", self.at()))
    }

    /// The cell of `column` as a whole number, if there; a leading integer is read from cells
    /// like `8192 (expert); 16384 (dense mlp)`.
    pub fn u32_opt(&self, column: &str) -> anyhow::Result<Option<u32>> {
        let Some(cell) = self.get(column) else {
            return Ok(None);
        };
        let digits: String = cell.chars().take_while(char::is_ascii_digit).collect();
        // Only a note after whitespace may follow the number.
        let rest = &cell[digits.len()..];
        let number = if rest.is_empty() || rest.starts_with(char::is_whitespace) {
            digits.as_str()
        } else {
            cell
        };
        match number.parse::<u32>() {
            Ok(x) => Ok(Some(x)),
            Err(_) => bail!("{}: {column} {cell:?} is not a whole number", self.at()),
        }
    }

    /// The cell of `column` as a whole number, which must be there.
    pub fn u32(&self, column: &str) -> anyhow::Result<u32> {
        self.u32_opt(column)?
            .with_context(|| format!("{}: {column} is empty", self.at()))
    }

    /// The cell of `column` as `true`/`false`, if there.
    pub fn bool_opt(&self, column: &str) -> anyhow::Result<Option<bool>> {
        match self.get(column).map(str::to_ascii_lowercase).as_deref() {
            None => Ok(None),
            Some("true") => Ok(Some(true)),
            Some("false") => Ok(Some(false)),
            Some(other) => bail!("{}: {column} {other:?} is not true or false", self.at()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_fields_and_bad_rows() {
        let t = Table::parse("t.csv", "a,b\n\"x, \"\"y\"\"\",2\r\n3,\n").unwrap();
        let rows: Vec<_> = t.rows().collect();
        assert_eq!(rows[0].get("a"), Some("x, \"y\""));
        assert_eq!(rows[0].f64("b").unwrap(), 2.0);
        assert_eq!(rows[1].get("b"), None);
        let err = rows[1].f64("b").unwrap_err().to_string();
        assert!(
            err.contains("t.csv line 3") && err.contains("b is empty"),
            "{err}"
        );
        let err = Table::parse("t.csv", "a,b\n1,2,3\n").unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("3 fields"), "{err}");
        let err = Table::parse("t.csv", "a,b\n\"1,2\n").unwrap_err();
        assert!(format!("{err:#}").contains("not closed"), "{err:#}");
        let t = Table::parse("t.csv", "a\nzz\n").unwrap();
        let err = t.rows().next().unwrap().f64("a").unwrap_err().to_string();
        assert!(err.contains("a \"zz\" is not a number"), "{err}");
        assert!(t.require(&["a", "q"]).unwrap_err().to_string().contains("\"q\""));
        let t = Table::parse("t.csv", "n\n8192 (expert); 16384 (dense mlp)\n40x96\n").unwrap();
        let rows: Vec<_> = t.rows().collect();
        assert_eq!(rows[0].u32("n").unwrap(), 8192);
        let err = rows[1].u32("n").unwrap_err().to_string();
        assert!(err.contains("t.csv line 3: n \"40x96\""), "{err}");
    }
}
