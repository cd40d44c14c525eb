//! One repetition directory, `<sweep>/<point>/<policy>/rep-<k>/`: `meta.json` (written last,
//! atomically), the resume rule, discarded attempts, and the measured-window rule.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

use schema::Window;

/// What a repetition directory holds, for resuming.
#[derive(Debug, Clone, PartialEq)]
pub enum CellState {
    /// No directory, or nothing in it.
    Missing,
    /// Files without a complete meta: a half cell from an interrupted run, to be redone.
    Incomplete,
    /// `meta.json` with `complete: true`; `accepted` tells whether it counts.
    Complete {
        /// Counted in the comparison.
        accepted: bool,
    },
    /// `meta.json` with `complete: true`, set aside because its evidence failed on every attempt
    /// ([`crate::gate::EVIDENCE_SET_ASIDE_PREFIX`]): the machine was too noisy to measure it, so a
    /// resumed sweep measures it again.
    SetAsideForEvidence,
}

impl CellState {
    /// Reads the state of `dir`.
    pub fn of(dir: &Path) -> CellState {
        if !dir.exists() {
            return CellState::Missing;
        }
        let meta = dir.join("meta.json");
        match std::fs::read_to_string(&meta)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        {
            Some(v) if v.get("complete").and_then(|c| c.as_bool()) == Some(true) => {
                let accepted = v.get("accepted").and_then(|a| a.as_bool()) != Some(false);
                let for_evidence = v
                    .get("set_aside_reason")
                    .and_then(|r| r.as_str())
                    .is_some_and(|r| r.starts_with(crate::gate::EVIDENCE_SET_ASIDE_PREFIX));
                if !accepted && for_evidence {
                    CellState::SetAsideForEvidence
                } else {
                    CellState::Complete { accepted }
                }
            }
            _ => {
                let empty = std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none());
                if empty {
                    CellState::Missing
                } else {
                    CellState::Incomplete
                }
            }
        }
    }

    /// Whether a resumed sweep skips this repetition: complete, and not set aside for its
    /// evidence.
    pub fn is_done(&self) -> bool {
        matches!(self, CellState::Complete { .. })
    }
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory, fsync, rename.
/// A reader sees the old file, or none, or the whole new one — never half of it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .context("an atomic write needs a parent directory")?;
    let name = path
        .file_name()
        .context("an atomic write needs a file name")?
        .to_string_lossy();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    {
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(bytes)
            .and_then(|()| f.sync_all())
            .with_context(|| format!("writing {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    // The rename is durable once the directory entry is.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Writes `meta.json` into `dir` atomically, as the last file of the repetition.
///
/// Generic over the record so that this crate does not own `meta.json`'s type: the writers pass
/// the one `Meta` definition (docs/CONTRACTS.md, "Measurements layout").
pub fn write_meta<M: Serialize + ?Sized>(dir: &Path, meta: &M) -> Result<()> {
    let text = serde_json::to_vec_pretty(meta)?;
    write_atomic(&dir.join("meta.json"), &text)
}

/// A repetition's directory: `<sweep>/<point>/<policy>/rep-<k>`.
pub fn rep_dir(sweep_dir: &Path, point: &str, policy: &str, rep: u32) -> PathBuf {
    sweep_dir
        .join(point)
        .join(policy)
        .join(format!("rep-{rep}"))
}

/// Empties a half-written repetition directory so it can be redone.
pub fn clear(dir: &Path) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

/// Moves a discarded attempt to `<sweep>/_discarded/<point>/<policy>/rep-<k>.attempt-<n>`, with
/// a `discarded.json` saying why, so that it stays inspectable but is never analysed.
pub fn discard(
    sweep_dir: &Path,
    point: &str,
    policy: &str,
    rep: u32,
    attempt: u32,
    reason: &str,
) -> Result<PathBuf> {
    let rep_dir = sweep_dir
        .join(point)
        .join(policy)
        .join(format!("rep-{rep}"));
    let parent = sweep_dir.join("_discarded").join(point).join(policy);
    std::fs::create_dir_all(&parent)?;
    // Attempt numbers restart when a sweep is resumed; an earlier run's record under the same
    // number is kept, and this one takes the next free name.
    let mut target = parent.join(format!("rep-{rep}.attempt-{attempt}"));
    let mut n = attempt;
    while target.exists() {
        n += 1;
        target = parent.join(format!("rep-{rep}.attempt-{n}"));
    }
    std::fs::rename(&rep_dir, &target)
        .with_context(|| format!("moving {} aside", rep_dir.display()))?;
    write_atomic(
        &target.join("discarded.json"),
        serde_json::to_string_pretty(&serde_json::json!({"reason": reason, "attempt": attempt}))?
            .as_bytes(),
    )?;
    Ok(target)
}

/// The measured window from the driver's send times: the sweep's rule, one definition in
/// [`schema::Window::measured`], with its error as this crate's.
pub fn measured_window(
    sent_s: &[f64],
    warmup_s: f64,
    planned_end_s: f64,
    closed_users: Option<usize>,
) -> Result<Window> {
    Ok(Window::measured(
        sent_s,
        warmup_s,
        planned_end_s,
        closed_users,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::scratch::Scratch;

    /// The fields of `meta.json` the resume rule reads.
    fn meta(complete: bool, accepted: bool) -> serde_json::Value {
        serde_json::json!({"sweep": "s", "complete": complete, "accepted": accepted})
    }

    #[test]
    fn resume_states() {
        let s = Scratch::new("resume");
        let dir = s.0.join("rep-1");
        assert_eq!(CellState::of(&dir), CellState::Missing);
        clear(&dir).unwrap();
        assert_eq!(
            CellState::of(&dir),
            CellState::Missing,
            "an empty dir is missing"
        );
        std::fs::write(dir.join("client.csv"), "request_id\n").unwrap();
        assert_eq!(
            CellState::of(&dir),
            CellState::Incomplete,
            "rows without meta"
        );
        assert!(!CellState::of(&dir).is_done());
        write_meta(&dir, &meta(false, true)).unwrap();
        assert_eq!(
            CellState::of(&dir),
            CellState::Incomplete,
            "complete: false"
        );
        std::fs::write(dir.join("meta.json"), "{\"complete\": tr").unwrap();
        assert_eq!(CellState::of(&dir), CellState::Incomplete, "truncated meta");
        write_meta(&dir, &meta(true, true)).unwrap();
        assert_eq!(CellState::of(&dir), CellState::Complete { accepted: true });
        write_meta(&dir, &serde_json::json!({"complete": true})).unwrap();
        assert_eq!(
            CellState::of(&dir),
            CellState::Complete { accepted: true },
            "no `accepted` means accepted"
        );
        write_meta(&dir, &meta(true, false)).unwrap();
        let state = CellState::of(&dir);
        assert_eq!(state, CellState::Complete { accepted: false });
        assert!(state.is_done(), "a rep set aside for drift is final too");
        // One set aside because the machine's evidence failed is measured again on a resume.
        let mut noisy = meta(true, false);
        noisy["set_aside_reason"] = serde_json::json!(
            "evidence failed on 3 attempts: replica 0 lateness p99 5.000 ms exceeds the bound 0.326 ms"
        );
        write_meta(&dir, &noisy).unwrap();
        assert_eq!(CellState::of(&dir), CellState::SetAsideForEvidence);
        assert!(!CellState::of(&dir).is_done());
        clear(&dir).unwrap();
        assert_eq!(
            CellState::of(&dir),
            CellState::Missing,
            "clearing redoes a half cell"
        );
    }

    #[test]
    fn atomic_write_leaves_no_temp_and_replaces_whole() {
        let s = Scratch::new("atomic");
        let path = s.0.join("meta.json");
        write_atomic(&path, b"first").unwrap();
        write_atomic(&path, b"second, longer").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "second, longer");
        let names: Vec<String> = std::fs::read_dir(&s.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["meta.json".to_string()]);
    }

    #[test]
    fn discarded_attempts_move_out_of_the_analysed_tree() {
        let s = Scratch::new("discard");
        let rep = s.0.join("ws1-s0/round-robin/rep-2");
        clear(&rep).unwrap();
        std::fs::write(rep.join("client.csv"), "x").unwrap();
        let moved = discard(&s.0, "ws1-s0", "round-robin", 2, 1, "lateness").unwrap();
        assert!(!rep.exists());
        assert!(moved.join("client.csv").exists());
        assert!(moved.ends_with("_discarded/ws1-s0/round-robin/rep-2.attempt-1"));
        let why = std::fs::read_to_string(moved.join("discarded.json")).unwrap();
        assert!(why.contains("lateness"));
        // A resumed sweep counts attempts from 1 again: the earlier record stays.
        clear(&rep).unwrap();
        let again = discard(&s.0, "ws1-s0", "round-robin", 2, 1, "drift").unwrap();
        assert!(again.ends_with("_discarded/ws1-s0/round-robin/rep-2.attempt-2"));
        let first = std::fs::read_to_string(moved.join("discarded.json")).unwrap();
        assert!(
            first.contains("lateness"),
            "the first record survives: {first}"
        );
    }

    #[test]
    fn window_rules() {
        let sent: Vec<f64> = (0..20).map(f64::from).collect();
        let open = measured_window(&sent, 2.0, 10.0, None).unwrap();
        assert_eq!((open.measured_start_s, open.measured_end_s), (2.0, 10.0));
        // 20 sends by 4 users: the 17th send (t = 16) leaves 3 unsent.
        let closed = measured_window(&sent, 2.0, 100.0, Some(4)).unwrap();
        assert_eq!(closed.measured_end_s, 16.0);
        let capped = measured_window(&sent, 2.0, 12.0, Some(4)).unwrap();
        assert_eq!(capped.measured_end_s, 12.0);
        assert!(measured_window(&sent, 17.0, 100.0, Some(4)).is_err());
        assert!(measured_window(&sent[..3], 0.0, 100.0, Some(4)).is_err());
    }

    fn full_meta(complete: bool, accepted: bool) -> schema::Meta {
        schema::Meta {
            sweep: "s".into(),
            point: "ws1-s0".into(),
            policy: "round-robin".into(),
            rep: 1,
            workload_name: "w".into(),
            workload_fingerprint: "f".into(),
            plan_fingerprint: "p".into(),
            fleet: serde_json::json!({"source": "emulated", "capacity_tokens": 1000}),
            slo: schema::Slo {
                ttft_ms: 100.0,
                itl_ms: 3.0,
            },
            window: Window {
                warmup_s: 1.0,
                measured_start_s: 1.0,
                measured_end_s: 5.0,
                clock: schema::WindowClock::Sent,
            },
            git_rev: None,
            versions: serde_json::Value::Null,
            virtual_time: false,
            complete,
            accepted,
            set_aside_reason: (!accepted).then(|| "drift".to_string()),
            attempts: 1,
            evidence: None,
            drift: None,
            run: None,
        }
    }

    #[test]
    fn meta_has_the_contract_fields_and_analysis_reads_it() {
        let s = Scratch::new("meta");
        let dir = rep_dir(&s.0, "ws1-s0", "round-robin", 1);
        assert_eq!(dir, s.0.join("ws1-s0/round-robin/rep-1"));
        clear(&dir).unwrap();
        write_meta(&dir, &full_meta(true, false)).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        for field in schema::meta::CONTRACT_FIELDS {
            assert!(v.get(field).is_some(), "meta.json lacks {field}");
        }
        let parsed = analysis::read_meta(&dir.join("meta.json")).unwrap();
        assert!(!parsed.accepted);
        assert_eq!(parsed.capacity_tokens(), Some(1000));
        assert_eq!(parsed.window.measured_s(), 4.0);
        assert_eq!(CellState::of(&dir), CellState::Complete { accepted: false });
    }
}
