//! The sources check of `docs/results.md`: every number the findings state must appear in a
//! published report that its paragraph or section links (issue #35, item 7).
//!
//! How it works:
//!
//! - **Where a number may come from.** The file is split into sections at its `##`, `###` and
//!   `####` headings (the text before the first `##` is the introduction, which inherits nothing
//!   and is inherited by nothing), and sections into paragraphs: runs of non-blank lines, each list
//!   item its own, a table one. A paragraph that links files is checked against the files it
//!   links; one that links none against the file links of every paragraph of its section and of
//!   the sections enclosing it (a directory link counts in its own paragraph only). A link is a relative markdown link (`[text](target)`, its `#fragment`
//!   dropped): a text file (`.md`, `.json`, `.csv`, `.txt`) is a source; a figure image (`.png`,
//!   `.svg`) brings its sibling `.csv`, the numbers drawn, not its own coordinates; a directory
//!   brings every text file under it, except the measurements root (`measurements/`), which brings
//!   only its `README.md` (one link would otherwise source any number). A `.md` report does *not*
//!   bring its sibling `.json`: the live grid's `report.json` holds 46,635 numbers (every
//!   repetition's drift statistics at full precision) and would source almost any figure, so a
//!   number found only in a record is cited by linking the record. In-file anchors are not
//!   sources. A link to a file, directory or anchor that does not exist fails the check.
//! - **Matching.** Numbers are compared by magnitude (a source's `-5.6%` is the prose's "5.6%
//!   below"; `−`, U+2212, is a minus). A *count* — an integer followed by a word that is not a
//!   unit: "317 of", "12 points", "3 seeds" — must equal an integer written in a source. A
//!   *measurement* — decimals, a percentage, a unit after it (`ms`, `s`, `µs`, `req/s`, `×`,
//!   `tokens`, …) or no word after it — written with `d` decimals matches a source number that
//!   rounds to it at `d` decimals: `1.62` matches `1.619`, `556 ms` matches `555.9`, `4.340`
//!   matches `4.34`, `655,280` matches `655280`. A percentage `p%` also matches a source fraction
//!   that rounds to `p / 100` at `d + 2` decimals (`92.7%` matches `0.9270`), because records
//!   (`summary.json`, `calibration.json`) store shares as fractions. A range "11.374–11.666" is
//!   two numbers; "93–94%" and the "[27.8–28.4]" after "28.1%" are percentages. A number right
//!   after `=` that equals the arithmetic written before it ("5 × 8,192 blocks × 16 = 655,360
//!   tokens", `×` before `+` and `−`) is matched by that arithmetic. Nothing else is derived: a
//!   difference, ratio, sum or count that no source prints does not match. Source numbers are
//!   every JSON number and every number in a JSON string or key, and every digit run of a text or
//!   CSV file, with and without thousands separators, whatever it is attached to.
//! - **What is not checked** (each counted by [`Skip`], printed by [`Report::summary`]): numbers
//!   in code spans, fenced code blocks and HTML comments (commands, paths, hashes:
//!   [`Skip::Code`]); in link targets and URLs ([`Skip::Link`]); dates and clock times ("3
//!   December 2026", "1–3 December", "4 Dec", "14:54 UTC": [`Skip::Date`]); references to issues,
//!   figures and sections ("#35", "figure 7", "figures 1–4", "§1–6", a heading's own numbering
//!   "## 3.": [`Skip::Reference`]); numbers that are part of a name (a digit run joined to a
//!   letter, directly or through `-`, `.` or `/`: "ws8-s1.4", "p99", "rep-2", "fig8", a commit
//!   hash "4f3a54f"; a dotted version "2.6.12"; a product's model number or version after
//!   "RTX"/"GTX"/"vLLM": [`Skip::Name`]); and wall-clock durations written in minutes or hours
//!   ("57 min", "2 h 09 min", "11 min 43 s": how long a run took, which no report records:
//!   [`Skip::WallTime`]; durations in seconds are checked). Small bare integers ("3 plan seeds",
//!   "12 points") are checked, as counts.
//! - **Exemptions.** A number that genuinely has no published source — a figure from attempts or
//!   runs that were not published, one computed here from a report's figures (a difference, a
//!   ratio, a count of rows), a wall time in seconds — is exempted by an HTML comment in its
//!   paragraph, invisible when rendered: `<!-- unsourced: <numbers> — <reason> -->`, or
//!   `<!-- unsourced: all — <reason> -->` for a paragraph none of whose numbers has a published
//!   source (a table from a report no longer published, a one-off computation). An exempted number
//!   is not looked up, at any of its occurrences in the paragraph; the reason after the em dash is
//!   required; a comment none of whose numbers occurs in its paragraph fails the check.
//!
//! What it cannot do: it checks that a number is *present* in the sources, not that it is the
//! right cell of them. A big report holds many nearby figures, so [`Report::matched_loosely`]
//! counts the matched numbers that would also have matched moved by ±3 in their last digit: there
//! the check catches a number from no report or from the wrong report, not a wrong digit.
//!
//! [`check_file`] runs it; `crates/experiment/tests/results_sources.rs` runs it on the real
//! `docs/results.md` in the default `cargo test` and fails with one
//! `docs/results.md:LINE: "<number>" has no source in <sources>` line per unsourced number.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Why a number in the results file is not checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Skip {
    /// In a code span, a fenced code block or an HTML comment: commands, paths, hashes.
    Code,
    /// In a link's target or a URL.
    Link,
    /// A date or a clock time.
    Date,
    /// An issue, figure or section reference, or a heading's own numbering.
    Reference,
    /// Part of a name: joined to a letter ("ws8-s1.4", "p99", "rep-2"), or a dotted version.
    Name,
    /// A wall-clock duration in minutes or hours ("57 min", "2 h 09 min", "11 min 43 s").
    WallTime,
}

impl Skip {
    /// Every rule, in the order the summary prints them.
    pub const ALL: [Skip; 6] = [
        Skip::Code,
        Skip::Link,
        Skip::Date,
        Skip::Reference,
        Skip::Name,
        Skip::WallTime,
    ];

    /// The rule in words, for the summary.
    pub fn describe(self) -> &'static str {
        match self {
            Skip::Code => "in code spans, fenced code and comments",
            Skip::Link => "in link targets and URLs",
            Skip::Date => "dates and clock times",
            Skip::Reference => "issue, figure and section references",
            Skip::Name => "part of a name (point, percentile, version, hash)",
            Skip::WallTime => "wall-clock durations in minutes or hours (run times)",
        }
    }
}

/// A number of the results file that none of its paragraph's sources holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsourced {
    /// 1-based line in the results file.
    pub line: usize,
    /// The number as written (sign and thousands separators as in the text).
    pub number: String,
    /// The heading of its section.
    pub section: String,
    /// The link targets searched (its paragraph's, or its section's and the enclosing
    /// sections'), relative to the results file's directory.
    pub sources: Vec<String>,
}

/// What the check found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The results file as named in the messages (e.g. `docs/results.md`).
    pub label: String,
    /// Sections (the introduction counted).
    pub sections: usize,
    /// Distinct source files read.
    pub source_files: usize,
    /// Numbers subject to the check (matched + exempted + unsourced).
    pub checked: usize,
    /// Numbers found in one of their paragraph's sources.
    pub matched: usize,
    /// Of those, matched only as a percentage of a source fraction.
    pub matched_as_fraction: usize,
    /// Of those, matched as the result of the arithmetic written before it ("3 × 4 = 12").
    pub matched_by_arithmetic: usize,
    /// Matched numbers whose neighbours (±3 in the last digit written) match too: where the
    /// sources are too dense to tell a wrong figure from a right one.
    pub matched_loosely: usize,
    /// Numbers exempted by an `unsourced` comment.
    pub exempted: usize,
    /// Of those, by an `unsourced: all` comment.
    pub exempted_by_all: usize,
    /// Exemption comments.
    pub exemption_comments: usize,
    /// Numbers not checked, by rule.
    pub skipped: BTreeMap<Skip, usize>,
    /// Each number not checked, for review: line, the number in its context, rule.
    pub skipped_numbers: Vec<(usize, String, Skip)>,
    /// Numbers with no source.
    pub unsourced: Vec<Unsourced>,
    /// Other failures: missing link targets, malformed or unused exemptions.
    pub problems: Vec<String>,
}

impl Report {
    /// True when every checked number has a source and nothing else failed.
    pub fn is_ok(&self) -> bool {
        self.unsourced.is_empty() && self.problems.is_empty()
    }

    /// One line per failure: `LABEL:LINE: "<number>" has no source in <sources>`, then the
    /// other problems.
    pub fn failures(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .unsourced
            .iter()
            .map(|u| {
                let sources = if u.sources.is_empty() {
                    "(no linked sources)".to_string()
                } else {
                    u.sources.join(", ")
                };
                format!(
                    "{}:{}: \"{}\" has no source in {sources} (section \"{}\")",
                    self.label, u.line, u.number, u.section
                )
            })
            .collect();
        out.extend(self.problems.iter().cloned());
        out
    }

    /// The counts, one per line.
    pub fn summary(&self) -> String {
        let skipped: usize = self.skipped.values().sum();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{}: {} sections, {} source files",
            self.label, self.sections, self.source_files
        );
        let _ = writeln!(
            s,
            "  checked {}: matched {} ({} as a percentage of a fraction, {} as arithmetic), exempted {} (by {} comments; {} by `all`), unsourced {}",
            self.checked,
            self.matched,
            self.matched_as_fraction,
            self.matched_by_arithmetic,
            self.exempted,
            self.exemption_comments,
            self.exempted_by_all,
            self.unsourced.len()
        );
        let _ = writeln!(
            s,
            "  matched loosely {} (the number ±3 in its last digit would have matched too)",
            self.matched_loosely
        );
        let _ = writeln!(s, "  not checked {skipped}:");
        for rule in Skip::ALL {
            let _ = writeln!(
                s,
                "    {:>5}  {}",
                self.skipped.get(&rule).copied().unwrap_or(0),
                rule.describe()
            );
        }
        if !self.problems.is_empty() {
            let _ = writeln!(s, "  other problems {}", self.problems.len());
        }
        s
    }
}

/// Checks `docs/results.md` under the repository root `repo`.
pub fn check_repo(repo: &Path) -> Result<Report> {
    check_file(&repo.join("docs/results.md"), "docs/results.md")
}

/// Checks the results file at `path`; links resolve against its directory, and messages name it
/// `label`.
pub fn check_file(path: &Path, label: &str) -> Result<Report> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    check(&text, dir, label)
}

/// Checks results `text` whose links resolve against `dir`.
pub fn check(text: &str, dir: &Path, label: &str) -> Result<Report> {
    let doc = Doc::parse(text);
    let mut report = Report {
        label: label.to_string(),
        sections: doc.sections.len(),
        ..Report::default()
    };
    let mut sources = SourceCache::new(dir);
    let slugs = doc.slugs();
    // A link target → its files, or why not (reported once).
    let mut resolved: HashMap<String, Option<Vec<PathBuf>>> = HashMap::new();
    for section in &doc.sections {
        for target in &section.links {
            if resolved.contains_key(target) {
                continue;
            }
            let files = match sources.expand(target) {
                Ok(files) => Some(files),
                Err(e) => {
                    report.problems.push(format!(
                        "{label}:{}: a link in this section, {target}: {e:#}",
                        section.line
                    ));
                    None
                }
            };
            resolved.insert(target.clone(), files);
        }
        for anchor in &section.anchors {
            if !slugs.contains_key(anchor.as_str()) {
                report.problems.push(format!(
                    "{label}:{}: a link in this section to #{anchor}, which is no heading of this file",
                    section.line
                ));
            }
        }
    }
    for section in &doc.sections {
        // A paragraph that links files is checked against those; one that links none against
        // every file link of its section and of the sections enclosing it (a directory link
        // counts in its own paragraph only: it brings many files).
        let is_file_link = |t: &&String| !dir.join(t.as_str()).is_dir();
        let mut inherited: BTreeSet<String> =
            section.links.iter().filter(is_file_link).cloned().collect();
        let mut at = section.parent;
        while let Some(k) = at {
            inherited.extend(doc.sections[k].links.iter().filter(is_file_link).cloned());
            at = doc.sections[k].parent;
        }
        for para in &section.paragraphs {
            let targets: BTreeSet<String> = if para.links.is_empty() {
                inherited.clone()
            } else {
                para.links.iter().cloned().collect()
            };
            let mut files: Vec<PathBuf> = Vec::new();
            let mut names: Vec<String> = Vec::new();
            for target in &targets {
                if let Some(Some(paths)) = resolved.get(target) {
                    names.push(target.clone());
                    files.extend(paths.iter().cloned());
                }
            }
            files.sort();
            files.dedup();
            for p in &files {
                sources.load(p)?;
            }
            let index: Vec<&Numbers> = files.iter().map(|p| sources.numbers(p)).collect();
            check_paragraph(para, section, &names, &index, &mut report);
        }
    }
    report.source_files = sources.loaded.len();
    Ok(report)
}

fn check_paragraph(
    para: &Paragraph,
    section: &Section,
    names: &[String],
    index: &[&Numbers],
    report: &mut Report,
) {
    report.exemption_comments += para.exemptions.len();
    let mut used = vec![false; para.exemptions.len()];
    for tok in &para.tokens {
        if let Some(rule) = tok.skip {
            *report.skipped.entry(rule).or_default() += 1;
            report
                .skipped_numbers
                .push((tok.line, tok.context.clone(), rule));
            continue;
        }
        report.checked += 1;
        // An exemption that names the number (or says `all`) states that no report holds it:
        // it is not looked up.
        if let Some(k) = para.exemptions.iter().position(|e| {
            e.problem.is_none() && (e.all || e.numbers.iter().any(|n| n.same_number(tok)))
        }) {
            used[k] = true;
            report.exempted += 1;
            if para.exemptions[k].all {
                report.exempted_by_all += 1;
            }
            continue;
        }
        if let Some(v) = tok.arithmetic
            && (v - tok.value).abs() <= 0.5 * 10f64.powi(-(tok.decimals as i32)) + 1e-9
        {
            report.matched += 1;
            report.matched_by_arithmetic += 1;
            continue;
        }
        match find(index, tok) {
            Found::Yes => report.matched += 1,
            Found::AsFraction => {
                report.matched += 1;
                report.matched_as_fraction += 1;
            }
            Found::No => {
                report.unsourced.push(Unsourced {
                    line: tok.line,
                    number: tok.text.clone(),
                    section: section.title.clone(),
                    sources: names.to_vec(),
                });
                continue;
            }
        }
        // How discriminating the sources are: would the number moved by 3 in its last digit,
        // both ways, have matched too?
        let step = 3.0 * 10f64.powi(-(tok.decimals as i32));
        let moved = |v: f64| Token {
            value: v,
            ..tok.clone()
        };
        let up = !matches!(find(index, &moved(tok.value + step)), Found::No);
        let down = tok.value < step || !matches!(find(index, &moved(tok.value - step)), Found::No);
        if up && down {
            report.matched_loosely += 1;
        }
    }
    for (e, used) in para.exemptions.iter().zip(used) {
        if let Some(problem) = &e.problem {
            report.problems.push(format!(
                "{}:{}: exemption comment {problem}",
                report.label, e.line
            ));
        } else if !used {
            report.problems.push(format!(
                "{}:{}: exemption \"{}\" names no number of its paragraph",
                report.label, e.line, e.raw
            ));
        }
    }
}

enum Found {
    Yes,
    AsFraction,
    No,
}

fn find(index: &[&Numbers], tok: &Token) -> Found {
    let half = 0.5 * 10f64.powi(-(tok.decimals as i32));
    // A count (an integer without a unit) matches an integer as written; a measured quantity
    // matches whatever rounds to it.
    let count = !tok.measured;
    let hit = |n: &&Numbers| {
        if count {
            within(&n.integers, tok.value, 0.0)
        } else {
            within(&n.all, tok.value, half)
        }
    };
    if index.iter().any(hit) {
        return Found::Yes;
    }
    if tok.percent
        && index
            .iter()
            .any(|n| within(&n.all, tok.value / 100.0, half / 100.0))
    {
        return Found::AsFraction;
    }
    Found::No
}

/// Whether sorted `vals` holds a value within `half` of `x` (ties included).
fn within(vals: &[f64], x: f64, half: f64) -> bool {
    let slack = half * (1.0 + 1e-9) + x.abs() * 1e-12;
    let lo = x - slack;
    let hi = x + slack;
    let i = vals.partition_point(|&v| v < lo);
    i < vals.len() && vals[i] <= hi
}

// ---------------------------------------------------------------------------------------------
// The results file: sections, paragraphs, number tokens.

/// A number of the results file.
#[derive(Clone, Debug)]
struct Token {
    /// As written (sign included when one was written).
    text: String,
    /// Magnitude.
    value: f64,
    decimals: usize,
    /// A percentage: followed by `%`, the first of a range that ends in one ("93–94%"), or inside
    /// the "[min–max]" after one.
    percent: bool,
    /// A measured quantity (decimals, a percentage, a unit after it — `ms`, `s`, `×`, … — or no
    /// word after it) rather than a count (an integer followed by a word: "317 of", "12 points").
    measured: bool,
    line: usize,
    /// Char offsets in its block.
    start: usize,
    end: usize,
    /// The value of `a × b + c =` written right before it, if any.
    arithmetic: Option<f64>,
    /// The number with a few characters either side, for review.
    context: String,
    skip: Option<Skip>,
}

impl Token {
    fn same_number(&self, other: &Token) -> bool {
        self.decimals == other.decimals && (self.value - other.value).abs() < 1e-9
    }
}

struct Exemption {
    line: usize,
    raw: String,
    /// `unsourced: all — …`: every number of the paragraph.
    all: bool,
    numbers: Vec<Token>,
    problem: Option<String>,
}

struct Paragraph {
    tokens: Vec<Token>,
    /// Relative link targets in this paragraph, fragment dropped.
    links: Vec<String>,
    exemptions: Vec<Exemption>,
}

struct Section {
    title: String,
    line: usize,
    level: usize,
    parent: Option<usize>,
    /// Relative link targets, fragment dropped.
    links: Vec<String>,
    /// In-file anchors linked.
    anchors: Vec<String>,
    paragraphs: Vec<Paragraph>,
}

struct Doc {
    sections: Vec<Section>,
}

impl Doc {
    fn parse(text: &str) -> Doc {
        let mut sections = vec![Section {
            title: "(introduction)".into(),
            line: 1,
            level: 1,
            parent: None,
            links: Vec::new(),
            anchors: Vec::new(),
            paragraphs: Vec::new(),
        }];
        // Blocks: runs of non-blank lines; a heading line is a block of its own; a fenced code
        // block is one block whose numbers are all code.
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        let mut block: Vec<(usize, &str)> = Vec::new();
        let flush = |block: &mut Vec<(usize, &str)>, sections: &mut Vec<Section>| {
            if block.is_empty() {
                return;
            }
            let cur = sections.last_mut().expect("the introduction");
            let scanned = scan_block(block, false);
            cur.links.extend(scanned.links);
            cur.anchors.extend(scanned.anchors);
            cur.paragraphs.push(scanned.paragraph);
            block.clear();
        };
        while i < lines.len() {
            let line = lines[i];
            let trimmed = line.trim_start();
            if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
                flush(&mut block, &mut sections);
                let fence = &trimmed[..3];
                let start = i;
                i += 1;
                while i < lines.len() && !lines[i].trim_start().starts_with(fence) {
                    i += 1;
                }
                let end = i.min(lines.len() - 1);
                let code: Vec<(usize, &str)> = (start..=end).map(|k| (k + 1, lines[k])).collect();
                let scanned = scan_block(&code, true);
                sections
                    .last_mut()
                    .expect("the introduction")
                    .paragraphs
                    .push(scanned.paragraph);
                i += 1;
                continue;
            }
            if let Some(level) = heading_level(line) {
                flush(&mut block, &mut sections);
                let title = line[level..].trim().to_string();
                if level >= 2 {
                    // The enclosing section: the nearest earlier one of a lower level, never the
                    // introduction.
                    let mut parent = None;
                    for k in (1..sections.len()).rev() {
                        if sections[k].level < level {
                            parent = Some(k);
                            break;
                        }
                    }
                    sections.push(Section {
                        title: title.clone(),
                        line: i + 1,
                        level,
                        parent,
                        links: Vec::new(),
                        anchors: Vec::new(),
                        paragraphs: Vec::new(),
                    });
                }
                let scanned = scan_block(&[(i + 1, line)], false);
                let cur = sections.last_mut().expect("the introduction");
                cur.links.extend(scanned.links);
                cur.anchors.extend(scanned.anchors);
                cur.paragraphs.push(scanned.paragraph);
                i += 1;
                continue;
            }
            if line.trim().is_empty() {
                flush(&mut block, &mut sections);
            } else {
                // Each list item is a paragraph of its own.
                if list_item(line) {
                    flush(&mut block, &mut sections);
                }
                block.push((i + 1, line));
            }
            i += 1;
        }
        flush(&mut block, &mut sections);
        Doc { sections }
    }

    /// GitHub's anchors of the headings → section index.
    fn slugs(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (k, s) in self.sections.iter().enumerate().skip(1) {
            let base = slug(&s.title);
            let n = seen.entry(base.clone()).or_default();
            let name = if *n == 0 {
                base.clone()
            } else {
                format!("{base}-{n}")
            };
            *n += 1;
            out.insert(name, k);
        }
        out
    }
}

/// Whether a line starts a list item (`- `, `* `, `1. `; in a block quote too).
fn list_item(line: &str) -> bool {
    let l = line.trim_start_matches(['>', ' ']);
    if l.starts_with("- ") || l.starts_with("* ") {
        return true;
    }
    let digits = l.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && l[digits..].starts_with(". ")
}

fn heading_level(line: &str) -> Option<usize> {
    let hashes = line.bytes().take_while(|&b| b == b'#').count();
    ((1..=6).contains(&hashes) && line[hashes..].starts_with(' ')).then_some(hashes)
}

/// GitHub's heading anchor: lower case, letters, digits, `-` and `_` kept, spaces to `-`, the
/// rest dropped.
fn slug(title: &str) -> String {
    let mut out = String::new();
    for c in title.chars() {
        if c.is_alphanumeric() || c == '_' || c == '-' {
            out.extend(c.to_lowercase());
        } else if c == ' ' {
            out.push('-');
        }
    }
    out
}

struct Scanned {
    paragraph: Paragraph,
    links: Vec<String>,
    anchors: Vec<String>,
}

const MONTHS: [&str; 24] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
    "Jan",
    "Feb",
    "Mar",
    "Apr",
    "Jun",
    "Jul",
    "Aug",
    "Sep",
    "Sept",
    "Oct",
    "Nov",
    "Dec",
];

const REFERENCE_WORDS: [&str; 12] = [
    "figure", "figures", "fig", "section", "sections", "issue", "issues", "item", "items", "PR",
    "§", "Figure",
];

/// Words before a product's model number or version ("RTX 3090", "vLLM 0.32").
const PRODUCT_WORDS: [&str; 3] = ["RTX", "GTX", "vLLM"];

fn is_month(word: &str) -> bool {
    MONTHS.contains(&word)
}

/// Scans one block (a paragraph, a heading, or a fenced code block when `code`).
fn scan_block(lines: &[(usize, &str)], code: bool) -> Scanned {
    // The block as one char vector with each char's line, so spans may cross lines.
    let mut chars: Vec<char> = Vec::new();
    let mut line_of: Vec<usize> = Vec::new();
    for (n, l) in lines {
        for c in l.chars() {
            chars.push(c);
            line_of.push(*n);
        }
        chars.push('\n');
        line_of.push(*n);
    }
    let mut mask: Vec<Option<Skip>> = vec![if code { Some(Skip::Code) } else { None }; chars.len()];
    let mut links = Vec::new();
    let mut anchors = Vec::new();
    let mut exemptions = Vec::new();
    // HTML comments: their numbers are not the text's (an exemption names its numbers there).
    let mut hidden = vec![false; chars.len()];
    if !code {
        mask_spans(
            &chars,
            &line_of,
            &mut mask,
            &mut hidden,
            &mut links,
            &mut anchors,
            &mut exemptions,
        );
    }
    let heading = !code && lines.len() == 1 && heading_level(lines[0].1).is_some();
    let tokens = tokenize(&chars, &line_of, &mask, heading)
        .into_iter()
        .filter(|t| !hidden[t.start])
        .collect();
    Scanned {
        paragraph: Paragraph {
            tokens,
            links: links.clone(),
            exemptions,
        },
        links,
        anchors,
    }
}

fn starts_with_at(chars: &[char], i: usize, pat: &str) -> bool {
    let pat: Vec<char> = pat.chars().collect();
    chars.get(i..i + pat.len()) == Some(pat.as_slice())
}

/// Marks code spans, HTML comments (parsing exemptions), link targets and URLs; collects links.
fn mask_spans(
    chars: &[char],
    line_of: &[usize],
    mask: &mut [Option<Skip>],
    hidden: &mut [bool],
    links: &mut Vec<String>,
    anchors: &mut Vec<String>,
    exemptions: &mut Vec<Exemption>,
) {
    let n = chars.len();
    let mut i = 0;
    while i < n {
        let c = chars[i];
        if c == '`' {
            let run = chars[i..].iter().take_while(|&&c| c == '`').count();
            // The closing run of the same length.
            let mut k = i + run;
            let mut close = None;
            while k < n {
                if chars[k] == '`' {
                    let r = chars[k..].iter().take_while(|&&c| c == '`').count();
                    if r == run {
                        close = Some(k);
                        break;
                    }
                    k += r;
                } else {
                    k += 1;
                }
            }
            match close {
                Some(k) => {
                    for m in &mut mask[i..k + run] {
                        *m = Some(Skip::Code);
                    }
                    i = k + run;
                }
                None => i += run,
            }
            continue;
        }
        if starts_with_at(chars, i, "<!--") {
            let end = (i + 4..n)
                .find(|&k| starts_with_at(chars, k, "-->"))
                .map_or(n, |k| k + 3);
            let body: String = chars[i + 4..end.saturating_sub(3).max(i + 4)]
                .iter()
                .collect();
            if let Some(rest) = body.trim().strip_prefix("unsourced:") {
                exemptions.push(parse_exemption(rest, line_of[i]));
            }
            for k in i..end {
                mask[k] = Some(Skip::Code);
                hidden[k] = true;
            }
            i = end;
            continue;
        }
        if c == ']' && i + 1 < n && chars[i + 1] == '(' {
            let end = (i + 2..n).find(|&k| chars[k] == ')').unwrap_or(n - 1);
            let target: String = chars[i + 2..end].iter().collect();
            let target = target.trim();
            if let Some(anchor) = target.strip_prefix('#') {
                anchors.push(anchor.to_string());
            } else if !target.contains("://") && !target.starts_with("mailto:") {
                let path = target.split('#').next().unwrap_or("");
                if !path.is_empty() {
                    links.push(path.to_string());
                }
            }
            for m in &mut mask[i + 1..=end] {
                *m = Some(Skip::Link);
            }
            i = end + 1;
            continue;
        }
        if starts_with_at(chars, i, "http://") || starts_with_at(chars, i, "https://") {
            let end = (i..n)
                .find(|&k| chars[k].is_whitespace() || chars[k] == '>' || chars[k] == ')')
                .unwrap_or(n);
            for m in &mut mask[i..end] {
                *m = Some(Skip::Link);
            }
            i = end;
            continue;
        }
        i += 1;
    }
}

fn parse_exemption(rest: &str, line: usize) -> Exemption {
    let raw = rest.trim().to_string();
    let (numbers, reason) = match rest.split_once('—') {
        Some((nums, reason)) => (nums, reason.trim()),
        None => (rest, ""),
    };
    let all = numbers.trim() == "all";
    let chars: Vec<char> = numbers.chars().collect();
    let line_of = vec![line; chars.len()];
    let mask = vec![None; chars.len()];
    let numbers: Vec<Token> = tokenize(&chars, &line_of, &mask, false)
        .into_iter()
        .filter(|t| t.skip.is_none())
        .collect();
    let problem = if reason.is_empty() {
        Some(format!(
            "\"{raw}\" gives no reason (write `<!-- unsourced: <numbers> — <reason> -->`)"
        ))
    } else if numbers.is_empty() && !all {
        Some(format!("\"{raw}\" names no number (or `all`)"))
    } else {
        None
    };
    Exemption {
        line,
        raw,
        all,
        numbers,
        problem,
    }
}

/// Units after which an integer is a rounded measurement rather than a count.
const UNITS: [&str; 18] = [
    "ms", "s", "µs", "us", "ns", "min", "h", "req/s", "×", "x", "MB", "kB", "KB", "GB", "MiB",
    "GiB", "KiB", "tokens",
];

/// Whether a unit of [`UNITS`] starts at `i` (after spaces).
fn has_unit(chars: &[char], i: usize) -> bool {
    UNITS.contains(&unit_after(chars, i).as_str())
}

/// The word (letters, `/`, `×`) at `i`, after spaces.
fn unit_after(chars: &[char], i: usize) -> String {
    let mut k = i;
    while k < chars.len() && chars[k] == ' ' {
        k += 1;
    }
    let start = k;
    while k < chars.len() && (chars[k].is_alphabetic() || chars[k] == '/' || chars[k] == '×') {
        k += 1;
    }
    chars[start..k].iter().collect()
}

/// A character of the words between the numbers of written arithmetic ("blocks", "req/s").
fn is_unit_word_char(c: char) -> bool {
    c.is_alphabetic() || c.is_whitespace() || c == '-' || c == '/'
}

fn is_word_char(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

/// The word (letters, or `§`) that ends right before `i`, skipping spaces.
fn word_before(chars: &[char], i: usize) -> String {
    let mut k = i;
    while k > 0 && chars[k - 1] == ' ' {
        k -= 1;
    }
    if k > 0 && chars[k - 1] == '§' {
        return "§".into();
    }
    // "fig. 3"
    if k > 0 && chars[k - 1] == '.' {
        k -= 1;
    }
    let end = k;
    while k > 0 && chars[k - 1].is_alphabetic() {
        k -= 1;
    }
    chars[k..end].iter().collect()
}

/// The word that starts at or after `i`, skipping spaces and one comma.
fn word_after(chars: &[char], i: usize) -> String {
    let mut k = i;
    while k < chars.len() && (chars[k] == ' ' || chars[k] == ',') {
        k += 1;
    }
    let start = k;
    while k < chars.len() && chars[k].is_alphabetic() {
        k += 1;
    }
    chars[start..k].iter().collect()
}

/// A raw digit run with optional thousands groups and decimals starting at `i`: (end, digits
/// without separators, decimals).
fn number_at(chars: &[char], i: usize) -> (usize, String, usize) {
    let n = chars.len();
    let mut k = i;
    let mut digits = String::new();
    while k < n && chars[k].is_ascii_digit() {
        digits.push(chars[k]);
        k += 1;
    }
    // Thousands groups: ",ddd" not followed by a digit, only after 1–3 leading digits.
    if digits.len() <= 3 {
        while k + 3 < n
            && chars[k] == ','
            && chars[k + 1..k + 4].iter().all(char::is_ascii_digit)
            && !(k + 4 < n && chars[k + 4].is_ascii_digit())
        {
            digits.extend(&chars[k + 1..k + 4]);
            k += 4;
        }
    }
    let mut decimals = 0;
    if k + 1 < n && chars[k] == '.' && chars[k + 1].is_ascii_digit() {
        digits.push('.');
        k += 1;
        while k < n && chars[k].is_ascii_digit() {
            digits.push(chars[k]);
            decimals += 1;
            k += 1;
        }
    }
    (k, digits, decimals)
}

/// The numbers of a scanned block, each with the rule that skips it, if any.
fn tokenize(chars: &[char], line_of: &[usize], mask: &[Option<Skip>], heading: bool) -> Vec<Token> {
    let n = chars.len();
    let mut out: Vec<Token> = Vec::new();
    // (end, skip) of the previous number, for ranges that continue a date or a reference.
    let mut prev: Option<(usize, Option<Skip>)> = None;
    // Inside "[min–max]" right after a percentage ("28.1% [27.8–28.4]"): percentages too.
    let mut percent_range = false;
    let mut i = 0;
    while i < n {
        if !chars[i].is_ascii_digit() {
            match chars[i] {
                '[' => {
                    let mut k = i;
                    while k > 0 && chars[k - 1] == ' ' {
                        k -= 1;
                    }
                    percent_range = k > 0 && chars[k - 1] == '%';
                }
                ']' => percent_range = false,
                _ => {}
            }
            i += 1;
            continue;
        }
        let start = i;
        let (mut end, digits, decimals) = number_at(chars, i);
        let mut skip = mask[start..end].iter().find_map(|m| *m);
        // A dotted version "2.6.12": the whole chain is a name.
        if end + 1 < n && chars[end] == '.' && chars[end + 1].is_ascii_digit() {
            while end < n && (chars[end].is_ascii_digit() || chars[end] == '.') {
                end += 1;
            }
            skip = skip.or(Some(Skip::Name));
        }
        let before = if start > 0 { chars[start - 1] } else { ' ' };
        let before2 = if start > 1 { chars[start - 2] } else { ' ' };
        let after = if end < n { chars[end] } else { ' ' };
        // Joined to a letter: directly, or through `-`, `.`, `/` (a name, a hash, a path).
        if skip.is_none()
            && (is_word_char(before)
                || is_word_char(after)
                || (matches!(before, '-' | '.' | '/' | '#') && is_word_char(before2)))
        {
            skip = Some(Skip::Name);
        }
        // A product's model number: "RTX 3090".
        if skip.is_none() && PRODUCT_WORDS.contains(&word_before(chars, start).as_str()) {
            skip = Some(Skip::Name);
        }
        if skip.is_none() && before == '#' {
            skip = Some(Skip::Reference);
        }
        // A heading's own numbering: "## 3. …".
        if skip.is_none() && heading {
            let lead: String = chars[..start].iter().collect();
            if lead.trim_end().chars().all(|c| c == '#') && after == '.' {
                skip = Some(Skip::Reference);
            }
        }
        if skip.is_none() {
            let wb = word_before(chars, start);
            let wb_lower = wb.to_lowercase();
            if REFERENCE_WORDS.contains(&wb.as_str())
                || REFERENCE_WORDS.contains(&wb_lower.as_str())
            {
                skip = Some(Skip::Reference);
            }
        }
        if skip.is_none() && decimals == 0 && digits.len() <= 2 {
            // "3 December", "1–3 December", "3 Dec": a day.
            let mut day = is_month(&word_after(chars, end));
            if !day {
                // "1–3 December": a day range.
                let mut k = end;
                while k < n && chars[k] == ' ' {
                    k += 1;
                }
                if k < n && matches!(chars[k], '–' | '-') {
                    k += 1;
                    while k < n && chars[k] == ' ' {
                        k += 1;
                    }
                    if k < n && chars[k].is_ascii_digit() {
                        let (e, d, dec) = number_at(chars, k);
                        day = dec == 0 && d.len() <= 2 && is_month(&word_after(chars, e));
                    }
                }
            }
            // "Dec 3", "December 3"
            day = day || is_month(&word_before(chars, start));
            // "14:54": a clock time.
            let clock = (after == ':'
                && end + 2 < n
                && chars[end + 1..end + 3].iter().all(char::is_ascii_digit))
                || (before == ':' && before2.is_ascii_digit() && end - start == 2);
            if day || clock {
                skip = Some(Skip::Date);
            }
        }
        if skip.is_none() {
            // A wall-clock duration in minutes or hours ("57 min", "2 h 09 min", "1 m 44 s"):
            // how long a run took, which no report records.
            let unit = unit_after(chars, end);
            let seconds_of_minutes = unit == "s"
                && matches!(prev, Some((pend, Some(Skip::WallTime))) if {
                    let between: String = chars[pend..start].iter().collect();
                    matches!(between.trim(), "min" | "m" | "h")
                });
            let minutes = unit == "m" && {
                let mut k = end;
                while k < n && !chars[k].is_ascii_digit() && k < end + 4 {
                    k += 1;
                }
                k < n
                    && chars[k].is_ascii_digit()
                    && unit_after(chars, number_at(chars, k).0) == "s"
            };
            if unit == "min" || unit == "h" || minutes || seconds_of_minutes {
                skip = Some(Skip::WallTime);
            }
        }
        if skip.is_none() && decimals == 0 && digits.len() == 4 {
            // A year after a month: "December 2026", "3 Dec 2026".
            let year: u32 = digits.parse().unwrap_or(0);
            if (1990..=2099).contains(&year) && is_month(&word_before(chars, start)) {
                skip = Some(Skip::Date);
            }
        }
        if skip.is_none() {
            // The second number of a range of references or dates: "figures 1–4", "§1–6".
            if let Some((pend, Some(pskip @ (Skip::Reference | Skip::Date)))) = prev {
                let between: String = chars[pend..start].iter().collect();
                let between = between.trim();
                let joins = matches!(between, "–" | "-")
                    || (pskip == Skip::Reference && matches!(between, "," | "and" | "§"));
                if joins {
                    skip = Some(pskip);
                }
            }
        }
        let value: f64 = digits.parse().unwrap_or(f64::NAN);
        // The sign as written, for the message.
        let sign = match before {
            '−' | '+' | '±' => Some(before),
            '-' if !before2.is_ascii_digit() => Some('-'),
            _ => None,
        };
        let mut text: String = chars[start..end].iter().collect();
        if let Some(s) = sign {
            text.insert(0, s);
        }
        let mut k = end;
        while k < n && chars[k] == ' ' {
            k += 1;
        }
        let mut percent = (k < n && chars[k] == '%') || percent_range;
        // Where its unit is read: after it, or after the range it opens ("556–951 ms").
        let mut unit_at = k;
        if k < n && chars[k] == '%' {
            text.push('%');
        } else if !percent && k < n && chars[k] == '–' {
            let mut j = k + 1;
            while j < n && chars[j] == ' ' {
                j += 1;
            }
            if j < n && chars[j].is_ascii_digit() {
                let (e, _, _) = number_at(chars, j);
                // The first number of a range of percentages: "93–94%".
                percent = e < n && chars[e] == '%';
                unit_at = e;
            }
        }
        // A count is an integer followed by a word that is not a unit ("317 of", "12 points");
        // anything else is a (rounded) measurement.
        let word_follows = unit_after(chars, unit_at)
            .chars()
            .next()
            .is_some_and(char::is_alphabetic);
        let measured = percent || decimals > 0 || has_unit(chars, unit_at) || !word_follows;
        let arithmetic = if skip.is_none() {
            arithmetic_before(chars, start, &out)
        } else {
            None
        };
        out.push(Token {
            text,
            value,
            decimals,
            percent,
            measured,
            line: line_of[start],
            start,
            end,
            arithmetic,
            context: chars[start.saturating_sub(12)..(end + 8).min(n)]
                .iter()
                .map(|&c| if c == '\n' { ' ' } else { c })
                .collect(),
            skip,
        });
        prev = Some((end, skip));
        i = end;
    }
    out
}

/// The value of the arithmetic written right before the number at `start`: numbers joined by
/// `×`, `+`, `−` (a unit word may follow each number) and then `=`, as in "5 × 8,192 blocks × 16 =
/// 655,360 tokens" or "1,100 + 6 × 150 = 2,000". `×` binds before `+` and `−`.
fn arithmetic_before(chars: &[char], start: usize, before: &[Token]) -> Option<f64> {
    let gap = |from: usize, to: usize| -> String { chars[from..to].iter().collect() };
    let last = before.last()?;
    let tail = gap(last.end, start);
    let tail = tail.trim_end();
    let words = tail.strip_suffix('=')?;
    if !words.chars().all(is_unit_word_char) {
        return None;
    }
    // Operands backwards: (operator before it, value).
    let mut terms: Vec<(char, f64)> = Vec::new();
    let mut k = before.len() - 1;
    loop {
        let tok = &before[k];
        if tok.skip.is_some() || tok.percent {
            return None;
        }
        let op = if k == 0 {
            None
        } else {
            let g = gap(before[k - 1].end, tok.start);
            let g = g.trim();
            let op = g.chars().last();
            let head = &g[..g.len() - op.map_or(0, char::len_utf8)];
            match op {
                Some(c @ ('×' | '+' | '−')) if head.chars().all(is_unit_word_char) => Some(c),
                _ => None,
            }
        };
        match op {
            Some(c) => {
                terms.push((c, tok.value));
                k -= 1;
            }
            None => {
                terms.push(('+', tok.value));
                break;
            }
        }
    }
    if terms.len() < 2 {
        return None;
    }
    terms.reverse();
    // terms[i].0 is the operator before operand i (the first's is a placeholder '+').
    let mut sum = 0.0;
    let mut product = terms[0].1;
    let mut sign = 1.0;
    for &(op, v) in &terms[1..] {
        match op {
            '×' => product *= v,
            _ => {
                sum += sign * product;
                sign = if op == '−' { -1.0 } else { 1.0 };
                product = v;
            }
        }
    }
    Some(sum + sign * product)
}

// ---------------------------------------------------------------------------------------------
// Sources: files and the numbers in them.

const TEXT_EXTENSIONS: [&str; 4] = ["md", "json", "csv", "txt"];

struct SourceCache {
    dir: PathBuf,
    loaded: HashMap<PathBuf, Numbers>,
}

impl SourceCache {
    fn new(dir: &Path) -> SourceCache {
        SourceCache {
            dir: dir.to_path_buf(),
            loaded: HashMap::new(),
        }
    }

    /// The files a link target brings.
    fn expand(&self, target: &str) -> Result<Vec<PathBuf>> {
        let path = self.dir.join(target);
        if path.is_dir() {
            let canonical = path.canonicalize()?;
            let root = self.dir.join("measurements");
            if root.is_dir() && canonical == root.canonicalize()? {
                let readme = path.join("README.md");
                return Ok(if readme.is_file() {
                    vec![readme]
                } else {
                    Vec::new()
                });
            }
            let mut out = Vec::new();
            walk(&path, &mut out)?;
            out.sort();
            return Ok(out);
        }
        if !path.is_file() {
            anyhow::bail!("no such file or directory: {}", path.display());
        }
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let mut out = Vec::new();
        match ext {
            "png" | "svg" => {
                let csv = path.with_extension("csv");
                if csv.is_file() {
                    out.push(csv);
                }
            }
            e if TEXT_EXTENSIONS.contains(&e) => out.push(path.clone()),
            _ => {}
        }
        Ok(out)
    }

    fn load(&mut self, path: &Path) -> Result<()> {
        if self.loaded.contains_key(path) {
            return Ok(());
        }
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut vals = Vec::new();
        let is_json = path.extension().is_some_and(|e| e == "json");
        match is_json
            .then(|| serde_json::from_str::<serde_json::Value>(&text).ok())
            .flatten()
        {
            Some(v) => json_numbers(&v, &mut vals),
            None => text_numbers(&text, &mut vals),
        }
        self.loaded
            .insert(path.to_path_buf(), Numbers::from_pairs(vals));
        Ok(())
    }

    fn numbers(&self, path: &Path) -> &Numbers {
        static EMPTY: Numbers = Numbers {
            all: Vec::new(),
            integers: Vec::new(),
        };
        self.loaded.get(path).unwrap_or(&EMPTY)
    }
}

fn is_text(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| TEXT_EXTENSIONS.contains(&e))
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if is_text(&path) {
            out.push(path);
        }
    }
    Ok(())
}

/// A source's numbers, magnitudes sorted: all of them, and those written as integers.
struct Numbers {
    all: Vec<f64>,
    integers: Vec<f64>,
}

impl Numbers {
    fn from_pairs(pairs: Vec<(f64, bool)>) -> Numbers {
        let mut all = Vec::with_capacity(pairs.len());
        let mut integers = Vec::new();
        for (v, integer) in pairs {
            if !v.is_finite() {
                continue;
            }
            all.push(v.abs());
            if integer {
                integers.push(v.abs());
            }
        }
        for v in [&mut all, &mut integers] {
            v.sort_by(f64::total_cmp);
            v.dedup();
        }
        Numbers { all, integers }
    }
}

/// Every number of a JSON value (`true` for one written as an integer), and the numbers in its
/// strings and keys.
fn json_numbers(v: &serde_json::Value, out: &mut Vec<(f64, bool)>) {
    match v {
        serde_json::Value::Number(n) => {
            if let Some(x) = n.as_f64() {
                out.push((x, !n.is_f64()));
            }
        }
        serde_json::Value::String(s) => text_numbers(s, out),
        serde_json::Value::Array(a) => a.iter().for_each(|x| json_numbers(x, out)),
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                text_numbers(k, out);
                json_numbers(x, out);
            }
        }
        _ => {}
    }
}

/// Every digit run of a text, with decimals, and also read with its thousands separators
/// (`true` for one written without decimals).
fn text_numbers(text: &str, out: &mut Vec<(f64, bool)>) {
    let chars: Vec<char> = text.chars().collect();
    let n = chars.len();
    let mut i = 0;
    while i < n {
        if !chars[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        // Plain: digits and decimals, no separators.
        let mut k = i;
        while k < n && chars[k].is_ascii_digit() {
            k += 1;
        }
        if k + 1 < n && chars[k] == '.' && chars[k + 1].is_ascii_digit() {
            k += 1;
            while k < n && chars[k].is_ascii_digit() {
                k += 1;
            }
        }
        let plain: String = chars[i..k].iter().collect();
        if let Ok(v) = plain.parse::<f64>() {
            out.push((v, !plain.contains('.')));
        }
        // With thousands separators, when there are any.
        let (e, digits, decimals) = number_at(&chars, i);
        if e > k
            && let Ok(v) = digits.parse::<f64>()
        {
            out.push((v, decimals == 0));
        }
        i = k;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(s: &str) -> Vec<(String, Option<Skip>)> {
        let block: Vec<(usize, &str)> = s.lines().enumerate().map(|(i, l)| (i + 1, l)).collect();
        scan_block(&block, false)
            .paragraph
            .tokens
            .into_iter()
            .map(|t| (t.text, t.skip))
            .collect()
    }

    #[test]
    fn tokens_and_their_rules() {
        let t = toks(
            "at ws8-s1.4 prefix-affinity 11.374 [11.374–11.666] (×1.610, −5.6%) on 3 December 2026, 14:54 UTC; 655,280 tokens; figures 1–4, #35, `cargo x --rate 4.077`, p99 0.6–3 ms",
        );
        let got: Vec<(&str, Option<Skip>)> = t.iter().map(|(s, k)| (s.as_str(), *k)).collect();
        assert_eq!(
            got,
            vec![
                ("8", Some(Skip::Name)),
                ("1.4", Some(Skip::Name)),
                ("11.374", None),
                ("11.374", None),
                ("11.666", None),
                ("1.610", None),
                ("−5.6%", None),
                ("3", Some(Skip::Date)),
                ("2026", Some(Skip::Date)),
                ("14", Some(Skip::Date)),
                ("54", Some(Skip::Date)),
                ("655,280", None),
                ("1", Some(Skip::Reference)),
                ("4", Some(Skip::Reference)),
                ("35", Some(Skip::Reference)),
                ("4.077", Some(Skip::Code)),
                ("99", Some(Skip::Name)),
                ("0.6", None),
                ("3", None),
            ]
        );
    }

    #[test]
    fn day_ranges_versions_and_headings() {
        let t = toks("1–3 December, 4 Dec, HAProxy 2.6.12, 120-s warm-up, 2,048-token");
        let got: Vec<(&str, Option<Skip>)> = t.iter().map(|(s, k)| (s.as_str(), *k)).collect();
        assert_eq!(
            got,
            vec![
                ("1", Some(Skip::Date)),
                ("3", Some(Skip::Date)),
                ("4", Some(Skip::Date)),
                ("2.6.12", Some(Skip::Name)),
                ("120", None),
                ("2,048", None),
            ]
        );
        let h = toks("## 3. What spill buys (figure 3)");
        assert!(h.iter().all(|(_, k)| *k == Some(Skip::Reference)), "{h:?}");
    }

    #[test]
    fn counts_measurements_arithmetic_and_wall_times() {
        let block = |s: &str| {
            let b: Vec<(usize, &str)> = vec![(1, s)];
            scan_block(&b, false).paragraph.tokens
        };
        // "317 of" is a count, "556 ms" and "2,134 /" are measurements.
        let t = block("317 of the 324 repetitions; p99 556–951 ms; 2,134 / 11.35 ms");
        let measured: Vec<(&str, bool)> = t
            .iter()
            .filter(|t| t.skip.is_none())
            .map(|t| (t.text.as_str(), t.measured))
            .collect();
        assert_eq!(
            measured,
            vec![
                ("317", false),
                ("324", false),
                ("556", true),
                ("951", true),
                ("2,134", true),
                ("11.35", true)
            ]
        );
        // Percentages: "93–94%" and the range after "28.1%".
        let t = block("93–94% of them, 28.1% [27.8–28.4]");
        assert!(t.iter().all(|t| t.percent), "{t:?}");
        // Written arithmetic.
        let t = block("5 × 8,192 blocks × 16 = 655,360 tokens");
        assert_eq!(t[3].arithmetic, Some(655_360.0));
        // Wall times in minutes or hours, and a product's model number.
        let t = block("2 h 09 min, 11 min 43 s, 1 m 44 s, 12 s; an RTX 3090");
        let skips: Vec<Option<Skip>> = t.iter().map(|t| t.skip).collect();
        assert_eq!(
            skips,
            vec![
                Some(Skip::WallTime),
                Some(Skip::WallTime),
                Some(Skip::WallTime),
                Some(Skip::WallTime),
                Some(Skip::WallTime),
                Some(Skip::WallTime),
                None,
                Some(Skip::Name)
            ]
        );
    }

    #[test]
    fn rounding_matches() {
        let vals = [0.096, 1.619, 26.2, 655280.0];
        assert!(within(&vals, 1.62, 0.005));
        assert!(!within(&vals, 1.63, 0.005));
        assert!(within(&vals, 26.0, 0.5));
        assert!(within(&vals, 655280.0, 0.5));
        assert!(within(&vals, 0.096, 0.0005));
    }

    #[test]
    fn slugs_follow_github() {
        assert_eq!(
            slug(
                "The live pressure grid on the full fleet, each point at its own capacity (figures 1–4)"
            ),
            "the-live-pressure-grid-on-the-full-fleet-each-point-at-its-own-capacity-figures-14"
        );
        assert_eq!(slug("Real engine: llama.cpp"), "real-engine-llamacpp");
    }
}
