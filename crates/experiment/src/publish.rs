//! Publication: copy what a sweep's (or fault run's) findings rest on into
//! `docs/measurements/<sweep>/` — summaries, meta and gzip-compressed rows, not logs or evidence
//! streams — so that the report and the figures can be rebuilt from the published copy alone.
//!
//! Only finished repetitions (those with their `meta.json`, which a cell writes last) are copied:
//! a half-written measurement never reaches the published tree. The copy is built beside the
//! destination and renamed over it, so an interrupted publish leaves the old copy whole.

use std::fs;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use flate2::Compression;
use flate2::write::GzEncoder;

/// What a publish copied.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Published {
    /// The published copy, `<to>/<sweep directory name>`.
    pub dest: PathBuf,
    /// Files written.
    pub files: usize,
    /// Of those, row files compressed.
    pub row_files: usize,
    /// Repetitions copied (finished: with `meta.json`).
    pub reps: usize,
    /// Repetition directories skipped because they are unfinished.
    pub unfinished_reps: usize,
    /// Bytes written.
    pub bytes: u64,
}

/// Publishes the sweep or fault-run directory `src` into `to/<its name>`. A sweep must have its
/// report (`report.json`: run `cargo xtask report` first), a fault run its `summary.json`
/// (written when the run finishes) and a per-policy capacity run its `policy-capacity.json`
/// (each search's record, and a live search's steps as repetitions with their rows), so that
/// what is published is what was analysed.
pub fn publish(src: &Path, to: &Path) -> Result<Published> {
    let analysed = ["report.json", "summary.json", "policy-capacity.json"]
        .iter()
        .any(|f| src.join(f).is_file());
    if !analysed {
        bail!(
            "{} has no report.json (a sweep: run `cargo xtask report {}` first, or finish the \
             sweep), no summary.json (a fault run: finish it with the same command) and no \
             policy-capacity.json (a per-policy capacity run: finish it)",
            src.display(),
            src.display()
        );
    }
    let name = src
        .file_name()
        .with_context(|| format!("{} names no directory", src.display()))?;
    let dest = to.join(name);
    let staging = to.join(format!(".{}.publishing", name.to_string_lossy()));
    if staging.exists() {
        fs::remove_dir_all(&staging)
            .with_context(|| format!("removing a stale {}", staging.display()))?;
    }
    fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
    let mut out = Published::default();
    copy_tree(src, &staging, &mut out, Where::Top)?;
    if dest.exists() {
        fs::remove_dir_all(&dest).with_context(|| format!("replacing {}", dest.display()))?;
    }
    fs::rename(&staging, &dest)
        .with_context(|| format!("moving {} to {}", staging.display(), dest.display()))?;
    out.dest = dest;
    Ok(out)
}

/// Where in a sweep tree a directory sits, which decides what of it is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Where {
    /// The sweep directory: summaries (`*.json`, `*.md`, `timeline.csv`).
    Top,
    /// Below the top (points, policies, `_discarded`): descend; keep `plan.json`, a point's own `capacity.json` and
    /// `discarded.json`.
    Inner,
    /// A repetition (`rep-<k>`): meta, fault record, the N routers' and HAProxy's records
    /// (`routers.json`, `haproxy-stats.json`) and rows.
    Rep,
}

fn copy_tree(src: &Path, dst: &Path, out: &mut Published, at: Where) -> Result<()> {
    let mut entries: Vec<PathBuf> = fs::read_dir(src)
        .with_context(|| format!("reading {}", src.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("reading {}", src.display()))?;
    entries.sort();
    for path in entries {
        let file_name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if path.is_dir() {
            if file_name == "logs" || file_name.starts_with('.') {
                continue;
            }
            // `rep-<k>` holds a repetition; `_discarded/…/rep-<k>.attempt-<n>` only the reason an
            // attempt was re-run.
            let is_rep = file_name.starts_with("rep-") && !file_name.contains(".attempt-");
            if is_rep && !path.join("meta.json").is_file() {
                out.unfinished_reps += 1;
                continue;
            }
            let target = dst.join(&file_name);
            fs::create_dir_all(&target)?;
            if is_rep {
                out.reps += 1;
                copy_tree(&path, &target, out, Where::Rep)?;
            } else {
                copy_tree(&path, &target, out, Where::Inner)?;
            }
            // Directories left empty (e.g. a point whose reps are all unfinished) are not published.
            if fs::read_dir(&target)?.next().is_none() {
                fs::remove_dir(&target)?;
            }
            continue;
        }
        match (at, file_name.as_str()) {
            (Where::Rep, n) if n.ends_with(".csv") => {
                let target = dst.join(format!("{n}.gz"));
                out.bytes += gzip(&path, &target)?;
                out.files += 1;
                out.row_files += 1;
            }
            // Rows already compressed: a sweep restored from its published copy and resumed
            // (a grid longer than one session) holds its earlier cells' rows this way.
            (Where::Rep, n) if n.ends_with(".csv.gz") => {
                let target = dst.join(n);
                out.bytes += fs::copy(&path, &target).with_context(|| {
                    format!("copying {} to {}", path.display(), target.display())
                })?;
                out.files += 1;
                out.row_files += 1;
            }
            (
                Where::Rep,
                "meta.json" | "fault.json" | "discarded.json" | "routers.json"
                | "haproxy-stats.json",
            )
            | (
                Where::Inner,
                "plan.json" | "capacity.json" | "unbracketed.json" | "discarded.json" | "meta.json"
                | "fault.json" | "point-ttl.json",
            )
            | (Where::Top, _)
                if is_summary(&file_name) =>
            {
                let target = dst.join(&file_name);
                out.bytes += fs::copy(&path, &target).with_context(|| {
                    format!("copying {} to {}", path.display(), target.display())
                })?;
                out.files += 1;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Summaries and records, not streams: JSON documents, markdown, the fault timeline. Evidence
/// streams (`*.jsonl`), logs and binary plans are left behind.
fn is_summary(name: &str) -> bool {
    name.ends_with(".json") || name.ends_with(".md") || name == "timeline.csv"
}

fn gzip(src: &Path, dst: &Path) -> Result<u64> {
    let input = fs::File::open(src).with_context(|| format!("opening {}", src.display()))?;
    let file = fs::File::create(dst).with_context(|| format!("creating {}", dst.display()))?;
    let mut enc = GzEncoder::new(BufWriter::new(file), Compression::best());
    std::io::copy(&mut BufReader::new(input), &mut enc)
        .with_context(|| format!("compressing {}", src.display()))?;
    let mut w = enc.finish()?;
    w.flush()?;
    Ok(fs::metadata(dst)?.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    use crate::scratch::Scratch;

    fn write(path: &Path, text: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    fn files_under(root: &Path) -> Vec<String> {
        let mut out = Vec::new();
        fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
            for e in fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(root, &p, out);
                } else {
                    out.push(p.strip_prefix(root).unwrap().display().to_string());
                }
            }
        }
        walk(root, root, &mut out);
        out.sort();
        out
    }

    #[test]
    fn publishes_summaries_and_finished_rows_only() {
        let s = Scratch::new("publish-tree");
        let sweep = s.0.join("measurements/grid");
        write(&sweep.join("report.json"), "{}");
        write(&sweep.join("report.md"), "# r");
        write(&sweep.join("sweep.json"), "{}");
        write(&sweep.join("logs/router.log"), "noise");
        write(&sweep.join("p1/plan.json"), "{}");
        write(&sweep.join("p1/plan.bin"), "bin");
        let rows = "request_id,ttft_ms\nu1-0,12.5\n";
        write(&sweep.join("p1/a/rep-1/meta.json"), "{}");
        write(&sweep.join("p1/a/rep-1/client.csv"), rows);
        write(&sweep.join("p1/a/rep-1/router.csv"), rows);
        write(&sweep.join("p1/a/rep-1/evidence.jsonl"), "{}");
        write(&sweep.join("p1/a/rep-1/routers.json"), "{}");
        write(&sweep.join("p1/a/rep-1/driver.log"), "log");
        // Unfinished: rows but no meta.
        write(&sweep.join("p1/a/rep-2/client.csv"), rows);
        write(
            &sweep.join("_discarded/p1/a/rep-2.attempt-1/discarded.json"),
            "{}",
        );
        write(
            &sweep.join("_discarded/p1/a/rep-2.attempt-1/client.csv"),
            rows,
        );

        let to = s.0.join("docs/measurements");
        let got = publish(&sweep, &to).unwrap();
        assert_eq!(got.dest, to.join("grid"));
        assert_eq!(got.reps, 1);
        assert_eq!(got.unfinished_reps, 1);
        assert_eq!(got.row_files, 2);
        assert_eq!(
            files_under(&to.join("grid")),
            vec![
                "_discarded/p1/a/rep-2.attempt-1/discarded.json",
                "p1/a/rep-1/client.csv.gz",
                "p1/a/rep-1/meta.json",
                "p1/a/rep-1/router.csv.gz",
                "p1/a/rep-1/routers.json",
                "p1/plan.json",
                "report.json",
                "report.md",
                "sweep.json",
            ]
        );
        let mut text = String::new();
        flate2::read::GzDecoder::new(
            fs::File::open(to.join("grid/p1/a/rep-1/client.csv.gz")).unwrap(),
        )
        .read_to_string(&mut text)
        .unwrap();
        assert_eq!(text, rows, "rows survive compression byte for byte");
        // Republishing replaces the copy whole and leaves no staging directory.
        fs::remove_dir_all(sweep.join("p1/a/rep-1")).unwrap();
        let again = publish(&sweep, &to).unwrap();
        assert_eq!(again.reps, 0);
        assert!(!to.join("grid/p1/a/rep-1").exists());
        let names: Vec<String> = fs::read_dir(&to)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["grid".to_string()]);
    }

    #[test]
    fn a_restored_and_resumed_sweep_republishes_its_earlier_rows() {
        let s = Scratch::new("publish-resumed");
        let sweep = s.0.join("measurements/grid");
        let rows = "request_id,ttft_ms\nu1-0,12.5\n";
        write(&sweep.join("report.json"), "{}");
        write(&sweep.join("p1/a/rep-1/meta.json"), "{}");
        write(&sweep.join("p1/a/rep-1/client.csv"), rows);
        let to = s.0.join("docs/measurements");
        publish(&sweep, &to).unwrap();
        // A later session: the working copy is gone; the published copy is restored and the
        // sweep resumes, adding a repetition with plain rows beside the compressed ones.
        fs::remove_dir_all(&sweep).unwrap();
        let restored = s.0.join("restored/grid");
        fs::create_dir_all(restored.parent().unwrap()).unwrap();
        fs::rename(to.join("grid"), &restored).unwrap();
        write(&restored.join("p1/a/rep-2/meta.json"), "{}");
        write(&restored.join("p1/a/rep-2/client.csv"), rows);
        let got = publish(&restored, &to).unwrap();
        assert_eq!((got.reps, got.row_files), (2, 2));
        for rep in ["rep-1", "rep-2"] {
            let mut text = String::new();
            flate2::read::GzDecoder::new(
                fs::File::open(to.join(format!("grid/p1/a/{rep}/client.csv.gz"))).unwrap(),
            )
            .read_to_string(&mut text)
            .unwrap();
            assert_eq!(text, rows, "{rep}'s rows survive");
        }
    }

    #[test]
    fn publishes_a_per_policy_capacity_run_with_its_records_and_live_steps() {
        let s = Scratch::new("publish-policy-capacity");
        let run = s.0.join("measurements/live-capacity");
        write(&run.join("policy-capacity.json"), "{}");
        write(&run.join("predicted-vs-live.json"), "[]");
        let search = run.join("policy-capacity/ws1-s0/session-affinity/seed-7");
        write(&search.join("capacity.json"), "{}");
        write(&search.join("predicted/capacity.json"), "{}");
        write(
            &run.join("policy-capacity/ws3-s0/round-robin/seed-7/unbracketed.json"),
            "[]",
        );
        write(
            &run.join("policy-capacity/ws1-s0/prefix-affinity-ttl-at-point/seed-7/point-ttl.json"),
            "{}",
        );
        let step = search.join("capacity/ws1-s0-rate9.253/session-affinity/rep-1");
        write(&step.join("meta.json"), "{}");
        write(&step.join("client.csv"), "request_id\n");
        write(&step.join("evidence.jsonl"), "{}\n");
        let out = publish(&run, &s.0.join("docs")).unwrap();
        let mut got = files_under(&out.dest);
        got.sort();
        assert_eq!(
            got,
            [
                "policy-capacity.json",
                "policy-capacity/ws1-s0/prefix-affinity-ttl-at-point/seed-7/point-ttl.json",
                "policy-capacity/ws1-s0/session-affinity/seed-7/capacity.json",
                "policy-capacity/ws1-s0/session-affinity/seed-7/capacity/ws1-s0-rate9.253/session-affinity/rep-1/client.csv.gz",
                "policy-capacity/ws1-s0/session-affinity/seed-7/capacity/ws1-s0-rate9.253/session-affinity/rep-1/meta.json",
                "policy-capacity/ws1-s0/session-affinity/seed-7/predicted/capacity.json",
                "policy-capacity/ws3-s0/round-robin/seed-7/unbracketed.json",
                "predicted-vs-live.json",
            ]
        );
    }

    #[test]
    fn refuses_a_sweep_without_its_report() {
        let s = Scratch::new("publish-noreport");
        let sweep = s.0.join("grid");
        write(&sweep.join("sweep.json"), "{}");
        let err = publish(&sweep, &s.0.join("out")).unwrap_err();
        assert!(err.to_string().contains("no report.json"), "{err}");
        assert!(!s.0.join("out/grid").exists());
    }

    #[test]
    fn publishes_a_finished_fault_run() {
        let s = Scratch::new("publish-fault");
        let run_dir = s.0.join("fault-kill");
        write(&run_dir.join("summary.json"), "{}");
        write(&run_dir.join("summary.md"), "# s");
        write(&run_dir.join("timeline.csv"), "second,good\n0,1\n");
        write(&run_dir.join("sweep.json"), "{}");
        write(&run_dir.join("p/plan.json"), "{}");
        write(&run_dir.join("p/a/rep-1/meta.json"), "{}");
        write(&run_dir.join("p/a/rep-1/fault.json"), "{}");
        write(&run_dir.join("p/a/rep-1/client.csv"), "request_id\nu1-0\n");
        write(&run_dir.join("p/a/rep-1/replica-0.log"), "log");
        let to = s.0.join("pub");
        let got = publish(&run_dir, &to).unwrap();
        assert_eq!((got.reps, got.row_files), (1, 1));
        assert_eq!(
            files_under(&to.join("fault-kill")),
            vec![
                "p/a/rep-1/client.csv.gz",
                "p/a/rep-1/fault.json",
                "p/a/rep-1/meta.json",
                "p/plan.json",
                "summary.json",
                "summary.md",
                "sweep.json",
                "timeline.csv",
            ]
        );
    }
}
