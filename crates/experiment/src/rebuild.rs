//! The rebuild check: everything published under `docs/measurements/` and `docs/figures/` that
//! the code derives from rows (each sweep's `report.md` / `report.json`, each fault run's
//! `summary.md` / `summary.json` / `timeline.csv`, the cross-checks whose both sides have rows,
//! and every figure) is rebuilt with today's code and compared byte for byte with the committed
//! file. A difference names the file and its first differing line. Directories that cannot be
//! rebuilt from what is published are listed in [`EXEMPT`] with the reason.
//!
//! With `write`, the differing files are replaced by the rebuilt ones — except a report or
//! summary that already names today's [`analysis::RULES_VERSION`]: its bytes changing under an
//! unchanged version means a rule changed without the version saying so, and that is refused.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Published directories that are not rebuilt, and why.
pub const EXEMPT: &[(&str, &str)] = &[
    (
        "fault-drain-quick",
        "published without its router rows (copied by hand before `publish` kept them), so its summary cannot be rebuilt; superseded by `fault-drain/`",
    ),
    (
        "fault-kill-quick",
        "published without its router rows (copied by hand before `publish` kept them), so its summary cannot be rebuilt; superseded by `fault-kill-quick-capacity/`",
    ),
    (
        "llama-step-floors",
        "raw output of `python3 scripts/llama_step_floors.py` (each request as measured); nothing in it is derived",
    ),
    (
        "vllm-step-floors",
        "raw output of `python3 scripts/vllm_step_floors.py` (each request as measured); nothing in it is derived",
    ),
    (
        "load-virtual",
        "virtual sweep published as its report only (no rows); rebuilt by re-running `cargo xtask sweep load --virtual`",
    ),
    (
        "llama-emulated-pressure-grid-quick-virtual",
        "virtual sweep published as its report only (no rows); rebuilt by re-running `bash scripts/llama-quick.sh virtual`",
    ),
    (
        "pressure-grid-virtual",
        "virtual sweep published as its report only (no rows); rebuilt by re-running `cargo xtask sweep pressure-grid --virtual`",
    ),
    (
        "pressure-grid-virtual-live-cal",
        "virtual sweep published as its report only (no rows); rebuilt by re-running `cargo xtask sweep pressure-grid --virtual --live-calibration docs/measurements/pressure-grid/calibration.json --capacity per-point --sweep-dir-name pressure-grid-virtual-live-cal`",
    ),
    (
        "pressure-grid-virtual-load0.9",
        "virtual sweep published as its report only (no rows); rebuilt by re-running `cargo xtask sweep pressure-grid --virtual --load 0.9 --sweep-dir-name pressure-grid-virtual-load0.9`",
    ),
    (
        "pressure-grid-quick-policy-capacity-virtual",
        "virtual per-policy capacity of the quick grid, judged by a live quick calibration, published as its report and each search's record (no rows); rebuilt by re-running `cargo xtask sweep pressure-grid --quick --virtual --policy-capacity --live-calibration docs/measurements/pressure-grid-quick-policy-capacity-virtual/calibration.json` (12 s)",
    ),
    (
        "pressure-grid-live-policy-capacity",
        "live per-policy capacity published as its reports, each search's record and prediction and each step's meta and rows; the reports are `analysis::capacity`'s of the records, rebuilt by re-running the same `cargo xtask sweep pressure-grid --policy-capacity` command, which reuses every record",
    ),
    (
        "trace-quick-policy-capacity-virtual",
        "virtual per-policy capacity on the trace, published as its report and each search's record (no rows: a search's steps are deleted once recorded); rebuilt by re-running `cargo xtask sweep trace --trace ../shared/traces/mooncake-conversation.jsonl --quick --virtual --policy-capacity` with its flags (docs/measurements/README.md; 12 s)",
    ),
    (
        "trace-quick-b16-policy-capacity-virtual",
        "the same at 16 tokens per hash id, published as its report and each search's record (no rows); rebuilt by re-running that command with `--trace-block-tokens 16` (9 s)",
    ),
    (
        "pressure-grid-virtual-policy-capacity",
        "virtual per-policy capacity published as its report and each search's record (no rows: a search's steps are deleted once recorded); rebuilt by re-running `cargo xtask sweep pressure-grid --virtual --policy-capacity` (57 min on the 2-core machine)",
    ),
    (
        "pressure-grid-virtual-ttl-spill",
        "virtual per-policy capacity of prefix-affinity's TTL and spill variants at ws1-s0 and ws3-s0, published as its report and each search's record (no rows: a search's steps are deleted once recorded); rebuilt by re-running `cargo xtask sweep pressure-grid --virtual --policy-capacity --points ws1-s0-load1.0,ws3-s0-load1.0 --policies session-affinity,prefix-affinity,prefix-affinity-spill-off --ttl-scale 0.5,1,2 --spill-abs 2,8,16,32 --spill-ratio 1.25,2 --sweep-dir-name pressure-grid-virtual-ttl-spill` (185 s on the 2-core machine)",
    ),
    (
        "pressure-grid-virtual-ttl-spill-no-groups",
        "the same variants on the workload without prefix groups, published as its report and each search's record (no rows); rebuilt by re-running the `pressure-grid-virtual-ttl-spill` command with `--prefix-groups 0 --sweep-dir-name pressure-grid-virtual-ttl-spill-no-groups` (124 s on the 2-core machine)",
    ),
    (
        "pressure-grid-virtual-ttl-at-point",
        "virtual per-policy capacity of prefix-affinity with the index TTL derived at each point's own rate beside its defaults, every point, published as its report, each search's record and each derived TTL (`point-ttl.json`; no rows: a search's steps and the deriving run are deleted once recorded); rebuilt by re-running `cargo xtask sweep pressure-grid --virtual --policy-capacity --policies prefix-affinity --ttl-at-point --sweep-dir-name pressure-grid-virtual-ttl-at-point` (167 s on the 2-core machine)",
    ),
    (
        "pressure-grid-virtual-shared",
        "virtual sweep published as its report only (no rows); rebuilt by re-running its virtual sweep (docs/measurements/README.md)",
    ),
];

/// Published cross-checks: the live directory holding `crosscheck.{md,json}`, the virtual
/// directory it was checked against, and the baseline policy. A cross-check whose virtual side
/// is exempt (published without rows) is exempt with it.
pub const CROSSCHECKS: &[(&str, &str, &str)] = &[
    ("crosscheck-live", "crosscheck-virtual", "session-affinity"),
    (
        "pressure-grid",
        "pressure-grid-virtual-live-cal",
        "session-affinity",
    ),
];

/// Figures drawn from a sweep other than the one [`figures::Sources::discover`] picks: the
/// subdirectory of the figures directory, the grid sweep they are drawn from, and which figures.
/// Every other source stays the discovered one: figures 1 and 2 of such a set lead with the
/// capacity panel of the published per-policy capacity report, as the main set's do, and
/// figure 10 (that report alone) is drawn, and checked, with the main set.
pub const FIGURE_SETS: &[(&str, &str, &[figures::FigureId])] = &[(
    "closed-loop",
    "pressure-grid-closed-loop",
    &[
        figures::FigureId::PressureMap,
        figures::FigureId::WinnersMap,
        figures::FigureId::Mechanism,
        figures::FigureId::KnowledgeLadder,
        figures::FigureId::Belief,
    ],
)];

/// One committed file that today's code rebuilds differently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// The committed file.
    pub path: PathBuf,
    /// Where it first differs, as a sentence: a line number with both lines, a byte offset, or
    /// that one of the two does not exist.
    pub first: String,
}

/// What a rebuild found.
#[derive(Debug, Clone, Default)]
pub struct Rebuilt {
    /// Files rebuilt and compared.
    pub checked: Vec<PathBuf>,
    /// Those that differ from the committed file.
    pub differences: Vec<Difference>,
    /// What was not rebuilt, and why.
    pub exempt: Vec<(String, String)>,
    /// Files replaced (with `write`).
    pub written: Vec<PathBuf>,
}

/// Settings of a rebuild.
#[derive(Debug, Clone)]
pub struct RebuildSettings {
    /// The published measurements (`docs/measurements`).
    pub measurements: PathBuf,
    /// The published figures (`docs/figures`).
    pub figures: PathBuf,
    /// Where the figures are drawn before comparison (emptied first).
    pub scratch: PathBuf,
    /// Replace differing committed files with the rebuilt ones.
    pub write: bool,
}

/// Rebuilds everything published from its rows and compares (see the module doc).
pub fn rebuild(s: &RebuildSettings) -> Result<Rebuilt> {
    let mut out = Rebuilt::default();
    let mut refused = Vec::new();
    let mut dirs: Vec<PathBuf> = fs::read_dir(&s.measurements)
        .with_context(|| format!("reading {}", s.measurements.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("reading {}", s.measurements.display()))?;
    dirs.retain(|d| d.is_dir());
    dirs.sort();
    for dir in &dirs {
        let name = dir_name(dir);
        if name.starts_with('.') {
            continue;
        }
        if let Some((_, why)) = EXEMPT.iter().find(|(n, _)| *n == name) {
            out.exempt.push((name, (*why).to_string()));
            continue;
        }
        let report = analysis::report_dir(dir, &analysis::ReportConfig::default())
            .with_context(|| format!("rebuilding {}", dir.display()))?;
        for f in report.files() {
            compare(&dir.join(f.name), &f.bytes, s.write, &mut out, &mut refused)?;
        }
    }
    for (live, virt, baseline) in CROSSCHECKS {
        let (live_dir, virt_dir) = (s.measurements.join(live), s.measurements.join(virt));
        if !live_dir.join("crosscheck.json").is_file() {
            continue;
        }
        if EXEMPT.iter().any(|(n, _)| n == virt) {
            out.exempt.push((
                format!("{live}/crosscheck.{{md,json}}"),
                format!("its virtual side `{virt}` is published without rows (exempt above)"),
            ));
            continue;
        }
        let (_, files) = analysis::crosscheck::crosscheck_files(
            &live_dir,
            &virt_dir,
            &format!("docs/measurements/{live}"),
            &format!("docs/measurements/{virt}"),
            baseline,
            analysis::crosscheck::Tolerance::EFFECT_SIZED,
        )
        .with_context(|| format!("rebuilding the cross-check of {live} against {virt}"))?;
        for f in files {
            compare(
                &live_dir.join(f.name),
                &f.bytes,
                s.write,
                &mut out,
                &mut refused,
            )?;
        }
    }
    rebuild_figures(s, &mut out, &mut refused)?;
    if !refused.is_empty() {
        bail!(
            "refused to overwrite {} file(s) whose bytes change under the rules version they already name (`{}`): a rule changed without bumping `analysis::RULES_VERSION`; bump it and run again:\n{}",
            refused.len(),
            analysis::RULES_VERSION,
            refused.join("\n")
        );
    }
    Ok(out)
}

/// Draws every figure into the scratch directory (the published set as `cargo xtask figures`
/// picks its sweeps, then each [`FIGURE_SETS`] entry) and compares each with the committed
/// file; a committed figure file that nothing drew is a difference too.
fn rebuild_figures(
    s: &RebuildSettings,
    out: &mut Rebuilt,
    refused: &mut Vec<String>,
) -> Result<()> {
    if s.scratch.exists() {
        fs::remove_dir_all(&s.scratch)
            .with_context(|| format!("emptying {}", s.scratch.display()))?;
    }
    let mut sets: Vec<(PathBuf, PathBuf)> = Vec::new();
    figures::render_all(&s.measurements, &s.scratch).context("drawing the figures")?;
    sets.push((s.scratch.clone(), s.figures.clone()));
    for (sub, grid, which) in FIGURE_SETS {
        let mut sources = figures::Sources::discover(&s.measurements);
        sources.grid = s.measurements.join(grid);
        let drawn = s.scratch.join(sub);
        figures::render(&sources, &drawn, which)
            .with_context(|| format!("drawing the figures of {sub}/ from {grid}"))?;
        sets.push((drawn, s.figures.join(sub)));
    }
    for (drawn, committed) in sets {
        for name in files_in(&drawn)? {
            let bytes = fs::read(drawn.join(&name))
                .with_context(|| format!("reading {}", drawn.join(&name).display()))?;
            compare(&committed.join(&name), &bytes, s.write, out, refused)?;
        }
        for name in files_in(&committed)? {
            if !drawn.join(&name).is_file() {
                out.differences.push(Difference {
                    path: committed.join(&name),
                    first: "is committed but no figure draws it".into(),
                });
            }
        }
    }
    Ok(())
}

/// Plain files directly in `dir`, sorted; none when it does not exist.
fn files_in(dir: &Path) -> Result<Vec<String>> {
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut names = Vec::new();
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e.with_context(|| format!("reading {}", dir.display()))?;
        if e.path().is_file() {
            names.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    Ok(names)
}

fn dir_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Compares the rebuilt `bytes` with the committed file at `path`; records a difference, and
/// with `write` replaces the file unless [`refuses_overwrite`] says no.
fn compare(
    path: &Path,
    bytes: &[u8],
    write: bool,
    out: &mut Rebuilt,
    refused: &mut Vec<String>,
) -> Result<()> {
    out.checked.push(path.to_path_buf());
    let committed = match fs::read(path) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    if committed.as_deref() == Some(bytes) {
        return Ok(());
    }
    let first = match &committed {
        None => "is not committed (today's code writes it)".to_string(),
        Some(c) => first_difference(c, bytes),
    };
    if write {
        if let Some(c) = &committed
            && refuses_overwrite(path, c)
        {
            refused.push(format!("{}: {first}", path.display()));
        } else {
            analysis::write_atomic(path, bytes)
                .with_context(|| format!("writing {}", path.display()))?;
            out.written.push(path.to_path_buf());
        }
    }
    out.differences.push(Difference {
        path: path.to_path_buf(),
        first,
    });
    Ok(())
}

/// Whether a committed report or summary already names today's rules version (then a rebuild
/// that changes its bytes is a rule change the version does not record).
pub fn refuses_overwrite(path: &Path, committed: &[u8]) -> bool {
    let name = dir_name(path);
    let text = String::from_utf8_lossy(committed);
    let version = analysis::RULES_VERSION;
    match name.as_str() {
        "report.json" | "summary.json" => serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("rules").and_then(|r| r.as_str()).map(str::to_owned))
            .is_some_and(|r| r == version),
        "report.md" | "summary.md" => text.contains(&format!("analysis rules `{version}`")),
        _ => false,
    }
}

/// Where `committed` and `rebuilt` first differ: the line (1-based) with both versions of it
/// for text, the byte offset for binary files.
pub fn first_difference(committed: &[u8], rebuilt: &[u8]) -> String {
    match (std::str::from_utf8(committed), std::str::from_utf8(rebuilt)) {
        (Ok(c), Ok(r)) => {
            let (mut cl, mut rl) = (c.lines(), r.lines());
            let mut n = 0usize;
            loop {
                n += 1;
                match (cl.next(), rl.next()) {
                    (Some(a), Some(b)) if a == b => continue,
                    (None, None) => {
                        return "differs only in its final newline".to_string();
                    }
                    (a, b) => {
                        let show = |l: Option<&str>| match l {
                            None => "(end of file)".to_string(),
                            Some(l) if l.chars().count() > 160 => {
                                format!("{:?}…", l.chars().take(160).collect::<String>())
                            }
                            Some(l) => format!("{l:?}"),
                        };
                        return format!("line {n}: committed {} / rebuilt {}", show(a), show(b));
                    }
                }
            }
        }
        _ => {
            let at = committed
                .iter()
                .zip(rebuilt)
                .position(|(a, b)| a != b)
                .unwrap_or(committed.len().min(rebuilt.len()));
            format!(
                "byte {at} (binary; committed {} bytes, rebuilt {} bytes)",
                committed.len(),
                rebuilt.len()
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_difference_names_its_first_line_and_both_versions() {
        let d = first_difference(b"a\nb\nc\n", b"a\nB\nc\n");
        assert_eq!(d, r#"line 2: committed "b" / rebuilt "B""#);
        let d = first_difference(b"a\n", b"a\nb\n");
        assert_eq!(d, r#"line 2: committed (end of file) / rebuilt "b""#);
        assert_eq!(
            first_difference(b"a\n", b"a"),
            "differs only in its final newline"
        );
    }

    #[test]
    fn a_binary_difference_names_its_first_byte() {
        let d = first_difference(&[0x89, 0xff, 1, 2], &[0x89, 0xff, 1, 3, 4]);
        assert_eq!(d, "byte 3 (binary; committed 4 bytes, rebuilt 5 bytes)");
    }

    #[test]
    fn a_report_naming_todays_rules_is_not_overwritten_one_naming_older_rules_is() {
        let v = analysis::RULES_VERSION;
        let today = format!("{{\"schema_version\": 1, \"sweep\": \"s\", \"rules\": \"{v}\"}}");
        let older = "{\"schema_version\": 1, \"sweep\": \"s\", \"rules\": \"2000-01-01.1\"}";
        let none = "{\"schema_version\": 1, \"sweep\": \"s\"}";
        let json = Path::new("x/report.json");
        assert!(refuses_overwrite(json, today.as_bytes()));
        assert!(!refuses_overwrite(json, older.as_bytes()));
        assert!(!refuses_overwrite(json, none.as_bytes()));
        let md = Path::new("x/summary.md");
        let line = analysis::markdown::rules_line(v);
        assert!(refuses_overwrite(
            md,
            format!("# Fault\n\n{line}").as_bytes()
        ));
        assert!(!refuses_overwrite(md, b"# Fault\n\nno rules named\n"));
        // Timelines and figures carry no version: a rebuild may always replace them.
        assert!(!refuses_overwrite(
            Path::new("x/timeline.csv"),
            today.as_bytes()
        ));
    }

    #[test]
    fn every_exempt_directory_and_cross_check_names_a_reason_and_a_real_directory() {
        let published = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/measurements");
        for (dir, why) in EXEMPT {
            assert!(!why.trim().is_empty(), "{dir}: no reason");
            assert!(
                published.join(dir).is_dir(),
                "{dir} is exempt but not published: drop it from EXEMPT"
            );
        }
        for (live, virt, _) in CROSSCHECKS {
            assert!(
                published.join(live).join("crosscheck.json").is_file(),
                "{live}"
            );
            assert!(published.join(virt).is_dir(), "{virt}");
        }
    }
}
