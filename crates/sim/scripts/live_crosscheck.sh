#!/bin/bash
# Live half of the simulator cross-check: 2 emulated engines + router + closed-loop driver on one
# plan, rows into OUT_DIR. Compare with:
#   cargo run --release -p sim --example crosscheck -- PLAN POLICY 2 BLOCKS 1 VIRT_DIR OUT_DIR
# usage: live_crosscheck.sh PLAN POLICY OUT_DIR [NUM_GPU_BLOCKS]   (release binaries must be built)
set -u
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
B=${CARGO_TARGET_DIR:-$ROOT/target}/release
PLAN=$1; POLICY=$2; OUT=$3; BLOCKS=${4:-1024}
mkdir -p "$OUT"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
ready() { # file → the readiness line (the servers print one JSON line once listening)
  for _ in $(seq 300); do line=$(head -1 "$1" 2>/dev/null); [ -n "$line" ] && { echo "$line"; return; }; sleep 0.1; done
  echo "no readiness line in $1" >&2; exit 1
}
field() { echo "$1" | sed "s/.*\"$2\":\"\([^\"]*\)\".*/\1/"; }
URLS=(); EVS=()
for i in 0 1; do
  "$B/engine" --port 0 --num-gpu-blocks "$BLOCKS" --enable-prompt-tokens-details --kv-events-port 0 \
    --seed "$i" > "$OUT/engine$i.out" 2> "$OUT/engine$i.err" &
  PIDS+=($!)
done
for i in 0 1; do
  line=$(ready "$OUT/engine$i.out")
  URLS+=("http://$(field "$line" listening)"); EVS+=("$(field "$line" kv_events)")
done
EXTRA=()
case $POLICY in exact-residency*) EXTRA=(--kv-events "${EVS[0]},${EVS[1]}");; esac
"$B/router" --port 0 --replicas "${URLS[0]},${URLS[1]}" --policy "$POLICY" --rows "$OUT/router.csv" \
  --model kvroute/emulated-8b "${EXTRA[@]}" > "$OUT/router.out" 2> "$OUT/router.err" &
RP=$!; PIDS+=($RP)
RURL="http://$(field "$(ready "$OUT/router.out")" listening)"
"$B/driver" closed --url "$RURL" --plan "$PLAN" --out "$OUT/client.csv" --progress off > "$OUT/driver.out" 2>&1
kill -TERM "$RP"; wait "$RP" 2>/dev/null
