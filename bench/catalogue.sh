#!/usr/bin/env bash
# catalogue.sh [BINARY] -- one qcowfs daemon serving a directory of N qcow2
# overlays of one base (`qcowfs SRCDIR MOUNTDIR`, issue 35), beside one daemon
# per image. Prints one "metric value" line per measure, then a Markdown table:
#   mount              seconds until `qcowfs SRCDIR MNT` returns (mounted)
#   ls -l              seconds for `ls -l MNT` (N views and their N <name>.d; the first listing)
#   RSS idle           the daemon's VmRSS with nothing open
#   RSS 100 open       VmRSS with OPEN views open, each read (READ_MIB MiB)
#   first open         median seconds of open() of a view not opened before
#   IOPS catalogue     fio, OPEN jobs, one view each, 4 KiB randread QD1 (psync), RUNTIME s
#   IOPS daemons       the same on OPEN separate qcowfs daemons (one per image)
#   idle CPU           the daemon's CPU ticks over IDLE_S s after every view closed
# Environment: N (1000), OPEN (100), BASE_SIZE (1G), BASE_DATA_MIB (256: written
# in the base so reads hit data), READ_MIB (4), RUNTIME (10), IDLE_S (10),
# WORK (a fresh directory under /var/tmp), SKIP_DAEMONS=1 skips the per-image daemons.
set -euo pipefail
BIN=${1:-$(dirname "$0")/../build/qcowfs}
BIN=$(realpath "$BIN")
N=${N:-1000}; OPEN=${OPEN:-100}; BASE_SIZE=${BASE_SIZE:-1G}; BASE_DATA_MIB=${BASE_DATA_MIB:-256}
READ_MIB=${READ_MIB:-4}; RUNTIME=${RUNTIME:-10}; IDLE_S=${IDLE_S:-10}
WORK=${WORK:-$(mktemp -d /var/tmp/qcowfs-catalogue.XXXXXX)}
SRC=$WORK/src; MNT=$WORK/mnt; DMNT=$WORK/daemons
mkdir -p "$SRC" "$MNT" "$DMNT"
now() { date +%s.%N; }
elapsed() { echo "$(now) - $1" | bc; }
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
cleanup() {
  fusermount3 -u "$MNT" 2>/dev/null || true
  for f in "$DMNT"/*.raw; do [ -e "$f" ] && fusermount3 -u "$f" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "# preparing $N overlays of one $BASE_SIZE base in $SRC" >&2
qemu-img create -q -f qcow2 "$SRC/base.qcow2" "$BASE_SIZE"
qemu-io -f qcow2 -c "write -q -P 0x5a 0 ${BASE_DATA_MIB}M" "$SRC/base.qcow2"
qemu-img create -q -f qcow2 -u -b base.qcow2 -F qcow2 "$WORK/overlay.qcow2" "$BASE_SIZE"
for i in $(seq -w 1 "$N"); do cp "$WORK/overlay.qcow2" "$SRC/vm$i.qcow2"; done
# The base is an image of the directory too: views are vm*.raw and base.raw.
sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true

t=$(now)
"$BIN" -o idle-timeout=5 "$SRC" "$MNT"
mount_s=$(elapsed "$t")
pid=$(pgrep -f -n "^$BIN -o idle-timeout=5 $SRC $MNT")
t=$(now); ls -l "$MNT" >/dev/null; ls_s=$(elapsed "$t")
t=$(now); ls -l "$MNT" >/dev/null; ls2_s=$(elapsed "$t")
sleep 1
rss_idle=$(rss_kib "$pid")

# First opens (median over OPEN views), then OPEN views held open and read:
# the holder writes the median to a file and keeps the views open until killed.
python3 - "$MNT" "$OPEN" "$READ_MIB" "$WORK/first_open" <<'PY' &
import os, signal, statistics, sys, time
mnt, n, mib, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
views = sorted(v for v in os.listdir(mnt) if v.startswith("vm") and v.endswith(".raw"))[:n]
fds, times = [], []
for v in views:
    t = time.perf_counter()
    fds.append(os.open(os.path.join(mnt, v), os.O_RDONLY))
    times.append(time.perf_counter() - t)
for fd in fds:
    for off in range(0, mib << 20, 1 << 20):
        os.pread(fd, 1 << 20, off)
with open(out + ".tmp", "w") as f:
    f.write(f"{statistics.median(times):.6f}\n")
os.rename(out + ".tmp", out)
signal.pause()
PY
holder=$!
for _ in $(seq 1200); do [ -s "$WORK/first_open" ] && break; sleep 0.1; done
first_open=$(cat "$WORK/first_open")
rss_open=$(rss_kib "$pid")
kill "$holder"; wait "$holder" 2>/dev/null || true

fio_jobs() {  # fio_jobs FILE... : OPEN jobs, one file each, 4 KiB randread QD1; prints total IOPS
  local args=() i=0
  for f in "$@"; do args+=(--name=j$i --filename="$f"); i=$((i + 1)); done
  fio --rw=randread --bs=4k --ioengine=psync --direct=1 --size="${BASE_DATA_MIB}M" --runtime="$RUNTIME" \
      --time_based --group_reporting --output-format=json "${args[@]}" |
    python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["read"]["iops"]))'
}
mapfile -t views < <(ls "$MNT" | grep '^vm.*\.raw$' | head -n "$OPEN")
iops_cat=$(fio_jobs "${views[@]/#/$MNT/}")

# Idle: every view closed; after the idle delay nothing may run.
sleep 7
t0=$(cpu_ticks "$pid"); sleep "$IDLE_S"; idle_ticks=$(( $(cpu_ticks "$pid") - t0 ))
rss_after=$(rss_kib "$pid")
fusermount3 -u "$MNT"

iops_daemons=skipped; rss_daemons=skipped; mount_daemons_s=skipped
if [ "${SKIP_DAEMONS:-0}" != 1 ]; then
  t=$(now)
  for v in "${views[@]}"; do
    touch "$DMNT/$v"
    "$BIN" "$SRC/${v%.raw}.qcow2" "$DMNT/$v"
  done
  mount_daemons_s=$(elapsed "$t")
  iops_daemons=$(fio_jobs "${views[@]/#/$DMNT/}")
  rss_daemons=0
  for p in $(pgrep -f "^$BIN $SRC/vm"); do rss_daemons=$((rss_daemons + $(rss_kib "$p"))); done
  for v in "${views[@]}"; do fusermount3 -u "$DMNT/$v"; done
fi

cat <<TABLE
| measure ($N overlays of one $BASE_SIZE base, $OPEN views) | one catalogue daemon | $OPEN daemons, one per image |
|---|---|---|
| mount | ${mount_s} s | ${mount_daemons_s} s |
| ls -l MOUNTDIR (first / second) | ${ls_s} / ${ls2_s} s | |
| RSS idle | $((rss_idle / 1024)) MiB | |
| RSS, $OPEN views open and read ($READ_MIB MiB each) | $((rss_open / 1024)) MiB | ${rss_daemons} KiB (sum) |
| first open of a view (median) | ${first_open} s | |
| $OPEN fio jobs, 4 KiB randread QD1, aggregate IOPS | ${iops_cat} | ${iops_daemons} |
| idle CPU over ${IDLE_S} s (clock ticks) | ${idle_ticks} | |
| RSS after every view closed | $((rss_after / 1024)) MiB | |
TABLE
