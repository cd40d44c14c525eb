#!/usr/bin/env python3
"""Per-request cache classes of two sweeps of the same plans, side by side: the real llama fleet
and its emulated twin (or the virtual one), cell by cell (point × policy, repetition 1).

Usage: python3 scripts/llama_compare.py REAL_SWEEP_DIR OTHER_SWEEP_DIR [LABEL_A LABEL_B]
       python3 scripts/llama_compare.py --report SWEEP_DIR...   (goodput beside attainment, TTFT
       and ITL p50, engine prefix-hit rate, busiest replica's share and measured requests per
       cell, from each sweep's report.json and rows, one column group per sweep)

Reads each cell's client rows (`client.csv` or the published `client.csv.gz`), every successful
row (warm-up included: the cache does not know about the window). The two sides' tokenizers and
replies differ, so raw counts cannot agree; the compared unit is the differential test's
(crates/fleet/tests/llama_emulator.rs), in each side's own tokens:
  first  turn 1 of a conversation;
  hit    a later turn whose cached tokens cover at least its previous turn's whole prompt (the
         conversation's slot survived and was chosen);
  part   a later turn with 16 or more cached tokens but less than that (another conversation's
         slot, or a slot overwritten in part);
  miss   a later turn with fewer than 16 cached tokens (the chat template's first tokens only).
Requests are joined by request id (the plan's: the same conversation and turn on both sides).
Prints one Markdown table: requests, later turns, hit / part / miss shares of the later turns,
Σcached / Σprompt over the later turns, per side, and the share of joined later turns whose class
agrees.
"""

import csv
import gzip
import os
import sys


def rows_of(cell):
    for name in ("client.csv", "client.csv.gz"):
        path = os.path.join(cell, name)
        if os.path.exists(path):
            opener = gzip.open if name.endswith(".gz") else open
            with opener(path, "rt", newline="") as f:
                return [r for r in csv.DictReader(f)]
    return None


def classes(rows):
    ok = [r for r in rows if r["status"] == "200" and not r["error"] and r["cached_tokens"]]
    prompt = {(r["session_id"], int(r["turn"])): int(r["prompt_tokens"]) for r in ok}
    out = {}
    for r in ok:
        turn, cached = int(r["turn"]), int(r["cached_tokens"])
        if turn == 1:
            c = "first"
        else:
            prev = prompt.get((r["session_id"], turn - 1))
            if prev is None:
                c = None  # previous turn failed or was not sent: unclassified
            elif cached >= prev:
                c = "hit"
            elif cached >= 16:
                c = "part"
            else:
                c = "miss"
        out[r["request_id"]] = (c, cached, int(r["prompt_tokens"]))
    return out


def summary(cls):
    later = [v for v in cls.values() if v[0] in ("hit", "part", "miss")]
    n = len(later)
    share = lambda k: sum(1 for v in later if v[0] == k) / n if n else float("nan")
    cached = sum(v[1] for v in later)
    prompt = sum(v[2] for v in later)
    return len(cls), n, share("hit"), share("part"), share("miss"), cached / prompt if prompt else float("nan")


def cells(sweep):
    for point in sorted(os.listdir(sweep)):
        pdir = os.path.join(sweep, point)
        if not os.path.isdir(pdir) or point.startswith("_") or point in ("logs", "calibration-runs"):
            continue
        for policy in sorted(os.listdir(pdir)):
            cell = os.path.join(pdir, policy, "rep-1")
            if os.path.isdir(cell):
                yield point, policy, cell


def measured(cell):
    """Measured requests of a closed-loop repetition: rows outside the warm-up sent in the window."""
    meta_path = os.path.join(cell, "meta.json")
    rows = rows_of(cell)
    if rows is None or not os.path.exists(meta_path):
        return None
    import json

    w = json.load(open(meta_path))["window"]
    lo, hi = w["measured_start_s"], w["measured_end_s"]
    return sum(1 for r in rows if r["warmup"] in ("0", "false") and r["sent_s"] and lo <= float(r["sent_s"]) < hi)


def report(sweeps):
    import json

    reps = {d: json.load(open(os.path.join(d, "report.json"))) for d in sweeps}
    names = [os.path.basename(d.rstrip("/")) for d in sweeps]
    print("| point | policy | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(sweeps))
    first = reps[sweeps[0]]
    for p in first["points"]:
        for c in p["cells"]:
            cols = []
            for d in sweeps:
                pt = next((q for q in reps[d]["points"] if q["point"] == p["point"]), None)
                cc = pt and next((x for x in pt["cells"] if x["policy"] == c["policy"]), None)
                if not cc or not cc["goodput_rps"]:
                    cols.append("—")
                    continue
                med = lambda k: cc[k]["median"] if cc.get(k) else float("nan")
                mech = cc["mechanism"]["all"]
                n = measured(os.path.join(d, p["point"], c["policy"], "rep-1"))
                cols.append(
                    f"{med('goodput_rps'):.2f} ({100 * med('slo_attainment'):.0f}%); TTFT {med('ttft_p50_ms'):.0f} ms, "
                    f"ITL {med('itl_p50_ms'):.1f} ms; hit {100 * mech['prefix_hit_rate']['median']:.0f}%, "
                    f"busiest {100 * mech['busiest_share']['median']:.0f}%; n={n}"
                )
            print(f"| {p['point']} | {c['policy']} | " + " | ".join(cols) + " |")


def main():
    if sys.argv[1] == "--report":
        report(sys.argv[2:])
        return
    a, b = sys.argv[1], sys.argv[2]
    la, lb = (sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else ("real", "emulated")
    print(f"| point | policy | requests {la} / {lb} | later turns | hit {la} / {lb} | part {la} / {lb} | miss {la} / {lb} | Σcached/Σprompt {la} / {lb} | class agrees (joined) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for point, policy, cell in cells(a):
        other = os.path.join(b, point, policy, "rep-1")
        ra, rb = rows_of(cell), rows_of(other) if os.path.isdir(other) else None
        if ra is None or rb is None:
            continue
        ca, cb = classes(ra), classes(rb)
        sa, sb = summary(ca), summary(cb)
        joined = [(ca[k][0], cb[k][0]) for k in ca.keys() & cb.keys()
                  if ca[k][0] in ("hit", "part", "miss") and cb[k][0] in ("hit", "part", "miss")]
        agree = sum(1 for x, y in joined if x == y)
        pct = lambda x: f"{100 * x:.0f}%"
        print(
            f"| {point} | {policy} | {sa[0]} / {sb[0]} | {sa[1]} / {sb[1]} | {pct(sa[2])} / {pct(sb[2])} | "
            f"{pct(sa[3])} / {pct(sb[3])} | {pct(sa[4])} / {pct(sb[4])} | {pct(sa[5])} / {pct(sb[5])} | "
            f"{agree} of {len(joined)} |"
        )


if __name__ == "__main__":
    main()
