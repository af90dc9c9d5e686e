#!/usr/bin/env bash
# bench.sh [QCOWFS_BINARY] -- qcowfs against the raw host file and qemu-storage-daemon on
# identical images, printed as a markdown table (IOPS / MiB/s and ratios).
#   raw-host     the plain raw host file (the disk's limit)
#   qsd          qemu-storage-daemon 7.2's FUSE export of the same image (cache.direct=on, io_uring)
#   qcowfs       `BINARY -f -o rw,cache=none,fuse_uring=off IMAGE MOUNTFILE`: requests through
#                /dev/fuse, what a stock kernel (fuse.enable_uring=N) gives
#   qcowfs-ring  the same with -o fuse_uring=on (the script turns enable_uring on for those runs)
#   floor, floor-ring  bench/fuse-floor.c (build/bench/fuse-floor, or FLOOR=PATH; FLOOR=none: left
#                out) over a fresh copy of the raw image: the simplest FUSE daemon doing the same
#                host I/O (O_DIRECT, one io_uring, reply on completion), over /dev/fuse and over
#                FUSE io_uring. Every row then also shows qcowfs / floor: what qcowfs costs above
#                what any FUSE daemon pays here. Not run in the FMT sets nor with BEFORE.
# SMOKE=1: no benchmark; mounts the floor daemon (both transports, the ring where the kernel has
# it) over a 16 MiB random raw file, reads 4 MiB through it and writes 4 MiB, and compares bytes.
# A job named JOB-ro runs JOB on read-only mounts (`ro` instead of `rw`, qsd writable=off), the
# default for qcowfs: there a raw image's reads pass through to the image file in the kernel.
# Image sets:
#   raw          1 GiB raw image (format=raw): randread4k-ro randread4k randwrite4k seqread1m-ro
#                seqread1m seqwrite1m
#   qcow2-full   fully written 1 GiB qcow2: randread4k randwrite4k (overwrite) seqread1m
#   qcow2-empty  empty 1 GiB qcow2: seqwrite1m, seqwrite1m-fill (one pass: allocating only) and
#                randwrite4k (allocating)
#   FMT-full     fully written 1 GiB image of FMT (qcow2 vmdk vhdx vdi qed vpc parallels; made by
#                qemu-img convert from the raw image), read-only mounts: randread4k-ro seqread1m-ro.
#                With SETS="qcow2-full-ro vmdk-full ..." a second table puts each format beside qcow2.
#   FMT-rw       the fully written FMT image, read-write: randwrite4k (overwrite); FMT-empty an
#                empty 1 GiB FMT image (qemu-img create; vpc with force_size=on): seqwrite1m and
#                seqwrite1m-fill (one pass: every write allocates).
#                A table puts each writable format beside qcow2: in each round, right beside
#                the format's own qcowfs run (before it in odd rounds, after it in even ones),
#                the same job runs on a fresh copy of the fully written (for -rw) or empty
#                (for -empty) qcow2 image (system qcow2-ref), and
#                the ratio is taken between those two adjacent runs (the disk drifts too much
#                over the minutes between a round's qcow2 set and a format's set).
#   raw-lat, qcow2-lat  low queue depth on the raw image and the fully written qcow2:
#                randread4k-qd1 randwrite4k-qd1 (psync) randread4k-qd1u randwrite4k-qd1u
#                (io_uring QD1) randread4k-qd4 randwrite4k-qd4 (io_uring QD4); a latency table
#                (mean and p99 beside the raw host file, IOPS beside qemu-storage-daemon).
#   qcow2-enc-full  fully written 1 GiB qcow2 encrypted with LUKS (aes-256-xts-plain64, the
#                default): randread4k randwrite4k seqread1m; with qcow2-full in SETS a table puts
#                it beside the unencrypted image (both mounts and qsd given the key).
# Every job runs ROUNDS times; in each round the systems run the job back to back, each on a
# fresh copy of the image, in reverse order in even rounds (so no system always runs after the
# same ones: a run may slow the disk for the next). The shared disk here drifts by up to 2x
# within minutes, so each ratio is taken within a round and the table shows the median over
# rounds (values: medians).
# QSD=none leaves qemu-storage-daemon out (its columns "-"), e.g. for a BEFORE comparison.
# Env: ROUNDS (default 3), RUNTIME (s per job, default 5), SETS (default "raw qcow2-full
# qcow2-empty"; JOBS: only these of each set's jobs; qcow2-full-ro is qcow2-full's read-only jobs, the reference of the FMT-full sets), OUT (table file), RAW_OUT (every measurement, one per line).
# WORK: the directory the images are made in (default /var/tmp; WORK=/dev/shm puts them in
# memory: no disk drift, only the CPU's work is measured, what a BEFORE comparison of code needs).
# BEFORE=OLD_BINARY compares two builds instead: in each round the raw host file, qsd, OLD_BINARY
# ("before") and BINARY ("after") run each job back to back, both over /dev/fuse, and the table
# shows after / before beside the round-to-round spread of the raw host file (the run's noise).
# Needs: fio, qemu-utils, qemu-system-common, fuse3; root (or the fuse group).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../build/qcowfs}
bin=$(readlink -f "$bin")
[ -x "$bin" ] || { echo "no qcowfs binary at $bin (build first)" >&2; exit 1; }
before=${BEFORE:+$(readlink -f "$BEFORE")}
[ -z "$before" ] || [ -x "$before" ] || { echo "no qcowfs binary at $BEFORE" >&2; exit 1; }
floor=${FLOOR:-$(dirname "$bin")/bench/fuse-floor}
[ "$floor" != none ] && [ ! -x "$floor" ] && { echo "no floor daemon at $floor (FLOOR=none leaves it out)" >&2; exit 1; }
uring_param=/sys/module/fuse/parameters/enable_uring
uring_old=$(cat "$uring_param" 2>/dev/null || true)
set_uring() { [ -w "$uring_param" ] && echo "$1" > "$uring_param"; }
floor_systems=
if [ "$floor" != none ]; then
  floor_systems=floor
  [ -w "$uring_param" ] && floor_systems="floor floor-ring"
fi
qsd=qsd; [ "${QSD:-}" = none ] && qsd=
systems="raw-host $qsd $floor_systems qcowfs qcowfs-ring"
[ -n "$before" ] && systems="raw-host $qsd before after"
work=$(mktemp -d "${WORK:-/var/tmp}/qcowfs-bench.XXXXXX") ||
  { echo "cannot make a directory in ${WORK:-/var/tmp} (WORK= names an existing, writable one)" >&2; exit 1; }
results=${RAW_OUT:-$work/results.txt}
cleanup() {
  for m in "$work"/*.mnt; do [ -e "$m" ] && fusermount3 -u "$m" 2>/dev/null; done
  [ -n "${qsdpid:-}" ] && kill "$qsdpid" 2>/dev/null
  [ -n "$uring_old" ] && set_uring "$uring_old"
  rm -rf "$work"
}
trap cleanup EXIT

mounted() { for _ in $(seq 100); do grep -q " $1 [^ ]* [^-]*- fuse" /proc/self/mountinfo && return 0; sleep 0.1; done; return 1; }

if [ -n "${SMOKE:-}" ]; then  # the floor daemon serves the file's bytes, on each transport
  [ "$floor" != none ] || { echo "SMOKE needs the floor daemon" >&2; exit 1; }
  head -c 16M /dev/urandom > "$work/smoke.img"; head -c 4M /dev/urandom > "$work/smoke.new"
  fail=0
  for sys in $floor_systems; do
    flag=; [ "$sys" = floor-ring ] && { set_uring Y; flag=--ring; } || set_uring N
    : > "$work/smoke.mnt"
    "$floor" $flag "$work/smoke.img" "$work/smoke.mnt" 2>"$work/floor.log" & fpid=$!
    ok=yes
    if mounted "$work/smoke.mnt"; then
      dd if="$work/smoke.mnt" of="$work/smoke.out" bs=64k skip=16 count=64 iflag=direct status=none &&
        cmp -s "$work/smoke.out" <(dd if="$work/smoke.img" bs=64k skip=16 count=64 status=none) || ok="no (read)"
      dd if="$work/smoke.new" of="$work/smoke.mnt" bs=1M seek=8 conv=notrunc oflag=direct status=none &&
        dd if="$work/smoke.mnt" of="$work/smoke.out" bs=1M skip=8 count=4 iflag=direct status=none &&
        cmp -s "$work/smoke.out" "$work/smoke.new" &&
        cmp -s "$work/smoke.new" <(dd if="$work/smoke.img" bs=1M skip=8 count=4 status=none) || ok="no (write)"
    else
      ok="no (not mounted)"
    fi
    fusermount3 -u "$work/smoke.mnt" 2>/dev/null; wait "$fpid"
    echo "smoke $sys: bytes match: $ok"; cat "$work/floor.log" >&2
    [ "$ok" = yes ] || fail=1
  done
  exit $fail
fi
export RUNTIME=${RUNTIME:-5} SIZE=1G
suite="$here/fio-suite.sh"
rounds=${ROUNDS:-3}
read -ra sets <<< "${SETS:-raw qcow2-full qcow2-empty}"

echo "preparing images in $work" >&2
qemu-img create -q -f qcow2 "$work/full.qcow2" 1G
qemu-io -c 'write -P 0x5a 0 1G' "$work/full.qcow2" >/dev/null
qemu-img create -q -f qcow2 "$work/empty.qcow2" 1G
# Not zeros: a sparse copy of a zero-filled raw image would be all holes, read without any disk I/O.
qemu-img create -q -f raw "$work/raw.img" 1G
qemu-io -f raw -c 'write -P 0x5a 0 1G' "$work/raw.img" >/dev/null
# The other formats, fully written, for the FMT-full sets asked for (vpc with force_size so the
# virtual size stays exactly 1 GiB instead of its CHS rounding).
for set in "${sets[@]}"; do
  case $set in
    qcow2-full|qcow2-full-ro|qcow2-empty|qcow2-enc-full|raw|raw-lat|qcow2-lat) ;;
    *-full|*-rw)
      fmt=${set%-full} fmt=${fmt%-rw} opts=
      [ "$fmt" = vpc ] && opts="-o force_size=on"
      [ -f "$work/full.$fmt" ] || qemu-img convert -f raw -O "$fmt" $opts "$work/raw.img" "$work/full.$fmt" ;;
    *-empty)
      fmt=${set%-empty} opts=
      [ "$fmt" = vpc ] && opts="-o force_size=on"
      qemu-img create -q -f "$fmt" $opts "$work/empty.$fmt" 1G ;;
  esac
done
key=$work/bench.key
printf benchpw > "$key"
if [[ " ${sets[*]} " == *" qcow2-enc-full "* ]]; then
  qemu-img create -q --object secret,id=s0,data=benchpw -f qcow2 \
    -o encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=100,encrypt.hash-alg=sha512 \
    "$work/full.qcow2-enc" 1G
  qemu-io --object secret,id=s0,data=benchpw --image-opts -c 'write -P 0x5a 0 1G' \
    "driver=qcow2,encrypt.key-secret=s0,file.filename=$work/full.qcow2-enc" >/dev/null
fi
# Written back now, not under a later measurement (every copy below is synced the same way).
sync "$work"/*.img "$work"/*.qcow2 "$work"/full.*
: > "$results"

# measure ROUND SET SYSTEM TEMPLATE FORMAT JOB: one job on a fresh copy of TEMPLATE
measure() {
  local round=$1 set=$2 sys=$3 tmpl=$4 fmt=$5 job=$6
  local img="$work/$sys.img" mnt="$work/$sys.mnt" mode=rw qpid=
  case $job in *-ro) mode=ro ;; esac
  if [ "$sys" = qcow2-ref ]; then  # qcow2's same job, next to the format's (see the header)
    fmt=qcow2 tmpl=$work/full.qcow2
    [ "${set%-empty}" != "$set" ] && tmpl=$work/empty.qcow2
  fi
  local opts="$mode,cache=none,format=${fmt%-enc}" fio_job=${job%-ro} qsd_object= qsd_fmt_opts=
  if [ "$fmt" = qcow2-enc ]; then
    opts+=",key-file=$key" qsd_object="secret,id=s0,data=benchpw" qsd_fmt_opts=",encrypt.format=luks,encrypt.key-secret=s0"
  fi
  if [ "$sys" = raw-host ]; then
    "$suite" "$work/raw.img" "$sys" "$fio_job" | sed "s/^/$round $set /;s/ $fio_job / $job /" >> "$results"
    return
  fi
  # Every system below runs on a fresh copy of its image, the floors on one of the raw image:
  # writes into the long-lived raw.img and into a fresh copy were not alike (bench/RESULTS.md,
  # 2026-12-06 16:28).
  if [ "$sys" = floor ] || [ "$sys" = floor-ring ]; then tmpl=$work/raw.img; fi
  cp --sparse=always "$tmpl" "$img" && sync "$img"; : > "$mnt"
  if [ "$sys" = floor ] || [ "$sys" = floor-ring ]; then
    local flag=
    [ "$sys" = floor-ring ] && { set_uring Y; flag=--ring; } || set_uring N
    "$floor" $flag "$img" "$mnt" 2>"$work/floor.log" & qpid=$!
    if mounted "$mnt"; then
      "$suite" "$mnt" "$sys" "$fio_job" | sed "s/^/$round $set /;s/ $fio_job / $job /" >> "$results"
    else
      echo "$sys did not mount" >&2; cat "$work/floor.log" >&2
      echo "$round $set $sys $job FAILED" >> "$results"
    fi
    fusermount3 -u "$mnt" 2>/dev/null; wait "$qpid" 2>/dev/null; rm -f "$img" "$mnt"
    return
  fi
  case $sys in
    qsd) qsdpid=$(FMT=${fmt%-enc} QSD_OBJECT=$qsd_object QSD_FMT_OPTS=$qsd_fmt_opts WRITABLE=$([ $mode = ro ] && echo off || echo on) "$here/qsd-mount.sh" "$img" "$mnt") ;;
    qcowfs|qcow2-ref) set_uring N; "$bin" -f -o "$opts,fuse_uring=off" "$img" "$mnt" 2>"$work/qcowfs.log" & qpid=$! ;;
    qcowfs-ring) set_uring Y; "$bin" -f -o "$opts,fuse_uring=on" "$img" "$mnt" 2>"$work/qcowfs.log" & qpid=$! ;;
    before) set_uring N; "$before" -f -o "$opts,fuse_uring=off" "$img" "$mnt" 2>"$work/qcowfs.log" & qpid=$! ;;
    after) set_uring N; "$bin" -f -o "$opts,fuse_uring=off" "$img" "$mnt" 2>"$work/qcowfs.log" & qpid=$! ;;
  esac
  if mounted "$mnt" && [ "$(stat -c %s "$mnt")" = 1073741824 ]; then
    "$suite" "$mnt" "$sys" "$fio_job" | sed "s/^/$round $set /;s/ $fio_job / $job /" >> "$results"
  else
    echo "$sys did not mount $img" >&2; cat "$work/qcowfs.log" >&2 2>/dev/null
    echo "$round $set $sys $job FAILED" >> "$results"
  fi
  fusermount3 -u "$mnt" 2>/dev/null; sleep 0.3
  [ "$sys" = qsd ] && { kill "$qsdpid" 2>/dev/null; qsdpid=; }
  [ -n "$qpid" ] && wait "$qpid" 2>/dev/null
  rm -f "$img" "$mnt"
}

for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  for set in "${sets[@]}"; do
    case $set in
      raw) tmpl=$work/raw.img fmt=raw jobs="randread4k-ro randread4k randread4k-aio randwrite4k seqread1m-ro seqread1m seqwrite1m" ;;
      qcow2-full) tmpl=$work/full.qcow2 fmt=qcow2 jobs="randread4k randread4k-aio randwrite4k seqread1m" ;;
      qcow2-empty) tmpl=$work/empty.qcow2 fmt=qcow2 jobs="seqwrite1m seqwrite1m-fill randwrite4k" ;;
      qcow2-full-ro) tmpl=$work/full.qcow2 fmt=qcow2 jobs="randread4k-ro seqread1m-ro" ;;
      qcow2-enc-full) tmpl=$work/full.qcow2-enc fmt=qcow2-enc jobs="randread4k randwrite4k seqread1m" ;;
      raw-lat|qcow2-lat)
        fmt=${set%-lat} tmpl=$work/raw.img
        [ "$fmt" = qcow2 ] && tmpl=$work/full.qcow2
        jobs="randread4k-qd1 randwrite4k-qd1 randread4k-qd1u randwrite4k-qd1u randread4k-qd4 randwrite4k-qd4" ;;
      *-full) fmt=${set%-full} tmpl=$work/full.$fmt jobs="randread4k-ro seqread1m-ro"
              [ -f "$tmpl" ] || { echo "unknown set $set" >&2; exit 2; } ;;
      *-rw) fmt=${set%-rw} tmpl=$work/full.$fmt jobs="randwrite4k"
            [ -f "$tmpl" ] || { echo "unknown set $set" >&2; exit 2; } ;;
      *-empty) fmt=${set%-empty} tmpl=$work/empty.$fmt jobs="seqwrite1m seqwrite1m-fill"
               [ -f "$tmpl" ] || { echo "unknown set $set" >&2; exit 2; } ;;
      *) echo "unknown set $set" >&2; exit 2 ;;
    esac
    set_systems=$systems
    case $set in
      qcow2-*|raw|raw-lat) ;;
      *-rw|*-empty) [ -z "$before" ] && set_systems="raw-host $qsd qcow2-ref qcowfs qcowfs-ring" ;;
      *) [ -n "$floor_systems" ] && set_systems=${systems/$floor_systems /} ;;  # the format sets: no floor
    esac
    for job in $jobs; do
      [ -n "${JOBS:-}" ] && [[ " $JOBS " != *" $job "* ]] && continue
      order=$set_systems
      # Even rounds run the systems in reverse: a job's runs may wear the disk (the VM's host
      # flushes behind them), so a system always run last would always pay for the others.
      (( round % 2 == 0 )) && order=$(echo "$set_systems" | tr ' ' '\n' | tac | tr '\n' ' ')
      for sys in $order; do measure "$round" "$set" "$sys" "$tmpl" "$fmt" "$job"; done
    done
  done
done

python3 - "$results" "$rounds" "${before:+compare}" <<'PY' | tee "${OUT:-/dev/null}"
import sys, collections, statistics
# lines: ROUND SET SYSTEM JOB VALUE IOPS MIBS MiB/s  (or ROUND SET SYSTEM JOB FAILED)
def is_mb(job): return job.removesuffix("-ro").removesuffix("-fill").endswith("1m")
runs = collections.OrderedDict()
lats = collections.OrderedDict()  # (set, job) -> round -> system -> (IOPS, mean us, p99 us)
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 5: continue
    rnd, s, sys_, job = f[0], f[1], f[2], f[3]
    val = None if f[4] == "FAILED" else (float(f[6]) if is_mb(job) else float(f[4]))
    if s.endswith("-lat"):
        lats.setdefault((s, job), collections.defaultdict(dict))[rnd][sys_] = (
            None if val is None or len(f) < 11 else (val, float(f[8]), float(f[10])))
        continue
    runs.setdefault((s, job), collections.defaultdict(dict))[rnd][sys_] = val
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
def fmt(v, job):
    if v is None: return "failed"
    return f"{v:,.0f} MiB/s" if is_mb(job) else f"{v:,.0f} IOPS"
def cell(rounds, k, job):  # "-" for a system this run left out (FLOOR=none, no FUSE io_uring)
    if not any(k in v for v in rounds.values()): return "-"
    return fmt(med([v.get(k) for v in rounds.values()]), job)
def ratio(rounds, a, b):
    r = med([v[a] / v[b] for v in rounds.values() if v.get(a) and v.get(b)])
    return "-" if r is None else f"{r:.2f}x"
print(f"Medians of {sys.argv[2]} rounds; ratios are medians of the per-round ratios.\n")
def lat_table(systems):
    # Latency: mean and p99 in microseconds; ratios of means to the raw host file's, IOPS to qsd's.
    if not lats: return
    systems = systems[:2] + [k for k in systems[2:]  # those this run measured
                             if any(k in r for rounds in lats.values() for r in rounds.values())]
    heads = " | ".join(f"{k} mean / p99 us" for k in systems)
    print(f"| image | job | {heads} | " + " | ".join(f"{k} mean / raw's | {k} IOPS / qsd's" for k in systems[2:]) + " |")
    print("|---|---|" + "---|" * (len(systems) + 2 * len(systems[2:])))
    for (s, job), rounds in lats.items():
        cells = []
        for k in systems:
            mean = med([v[k][1] for v in rounds.values() if v.get(k)])
            p99 = med([v[k][2] for v in rounds.values() if v.get(k)])
            measured = any(k in v for v in rounds.values())
            cells.append(("failed" if measured else "-") if mean is None else f"{mean:.0f} / {p99:.0f}")
        for k in systems[2:]:
            r1 = med([v[k][1] / v["raw-host"][1] for v in rounds.values() if v.get(k) and v.get("raw-host")])
            r2 = med([v[k][0] / v["qsd"][0] for v in rounds.values() if v.get(k) and v.get("qsd")])
            cells += ["-" if r1 is None else f"{r1:.2f}x", "-" if r2 is None else f"{r2:.2f}x"]
        print(f"| {s.removesuffix('-lat')} | {job} | " + " | ".join(cells) + " |")
    print()
if sys.argv[3:] == ["compare"]:
    def spread(xs):
        xs = [x for x in xs if x]
        return f"{min(xs) / statistics.median(xs):.2f}-{max(xs) / statistics.median(xs):.2f}" if xs else "-"
    def per_round(rounds):
        return " ".join(f"{v['after'] / v['before']:.2f}" for v in rounds.values() if v.get("after") and v.get("before"))
    lat_table(["raw-host", "qsd", "before", "after"])
    print("| image | job | raw host file | qsd | before | after | after / before | per round "
          "| raw host file, min-max / median |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (s, job), rounds in runs.items():
        m = {k: med([v.get(k) for v in rounds.values()]) for k in ("raw-host", "qsd", "before", "after")}
        print(f"| {s} | {job} | {fmt(m['raw-host'], job)} | {cell(rounds, 'qsd', job)} | {fmt(m['before'], job)} "
              f"| {fmt(m['after'], job)} | {ratio(rounds, 'after', 'before')} | {per_round(rounds)} "
              f"| {spread([v.get('raw-host') for v in rounds.values()])} |")
    sys.exit(0)
lat_table(["raw-host", "qsd", "floor", "qcowfs", "floor-ring", "qcowfs-ring"])
# The floor daemon's means beside qcowfs's on the same transport (a ratio of means, within a round).
floor_lat = [(s, job, rounds) for (s, job), rounds in lats.items()
             if any(v.get("floor") or v.get("floor-ring") for v in rounds.values())]
if floor_lat:
    print("| image | job | qcowfs mean / floor's (/dev/fuse) | qcowfs mean / floor's (FUSE io_uring) |")
    print("|---|---|---|---|")
    for s, job, rounds in floor_lat:
        cells = []
        for q, f in (("qcowfs", "floor"), ("qcowfs-ring", "floor-ring")):
            r = med([v[q][1] / v[f][1] for v in rounds.values() if v.get(q) and v.get(f)])
            cells.append("-" if r is None else f"{r:.2f}x")
        print(f"| {s.removesuffix('-lat')} | {job} | " + " | ".join(cells) + " |")
    print()
if not runs: sys.exit(0)
print("| image | job | raw host file | qemu-storage-daemon | floor | qcowfs | qcowfs / raw | qcowfs / floor "
      "| qcowfs / qsd | floor, FUSE io_uring | qcowfs, FUSE over io_uring | its / raw | its / floor-ring "
      "| its / qsd |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for (s, job), rounds in runs.items():
    m = {k: med([v.get(k) for v in rounds.values()])
         for k in ("raw-host", "qsd", "floor", "qcowfs", "floor-ring", "qcowfs-ring")}
    print(f"| {s} | {job} | {fmt(m['raw-host'], job)} | {cell(rounds, 'qsd', job)} | {cell(rounds, 'floor', job)} "
          f"| {fmt(m['qcowfs'], job)} | {ratio(rounds, 'qcowfs', 'raw-host')} | {ratio(rounds, 'qcowfs', 'floor')} "
          f"| {ratio(rounds, 'qcowfs', 'qsd')} | {cell(rounds, 'floor-ring', job)} "
          f"| {fmt(m['qcowfs-ring'], job)} | {ratio(rounds, 'qcowfs-ring', 'raw-host')} "
          f"| {ratio(rounds, 'qcowfs-ring', 'floor-ring')} | {ratio(rounds, 'qcowfs-ring', 'qsd')} |")
# Each format beside qcow2 (qcow2-full-ro), ratios taken within a round.
ref = {job: rounds for (s, job), rounds in runs.items() if s == "qcow2-full-ro"}
others = [(s, job, rounds) for (s, job), rounds in runs.items()
          if s.endswith("-full") and s != "qcow2-enc-full" and job in ref]
if others:
    print("\n| format | job | qcowfs | qcowfs / qcow2 | qcowfs / qsd (same image) | qcowfs / raw host file |")
    print("|---|---|---|---|---|---|")
    for s, job, rounds in others:
        q = ref[job]
        r = med([v["qcowfs"] / q[k]["qcowfs"] for k, v in rounds.items()
                 if v.get("qcowfs") and q.get(k, {}).get("qcowfs")])
        print(f"| {s.removesuffix('-full')} | {job} | {fmt(med([v.get('qcowfs') for v in rounds.values()]), job)} "
              f"| {'-' if r is None else f'{r:.2f}x'} | {ratio(rounds, 'qcowfs', 'qsd')} "
              f"| {ratio(rounds, 'qcowfs', 'raw-host')} |")
# Each writable format beside qcow2: the qcow2-ref run just before the format's (overwrites on
# the fully written qcow2, allocating writes on the empty one), ratios taken within a round;
# without one (older raw results), qcow2-full/qcow2-rw and qcow2-empty of the same round.
wref = {(s, job): rounds for (s, job), rounds in runs.items() if s in ("qcow2-full", "qcow2-rw", "qcow2-empty")}
writers = [(s, job, rounds) for (s, job), rounds in runs.items()
           if (s.endswith("-rw") or s.endswith("-empty")) and s not in ("qcow2-empty", "qcow2-rw")]
if writers:
    print("\n| format | job | qcowfs | qcowfs / qcow2 | qsd (same image) | qcowfs / qsd | qcowfs / raw host file |")
    print("|---|---|---|---|---|---|---|")
    for s, job, rounds in writers:
        q = (wref.get(("qcow2-rw", job)) or wref.get(("qcow2-full", job), {})) if s.endswith("-rw") \
            else wref.get(("qcow2-empty", job), {})
        if any(v.get("qcow2-ref") for v in rounds.values()):
            r = med([v["qcowfs"] / v["qcow2-ref"] for v in rounds.values() if v.get("qcowfs") and v.get("qcow2-ref")])
        else:
            r = med([v["qcowfs"] / q[k]["qcowfs"] for k, v in rounds.items()
                     if v.get("qcowfs") and q.get(k, {}).get("qcowfs")])
        name = s.removesuffix("-rw").removesuffix("-empty")
        print(f"| {name} | {job} | {fmt(med([v.get('qcowfs') for v in rounds.values()]), job)} "
              f"| {'-' if r is None else f'{r:.2f}x'} | {cell(rounds, 'qsd', job)} "
              f"| {ratio(rounds, 'qcowfs', 'qsd')} | {ratio(rounds, 'qcowfs', 'raw-host')} |")
# The encrypted qcow2 beside the same image unencrypted (qcow2-full), ratios within a round.
plain = {job: rounds for (s, job), rounds in runs.items() if s == "qcow2-full"}
enc = [(job, rounds) for (s, job), rounds in runs.items() if s == "qcow2-enc-full" and job in plain]
if enc:
    print("\n| job | encrypted qcow2, qcowfs | encrypted / unencrypted (qcowfs) | qsd, encrypted "
          "| qcowfs / qsd (encrypted) |")
    print("|---|---|---|---|---|")
    for job, rounds in enc:
        q = plain[job]
        r = med([v["qcowfs"] / q[k]["qcowfs"] for k, v in rounds.items()
                 if v.get("qcowfs") and q.get(k, {}).get("qcowfs")])
        print(f"| {job} | {fmt(med([v.get('qcowfs') for v in rounds.values()]), job)} "
              f"| {'-' if r is None else f'{r:.2f}x'} | {cell(rounds, 'qsd', job)} "
              f"| {ratio(rounds, 'qcowfs', 'qsd')} |")
PY
