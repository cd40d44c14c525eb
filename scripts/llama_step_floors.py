#!/usr/bin/env python3
"""Measures one real llama-server replica's floors for the emulator's `llama-tiny` step model.

One replica of the tiny grid model with the fleet's pinned flags (fleet::llama::LlamaSpec:
`-np 4 -c 16384 -t 1 -tb 1 --cache-reuse 0 --slot-prompt-similarity 0.1 --cache-ram 0
--kv-unified`), streamed chat requests one at a time (and one round of four at once for the
batched inter-token gap):

- TTFT of unseen prompts at about 300, 1,000, 2,000 and 4,000 tokens, one token generated (each
  opens with its own words, so no slot matches more than the chat template's first tokens);
- TTFT of the same 1,100-token prompt re-sent (all but its last token cached);
- the inter-token gap from the stream (64 tokens, `ignore_eos`), alone and with four streams;
- llama.cpp's own `timings` (`prompt_ms`, `predicted_per_token_ms`) beside the client's clock;
- the two-step tokenize round trip (`/apply-template`, `/tokenize`) of the 1,100-token prompt.

Every request also records the CPU time the server's threads ran meanwhile
(`/proc/PID/task/*/schedstat`): on a shared machine the wall clock measures the other processes
too, while one compute thread's CPU time is the engine's own cost (its floor). Decode CPU per token
comes from the same prompts with 65 and with 1 generated token.

Prints one JSON object. Light on purpose (a shared 2-core machine): about 20 requests, one
thread. Usage: llama_step_floors.py [LLAMA_DIR] (default ~/.cache/kvroute/llama-11434.0.0).
"""

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
DIR = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/kvroute/llama-11434.0.0")
BIN = os.path.join(DIR, "bin", "llama-server")
MODEL = os.path.join(DIR, "models", "tiny-words.gguf")
FLAGS = ["-np", "4", "-c", "16384", "-t", "1", "-tb", "1", "--cache-reuse", "0",
         "--slot-prompt-similarity", "0.1", "--cache-ram", "0", "--kv-unified", "--metrics",
         "--slots", "--seed", "1"]


def words():
    src = open(os.path.join(HERE, "..", "crates", "workload", "src", "text.rs")).read()
    out = []
    for name in ("FUNCTION_WORDS", "CONTENT_WORDS"):
        m = re.search(r"const " + name + r": &\[&str\] = &\[(.*?)\];", src, re.S)
        out += re.findall(r'"([^"]+)"', m.group(1))
    return out


WORDS = words()


def text(seed, n_words):
    # A deterministic word stream (an LCG over the vocabulary); seed-specific from the first word.
    x = seed * 2654435761 + 12345
    out = []
    for _ in range(n_words):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(WORDS[(x >> 33) % len(WORDS)])
    return " ".join(out)


def start():
    proc = subprocess.Popen(
        ["nice", "-n", "19", BIN, "-m", MODEL, "--alias", "kvroute/tiny", "--host", "127.0.0.1",
         "--port", "0"] + FLAGS,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    port = None
    for line in proc.stdout:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
        if port or time.time() > deadline:
            break
    # Drain the log so the server never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return proc, url
        except Exception:
            time.sleep(0.1)
    proc.kill()
    sys.exit("llama-server did not become healthy")


def post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


SERVER_PID = None


def cpu_ns():
    """CPU time the server's threads have run, ns (/proc/PID/task/*/schedstat): what a request
    costs the engine whatever else the shared machine runs meanwhile."""
    total = 0
    for tid in os.listdir(f"/proc/{SERVER_PID}/task"):
        try:
            with open(f"/proc/{SERVER_PID}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            pass  # a thread that just ended
    return total


def chat(url, content, max_tokens, out):
    body = json.dumps({"model": "kvroute/tiny", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    c0 = cpu_ns()
    t0 = time.perf_counter()
    arrivals, usage, timings = [], None, None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                if ch.get("delta", {}).get("content"):
                    arrivals.append(time.perf_counter() - t0)
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
    cpu_ms = (cpu_ns() - c0) / 1e6
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    out.append({
        "cpu_ms": cpu_ms,
        "ttft_ms": arrivals[0] * 1000,
        "itl_ms_p50": statistics.median(gaps) * 1000 if gaps else None,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "server_prompt_ms": timings and timings.get("prompt_ms"),
        "server_prompt_n": timings and timings.get("prompt_n"),
        "server_predicted_per_token_ms": timings and timings.get("predicted_per_token_ms"),
    })


def main():
    global SERVER_PID
    proc, url = start()
    SERVER_PID = proc.pid
    try:
        res = {"flags": FLAGS, "model": MODEL}
        chat(url, text(999, 50), 4, [])  # warm-up: first-request allocations
        seed = 0
        for name, n_words in [("unseen_300", 270), ("unseen_1100", 1000), ("unseen_2200", 2000),
                              ("unseen_4000", 4000)]:
            rows = []
            for _ in range(3):
                seed += 1
                chat(url, text(seed, n_words), 1, rows)
            res[name] = rows
        rows = []
        base = text(500, 1000)
        chat(url, base, 8, [])
        for _ in range(3):
            chat(url, base, 1, rows)
        res["cached_1100"] = rows
        # Decode CPU: the same-size unseen prompt with 1 and with 65 generated tokens.
        for n_out in (1, 65):
            rows = []
            for _ in range(3):
                seed += 1
                chat(url, text(seed, 100), n_out, rows)
            res[f"decode_cpu_{n_out}"] = rows
        rows = []
        for _ in range(3):
            seed += 1
            chat(url, text(seed, 100), 64, rows)
        res["itl_alone"] = rows
        rows = []
        ts = [threading.Thread(target=chat, args=(url, text(700 + i, 100), 64, rows)) for i in range(4)]
        c0 = cpu_ns()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        res["itl_four_streams"] = rows
        res["four_streams_total_cpu_ms"] = (cpu_ns() - c0) / 1e6
        # fleet::llama::tokenize_messages' two round trips (apply-template, tokenize), 1,100 tokens.
        rows = []
        for _ in range(5):
            t0 = time.perf_counter()
            msgs = {"messages": [{"role": "user", "content": base}]}
            p = post(url, "/apply-template", msgs)["prompt"]
            n = len(post(url, "/tokenize", {"content": p, "add_special": True,
                                            "parse_special": True})["tokens"])
            rows.append({"tokenize_ms": (time.perf_counter() - t0) * 1000, "tokens": n})
        res["tokenize_1100"] = rows
        print(json.dumps(res, indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


main()
