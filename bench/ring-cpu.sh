#!/usr/bin/env bash
# ring-cpu.sh -- daemon CPU per request over FUSE io_uring, several daemons in alternating rounds
# (a loaded machine moves throughput, much less the cost per request): each round mounts every
# CONFIG in turn over the same 1 GiB raw image, runs a warm-up and then IOS 4 KiB requests per fio
# job at QD32 (io_uring), and prints fio's IOPS, the daemon's task-clock, context switches and
# io_uring_enter calls per request (perf stat -p) and its user and system time per request
# (/proc/PID/stat, 10 ms ticks).
# Env: CONFIGS (space-separated LABEL=BINARY:OPTIONS; BINARY "floor" is bench/fuse-floor --ring with
#      OPTIONS as its arguments, anything else a qcowfs binary mounted -o rw,cache=none,format=raw,OPTIONS),
#      RW (randread or randwrite, default randread), IOS (per job, default 60000), NJOBS (default 1),
#      ROUNDS (default 3), FLOOR (the fuse-floor binary, default build/bench/fuse-floor).
# Example: CONFIGS="floor=floor: old=build-old/qcowfs:fuse_uring=on new=build/qcowfs:fuse_uring=on" \
#          RW=randwrite bench/ring-cpu.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
floor=$(readlink -f "${FLOOR:-$here/../build/bench/fuse-floor}")
ios=${IOS:-60000} rw=${RW:-randread} rounds=${ROUNDS:-3} jobs=${NJOBS:-1}
# shellcheck source=bench/transport-setup.sh
. "$here/transport-setup.sh" qcowfs-ringcpu
echo Y > $param
: > "$work/mnt"
fio="fio --name=j --filename=$work/mnt --ioengine=io_uring --rw=$rw --bs=4k --iodepth=32 --direct=1
     --size=1G --numjobs=$jobs --group_reporting --output-format=terse"
for r in $(seq "$rounds"); do
  for c in ${CONFIGS:?set CONFIGS}; do
    label=${c%%=*} rest=${c#*=}; bin=${rest%%:*} opts=${rest#*:}
    if [ "$bin" = floor ]; then "$floor" --ring $opts "$img" "$work/mnt" & pid=$!
    else "$bin" -f -o "rw,cache=none,format=raw${opts:+,$opts}" "$img" "$work/mnt" & pid=$!; fi
    mounted "$work/mnt" || true
    $fio --number_ios=5000 >/dev/null  # warm-up
    perf stat -x, -e task-clock,context-switches,syscalls:sys_enter_io_uring_enter -p "$pid" -o "$work/perf" & p=$!
    sleep 0.2
    read -r u0 s0 < <(awk '{print $14, $15}' /proc/$pid/stat)
    iops=$($fio --number_ios="$ios" | awk -F';' '{print $8 + $49}')
    read -r u1 s1 < <(awk '{print $14, $15}' /proc/$pid/stat)
    kill -INT "$p"; wait "$p" || true
    n=$((ios * jobs)) tick_us=$((1000000 / $(getconf CLK_TCK)))
    awk -F, -v n=$n -v l="$label" -v r=$r -v iops="$iops" -v ut=$(( (u1 - u0) * tick_us )) -v st=$(( (s1 - s0) * tick_us )) '
      /task-clock/ {t = $1} /context-sw/ {c = $1} /io_uring_enter/ {e = $1}
      END {printf "%d %-10s %7d IOPS  cpu %6.2f us/req  cs %.3f/req  enter %.3f/req  user %.2f sys %.2f us/req\n",
           r, l, iops, t * 1000 / n, c / n, e / n, ut / n, st / n}' "$work/perf"
    fusermount3 -u "$work/mnt"; wait "$pid" || true; pid=
  done
done
