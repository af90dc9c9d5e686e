#!/usr/bin/env bash
# qd1-floor.sh [QCOWFS_BINARY] -- what queue depth 1 costs through FUSE on this machine, and how
# much of it any FUSE daemon must pay. 4 KiB random reads (and writes) at QD1 with psync
# (fio-suite.sh's randread4k-qd1, randwrite4k-qd1), O_DIRECT, in alternating rounds against:
#   raw-host        the raw host file (the disk alone)
#   null            bench/fuse-null.c, single-threaded: the FUSE round trip alone (no disk)
#   null-spin       the same never sleeping (busy-reading /dev/fuse): the round trip without the
#                   daemon's wake-up, i.e. the floor of a daemon that polls
#   qsd             qemu-storage-daemon 7.2's FUSE export of a fully written 1 GiB qcow2
#   qcowfs          qcowfs on the same image over /dev/fuse (cache=none)
#   qcowfs-ring     the same over FUSE io_uring
# A FUSE daemon that reads the disk pays at least raw-host + (null - the client's own syscall),
# and a polling one raw-host + (null-spin - ...): the table gives both beside the measured ones.
# It also prints the share of CPU time the hypervisor took (steal, /proc/stat) during the run.
# Env: ROUNDS (default 5), RUNTIME (s per job, default 3), JOBS (default "randread4k-qd1
# randwrite4k-qd1"). Needs root, fio, qemu-utils, qemu-system-common, libfuse3-dev, cc.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(readlink -f "${1:-$here/../build/qcowfs}")
[ -x "$bin" ] || { echo "no qcowfs binary at $bin (build first)" >&2; exit 1; }
work=$(mktemp -d /var/tmp/qcowfs-qd1.XXXXXX)
uring_param=/sys/module/fuse/parameters/enable_uring
uring_old=$(cat "$uring_param" 2>/dev/null || true)
set_uring() { [ -w "$uring_param" ] && echo "$1" > "$uring_param"; }
cleanup() {
  for m in "$work"/*.mnt; do [ -e "$m" ] && fusermount3 -u "$m" 2>/dev/null; done
  [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null
  [ -n "$uring_old" ] && set_uring "$uring_old"
  rm -rf "$work"
}
trap cleanup EXIT
export RUNTIME=${RUNTIME:-3} SIZE=1G
rounds=${ROUNDS:-5}
read -ra jobs <<< "${JOBS:-randread4k-qd1 randwrite4k-qd1}"
systems="raw-host null null-spin qsd qcowfs qcowfs-ring"

cc -O2 -o "$work/fuse-null" "$here/fuse-null.c" $(pkg-config --cflags --libs fuse3) || exit 1
qemu-img create -q -f raw "$work/raw.img" 1G
qemu-io -f raw -c 'write -P 0x5a 0 1G' "$work/raw.img" >/dev/null
qemu-img convert -f raw -O qcow2 "$work/raw.img" "$work/full.qcow2"
sync "$work/raw.img" "$work/full.qcow2"
results=$work/results.txt
: > "$results"

mounted() { for _ in $(seq 100); do grep -q " $1 [^ ]* [^-]*- fuse" /proc/self/mountinfo && return 0; sleep 0.1; done; return 1; }

# measure ROUND SYSTEM JOB
measure() {
  local round=$1 sys=$2 job=$3 mnt="$work/$2.mnt" target
  pid=
  case $sys in
    raw-host) target=$work/raw.img ;;
    null|null-spin)
      : > "$mnt"; target=$mnt
      if [ "$sys" = null-spin ]; then "$work/fuse-null" --spin -f -s "$mnt" & else "$work/fuse-null" -f -s "$mnt" & fi
      pid=$! ;;
    qsd) cp "$work/full.qcow2" "$work/img.qcow2"; target=$mnt
         pid=$("$here/qsd-mount.sh" "$work/img.qcow2" "$mnt") ;;
    qcowfs|qcowfs-ring)
      cp "$work/full.qcow2" "$work/img.qcow2"; : > "$mnt"; target=$mnt
      local ring=off; [ "$sys" = qcowfs-ring ] && ring=on
      set_uring "$([ $ring = on ] && echo Y || echo N)"
      "$bin" -f -o "rw,cache=none,format=qcow2,fuse_uring=$ring" "$work/img.qcow2" "$mnt" 2>"$work/qcowfs.log" &
      pid=$! ;;
  esac
  if [ "$sys" = raw-host ] || mounted "$mnt"; then
    "$here/fio-suite.sh" "$target" "$sys" "$job" | sed "s/^/$round /" >> "$results"
  else
    echo "$sys did not mount" >&2
  fi
  if [ "$sys" != raw-host ]; then fusermount3 -u "$mnt" 2>/dev/null; sleep 0.3; kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; fi
  pid=
  rm -f "$mnt" "$work/img.qcow2"
}

steal() { awk '/^cpu /{print $9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }
read -r s0 t0 < <(steal)
for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  for job in "${jobs[@]}"; do
    # Alternate the order so no system always follows the same one.
    order=$systems; [ $((round % 2)) -eq 0 ] && order=$(echo $systems | tr ' ' '\n' | tac | tr '\n' ' ')
    for sys in $order; do measure "$round" "$sys" "$job"; done
  done
done
read -r s1 t1 < <(steal)
python3 - "$results" "$rounds" "$s0" "$t0" "$s1" "$t1" <<'PY'
import collections, statistics, sys
# ROUND SYSTEM JOB IOPS "IOPS" MIBS "MiB/s" MEAN "us-mean" P99 "us-p99"
data = collections.defaultdict(lambda: collections.defaultdict(dict))
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 11: continue
    data[f[2]][f[0]][f[1]] = (float(f[3]), float(f[7]), float(f[9]))
steal = (float(sys.argv[5]) - float(sys.argv[3])) / max(1.0, float(sys.argv[6]) - float(sys.argv[4]))
print(f"Medians of {sys.argv[2]} rounds (ratios: medians of per-round ratios); steal time during the run: "
      f"{100 * steal:.0f}% of CPU time.\n")
systems = ["raw-host", "null", "null-spin", "qsd", "qcowfs", "qcowfs-ring"]
med = lambda xs: statistics.median(xs) if xs else float("nan")
for job, rounds in data.items():
    print(f"{job}\n\n| system | mean us | p99 us | IOPS | mean / raw's | IOPS / qsd's |")
    print("|---|---|---|---|---|---|")
    for s in systems:
        rs = [r[s] for r in rounds.values() if s in r]
        if not rs: continue
        to_raw = med([r[s][1] / r["raw-host"][1] for r in rounds.values() if s in r and "raw-host" in r])
        to_qsd = med([r[s][0] / r["qsd"][0] for r in rounds.values() if s in r and "qsd" in r])
        print(f"| {s} | {med([x[1] for x in rs]):.1f} | {med([x[2] for x in rs]):.1f} | {med([x[0] for x in rs]):,.0f} "
              f"| {to_raw:.2f}x | {to_qsd:.2f}x |")
    bound = med([(r["raw-host"][1] + r["null"][1]) / r["raw-host"][1] for r in rounds.values()
                 if "null" in r and "raw-host" in r])
    spin = med([(r["raw-host"][1] + r["null-spin"][1]) / r["raw-host"][1] for r in rounds.values()
                if "null-spin" in r and "raw-host" in r])
    print(f"\nraw + FUSE round trip, over raw: {bound:.2f}x sleeping, {spin:.2f}x polling "
          "(upper estimates: each includes one client syscall twice)\n")
PY
