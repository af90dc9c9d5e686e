#!/usr/bin/env bash
# transport-cost.sh [QCOWFS_BINARY] -- per-request costs of the two FUSE transports, qcowfs beside
# bench/fuse-floor.c, in figures a loaded machine does not move much: for a fixed number of
# requests of one fio job, the daemon's CPU time (task-clock), its context switches and
# io_uring_enter and read calls (perf stat -p, software events and syscall tracepoints), fio's own context
# switches, and at the disk (/sys/block/DEV/stat deltas) the mean request size and the mean number
# of requests in flight (of the job's direction). Also fio's IOPS or MiB/s, which a loaded machine does move.
# Systems: raw (the host file), floor, floor-ring, qcowfs (fuse_uring=off), qcowfs-ring
# (fuse_uring=on), each over the same 1 GiB raw image (qcowfs: format=raw, or FORMAT below,
# cache=none, rw, so no passthrough); ROUNDS rounds, the systems in turn within each (in
# reverse order in even rounds).
# Env: JOBS (fio-suite job names, default "randread4k seqread1m"), IOS (requests per 4 KiB job,
# default 60000; 1 MiB jobs run IOS/20), ROUNDS (default 2), SYSTEMS, QCOWFS_OPTS (extra -o),
# BEFORE (a second qcowfs binary: systems before and before-ring, for a same-run A/B; it may be
# the same binary with BEFORE_OPTS, extra -o options for the before systems only), FORMAT (the
# image format of the qcowfs and before systems, default raw: other formats are a qemu-img
# convert of the raw image, fully allocated, which those systems mount instead; raw and the
# floors keep the raw image).
# The fuse.enable_uring parameter is only read, never written (it is global: other mounts depend
# on it): the floor without --ring and qcowfs with fuse_uring=off use /dev/fuse whatever it says,
# and the -ring systems are skipped unless it is Y.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(readlink -f "${1:-$here/../build/qcowfs}")
floor=${FLOOR:-$(dirname "$bin")/bench/fuse-floor}
ios=${IOS:-60000}
ring_ok=$(cat /sys/module/fuse/parameters/enable_uring 2>/dev/null || echo N)
before=${BEFORE:+$(readlink -f "$BEFORE")}
# This script never writes fuse.enable_uring: the set-up must not restore it either.
restore_uring=0
# shellcheck source=bench/transport-setup.sh
. "$here/transport-setup.sh" qcowfs-tc
fmt=${FORMAT:-raw} qimg=$img
if [ "$fmt" != raw ]; then
  qimg=$work/img.$fmt
  qemu-img convert -f raw -O "$fmt" $([ "$fmt" = vpc ] && echo -o force_size=on) "$img" "$qimg"
  sync "$qimg"
fi
dev=$(lsblk -no pkname "$(df --output=source "$work" | tail -1)" 2>/dev/null || true)
[ -n "$dev" ] || dev=$(basename "$(df --output=source "$work" | tail -1)")

run() {  # run SYSTEM JOB ROUND
  local sys=$1 job=$2 round=$3 target=$work/mnt n=$ios a
  case $job in
    randread4k) a="--rw=randread --bs=4k --iodepth=32" ;;
    randread4k-aio) a="--rw=randread --bs=4k --iodepth=32 --ioengine=libaio" ;;
    randwrite4k) a="--rw=randwrite --bs=4k --iodepth=32" ;;
    randread4k-qd1u) a="--rw=randread --bs=4k --iodepth=1" n=$((ios / 4)) ;;
    randwrite4k-qd1u) a="--rw=randwrite --bs=4k --iodepth=1" n=$((ios / 4)) ;;
    seqread1m) a="--rw=read --bs=1M --iodepth=8" n=$((ios / 20)) ;;
    seqwrite1m) a="--rw=write --bs=1M --iodepth=8" n=$((ios / 20)) ;;
    *) echo "unknown job $job" >&2; exit 2 ;;
  esac
  pid=
  case $sys in
    raw) target=$work/img ;;
    *-ring) [ "$ring_ok" = Y ] || { echo "$sys: skipped (fuse.enable_uring is not Y)" >&2; return 0; } ;;&
    floor) : > "$work/mnt"; "$floor" "$work/img" "$work/mnt" & pid=$! ;;
    floor-ring) : > "$work/mnt"; "$floor" --ring "$work/img" "$work/mnt" & pid=$! ;;
    qcowfs|before|qcowfs-ring|before-ring) : > "$work/mnt"
      local b=$bin o=${QCOWFS_OPTS:-} uring=off
      [ "${sys%-ring}" = before ] && { b=$before; o=${BEFORE_OPTS:-$o}; }
      [ "$sys" != "${sys%-ring}" ] && uring=on
      "$b" -f -o "rw,cache=none,format=$fmt,fuse_uring=$uring${o:+,$o}" "$qimg" "$work/mnt" & pid=$! ;;
  esac
  [ -n "$pid" ] && { mounted "$work/mnt" || { echo "$sys did not mount" >&2; exit 1; }; }
  local fio="fio --name=j --filename=$target --ioengine=io_uring $a --direct=1 --size=1G --number_ios=$n --output-format=json"
  $fio --number_ios=$((n / 10)) >/dev/null  # warm-up
  local d0 p=()
  read -ra d0 < /sys/block/$dev/stat
  [ -n "$pid" ] && { perf stat -x, -e task-clock,context-switches,syscalls:sys_enter_io_uring_enter,syscalls:sys_enter_read -p "$pid" -o "$work/perf" & p=($!); sleep 0.2; }
  perf stat -x, -e context-switches -o "$work/perf-fio" $fio --output="$work/fio.json" >/dev/null
  [ ${#p[@]} -gt 0 ] && { kill -INT "${p[0]}"; wait "${p[0]}" || true; }
  local d1; read -ra d1 < /sys/block/$dev/stat
  python3 - "$sys" "$job" "$round" "$n" "$work/fio.json" "$work/perf" "$work/perf-fio" "${d0[*]}" "${d1[*]}" "$([ -n "$pid" ] && echo 1)" <<'PY'
import json, sys
sys_, job, rnd, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t = open(sys.argv[5]).read(); d = json.loads(t[t.index("{"):])["jobs"][0]
side = d["read"] if d["read"]["io_bytes"] else d["write"]
perf = {}
if sys.argv[10]:
    for line in open(sys.argv[6]):
        f = line.split(",")
        if len(f) > 3 and f[0].replace(".", "").isdigit(): perf[f[2]] = float(f[0])
fiocs = next((float(l.split(",")[0]) for l in open(sys.argv[7]) if "context-switches" in l), 0)
a = list(map(int, sys.argv[8].split())); b = list(map(int, sys.argv[9].split()))
w = 0 if d["read"]["io_bytes"] else 4  # the job's direction only: other processes write to this disk too
ios_ = b[w] - a[w]; sect = b[w + 2] - a[w + 2]; qms = b[w + 3] - a[w + 3]  # ticks: ms spent by those requests
ms = d["job_runtime"] or 1
rate = f"{side['bw'] / 1024:8.0f} MiB/s" if job.endswith("1m") else f"{side['iops']:8.0f} IOPS"
cpu = perf.get("task-clock", 0) * 1000 / n if perf else 0  # task-clock is in ms
print(f"{rnd} {sys_:<12} {job:<14} {rate} lat {side['lat_ns']['mean'] / 1000:7.1f} us | daemon cpu {cpu:6.2f} us/req "
      f"cs {perf.get('context-switches', 0) / n:5.2f}/req enter {perf.get('syscalls:sys_enter_io_uring_enter', 0) / n:5.2f}/req "
      f"read {perf.get('syscalls:sys_enter_read', 0) / n:5.2f}/req "
      f"| fio cs {fiocs / n:5.2f}/req | disk {sect * 512 / max(ios_, 1) / 1024:6.0f} KiB/rq, {qms / ms:5.2f} in flight", flush=True)
PY
  if [ -n "$pid" ]; then fusermount3 -u "$work/mnt"; wait "$pid" 2>/dev/null || true; pid=; fi
}

systems=${SYSTEMS:-raw floor qcowfs floor-ring qcowfs-ring}
for round in $(seq "${ROUNDS:-2}"); do
  for job in ${JOBS:-randread4k seqread1m}; do
    order=$systems  # even rounds in reverse, so no system always runs right after the same one
    (( round % 2 == 0 )) && order=$(echo "$systems" | tr ' ' '\n' | tac | tr '\n' ' ')
    for sys in $order; do run "$sys" "$job" "$round"; done
  done
done
