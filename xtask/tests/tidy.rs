//! Tidy: the architecture's invariants (docs/ARCHITECTURE.md, "Invariants") as a test, in the
//! way rust-analyzer keeps its own — read the workspace's manifests and sources and fail with the
//! file that breaks a rule. Runs under `cargo test --workspace`; needs nothing but the checkout.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Which workspace crates each library crate may depend on (`[dependencies]`; dev-dependencies
/// are free, since tests may wire crates together). The layering of docs/ARCHITECTURE.md: a crate
/// missing here fails the test, so a new crate states its place before it lands.
#[rustfmt::skip]
const LAYERS: &[(&str, &[&str])] = &[
    ("schema", &[]),
    ("prom-text", &[]),
    ("kv-index", &[]),
    ("workload", &[]),
    ("trace", &["workload"]),
    ("rt-sched", &[]),
    ("engine-core", &[]),
    ("engine", &["engine-core", "rt-sched"]),
    ("policies", &["kv-index"]),
    ("proxy", &["kv-index", "policies", "schema", "prom-text", "rt-sched"]),
    ("epp", &["proxy", "policies", "rt-sched"]),
    ("driver", &["workload", "schema", "trace"]),
    ("fleet", &["schema", "prom-text", "rt-sched"]),
    ("analysis", &["workload", "schema"]),
    ("figures", &["analysis", "schema"]),
    ("sim", &["workload", "trace", "policies", "kv-index", "engine-core", "schema"]),
    ("proxy-bench", &["proxy", "analysis", "schema"]),
    ("experiment", &[
        "schema", "workload", "trace", "fleet", "analysis", "figures", "sim", "policies",
        "kv-index", "engine-core",
    ]),
    // Dev-only: what the tests share (taken under [dev-dependencies] only).
    ("test-support", &[]),
];

/// Crates whose code knows nothing of HTTP, async runtimes, files, processes or clocks: time
/// enters them as an argument. `engine-core` is the emulator's core, which the simulator drives
/// in virtual time; its server is the separate `engine` crate, which is not pure. No exemptions.
const PURE: &[&str] = &[
    "schema",
    "prom-text",
    "kv-index",
    "policies",
    "workload",
    "trace",
    "engine-core",
];

/// Dependencies a pure crate may not declare.
const IMPURE_DEPS: &[&str] = &[
    "tokio",
    "hyper",
    "hyper-util",
    "http-body-util",
    "zeromq",
    "tonic",
    "ureq",
    "nvml-wrapper",
    "libc",
    "tower-service",
    "atomic-write-file",
];

/// Crates that run without an async runtime (the simulator; the experiments, over blocking `fleet`
/// calls): nothing they reach through `[dependencies]` (workspace crates by their manifests, other
/// packages by Cargo.lock) is an async or server stack, or the engine's server crate.
const NO_ASYNC: &[&str] = &["sim", "experiment"];
const ASYNC_STACK: &[&str] = &["tokio", "hyper", "zeromq", "tonic", "engine"];

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
/// tests included, this file aside), so logic that grows lands in a library crate instead.
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
        for dep in dependencies(&dir.join("Cargo.toml")) {
            if IMPURE_DEPS.contains(&dep.as_str()) {
                problems.push(format!("crates/{name}/Cargo.toml depends on `{dep}`"));
            }
        }
        let mut files = Vec::new();
        rust_files(&dir.join("src"), &mut files);
        for file in &files {
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
    /// The names a README's module map gives entries: within its `Module map` section (up to the
    /// next heading of the same or a higher level), the backticked names in the first cell of a
    /// table row (and the `name::child` spans elsewhere in that row: its submodules), or the
    /// backticked name a bullet opens with; `.rs` dropped, `/` read as `::` (`server::api`,
    /// `bin/fake-replica`, `env.rs`). A word mentioned in passing is no entry.
    fn module_map_entries(text: &str) -> Option<BTreeSet<String>> {
        let heading = |line: &str| {
            let level = line.chars().take_while(|&c| c == '#').count();
            (level > 0 && line[level..].starts_with(' ')).then_some(level)
        };
        let mut lines = text.lines();
        let level =
            lines.find_map(|l| heading(l).filter(|_| l.to_lowercase().contains("module map")))?;
        let normalise = |name: &str| name.trim_end_matches(".rs").replace('/', "::");
        let mut entries = BTreeSet::new();
        for line in lines.take_while(|l| heading(l).is_none_or(|n| n > level)) {
            let line = line.trim_start();
            if let Some(row) = line.strip_prefix('|') {
                let (first_cell, rest) = row.split_once('|').unwrap_or((row, ""));
                let names: Vec<String> = first_cell
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .map(normalise)
                    .collect();
                // A row may map its module's submodules too, as `parent::child` spans.
                let children = rest.split('`').skip(1).step_by(2).map(normalise);
                let children: Vec<String> = children
                    .filter(|c| names.iter().any(|n| c.starts_with(&format!("{n}::"))))
                    .collect();
                entries.extend(names);
                entries.extend(children);
            } else if let Some((name, _)) = line
                .strip_prefix("- `")
                .or_else(|| line.strip_prefix("* `"))
                .and_then(|item| item.split_once('`'))
            {
                entries.insert(normalise(name));
            }
        }
        Some(entries)
    }

    // The reading itself: a word in passing maps nothing, a row or a bullet does.
    let sample = "# c\n\nrows and state.\n\n## Module map\n\n| module | what |\n|---|---|\n\
                  | `rows` | the rows, `state` and `rows::csv` |\n- `server/api.rs` — the API\n\n\
                  ## Later\n\n| `state` | not in the map |\n";
    assert_eq!(
        module_map_entries(sample),
        Some(BTreeSet::from(
            ["rows", "rows::csv", "server::api"].map(String::from)
        ))
    );

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
        let Some(entries) = module_map_entries(&text) else {
            problems.push(format!("{} has no `Module map` section", rel(&readme)));
            continue;
        };
        let src = dir.join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        for file in files {
            let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
            if matches!(stem.as_str(), "lib" | "main" | "tests") || stem.ends_with("_tests") {
                continue;
            }
            // The module's path from the crate root: `server/mod.rs` is `server`, `server/api.rs`
            // is `server::api`.
            let relative = file
                .strip_prefix(&src)
                .expect("under src/")
                .with_extension("");
            let mut segments: Vec<String> = relative
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            if stem == "mod" {
                segments.pop();
            }
            let module = segments.join("::");
            if !entries.contains(&module) {
                problems.push(format!(
                    "{} does not map the module `{module}` ({}): its module map needs an entry \
                     naming it in backticks (a table row's first cell, or a bullet's opening)",
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
    // This file is the workspace's architecture check, kept here as rust-analyzer keeps its
    // own: it grows with the workspace's rules, not with the driver, so it is not counted.
    let this = root().join("xtask/tests/tidy.rs");
    let lines: usize = files
        .iter()
        .filter(|f| **f != this)
        .map(|f| fs::read_to_string(f).expect("source").lines().count())
        .sum();
    assert!(
        lines <= XTASK_MAX_LINES,
        "xtask has {lines} lines of Rust (tests included, this tidy test aside), over {XTASK_MAX_LINES}: move experiment logic into a library crate"
    );
}

/// Each package's dependencies as Cargo.lock records them (names only; versions merged).
fn lock_dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let text = fs::read_to_string(root().join("Cargo.lock")).expect("Cargo.lock");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for package in text.split("[[package]]").skip(1) {
        let name = package
            .lines()
            .find_map(|l| l.strip_prefix("name = "))
            .expect("a name");
        let deps = package
            .split_once("dependencies = [")
            .map_or("", |(_, d)| d);
        let deps = deps
            .split(']')
            .next()
            .unwrap()
            .split(',')
            .map(|d| d.trim().trim_matches('"'));
        let deps = deps
            .filter_map(|d| d.split(' ').next())
            .filter(|d| !d.is_empty());
        let entry = graph.entry(name.trim_matches('"').to_string()).or_default();
        entry.extend(deps.map(String::from));
    }
    graph
}

#[test]
fn simulator_and_experiments_reach_no_async_runtime() {
    let workspace: BTreeMap<String, PathBuf> = library_crates()
        .into_iter()
        .map(|d| (name_of(&d), d))
        .collect();
    let lock = lock_dependencies();
    let mut problems = Vec::new();
    for start in NO_ASYNC {
        // Every package reached, with the one it was reached from.
        let mut via: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = vec![start.to_string()];
        while let Some(package) = queue.pop() {
            let deps = match workspace.get(&package) {
                Some(dir) => dependencies(&dir.join("Cargo.toml")),
                None => lock.get(&package).cloned().unwrap_or_default(),
            };
            for dep in deps {
                if dep != *start && !via.contains_key(&dep) {
                    via.insert(dep.clone(), package.clone());
                    queue.push(dep);
                }
            }
        }
        for banned in ASYNC_STACK.iter().filter(|b| via.contains_key(**b)) {
            let mut path = vec![banned.to_string()];
            while let Some(parent) = via.get(path.last().unwrap()) {
                path.push(parent.clone());
            }
            path.reverse();
            problems.push(format!(
                "crates/{start} reaches `{banned}`: {}",
                path.join(" → ")
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every crate under `crates/` has a `**`crates/NAME`**` entry in docs/ARCHITECTURE.md's code map,
/// every binary under `bins/` one or its name in backticks in the `**`bins/*`**` entry, and every
/// entry names a crate that exists.
#[test]
fn every_crate_is_in_the_architecture_code_map() {
    let text = fs::read_to_string(root().join("docs/ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let map = text
        .split("\n## Code map")
        .nth(1)
        .expect("a `## Code map` section");
    let map = map.split("\n## ").next().unwrap();
    let entries: BTreeSet<&str> = map
        .split("**`")
        .skip(1)
        .filter_map(|r| r.split_once("`**"))
        .map(|(e, _)| e)
        .collect();
    let bins = map
        .split("\n\n")
        .find(|p| p.starts_with("**`bins/*`**"))
        .unwrap_or("");
    let mut problems = Vec::new();
    for kind in ["crates", "bins"] {
        for dir in fs::read_dir(root().join(kind)).expect("crates/ and bins/") {
            let (dir, in_bins) = (dir.expect("entry").path(), |n: &str| {
                bins.contains(&format!("`{n}`"))
            });
            let (name, entry) = (name_of(&dir), format!("{kind}/{}", name_of(&dir)));
            let listed = entries.contains(entry.as_str()) || (kind == "bins" && in_bins(&name));
            if dir.join("Cargo.toml").is_file() && !listed {
                problems.push(format!(
                    "{entry} has no entry in docs/ARCHITECTURE.md's code map"
                ));
            }
        }
    }
    for entry in entries
        .iter()
        .filter(|e| e.starts_with("crates/") || e.starts_with("bins/"))
    {
        if !entry.ends_with('*') && !root().join(entry).join("Cargo.toml").is_file() {
            problems.push(format!(
                "docs/ARCHITECTURE.md's code map names {entry}, not a crate"
            ));
        }
    }
    problems.sort();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Dependencies a crate declares that no source of it names as a path (`name::`, `use name`,
/// `extern crate name`), with why the crate still needs them: used only through a Cargo feature,
/// a macro that names no path, or linked for a side effect. `(crate, dependency, reason)`; an
/// entry that is no longer declared, or whose dependency the sources now name, fails the test,
/// so the list never outlives its reason.
#[rustfmt::skip]
const USED_WITHOUT_A_PATH: &[(&str, &str, &str)] = &[];

/// Every workspace member's directory: `crates/*`, `bins/*` and `xtask`.
fn members() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for kind in ["crates", "bins"] {
        for e in fs::read_dir(root().join(kind)).expect("crates/ and bins/") {
            let p = e.expect("entry").path();
            if p.join("Cargo.toml").is_file() {
                dirs.push(p);
            }
        }
    }
    dirs.push(root().join("xtask"));
    dirs.sort();
    dirs
}

/// Every dependency a manifest declares, with its table: `[dependencies]`,
/// `[dev-dependencies]`, `[build-dependencies]` (and their `[target.….…]` forms), as
/// `name.workspace = true` / `name = …` lines or `[dependencies.name]` tables.
fn declared_dependencies(manifest: &Path) -> Vec<(String, String)> {
    const TABLES: &[&str] = &["dependencies", "dev-dependencies", "build-dependencies"];
    let text = fs::read_to_string(manifest).expect("Cargo.toml");
    let mut deps = Vec::new();
    let mut table: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_end_matches(']');
            // `[target.'cfg(…)'.dev-dependencies]`: the table is the last segment.
            let header = match header.strip_prefix("target.") {
                Some(t) => t.rsplit('.').next().unwrap_or(t),
                None => header,
            };
            table = None;
            for t in TABLES {
                if header == *t {
                    table = Some((*t).to_string());
                } else if let Some(name) = header.strip_prefix(&format!("{t}.")) {
                    deps.push(((*t).to_string(), name.trim_matches('"').to_string()));
                }
            }
            continue;
        }
        let Some(t) = &table else { continue };
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let key = line.split(['=', '.']).next().expect("a key");
        deps.push((t.clone(), key.trim().trim_matches('"').to_string()));
    }
    deps
}

/// Whether `ident` (a crate name as Rust spells it) is named as a path in `text`: `ident::…`
/// (uses, calls, attributes such as `#[tokio::main]`, derives such as `thiserror::Error`),
/// `use ident…` or `extern crate ident`.
fn names_crate(text: &str, ident: &str) -> bool {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut from = 0;
    while let Some(i) = text[from..].find(ident).map(|i| i + from) {
        from = i + ident.len();
        let before = text[..i].chars().next_back();
        let after = &text[from..];
        if before.is_some_and(is_ident) || after.starts_with(is_ident) {
            continue;
        }
        let head = text[..i].trim_end();
        if after.starts_with("::")
            || head.ends_with("use")
            || head.ends_with("extern crate")
            || head.ends_with("pub use")
        {
            return true;
        }
    }
    false
}

/// A crate's Rust sources (src, tests, benches, examples, build.rs), line comments cut, so a
/// dependency named only in a comment or doc counts as unused.
fn crate_source_text(dir: &Path) -> String {
    let mut files = Vec::new();
    rust_files(dir, &mut files);
    let mut text = String::new();
    for f in files {
        for line in fs::read_to_string(&f).expect("source").lines() {
            text.push_str(line.split_once("//").map_or(line, |(code, _)| code));
            text.push('\n');
        }
    }
    text
}

#[test]
fn every_declared_dependency_is_used() {
    let mut problems = Vec::new();
    let mut allowed_seen = BTreeSet::new();
    let mut declared_anywhere = BTreeSet::new();
    for dir in members() {
        let manifest = dir.join("Cargo.toml");
        let text = crate_source_text(&dir);
        let krate = rel(&dir);
        for (table, dep) in declared_dependencies(&manifest) {
            declared_anywhere.insert(dep.clone());
            let allowed = USED_WITHOUT_A_PATH
                .iter()
                .find(|(c, d, _)| *c == name_of(&dir) && *d == dep);
            let used = names_crate(&text, &dep.replace('-', "_"));
            match (used, allowed) {
                (false, None) => problems.push(format!(
                    "{krate}: [{table}] `{dep}` is not used by any of its sources (no `{}::`, `use {}` or `extern crate {}`): remove it, or list it in USED_WITHOUT_A_PATH with the reason",
                    dep.replace('-', "_"),
                    dep.replace('-', "_"),
                    dep.replace('-', "_"),
                )),
                (true, Some(_)) => problems.push(format!(
                    "{krate}: `{dep}` is listed in USED_WITHOUT_A_PATH but its sources name it: drop the entry"
                )),
                _ => {}
            }
            if allowed.is_some() {
                allowed_seen.insert((name_of(&dir), dep));
            }
        }
    }
    for (c, d, _) in USED_WITHOUT_A_PATH {
        if !allowed_seen.contains(&(c.to_string(), d.to_string())) {
            problems.push(format!(
                "USED_WITHOUT_A_PATH lists `{d}` for `{c}`, which does not declare it: drop the entry"
            ));
        }
    }
    // The workspace's own table: an entry no member declares is dead too.
    for (_, dep) in workspace_dependencies() {
        if !declared_anywhere.contains(&dep) {
            problems.push(format!(
                "Cargo.toml: [workspace.dependencies] `{dep}` is declared by no workspace member: remove it"
            ));
        }
    }
    problems.sort();
    problems.dedup();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The names in the root manifest's `[workspace.dependencies]`.
fn workspace_dependencies() -> Vec<(String, String)> {
    let text = fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    let mut inside = false;
    let mut deps = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            inside = line == "[workspace.dependencies]";
            continue;
        }
        if inside && !line.is_empty() && !line.starts_with('#') {
            let key = line.split(['=', '.']).next().expect("a key");
            deps.push((
                "workspace.dependencies".into(),
                key.trim().trim_matches('"').to_string(),
            ));
        }
    }
    deps
}
