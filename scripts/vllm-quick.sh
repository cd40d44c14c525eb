#!/usr/bin/env bash
# The vLLM fleet end to end, one command: vLLM and its tiny model (scripts/vllm-server.sh,
# installed or reused), then `cargo xtask calibrate`, the quick pressure grid and a fault kill on
# three real vLLM replicas (`--fleet vllm`), each step resumable (rerun the script after an
# interruption: finished cells are skipped, a matching calibration is reused).
#
#   bash scripts/vllm-quick.sh            # the real vLLM fleet
#   bash scripts/vllm-quick.sh emulated   # the same steps on its emulated twin
#                                         # (`--fleet emulated --cache-model vllm-tiny`, speed 1:
#                                         # 32-token blocks, the vllm-tiny-cpu step model fitted
#                                         # by scripts/vllm_step_floors.py)
#
# Why these settings (docs/results.md, "Real engine: vLLM", has the measurements):
# - The same shape as the llama fleet's (scripts/llama-quick.sh), so the two real engines are
#   measured alike: closed loop, 8 users, think 1 s, 20 s warm-up + 40 s measured, one
#   repetition, `--prefix-groups 0` (1,100-token private contexts), `--include-outliers` (the
#   replicas share two cores with each other and everything else).
# - 512 blocks of 32 tokens per replica (16,384 tokens, the llama fleet's `-c`): the CPU
#   attention backend takes multiples of 32 only, and the router keys 32-token blocks to match
#   (the harness passes the fleet's block size; the router's token-parity probe refuses any other).
# - Every quick policy, exact-residency included: vLLM publishes KV events.
# - The fault: open loop at 0.5 req/s, 15 s warm-up, 40 s before the kill, the replica back
#   after 20 s (a vLLM restart takes 20-40 s of that), 40 s after.
# Everything runs under `nice -n 10` (the machine is shared). Output under measurements/.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE="${1:-vllm}"
MODEL=kvroute/tiny
case "$MODE" in
    vllm) FLEET=(--fleet vllm --model "$MODEL" --num-gpu-blocks 512 --ready-timeout-s 240); NAME=vllm ;;
    emulated) FLEET=(--fleet emulated --cache-model vllm-tiny --model "$MODEL" --num-gpu-blocks 512); NAME=vllm-emulated ;;
    *) echo "usage: $0 [vllm|emulated]" >&2; exit 2 ;;
esac
OUT=measurements
CAL="$OUT/$NAME-calibration.json"
LOAD=(--users 8 --think-s 1)
WINDOW=(--warmup-s 20 --measure-s 40)
GRID=(sweep pressure-grid --quick --reps 1 --prefix-groups 0 "${LOAD[@]}" "${WINDOW[@]}"
      --policies round-robin,session-affinity,prefix-affinity,exact-residency)
NB=()
[ "${KVROUTE_NO_BUILD:-0}" = 1 ] && NB=(--no-build)
X=(nice -n 10 cargo xtask)

if [ "$MODE" = vllm ]; then
    # Installs vLLM and makes the model (3-5 min and 6.2 GB the first time), or reuses them (0.02 s).
    bash scripts/vllm-server.sh >/dev/null
fi

T0=$(date +%s)
step() { echo "vllm-quick [$MODE] $1 — $(( $(date +%s) - T0 )) s elapsed" >&2; }

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
    --policies session-affinity,prefix-affinity,exact-residency --rate 0.5 \
    --warmup-s 15 --before-s 40 --outage-model-s 20 --after-s 40 \
    --sweep-dir-name "$NAME-fault-kill-quick" "${NB[@]}"

step "done"
