//! Workload description files (issue #41): a TOML file that says what a benchmark sends, turned
//! into a Mooncake-format trace (`trace::generate`) that `sweep trace` replays live or in
//! virtual time. Today's one shape is the single-turn shared-prefix workload of common
//! prefix-cache benchmarks, sent as a staged load ladder:
//!
//! ```toml
//! name = "sglang-generated-shared-prefix"
//! source = "SGLang bench_serving --dataset-name generated-shared-prefix, its defaults"
//!
//! [shared_prefix]
//! groups = 64               # distinct shared prefixes
//! prompts_per_group = 16    # each group's own questions
//! prefix_tokens = 2048      # whole 512-token trace blocks
//! question_tokens = 128
//! output_tokens = 256
//! seed = 1                  # the prompt order (shuffled once, cycled) and the arrival gaps
//!
//! [[stage]]                 # one per ladder step, in order
//! requests = 1024
//! rate_rps = 8.0            # Poisson; leave out to send the stage all at once
//! wait_for_drain = false    # true: start only when every earlier request has ended
//! ```
//!
//! Unknown keys are refused, and every error names `path:line`.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use serde::Deserialize;
use trace::{SharedPrefix, Stage};

use crate::fleet_description::{from_toml, line_of_key};

/// A parsed workload description.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadDescription {
    /// Its name.
    pub name: String,
    /// Where its shape comes from (a benchmark and its settings).
    pub source: String,
    /// What it sends.
    pub shared_prefix: SharedPrefix,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    name: String,
    source: String,
    shared_prefix: SharedPrefixFile,
    stage: Vec<StageFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SharedPrefixFile {
    groups: u32,
    prompts_per_group: u32,
    prefix_tokens: u32,
    question_tokens: u32,
    output_tokens: u32,
    seed: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StageFile {
    requests: u32,
    rate_rps: Option<f64>,
    #[serde(default)]
    wait_for_drain: bool,
}

impl WorkloadDescription {
    /// Reads and checks the description at `path`.
    pub fn read(path: &Path) -> Result<WorkloadDescription> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the workload description {}", path.display()))?;
        Self::parse(path, &text)
    }

    /// Parses and checks `text`, read from `path` (named in every error as `path:line`).
    pub fn parse(path: &Path, text: &str) -> Result<WorkloadDescription> {
        let file: File = from_toml(path, text)?;
        let s = file.shared_prefix;
        let shared_prefix = SharedPrefix {
            groups: s.groups,
            prompts_per_group: s.prompts_per_group,
            prefix_tokens: s.prefix_tokens,
            question_tokens: s.question_tokens,
            output_tokens: s.output_tokens,
            seed: s.seed,
            stages: file
                .stage
                .iter()
                .map(|st| Stage {
                    rate_rps: st.rate_rps,
                    requests: st.requests,
                    wait_for_drain: st.wait_for_drain,
                })
                .collect(),
        };
        shared_prefix.validate().map_err(|e| {
            // The field the message names, at its line.
            let msg = e.to_string();
            let key = [
                "prefix_tokens",
                "question_tokens",
                "prompts_per_group",
                "groups",
                "rate",
                "requests",
            ]
            .into_iter()
            .find(|k| msg.contains(k))
            .map(|k| if k == "rate" { "rate_rps" } else { k });
            let line = key.and_then(|k| line_of_key(text, k));
            match line {
                Some(line) => anyhow!("{}:{line}: {msg}", path.display()),
                None => anyhow!("{}: {msg}", path.display()),
            }
        })?;
        Ok(WorkloadDescription {
            name: file.name,
            source: file.source,
            shared_prefix,
        })
    }

    /// Writes the generated trace to `out` (atomically) and returns a one-paragraph summary of
    /// it: prompts, shared share, requests and the ladder's span.
    pub fn write_trace(&self, out: &Path) -> Result<String> {
        let text = self.shared_prefix.to_jsonl()?;
        crate::cell::write_atomic(out, text.as_bytes())?;
        let s = &self.shared_prefix;
        let requests: u32 = s.stages.iter().map(|st| st.requests).sum();
        let span_s = s
            .arrivals_us()
            .last()
            .map_or(0.0, |(at, _)| *at as f64 / 1e6);
        Ok(format!(
            "{}: {} groups × {} prompts ({} distinct), each {} shared + {} own tokens ({:.1}% shared), {} output tokens; {} stages, {requests} requests over {span_s:.3} s of trace time; written to {}. Replay it with `cargo xtask sweep trace --trace {}`, whose cells send only what their warm-up + window cover (wall s = trace s × --time-scale ÷ the fleet's speed); the report gives each stage",
            self.name,
            s.groups,
            s.prompts_per_group,
            s.prompts(),
            s.prefix_tokens,
            s.question_tokens,
            100.0 * f64::from(s.prefix_tokens) / f64::from(s.prefix_tokens + s.question_tokens),
            s.output_tokens,
            s.stages.len(),
            out.display(),
            out.display()
        ))
    }
}

/// `cargo xtask workload DESCRIPTION --out TRACE`: reads the description, writes its trace and
/// prints the summary.
pub fn write(description: &Path, out: &Path) -> Result<()> {
    let summary = WorkloadDescription::read(description)?.write_trace(out)?;
    println!("{summary}");
    Ok(())
}

/// The descriptions kvroute ships (`workloads/*.toml` under `root`), sorted by path.
pub fn shipped(root: &Path) -> Result<Vec<WorkloadDescription>> {
    crate::fleet_description::read_toml_dir(&root.join("workloads"), WorkloadDescription::read)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    #[test]
    fn shipped_descriptions_parse_and_generate() {
        let all = shipped(&root()).unwrap();
        assert!(!all.is_empty());
        for d in &all {
            let text = d.shared_prefix.to_jsonl().unwrap();
            let t = trace::Trace::parse_bytes(&d.name, text.as_bytes()).unwrap();
            let requests: u32 = d.shared_prefix.stages.iter().map(|s| s.requests).sum();
            assert_eq!(t.len(), requests as usize, "{}", d.name);
            assert!(!d.source.is_empty());
        }
    }

    #[test]
    fn a_broken_description_names_its_line() {
        let good = "name = \"w\"\nsource = \"s\"\n\n[shared_prefix]\ngroups = 2\nprompts_per_group = 2\nprefix_tokens = 512\nquestion_tokens = 10\noutput_tokens = 4\nseed = 1\n\n[[stage]]\nrequests = 8\nrate_rps = 2.0\n";
        let p = Path::new("w.toml");
        let d = WorkloadDescription::parse(p, good).unwrap();
        assert_eq!(d.shared_prefix.stages[0].rate_rps, Some(2.0));
        let typo = good.replace("question_tokens", "question_token");
        let err = WorkloadDescription::parse(p, &typo)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("w.toml:8:"), "{err}");
        let bad = good.replace("prefix_tokens = 512", "prefix_tokens = 500");
        let err = WorkloadDescription::parse(p, &bad).unwrap_err().to_string();
        assert!(
            err.starts_with("w.toml:7:") && err.contains("512-token"),
            "{err}"
        );
        let bad = good.replace("rate_rps = 2.0", "rate_rps = -1.0");
        let err = WorkloadDescription::parse(p, &bad).unwrap_err().to_string();
        assert!(err.starts_with("w.toml:14:"), "{err}");
        let scratch = crate::scratch::Scratch::new("workload-description");
        let out = scratch.0.join("w.jsonl");
        let summary = d.write_trace(&out).unwrap();
        assert!(
            summary.contains("2 groups × 2 prompts (4 distinct)"),
            "{summary}"
        );
        let t = trace::Trace::parse_bytes("w", &std::fs::read(&out).unwrap()).unwrap();
        assert_eq!(t.len(), 8);
    }

    /// A described ladder replayed in virtual time: no capacity search, every cell accepted
    /// whatever its drift (the load changes by design), and the report gives each repetition
    /// stage by stage, every request of each stage counted.
    #[test]
    fn a_ladder_replayed_in_virtual_time_is_reported_stage_by_stage() {
        use crate::grid::SweepName;
        use crate::sweep::SweepSettings;
        use crate::trace_sweep::TraceSettings;
        let scratch = crate::scratch::Scratch::new("ladder");
        let d = WorkloadDescription {
            name: "ladder".into(),
            source: "test".into(),
            shared_prefix: SharedPrefix {
                groups: 4,
                prompts_per_group: 4,
                prefix_tokens: 512,
                question_tokens: 64,
                output_tokens: 8,
                seed: 3,
                stages: vec![
                    Stage {
                        rate_rps: Some(2.0),
                        requests: 20,
                        wait_for_drain: false,
                    },
                    Stage {
                        rate_rps: Some(6.0),
                        requests: 30,
                        wait_for_drain: true,
                    },
                ],
            },
        };
        let trace = scratch.0.join("ladder.jsonl");
        d.write_trace(&trace).unwrap();
        let s = SweepSettings {
            name: SweepName::Trace,
            policies: vec!["round-robin".into(), "prefix-affinity".into()],
            warmup_s: 1.0,
            measure_s: 3.0,
            trace: Some(TraceSettings {
                // The ladder spans 10 + 5 s of trace time: all of it.
                duration_s: Some(20.0),
                ..TraceSettings::new(trace, true, Some(512), None)
            }),
            ..SweepSettings::test_quick()
        };
        assert!(!s.needs_capacity(), "a replay's load is its own");
        let out = scratch.0.join("sweep");
        std::fs::create_dir_all(&out).unwrap();
        let prepared = crate::virtual_sweep::prepare(&s, &out).unwrap();
        assert!(prepared.calibration.capacity.is_none(), "nothing searched");
        assert_eq!(prepared.jobs.len(), 2);
        for job in &prepared.jobs {
            crate::virtual_sweep::run_cell(&prepared.cells, job).unwrap();
        }
        let report = analysis::analyze_dir(&out, &analysis::ReportConfig::default()).unwrap();
        assert_eq!(report.stages.len(), 2, "one per repetition");
        for c in &report.stages {
            let st = &c.report.stages;
            assert_eq!(st.len(), 2, "{c:?}");
            assert_eq!((st[0].requests, st[1].requests), (20, 30));
            // Model time: the offered rates are the ladder's (Poisson: within 60% on 20 and 30
            // arrivals), whatever the emulator's speed.
            let (a, b) = (st[0].offered_rps.unwrap(), st[1].offered_rps.unwrap());
            assert!(
                (a / 2.0 - 1.0).abs() < 0.6 && (b / 6.0 - 1.0).abs() < 0.6,
                "{a} {b}"
            );
            assert!(st.iter().all(|x| x.output_tokens_per_s > 0.0));
        }
        let md = analysis::markdown::render(&report);
        assert!(md.contains("## Stages"), "{md}");
        for p in report.points.iter().flat_map(|p| &p.cells) {
            assert!(p.set_aside.is_empty(), "{p:?}");
        }
    }
}
