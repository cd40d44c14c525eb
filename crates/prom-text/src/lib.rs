//! The Prometheus text exposition format (version 0.0.4), read side.
//!
//! One parser for the whole workspace: the router reads each replica's KV usage with it, the
//! harness reads cache shapes and lateness histograms. [`parse_line`] classifies one line;
//! [`samples`] yields every sample of a scrape and skips malformed lines, so one odd line in a
//! foreign exposition costs only itself.
//!
//! The grammar (<https://prometheus.io/docs/instrumenting/exposition_formats/>):
//!
//! ```text
//! # HELP name docstring            docstring escapes: \\ and \n
//! # TYPE name counter|gauge|histogram|summary|untyped
//! # anything else is a comment
//! name[{label="value",…}] value [timestamp_ms]
//! ```
//!
//! Names may contain colons (`vllm:num_requests_running`); label values escape `\\`, `\"` and
//! `\n` and may hold commas and braces; a trailing comma before `}` is allowed; tokens may be
//! separated by blanks and tabs; values are Go floats (`+Inf`, `-Inf`, `NaN`, exponents).

use std::fmt;

/// The declared type of a metric family (`# TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    /// `counter`.
    Counter,
    /// `gauge`.
    Gauge,
    /// `histogram`.
    Histogram,
    /// `summary`.
    Summary,
    /// `untyped`.
    Untyped,
}

impl MetricType {
    fn parse(s: &str) -> Option<MetricType> {
        Some(match s {
            "counter" => MetricType::Counter,
            "gauge" => MetricType::Gauge,
            "histogram" => MetricType::Histogram,
            "summary" => MetricType::Summary,
            "untyped" => MetricType::Untyped,
            _ => return None,
        })
    }
}

/// One sample line: metric name, labels, value, optional timestamp.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name as on the wire (e.g. `vllm:cache_config_info`, `x_bucket`).
    pub name: String,
    /// Label pairs in wire order, values unescaped.
    pub labels: Vec<(String, String)>,
    /// The sample value.
    pub value: f64,
    /// Milliseconds since the Unix epoch, when the line carries one.
    pub timestamp_ms: Option<i64>,
}

impl Sample {
    /// The value of label `key`, if present.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// What one line of an exposition is.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    /// Empty or only blanks.
    Blank,
    /// A `#` line that is neither HELP nor TYPE (text after the `#`).
    Comment(String),
    /// `# HELP name docstring`, docstring unescaped.
    Help {
        /// Metric family name.
        name: String,
        /// The docstring.
        text: String,
    },
    /// `# TYPE name type`.
    Type {
        /// Metric family name.
        name: String,
        /// The declared type.
        kind: MetricType,
    },
    /// A sample.
    Sample(Sample),
}

/// Why a line is not valid exposition text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// Byte offset in the line where parsing stopped.
    pub column: usize,
    /// What was expected there.
    pub reason: &'static str,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "column {}: {}", self.column, self.reason)
    }
}

impl std::error::Error for ParseError {}

/// Every sample of an exposition, in order; blank, comment, HELP and TYPE lines and malformed
/// lines are skipped.
pub fn samples(text: &str) -> impl Iterator<Item = Sample> + '_ {
    text.lines().filter_map(|line| match parse_line(line) {
        Ok(Line::Sample(s)) => Some(s),
        _ => None,
    })
}

/// A sample value: a Go float as Prometheus writes it (`1`, `2.5e-3`, `+Inf`, `-Inf`, `NaN`).
pub fn parse_value(s: &str) -> Option<f64> {
    // Rust's float syntax is Go's minus hex floats and underscores, which the exposition
    // never uses; it takes `inf`, `infinity` and `nan` in any case, with an optional sign.
    s.parse().ok()
}

/// Classifies and parses one line (without its newline).
pub fn parse_line(line: &str) -> Result<Line, ParseError> {
    let mut c = Cursor { s: line, at: 0 };
    c.skip_blanks();
    if c.done() {
        return Ok(Line::Blank);
    }
    if c.eat('#') {
        return Ok(comment(&mut c));
    }
    sample(&mut c).map(Line::Sample)
}

fn comment(c: &mut Cursor<'_>) -> Line {
    let body = c.rest().to_string();
    c.skip_blanks();
    let keyword = c.token();
    if keyword != "HELP" && keyword != "TYPE" {
        return Line::Comment(body);
    }
    c.skip_blanks();
    let name = c.token().to_string();
    if name.is_empty() {
        return Line::Comment(body);
    }
    if keyword == "HELP" {
        // One blank separates the name from the docstring; the rest is the docstring verbatim.
        if matches!(c.peek(), Some(' ' | '\t')) {
            c.at += 1;
        }
        return Line::Help {
            name,
            text: unescape_help(c.rest()),
        };
    }
    c.skip_blanks();
    let kind = c.token();
    c.skip_blanks();
    match MetricType::parse(kind) {
        Some(kind) if c.done() => Line::Type { name, kind },
        _ => Line::Comment(body),
    }
}

fn unescape_help(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(ch) = chars.next() {
        if ch != '\\' {
            out.push(ch);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('\\') => out.push('\\'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

fn sample(c: &mut Cursor<'_>) -> Result<Sample, ParseError> {
    let name = c.name(true);
    if name.is_empty() {
        return Err(c.error("a metric name"));
    }
    let name = name.to_string();
    c.skip_blanks();
    let labels = if c.eat('{') { labels(c)? } else { Vec::new() };
    c.skip_blanks();
    let value_at = c.at;
    let value = c.token();
    if value.is_empty() {
        return Err(c.error("a value"));
    }
    let value = parse_value(value).ok_or(ParseError {
        column: value_at,
        reason: "a float value",
    })?;
    c.skip_blanks();
    let timestamp_ms = if c.done() {
        None
    } else {
        let at = c.at;
        let ts = c.token().parse().map_err(|_| ParseError {
            column: at,
            reason: "an integer timestamp (ms)",
        })?;
        c.skip_blanks();
        if !c.done() {
            return Err(c.error("the end of the line after the timestamp"));
        }
        Some(ts)
    };
    Ok(Sample {
        name,
        labels,
        value,
        timestamp_ms,
    })
}

/// Label pairs after `{`, through the closing `}`.
fn labels(c: &mut Cursor<'_>) -> Result<Vec<(String, String)>, ParseError> {
    let mut labels = Vec::new();
    loop {
        c.skip_blanks();
        if c.eat('}') {
            return Ok(labels);
        }
        let key = c.name(false);
        if key.is_empty() {
            return Err(c.error("a label name or `}`"));
        }
        let key = key.to_string();
        c.skip_blanks();
        if !c.eat('=') {
            return Err(c.error("`=` after the label name"));
        }
        c.skip_blanks();
        if !c.eat('"') {
            return Err(c.error("a quoted label value"));
        }
        let mut value = String::new();
        loop {
            match c.next() {
                None => return Err(c.error("the closing quote of the label value")),
                Some('"') => break,
                Some('\\') => match c.next() {
                    Some('n') => value.push('\n'),
                    Some(escaped) => value.push(escaped),
                    None => return Err(c.error("an escaped character")),
                },
                Some(ch) => value.push(ch),
            }
        }
        labels.push((key, value));
        c.skip_blanks();
        if c.eat(',') {
            continue;
        }
        if c.eat('}') {
            return Ok(labels);
        }
        return Err(c.error("`,` or `}` after the label value"));
    }
}

/// A position in one line.
struct Cursor<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.at..]
    }

    fn done(&self) -> bool {
        self.at >= self.s.len()
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn next(&mut self) -> Option<char> {
        let ch = self.peek()?;
        self.at += ch.len_utf8();
        Some(ch)
    }

    fn eat(&mut self, want: char) -> bool {
        if self.peek() == Some(want) {
            self.at += want.len_utf8();
            true
        } else {
            false
        }
    }

    fn skip_blanks(&mut self) {
        while matches!(self.peek(), Some(' ' | '\t')) {
            self.at += 1;
        }
    }

    /// Up to the next blank or tab.
    fn token(&mut self) -> &'a str {
        let rest = self.rest();
        let end = rest.find([' ', '\t']).unwrap_or(rest.len());
        self.at += end;
        &rest[..end]
    }

    /// `[a-zA-Z_:][a-zA-Z0-9_:]*` for metric names, the same without `:` for label names.
    fn name(&mut self, colons: bool) -> &'a str {
        let rest = self.rest();
        let end = rest
            .char_indices()
            .find(|&(i, ch)| {
                let ok = ch.is_ascii_alphabetic()
                    || ch == '_'
                    || (colons && ch == ':')
                    || (i > 0 && ch.is_ascii_digit());
                !ok
            })
            .map_or(rest.len(), |(i, _)| i);
        self.at += end;
        &rest[..end]
    }

    fn error(&self, reason: &'static str) -> ParseError {
        ParseError {
            column: self.at,
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(line: &str) -> Sample {
        match parse_line(line) {
            Ok(Line::Sample(s)) => s,
            other => panic!("`{line}` is not a sample: {other:?}"),
        }
    }

    #[test]
    fn help_type_and_comments() {
        assert_eq!(parse_line(""), Ok(Line::Blank));
        assert_eq!(parse_line(" \t "), Ok(Line::Blank));
        assert_eq!(
            parse_line(r"# HELP vllm:cache_config_info Information of the \\ config\nsecond line"),
            Ok(Line::Help {
                name: "vllm:cache_config_info".into(),
                text: "Information of the \\ config\nsecond line".into(),
            })
        );
        assert_eq!(
            parse_line("#  TYPE\tx_seconds   histogram "),
            Ok(Line::Type {
                name: "x_seconds".into(),
                kind: MetricType::Histogram,
            })
        );
        assert_eq!(
            parse_line("# TYPE x bogus"),
            Ok(Line::Comment(" TYPE x bogus".into()))
        );
        assert_eq!(
            parse_line("# just a remark"),
            Ok(Line::Comment(" just a remark".into()))
        );
        assert_eq!(parse_line("#"), Ok(Line::Comment(String::new())));
    }

    #[test]
    fn a_line_with_a_timestamp() {
        let s = one(r#"http_requests_total{method="post",code="200"} 1027 1395066363000"#);
        assert_eq!(s.name, "http_requests_total");
        assert_eq!(s.label("code"), Some("200"));
        assert_eq!(s.value, 1027.0);
        assert_eq!(s.timestamp_ms, Some(1_395_066_363_000));
        let s = one("vllm:kv_cache_usage_perc 0.25 -17");
        assert_eq!((s.value, s.timestamp_ms), (0.25, Some(-17)));
        assert_eq!(one("up 1").timestamp_ms, None);
    }

    #[test]
    fn labels_with_escapes_commas_braces_and_blanks() {
        let s = one(
            r#"msdos_file_access_time_seconds{path="C:\\DIR\\FILE.TXT",error="Cannot find file:\n\"FILE.TXT\"",x="a,b}c"} 1.458255915e9"#,
        );
        assert_eq!(s.label("path"), Some(r"C:\DIR\FILE.TXT"));
        assert_eq!(s.label("error"), Some("Cannot find file:\n\"FILE.TXT\""));
        assert_eq!(s.label("x"), Some("a,b}c"));
        assert_eq!(s.value, 1.458255915e9);
        let s = one("m { a = \"1\" ,\tb=\"2\", } 3");
        assert_eq!(
            s.labels,
            vec![("a".into(), "1".into()), ("b".into(), "2".into())]
        );
        assert_eq!(one("m{} 4").labels, vec![]);
        // Label order is kept as on the wire.
        let s = one(r#"vllm:cache_config_info{num_gpu_blocks="2048",block_size="16"} 1.0"#);
        assert_eq!(s.labels[0].0, "num_gpu_blocks");
    }

    #[test]
    fn special_values() {
        assert_eq!(one(r#"h_bucket{le="+Inf"} 7"#).label("le"), Some("+Inf"));
        assert_eq!(parse_value("+Inf"), Some(f64::INFINITY));
        assert_eq!(parse_value("Inf"), Some(f64::INFINITY));
        assert_eq!(parse_value("-Inf"), Some(f64::NEG_INFINITY));
        assert!(parse_value("NaN").unwrap().is_nan());
        assert_eq!(parse_value("2.5e-3"), Some(0.0025));
        assert_eq!(parse_value("1e3"), Some(1000.0));
        assert_eq!(parse_value("x"), None);
        assert_eq!(one("g +Inf").value, f64::INFINITY);
        assert_eq!(one("g -Inf 5").value, f64::NEG_INFINITY);
        assert!(one("g NaN").value.is_nan());
    }

    #[test]
    fn malformed_lines_are_errors_and_skipped() {
        for bad in [
            r#"m{a="unterminated} 1"#,
            r#"m{a=1} 1"#,
            r#"m{a="1" b="2"} 1"#,
            "m",
            "m{} ",
            "m 1 2 3",
            "m 1 12.5",
            "m one",
            "{a=\"1\"} 1",
            "9m 1",
        ] {
            assert!(parse_line(bad).is_err(), "`{bad}` parsed");
        }
        let text = "# TYPE a gauge\na 1\nbroken{ 2\n\nb{x=\"y\"} 3 1700000000000\n";
        let all: Vec<Sample> = samples(text).collect();
        assert_eq!(all.len(), 2);
        assert_eq!((all[0].name.as_str(), all[0].value), ("a", 1.0));
        assert_eq!(all[1].timestamp_ms, Some(1_700_000_000_000));
        let e = parse_line("m 1 x").unwrap_err();
        assert_eq!(e.column, 4);
        assert_eq!(e.to_string(), "column 4: an integer timestamp (ms)");
    }
}
