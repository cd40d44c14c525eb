//! Tidy: the architecture's invariants (docs/ARCHITECTURE.md, "Invariants") as a test, in the
//! way rust-analyzer keeps its own — read the workspace's manifests and sources and fail with the
//! file that breaks a rule. Runs under `cargo test --workspace`; needs nothing but the checkout.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// Which workspace crates each library crate may depend on (`[dependencies]`; dev-dependencies
/// are free, since tests may wire crates together). The layering of docs/ARCHITECTURE.md: a crate
/// missing here fails the test, so a new crate states its place before it lands.
const LAYERS: &[(&str, &[&str])] = &[
    ("schema", &[]),
    ("prom-text", &[]),
    ("kv-index", &[]),
    ("workload", &[]),
    ("trace", &["workload"]),
    ("rt-sched", &[]),
    ("engine", &["rt-sched"]),
    ("policies", &["kv-index"]),
    (
        "proxy",
        &["kv-index", "policies", "schema", "prom-text", "rt-sched"],
    ),
    ("epp", &["proxy", "policies", "rt-sched"]),
    ("driver", &["workload", "schema", "trace"]),
    ("fleet", &["schema", "prom-text", "rt-sched"]),
    ("analysis", &["workload", "schema"]),
    ("figures", &["analysis", "schema"]),
    (
        "sim",
        &[
            "workload", "trace", "policies", "kv-index", "engine", "schema",
        ],
    ),
    ("proxy-bench", &["proxy", "analysis", "schema"]),
    (
        "experiment",
        &[
            "schema", "workload", "trace", "fleet", "analysis", "sim", "policies", "kv-index",
            "engine",
        ],
    ),
];

/// Crates whose code knows nothing of HTTP, async runtimes, files, processes or clocks: time
/// enters them as an argument. For `engine` the rule covers its core (everything outside
/// `src/server/`), which the simulator drives in virtual time.
const PURE: &[&str] = &[
    "schema",
    "prom-text",
    "kv-index",
    "policies",
    "workload",
    "trace",
    "engine",
];

/// Dependencies a pure crate may not declare (engine is exempt: its `server` module needs them).
const IMPURE_DEPS: &[&str] = &[
    "tokio",
    "hyper",
    "hyper-util",
    "http-body-util",
    "zeromq",
    "nvml-wrapper",
    "libc",
    "tower-service",
];

/// Source text a pure module may not contain.
const IMPURE_PATHS: &[&str] = &[
    "tokio::",
    "hyper::",
    "std::fs",
    "std::net",
    "std::process",
    "std::time",
    "std::env",
    "std::thread::sleep",
    "Instant::now",
    "SystemTime",
];

/// xtask is a thin driver of library calls; this is the size it must stay under (lines of Rust,
/// tests included), so logic that grows lands in a library crate instead.
const XTASK_MAX_LINES: usize = 3_000;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace root")
        .to_path_buf()
}

fn library_crates() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(root().join("crates"))
        .expect("crates/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    dirs.sort();
    dirs
}

fn name_of(dir: &Path) -> String {
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

/// The names in a manifest's `[dependencies]` table (and target-specific ones), without
/// dev- or build-dependencies. The manifests here use `name.workspace = true` or
/// `name = …` lines, which is all this reads.
fn dependencies(manifest: &Path) -> BTreeSet<String> {
    let text = fs::read_to_string(manifest).expect("Cargo.toml");
    let mut deps = BTreeSet::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            inside = line == "[dependencies]"
                || (line.starts_with("[target.") && line.ends_with(".dependencies]"));
            continue;
        }
        if !inside || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let key = line
            .split(['=', '.'])
            .next()
            .expect("a key")
            .trim()
            .trim_matches('"');
        deps.insert(key.to_string());
    }
    deps
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let p = e.expect("entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

#[test]
fn every_crate_depends_only_on_the_layers_below_it() {
    let workspace: BTreeSet<String> = library_crates().iter().map(|d| name_of(d)).collect();
    let mut problems = Vec::new();
    for dir in library_crates() {
        let name = name_of(&dir);
        let Some((_, allowed)) = LAYERS.iter().find(|(n, _)| *n == name) else {
            problems.push(format!(
                "crates/{name} has no entry in tidy's LAYERS: state which workspace crates it may depend on (and add it to docs/ARCHITECTURE.md)"
            ));
            continue;
        };
        for dep in dependencies(&dir.join("Cargo.toml")) {
            if workspace.contains(&dep) && !allowed.contains(&dep.as_str()) {
                problems.push(format!(
                    "crates/{name}/Cargo.toml depends on `{dep}`; it may depend on {allowed:?}"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn pure_crates_know_nothing_of_io_async_or_clocks() {
    let mut problems = Vec::new();
    for name in PURE {
        let dir = root().join("crates").join(name);
        assert!(dir.is_dir(), "pure crate {name} is missing from crates/");
        if *name != "engine" {
            for dep in dependencies(&dir.join("Cargo.toml")) {
                if IMPURE_DEPS.contains(&dep.as_str()) {
                    problems.push(format!("crates/{name}/Cargo.toml depends on `{dep}`"));
                }
            }
        }
        let mut files = Vec::new();
        rust_files(&dir.join("src"), &mut files);
        let server = dir.join("src").join("server");
        for file in files.iter().filter(|f| !f.starts_with(&server)) {
            let text = fs::read_to_string(file).expect("source");
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                for banned in IMPURE_PATHS {
                    if code.contains(banned) {
                        problems.push(format!(
                            "{}:{}: `{banned}` in a pure crate",
                            rel(file),
                            n + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_crate_readme_maps_its_modules_and_boundaries() {
    let mut problems = Vec::new();
    let mut dirs = library_crates();
    dirs.push(root().join("xtask"));
    for dir in dirs {
        let readme = dir.join("README.md");
        let Ok(text) = fs::read_to_string(&readme) else {
            problems.push(format!("{} is missing", rel(&readme)));
            continue;
        };
        // Whitespace-normalised, so a phrase may break across lines of the Markdown.
        let lower = text
            .to_lowercase()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        if dir.starts_with(root().join("crates")) && !lower.contains("may not import") {
            problems.push(format!(
                "{} does not say what the crate may not import",
                rel(&readme)
            ));
        }
        let mut files = Vec::new();
        rust_files(&dir.join("src"), &mut files);
        for file in files {
            let module = file.file_stem().unwrap().to_string_lossy().into_owned();
            if matches!(module.as_str(), "lib" | "main" | "mod") || module.ends_with("_tests") {
                continue;
            }
            if !text.contains(&module) {
                problems.push(format!(
                    "{} does not map the module `{module}` ({})",
                    rel(&readme),
                    rel(&file)
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn xtask_stays_a_thin_driver() {
    let mut files = Vec::new();
    rust_files(&root().join("xtask"), &mut files);
    let lines: usize = files
        .iter()
        .map(|f| fs::read_to_string(f).expect("source").lines().count())
        .sum();
    assert!(
        lines <= XTASK_MAX_LINES,
        "xtask has {lines} lines of Rust (tests included), over {XTASK_MAX_LINES}: move experiment logic into a library crate"
    );
}
