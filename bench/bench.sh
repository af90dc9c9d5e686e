#!/usr/bin/env bash
# bench.sh [QCOWFS_BINARY] -- one run, side by side, on identical images, printed as a
# markdown table of IOPS / MiB/s and ratios (qcowfs / raw host file, qcowfs / qemu-storage-daemon).
#   raw-host    the plain raw host file (the disk's limit)
#   qsd         qemu-storage-daemon 7.2's FUSE export of the same image (cache.direct=on, io_uring)
#   qcowfs      our binary: `BINARY -f -o rw,cache=none IMAGE MOUNTFILE`, FUSE over io_uring
#               (the script turns the fuse module's enable_uring on for the run when it can)
#   qcowfs-dev  the same with -o fuse_uring=off: requests through /dev/fuse reads and writes
# Image sets:
#   qcow2-full  fully written 1 GiB qcow2: randread4k randwrite4k (overwrite) seqread1m
#   qcow2-empty empty 1 GiB qcow2: seqwrite1m and randwrite4k (allocating), fresh copy per job
#   raw         1 GiB raw image through qcowfs (format=raw) vs the raw host file
# Env: RUNTIME (s, default 6), SETS (default "raw qcow2-full qcow2-empty"), OUT (table file).
# Needs: fio, qemu-utils, qemu-system-common, fuse3; root (or the fuse group).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../build/qcowfs}
bin=$(readlink -f "$bin")
[ -x "$bin" ] || { echo "no qcowfs binary at $bin (build first)" >&2; exit 1; }
work=$(mktemp -d /var/tmp/qcowfs-bench.XXXXXX)
results="$work/results.txt"
uring_param=/sys/module/fuse/parameters/enable_uring
uring_old=$(cat "$uring_param" 2>/dev/null || true)
cleanup() {
  for m in "$work"/*.mnt; do [ -e "$m" ] && fusermount3 -u "$m" 2>/dev/null; done
  [ -n "${qsdpid:-}" ] && kill "$qsdpid" 2>/dev/null
  [ -n "$uring_old" ] && echo "$uring_old" > "$uring_param" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
if [ -w "$uring_param" ]; then echo Y > "$uring_param"; fi
echo "fuse.enable_uring=$(cat "$uring_param" 2>/dev/null || echo absent)" >&2
export RUNTIME=${RUNTIME:-6} SIZE=1G
suite="$here/fio-suite.sh"
read -ra sets <<< "${SETS:-raw qcow2-full qcow2-empty}"

echo "preparing images in $work" >&2
qemu-img create -q -f qcow2 "$work/full.qcow2" 1G
qemu-io -c 'write -P 0x5a 0 1G' "$work/full.qcow2" >/dev/null
qemu-img create -q -f qcow2 "$work/empty.qcow2" 1G
dd if=/dev/zero of="$work/raw.img" bs=1M count=1024 status=none
: > "$results"

mounted() { for _ in $(seq 100); do grep -q " $1 [^ ]* [^-]*- fuse" /proc/self/mountinfo && return 0; sleep 0.1; done; return 1; }
record() { sed "s/^/$1 /" >> "$results"; }  # prefix lines with the image set

# run_on SET SYSTEM TEMPLATE FORMAT JOBS...: mount a fresh copy of TEMPLATE with SYSTEM, run JOBS
run_on() {
  local set=$1 sys=$2 tmpl=$3 fmt=$4; shift 4
  local img="$work/$sys.img" mnt="$work/$sys.mnt"
  cp --sparse=always "$tmpl" "$img"; : > "$mnt"
  case $sys in
    qsd) qsdpid=$(FMT=$fmt "$here/qsd-mount.sh" "$img" "$mnt") ;;
    qcowfs) "$bin" -f -o "rw,cache=none,format=$fmt" "$img" "$mnt" 2>"$work/qcowfs.log" & qpid=$! ;;
    qcowfs-dev) "$bin" -f -o "rw,cache=none,format=$fmt,fuse_uring=off" "$img" "$mnt" 2>"$work/qcowfs.log" & qpid=$! ;;
  esac
  if mounted "$mnt" && [ "$(stat -c %s "$mnt")" = 1073741824 ]; then
    "$suite" "$mnt" "$sys" "$@" | record "$set"
  else
    echo "$sys did not mount $img" >&2; cat "$work/qcowfs.log" >&2 2>/dev/null
    for j in "$@"; do echo "$sys $j FAILED" | record "$set"; done
  fi
  fusermount3 -u "$mnt" 2>/dev/null; sleep 0.3
  [ "$sys" = qsd ] && { kill "$qsdpid" 2>/dev/null; qsdpid=; }
  [ "${sys%-dev}" = qcowfs ] && wait "$qpid" 2>/dev/null
  rm -f "$img" "$mnt"
}

for set in "${sets[@]}"; do
  case $set in
    raw)
      "$suite" "$work/raw.img" raw-host randread4k randwrite4k seqread1m seqwrite1m | record raw
      for s in qsd qcowfs qcowfs-dev; do run_on raw "$s" "$work/raw.img" raw randread4k randwrite4k seqread1m seqwrite1m; done ;;
    qcow2-full)
      "$suite" "$work/raw.img" raw-host randread4k randwrite4k seqread1m | record qcow2-full
      for s in qsd qcowfs qcowfs-dev; do run_on qcow2-full "$s" "$work/full.qcow2" qcow2 randread4k randwrite4k seqread1m; done ;;
    qcow2-empty)
      "$suite" "$work/raw.img" raw-host seqwrite1m randwrite4k | record qcow2-empty
      for s in qsd qcowfs qcowfs-dev; do
        run_on qcow2-empty "$s" "$work/empty.qcow2" qcow2 seqwrite1m
        run_on qcow2-empty "$s" "$work/empty.qcow2" qcow2 randwrite4k
      done ;;
    *) echo "unknown set $set" >&2; exit 2 ;;
  esac
done

python3 - "$results" <<'PY' | tee "${OUT:-/dev/null}"
import sys, collections
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 3: continue
    s, sys_, job = f[0], f[1], f[2]
    val = None if f[3] == "FAILED" else (float(f[5]) if job.endswith("1m") else float(f[3]))
    rows.setdefault((s, job), {})[sys_] = val
def fmt(v, job):
    if v is None: return "failed"
    return f"{v:,.0f} MiB/s" if job.endswith("1m") else f"{v:,.0f} IOPS"
def ratio(a, b):
    return "-" if a is None or not b else f"{a / b:.2f}x"
print("| image | job | raw host file | qemu-storage-daemon | qcowfs | qcowfs / raw | qcowfs / qsd "
      "| qcowfs, /dev/fuse | its / raw | its / qsd |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (s, job), v in rows.items():
    q, r, d, o = v.get("qcowfs"), v.get("raw-host"), v.get("qsd"), v.get("qcowfs-dev")
    print(f"| {s} | {job} | {fmt(r, job)} | {fmt(d, job)} | {fmt(q, job)} | {ratio(q, r)} | {ratio(q, d)} "
          f"| {fmt(o, job)} | {ratio(o, r)} | {ratio(o, d)} |")
PY
