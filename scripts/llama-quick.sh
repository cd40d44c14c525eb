#!/usr/bin/env bash
# The llama fleet end to end, one command: llama-server and its models (scripts/llama-server.sh,
# built or reused), then `cargo xtask calibrate`, the quick pressure grid and a fault kill on three
# llama-server replicas (`--fleet llama`), each step resumable (rerun the script after an
# interruption: finished cells are skipped, a matching calibration is reused).
#
#   bash scripts/llama-quick.sh            # the real llama.cpp fleet (22 min measured on 2 shared cores)
#   bash scripts/llama-quick.sh emulated   # the same steps on its emulated twin
#                                          # (`--fleet emulated --cache-model llama-slots`, speed 1)
#   bash scripts/llama-quick.sh virtual    # the twin's grid in virtual time (seconds), judged by
#                                          # the emulated twin's calibration (run `emulated` first)
#
# Why these settings (docs/results.md, "Real engine: llama.cpp", has the measurements):
# - Closed loop, 8 users (the fleet has 12 slots), think 1 s, 20 s warm-up + 40 s measured:
#   a llama-server replica on one thread serves ~1 request/s of the grid's prompts, so a
#   capacity search (minutes per step) and open-loop rates near it do not fit; a closed loop
#   settles at whatever the fleet serves and needs no capacity (`--no-capacity`).
# - `--prefix-groups 0`: 1,100-token contexts, the floors' prompt length. llama.cpp's decode
#   time grows with the busy slots' context on its one thread, so an SLO from 1,100-token floors
#   would be missed by every policy on the default 2,560-token grouped prompts.
# - Floors with the 4 slots busy (calibrate's default on a llama fleet): one request at a time
#   never sees the batch's decode cost.
# - `--include-outliers`: replicas share two cores with each other and with everything else on
#   the machine, so a floor 1.3× its peers' is contention, not a throttled card.
# - Quick policies: round-robin, session-affinity, prefix-affinity (exact-residency needs KV
#   events, which llama-server does not publish); one repetition.
# - The fault: open loop at 0.25 req/s (the fault point's prompts are the grouped workload's
#   ~2,600 tokens; the grid's closed loop served ~0.5 req/s of 1,100-token prompts here), so the
#   two surviving replicas are not overloaded; 15 s warm-up, 40 s before the kill, the replica
#   back after 20 s, 40 s after.
# Everything runs under `nice -n 10` (the machine is shared). Output under measurements/.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE="${1:-llama}"
MODEL=kvroute/tiny
case "$MODE" in
    llama) FLEET=(--fleet llama --model "$MODEL"); NAME=llama ;;
    emulated | virtual) FLEET=(--fleet emulated --cache-model llama-slots --model "$MODEL"); NAME=llama-emulated ;;
    *) echo "usage: $0 [llama|emulated|virtual]" >&2; exit 2 ;;
esac
OUT=measurements
CAL="$OUT/$NAME-calibration.json"
LOAD=(--users 8 --think-s 1)
WINDOW=(--warmup-s 20 --measure-s 40)
GRID=(sweep pressure-grid --quick --reps 1 --prefix-groups 0 "${LOAD[@]}" "${WINDOW[@]}")
# KVROUTE_NO_BUILD=1: use the release binaries already in target/release (`--no-build`).
NB=()
[ "${KVROUTE_NO_BUILD:-0}" = 1 ] && NB=(--no-build)
X=(nice -n 10 cargo xtask)

if [ "$MODE" = virtual ]; then
    [ -f "$CAL" ] || { echo "$CAL is missing: run \`bash $0 emulated\` first" >&2; exit 1; }
    "${X[@]}" "${GRID[@]}" "${FLEET[@]}" --virtual --live-calibration "$CAL" \
        --sweep-dir-name llama-emulated-pressure-grid-quick-virtual
    exit 0
fi

if [ "$MODE" = llama ]; then
    # Builds llama-server (~8-12 min the first time) and the models, or reuses them (0.01 s).
    bash scripts/llama-server.sh >/dev/null
fi

T0=$(date +%s)
step() { echo "llama-quick [$MODE] $1 — $(( $(date +%s) - T0 )) s elapsed" >&2; }

step "1/3 calibrate"
if [ ! -f "$CAL" ]; then
    "${X[@]}" calibrate "${FLEET[@]}" --quick --include-outliers --requests 12 \
        "${LOAD[@]}" --warmup-s 20 --measure-s 40 --no-capacity --out "$CAL" "${NB[@]}"
fi

step "2/3 quick grid"
"${X[@]}" "${GRID[@]}" "${FLEET[@]}" --calibration "$CAL" \
    --sweep-dir-name "$NAME-pressure-grid-quick" "${NB[@]}"

step "3/3 fault kill"
"${X[@]}" fault kill --quick "${FLEET[@]}" --calibration "$CAL" \
    --policies session-affinity,prefix-affinity --rate 0.25 \
    --warmup-s 15 --before-s 40 --outage-model-s 20 --after-s 40 \
    --sweep-dir-name "$NAME-fault-kill-quick" "${NB[@]}"

step "done"
