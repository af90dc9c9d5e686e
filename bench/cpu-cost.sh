#!/usr/bin/env bash
# cpu-cost.sh [QCOWFS_BINARY] -- CPU cost per request of the daemon, robust to a loaded machine:
# mounts a 256 MiB raw image (format=raw, cache=none, passthrough=off so reads reach the daemon), runs a fixed number of 4 KiB random reads
# at QD32 with fio and reports the daemon's task-clock and context switches per request
# (perf stat), and /dev/fuse read() calls per request and their EAGAIN share (strace -c).
# Env: IOS (requests, default 100000), QUEUES (-o queues=N, default: the binary's default),
#      OPTS (more -o options, e.g. fuse_uring=off), RW=randwrite (4 KiB random writes on a
#      read-write mount instead of reads),
#      FMT (raw, qcow2, qcow2-enc: LUKS aes-256-xts, or vmdk vhdx vdi qed vpc parallels: the
#      fully written qcow2 converted by qemu-img; default raw).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(readlink -f "${1:-$here/../build/qcowfs}")
ios=${IOS:-100000}
fmt=${FMT:-raw}
work=$(mktemp -d /var/tmp/qcowfs-cpu.XXXXXX)
pid=
cleanup() { fusermount3 -u "$work/mnt" 2>/dev/null || true; [ -n "$pid" ] && wait "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
keyopt=
if [ "$fmt" = qcow2 ]; then
  qemu-img create -q -f qcow2 "$work/img" 256M
  qemu-io -c 'write -P 0x5a 0 256M' "$work/img" >/dev/null
elif [ "$fmt" = qcow2-enc ]; then
  printf benchpw > "$work/key"
  qemu-img create -q --object secret,id=s0,data=benchpw -f qcow2 \
    -o encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=100,encrypt.hash-alg=sha512 \
    "$work/img" 256M
  qemu-io --object secret,id=s0,data=benchpw --image-opts -c 'write -P 0x5a 0 256M' \
    "driver=qcow2,encrypt.key-secret=s0,file.filename=$work/img" >/dev/null
  fmt=qcow2 keyopt=",key-file=$work/key"
elif [ "$fmt" = raw ]; then
  dd if=/dev/zero of="$work/img" bs=1M count=256 status=none
else
  qemu-img create -q -f qcow2 "$work/full" 256M
  qemu-io -c 'write -P 0x5a 0 256M' "$work/full" >/dev/null
  copts=; [ "$fmt" = vpc ] && copts="-o force_size=on"
  qemu-img convert -O "$fmt" $copts "$work/full" "$work/img" && rm -f "$work/full"
fi
: > "$work/mnt"
rwjob=${RW:-randread}
mode=ro; [ "$rwjob" = randread ] || mode=rw
opts="$mode,cache=none,passthrough=off,format=$fmt$keyopt${QUEUES:+,queues=$QUEUES}${OPTS:+,$OPTS}"
"$bin" -f -o "$opts" "$work/img" "$work/mnt" & pid=$!
for _ in $(seq 100); do grep -q " $work/mnt " /proc/self/mountinfo && break; sleep 0.1; done
run_fio() {
  fio --name=r --filename="$work/mnt" --rw="$rwjob" --bs=4k --iodepth=32 --ioengine=io_uring \
    --direct=1 --number_ios="$ios" --size=256M --output-format=terse >/dev/null
}
run_fio  # warm-up (page tables, buffer pools)
perf stat -x, -e task-clock,context-switches -p "$pid" -o "$work/perf" & ppid=$!
sleep 0.3; run_fio; kill -INT "$ppid"; wait "$ppid" || true
awk -F, -v n="$ios" '/task-clock/ {printf "task-clock/request: %.2f us\n", $1 * 1000 / n}
  /context-switches/ {printf "context-switches/request: %.3f\n", $1 / n}' "$work/perf"
strace -c -f -e trace=read,writev,io_uring_enter -p "$pid" -o "$work/strace" & spid=$!
sleep 0.5; run_fio; kill -INT "$spid"; wait "$spid" || true
awk -v n="$ios" '$NF == "read" || $NF == "writev" || $NF == "io_uring_enter" {
  calls = $4; errs = ($5 ~ /^[0-9]+$/) ? $5 : 0
  printf "%s/request: %.3f (errors %.3f)\n", $NF, calls / n, errs / n }' "$work/strace"
