//! Finding and loading repetitions: `<sweep>/<point>/<policy>/rep-<k>/`. A repetition counts as
//! finished only when its `meta.json` exists and says `"complete": true` (the sweep writes it
//! last, atomically); anything else is listed as incomplete and never analysed.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{AnalysisError, Result};
use crate::meta::{Meta, read_meta};
use crate::rows::{ClientRow, RouterRow, read_client_csv, read_router_csv, rows_file};

/// A finished repetition with its rows.
#[derive(Debug, Clone)]
pub struct RepData {
    /// Point directory name.
    pub point: String,
    /// Policy directory name.
    pub policy: String,
    /// `k` of `rep-<k>`.
    pub rep: u32,
    /// The repetition directory.
    pub dir: PathBuf,
    /// Its meta.
    pub meta: Meta,
    /// Driver rows.
    pub client: Vec<ClientRow>,
    /// Router rows; `None` when the ingress writes none (for example HAProxy).
    pub router: Option<Vec<RouterRow>>,
}

/// A repetition directory that is not finished.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IncompleteRep {
    /// Point directory name.
    pub point: String,
    /// Policy directory name.
    pub policy: String,
    /// `k` of `rep-<k>`.
    pub rep: u32,
    /// Why it is not analysed.
    pub reason: String,
}

/// Everything found under a sweep directory.
#[derive(Debug, Clone)]
pub struct SweepData {
    /// The sweep directory's name.
    pub sweep: String,
    /// Finished repetitions, ordered by point, policy, rep.
    pub reps: Vec<RepData>,
    /// Unfinished repetitions, same order.
    pub incomplete: Vec<IncompleteRep>,
}

/// What a repetition directory holds.
#[derive(Debug, Clone)]
pub enum RepLoad {
    /// Finished: rows and meta loaded.
    Complete(Box<RepData>),
    /// Not finished; the reason says what is missing.
    Incomplete(String),
}

/// Parses `rep-<k>`.
pub fn rep_number(name: &str) -> Option<u32> {
    let k = name.strip_prefix("rep-")?;
    (!k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
        .then(|| k.parse().ok())
        .flatten()
}

/// Loads one repetition directory; `point` and `policy` name it in messages and results.
/// Rows are read only when the meta says complete; malformed rows are an error, not a skip.
pub fn load_rep(dir: &Path, point: &str, policy: &str, rep: u32) -> Result<RepLoad> {
    let meta_path = dir.join("meta.json");
    if !meta_path.exists() {
        return Ok(RepLoad::Incomplete("no meta.json".into()));
    }
    let meta = match read_meta(&meta_path) {
        Ok(m) => m,
        // A meta the sweep never finished writing must not sink the whole report; it is listed.
        Err(e) => return Ok(RepLoad::Incomplete(e.to_string())),
    };
    if !meta.complete {
        return Ok(RepLoad::Incomplete(
            "meta.json does not say \"complete\": true".into(),
        ));
    }
    let Some(client_path) = rows_file(dir, "client.csv") else {
        return Ok(RepLoad::Incomplete(
            "meta.json says complete but client.csv is missing".into(),
        ));
    };
    let client = read_client_csv(&client_path)?;
    let router = match rows_file(dir, "router.csv") {
        Some(router_path) => Some(read_router_csv(&router_path)?),
        None => None,
    };
    Ok(RepLoad::Complete(Box::new(RepData {
        point: point.to_string(),
        policy: policy.to_string(),
        rep,
        dir: dir.to_path_buf(),
        meta,
        client,
        router,
    })))
}

fn subdirs(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| AnalysisError::io(dir, e))? {
        let entry = entry.map_err(|e| AnalysisError::io(dir, e))?;
        let path = entry.path();
        if path.is_dir()
            && let Some(name) = entry.file_name().to_str()
        {
            out.push((name.to_string(), path));
        }
    }
    out.sort();
    Ok(out)
}

/// The repetition directories of one point, found without reading them.
#[derive(Debug, Clone, PartialEq)]
pub struct PointDirs {
    /// Point directory name.
    pub point: String,
    /// `(policy, rep, dir)` ordered by policy directory name, then rep.
    pub reps: Vec<(String, u32, PathBuf)>,
}

/// The sweep's name (its directory name) and its points' repetition directories. Directories
/// that do not have the `<point>/<policy>/rep-<k>` shape (logs, figures) and top-level names
/// starting with `_` or `.` (such as `_discarded/`) are ignored; no repetition directory at all
/// is an error.
pub fn discover(sweep_dir: &Path) -> Result<(String, Vec<PointDirs>)> {
    let sweep = sweep_dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| sweep_dir.display().to_string());
    let mut points = Vec::new();
    for (point, point_dir) in subdirs(sweep_dir)? {
        // `_discarded/` (attempts the sweep threw away) and hidden directories are not points.
        if point.starts_with('_') || point.starts_with('.') {
            continue;
        }
        let mut reps = Vec::new();
        for (policy, policy_dir) in subdirs(&point_dir)? {
            let mut rep_dirs: Vec<(u32, PathBuf)> = subdirs(&policy_dir)?
                .into_iter()
                .filter_map(|(name, p)| rep_number(&name).map(|k| (k, p)))
                .collect();
            rep_dirs.sort();
            reps.extend(rep_dirs.into_iter().map(|(k, p)| (policy.clone(), k, p)));
        }
        if !reps.is_empty() {
            points.push(PointDirs { point, reps });
        }
    }
    if points.is_empty() {
        return Err(AnalysisError::EmptySweep {
            path: sweep_dir.to_path_buf(),
        });
    }
    Ok((sweep, points))
}

/// Loads one point's repetitions: the finished ones, and the unfinished ones listed.
pub fn load_point(dirs: &PointDirs) -> Result<(Vec<RepData>, Vec<IncompleteRep>)> {
    let mut reps = Vec::new();
    let mut incomplete = Vec::new();
    for (policy, rep, dir) in &dirs.reps {
        match load_rep(dir, &dirs.point, policy, *rep)? {
            RepLoad::Complete(data) => reps.push(*data),
            RepLoad::Incomplete(reason) => incomplete.push(IncompleteRep {
                point: dirs.point.clone(),
                policy: policy.clone(),
                rep: *rep,
                reason,
            }),
        }
    }
    Ok((reps, incomplete))
}

/// Loads every repetition under a sweep directory (all rows in memory at once; the report loads
/// one point at a time instead).
pub fn load_sweep(sweep_dir: &Path) -> Result<SweepData> {
    let (sweep, points) = discover(sweep_dir)?;
    let mut reps = Vec::new();
    let mut incomplete = Vec::new();
    for p in &points {
        let (r, i) = load_point(p)?;
        reps.extend(r);
        incomplete.extend(i);
    }
    Ok(SweepData {
        sweep,
        reps,
        incomplete,
    })
}
