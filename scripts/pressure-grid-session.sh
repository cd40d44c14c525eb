#!/usr/bin/env bash
# Runs the live full pressure grid for at most MINUTES, then reports and publishes what finished.
#
# Why: the full grid (12 points × 9 policies × 3 repetitions, 70–160 s an attempt: 40 s measured
# after a warm-up derived per point from its settling time) takes ≈ 7–10 h on a 2-core machine,
# longer than a session, and `measurements/` is not kept from one session to the next (on 2 Dec 2026
# seven finished points were lost that way). So the grid advances a session at a time and lives in
# its published copy:
#
#   1. restore `docs/measurements/pressure-grid` into `measurements/pressure-grid` when the working
#      copy is absent (rows stay compressed; the report and a republish read them as they are);
#   2. `xtask sweep pressure-grid` resumes: finished cells are skipped, the calibration the grid
#      began with is kept (`calibration.json` travels with the published copy);
#   3. at the deadline the sweep gets SIGINT: the cell in flight is dropped, finished cells stay;
#   4. `xtask report`, then `xtask publish` → `docs/measurements/pressure-grid`, for a commit.
#
# Usage: scripts/pressure-grid-session.sh MINUTES [more `xtask sweep` flags]
# Nothing else should run on the machine meanwhile: the cells' evidence gate (engine lateness)
# discards attempts disturbed by other work, and each discard costs a whole attempt; a compile
# during a cell pushed lateness p99.9 to 10 ms on 2 Dec 2026.
set -euo pipefail

minutes="${1:?usage: scripts/pressure-grid-session.sh MINUTES [sweep flags]}"
shift
cd "$(dirname "$0")/.."

work=measurements/pressure-grid
published=docs/measurements/pressure-grid
if [[ ! -d "$work" && -f "$published/calibration.json" ]]; then
    mkdir -p measurements
    cp -a "$published" "$work"
    echo "pressure-grid-session: restored $work from $published" >&2
fi

cargo build --quiet --release --package xtask
xtask=target/release/xtask
started=$(date -u +%FT%TZ)
echo "pressure-grid-session: sweep from $started for at most $minutes min" >&2
rc=0
# SIGINT at the deadline is the sweep's own interrupt (finished cells kept); SIGKILL two minutes
# later only if it has not stopped by then.
timeout --signal=INT --kill-after=120 "$((minutes * 60))" \
    "$xtask" sweep pressure-grid "$@" || rc=$?
echo "pressure-grid-session: sweep ended with status $rc at $(date -u +%FT%TZ)" >&2
if [[ ! -f "$work/calibration.json" ]]; then
    echo "pressure-grid-session: no calibration was finished; nothing to publish" >&2
    exit 1
fi
"$xtask" report "$work"
"$xtask" publish "$work"
