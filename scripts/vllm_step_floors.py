#!/usr/bin/env python3
"""Measures one real vLLM replica's floors for the emulator's `vllm-tiny-cpu` step model.

Starts one replica of the tiny model the way the vLLM fleet does (fleet::vllm::VllmSpec: 32-token
blocks, 512 blocks, 4,096 tokens per sequence, eager, prefix caching; OpenMP on core 0), then
sends streamed `/v1/completions` requests of token-id prompts one at a time:

- TTFT of unseen prompts of 256, 1,024, 2,048 and 3,072 tokens, one token generated, 4 each
  (each prompt starts with its own tokens, so nothing is cached);
- TTFT of a 1,024-token prompt re-sent (all but its last block cached);
- the inter-token gap of 64 generated tokens (`ignore_eos`) on a 1,024-token prompt, alone and
  with four streams at once;
- the `/tokenize` round trip of a chat of about 1,100 tokens, the body the router sends (its
  cost per request with exact keys), 10 times.

Fits the step model's constants (crates/engine-core README, "vllm-tiny-cpu"): CPU-bound, so the
memory terms are off and every cost is compute. A prefill of N fresh tokens costs
`overhead + c_tok·N + c_attn·N²/2` (least squares over the unseen TTFTs, minus the frontend);
a decode step of d sequences with total context C costs `overhead + c_tok·d + c_decode_ctx·C`
(the two gaps); the frontend is what the TTFT's intercept holds beyond one step's overhead.

Prints one JSON object: the raw medians and the fit. Usage:
vllm_step_floors.py [VLLM_DIR] (default ~/.cache/kvroute/vllm-0.32.0).
"""

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

DIR = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/kvroute/vllm-0.32.0")
MODEL = "kvroute/tiny"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start():
    port, kv = free_port(), free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0",
               VLLM_CACHE_ROOT=os.path.join(DIR, "cache"), HF_HUB_OFFLINE="1",
               VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{kv}", "topic": "kv-events"})
    cmd = [os.path.join(DIR, "venv", "bin", "vllm"), "serve", os.path.join(DIR, "models", "tiny-llama"),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
           "--dtype", "float32", "--enable-prefix-caching", "--block-size", "32",
           "--max-model-len", "4096", "--enable-prompt-tokens-details", "--enforce-eager",
           "--num-gpu-blocks-override", "512", "--kv-events-config", events]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(480):
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("vLLM did not become healthy")


def stream(url, prompt, max_tokens):
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    t0 = time.perf_counter()
    times = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    ttft = (times[0] - t0) * 1000
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    return ttft, gaps


def main():
    rng = random.Random(41)
    proc, url = start()
    try:
        fresh = lambda n: [rng.randrange(10, 3000) for _ in range(n)]
        stream(url, fresh(64), 1)  # the first request pays one-time costs
        ttft = {}
        for n in (256, 1024, 2048, 3072):
            ttft[n] = statistics.median(stream(url, fresh(n), 1)[0] for _ in range(4))
        p = fresh(1024)
        stream(url, p, 1)
        cached = statistics.median(stream(url, p, 1)[0] for _ in range(4))
        alone = statistics.median(stream(url, fresh(1024), 65)[1])
        gaps4 = []
        def one():
            gaps4.extend(stream(url, fresh(1024), 65)[1])
        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        four = statistics.median(gaps4)
        words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(450))
        tok_body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": words}],
                               "add_special_tokens": False}).encode()
        tok_ms, tok_len = [], 0
        for _ in range(10):
            req = urllib.request.Request(url + "/tokenize", tok_body, {"content-type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=30) as r:
                tok_len = json.load(r)["count"]
            tok_ms.append((time.perf_counter() - t0) * 1000)
        tokenize = statistics.median(tok_ms)
    finally:
        os.killpg(proc.pid, 9)
    # Least squares of TTFT = a + b·N + c·N²/2 over the four lengths.
    xs = sorted(ttft)
    rows = [[1.0, float(n), n * n / 2.0] for n in xs]
    ys = [ttft[n] for n in xs]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(3)]
    a, b, c = solve(ata, aty)
    c = max(c, 0.0)
    # Decode: gap(d, C) = overhead + b·d + k·C with C = d × ~1,056 (prompt + half the output).
    ctx = 1024 + 32
    k = max(((four - 4 * b) - (alone - b)) / (3 * ctx), 0.0)
    overhead = max(alone - b - k * ctx, 0.0)
    frontend = max(a - overhead, 0.0)
    print(json.dumps({
        "ttft_unseen_ms": {str(n): round(ttft[n], 2) for n in xs},
        "ttft_cached_1024_ms": round(cached, 2),
        "itl_alone_ms": round(alone, 3),
        "itl_four_streams_ms": round(four, 3),
        "tokenize_chat_ms": round(tokenize, 2),
        "tokenize_chat_tokens": tok_len,
        "fit": {"overhead_ms": round(overhead, 3), "c_tok_ms": round(b, 5),
                "c_attn_ms": float(f"{c:.3e}"), "c_decode_ctx_ms": float(f"{k:.3e}"),
                "frontend_ms": round(frontend, 2), "tokenize_ms": round(tokenize, 2)},
    }, indent=1))


def solve(m, v):
    n = len(v)
    m = [row[:] + [v[i]] for i, row in enumerate(m)]
    for i in range(n):
        piv = max(range(i, n), key=lambda r: abs(m[r][i]))
        m[i], m[piv] = m[piv], m[i]
        for r in range(n):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [x - f * y for x, y in zip(m[r], m[i])]
    return [m[i][n] / m[i][i] for i in range(n)]


if __name__ == "__main__":
    main()
