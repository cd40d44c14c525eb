#!/bin/bash
# Samples the scheduling of the next kvroute router process to start on this machine, for the
# measurement in docs/proxy-bench.md ("The router's overhead in a live cell"):
#   bash scripts/router-schedstat.sh OUT [other]
# waits for `target/release/router` to start, optionally demotes all its threads to SCHED_OTHER
# (`other`: what a router without --sched-fifo-priority gets), then reads
# /proc/<pid>/task/*/schedstat (on-CPU ns, run-queue wait ns, timeslices; summed over its
# threads) every 0.1 s until it exits. OUT gets the first sample and the largest sums.
set -euo pipefail
out=$1
mode=${2:-as-started}
: >"$out"
while true; do
  pid=$(pgrep -f 'target/release/router --host' | head -1 || true)
  [ -n "$pid" ] && break
  sleep 0.02
done
if [ "$mode" = other ]; then
  chrt -o -a -p 0 "$pid"
fi
echo "pid $pid mode $mode $(chrt -p "$pid" | tr '\n' ' ')" >>"$out"
first=""
best=(0 0 0)
while kill -0 "$pid" 2>/dev/null; do
  s=$(cat /proc/"$pid"/task/*/schedstat 2>/dev/null | awk '{a+=$1;b+=$2;c+=$3} END {print a, b, c}' || true)
  if [ -n "$s" ]; then
    read -r cpu wait slices <<<"$s"
    [ -z "$first" ] && first="$s" && echo "first $s" >>"$out"
    if awk "BEGIN{exit !($cpu > ${best[0]})}"; then best=("$cpu" "$wait" "$slices"); fi
  fi
  sleep 0.1
done
echo "max ${best[*]}" >>"$out"
