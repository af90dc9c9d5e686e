#!/usr/bin/env bash
# remote.sh [QCOWFS_BINARY] -- remote images (issue 33): a fully written qcow2 (SIZE, default
# 1 GiB, random data) served on loopback, read through
#   qcowfs-http  qcowfs over http:// (nginx)               qsd-curl  qemu-storage-daemon's FUSE export
#   qcowfs-nbd   qcowfs over nbd:// (qemu-nbd, raw bytes)   qsd-nbd   over its curl / nbd driver, qcow2 on top
#   curl         `curl -o /dev/null` of the whole file, 4 times on one connection (CURL_REPEAT)
#                (sequential only: the download to beat;
#                also run right before each sequential round over http, whose ratio to it is
#                printed under the table per round and as a median: the same minute's download)
# with fio (bench/fio-suite.sh, O_DIRECT): seqread1m (1 MiB, QD8), seqread1m-qd1 (psync),
# randread4k-qd1 (psync), randread4k (QD32), RUNTIME seconds each, the median of ROUNDS runs; a
# run without an answer in RUNTIME+30 s is a `hangs` cell (the daemon is killed and mounted again
# for the next run: qsd over curl hangs with 2 or more requests in flight, see bench/RESULTS.md,
# so seqread1m-qd1 is its sequential figure); and the time from starting
# the mount command to the end of a first 4 KiB O_DIRECT read of the view (median of 3; the same
# helper starts every system and polls for its mount, so all are timed alike). One markdown table
# row per system and round-trip time, with the measured TCP connect time (one round trip).
#
# Network: everything runs in a network namespace this script creates (ip netns) and deletes, on
# that namespace's own loopback interface (127.0.0.1): no other address is used, no interface of
# the host is touched, nothing outside is contacted. Latency: `tc qdisc netem delay RTT/2` on the
# namespace's lo (each packet crosses lo once per direction, so a request sees RTT). A kernel
# without sch_netem (CONFIG_NET_SCH_NETEM unset, as on the machine this was written on) cannot add
# latency: the script finds that out first and prints a line saying the RTT>0 rows were not run
# and why, and measures the 0 ms rows. The daemons enter only the namespace's network (nsenter
# --net), so their FUSE mounts are visible to fio in the host's mount namespace. Every server and
# daemon started here is stopped on exit, also on error or interrupt.
#
# qemu-storage-daemon over curl: QEMU's curl driver is read-only (read-only=on), fetches each
# request plus `readahead` (QEMU's default 256 KiB, kept) and fails a transfer that takes longer
# than `timeout` (QEMU's default 5 s; set to 30 s, qcowfs's remote-timeout, so a busy machine
# gives slow numbers rather than EIO).
# Env: RTTS (ms, default "0 5"), RUNTIME (s per fio job, default 8), ROUNDS (fio runs per job,
# median, default 1), SIZE (default 1G), SYSTEMS (default all four; also qcowfs-http-base: over http
# with the binary QCOWFS_BASE, to compare two builds in one run), QCOWFS_OPTS (extra -o for
# qcowfs, e.g. remote-block-size=64K), QSD_CURL_OPTS (extra options of QEMU's curl node, e.g.
# readahead=1M), JOBS (the fio jobs to run, default all four: seqread1m seqread1m-qd1
# randread4k-qd1 randread4k; the others' cells say "-"), FIRST_BYTE (0: skip the mount-to-first-byte
# column), CURL (0: no curl row), NBDCOPY (0: no row for the plain libnbd client, nbdcopy: see
# below), WORK (scratch dir, default /var/tmp), OUT (table file). Only the nbd rows:
# SYSTEMS="qcowfs-nbd qsd-nbd" CURL=0.
# Needs root, iproute2, nginx-light, qemu-utils, qemu-system-common, qemu-block-extra, fio, curl,
# libnbd-bin.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(readlink -f "${1:-$here/../build/qcowfs}")
[ -x "$bin" ] || { echo "no qcowfs binary at $bin (build first)" >&2; exit 1; }
RUNTIME=${RUNTIME:-8}; SIZE=${SIZE:-1G}; RTTS=${RTTS:-"0 5"}; ROUNDS=${ROUNDS:-1}
SYSTEMS=${SYSTEMS:-"qcowfs-http qsd-curl qcowfs-nbd qsd-nbd"}
work=$(mktemp -d "${WORK:-/var/tmp}/qcowfs-remote-bench.XXXXXX")
ns=qcowfs-rb-$$
port=18080; nbdport=18109
servers=()   # nginx, qemu-nbd

log() { echo "remote.sh: $*" >&2; }
# alive PID: the process exists and is not a zombie (the daemons' parent exits before them).
alive() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null) && [ "${st:0:1}" != Z ]; }

# Unmounts MOUNTFILE and ends the daemon serving it (its pid in MOUNTFILE.pid): qcowfs exits on
# unmount, qemu-storage-daemon runs until killed (and a hung one only by SIGKILL; a lazy unmount
# then removes its dead mount).
umount_system() {
  local mnt=$1 pid=
  [ -f "$mnt.pid" ] && pid=$(cat "$mnt.pid")
  grep -q " $mnt fuse" /proc/mounts && fusermount3 -u "$mnt" 2>/dev/null
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && kill -9 "$pid" 2>/dev/null
  fi
  grep -q " $mnt fuse" /proc/mounts && umount -l "$mnt" 2>/dev/null
  rm -f "$mnt" "$mnt.pid"
}

cleanup() {
  trap - EXIT INT TERM HUP
  local m p
  for m in "$work"/mnt-*; do
    case $m in *.pid|*.log|*'*') ;; *) umount_system "$m" ;; esac
  done
  for p in "${servers[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${servers[@]}"; do
    for _ in $(seq 50); do alive "$p" || break; sleep 0.1; done
    alive "$p" && kill -9 "$p" 2>/dev/null
  done
  ip netns del "$ns" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP

in_ns() { nsenter --net="/var/run/netns/$ns" "$@"; }

ip netns add "$ns" || { echo "cannot create a network namespace (root needed)" >&2; exit 1; }
ip -n "$ns" link set lo up

# netem: tc parses its arguments before asking the kernel, so "Specified qdisc kind is unknown"
# means the command is right and the kernel lacks sch_netem.
netem_args() { echo "netem delay $(awk "BEGIN{print $1/2}")ms limit 100000"; }
netem_missing=
rtts_run=
for rtt in $RTTS; do
  if [ "$rtt" != 0 ] && [ -z "$netem_missing" ]; then
    # shellcheck disable=SC2046
    if in_ns tc qdisc add dev lo root $(netem_args "$rtt") 2>"$work/tc.err"; then
      in_ns tc qdisc del dev lo root
    else
      netem_missing=$(tr '\n' ' ' < "$work/tc.err" | sed 's/ *$//')
      grep -q "qdisc kind is unknown" "$work/tc.err" &&
        netem_missing="this kernel has no sch_netem (CONFIG_NET_SCH_NETEM not set; tc: $netem_missing)"
    fi
  fi
  if [ "$rtt" = 0 ] || [ -z "$netem_missing" ]; then rtts_run="$rtts_run $rtt"; fi
done
skipped=$(for r in $RTTS; do case " $rtts_run " in *" $r "*) ;; *) printf '%s ' "$r";; esac; done)
[ -n "$skipped" ] && log "the ${skipped}ms rows are NOT run: no latency can be added: $netem_missing"

log "making a $SIZE qcow2 of random data..."
mkdir -p "$work/www" "$work/nginx/tmp"
head -c "$SIZE" /dev/urandom > "$work/disk.raw" &&
  qemu-img convert -f raw -O qcow2 "$work/disk.raw" "$work/www/disk.qcow2" ||
  { echo "cannot make the image" >&2; exit 1; }
rm -f "$work/disk.raw"
cat > "$work/nginx/nginx.conf" <<EOF
daemon off; user root; worker_processes auto; pid $work/nginx/nginx.pid; error_log $work/nginx/error.log;
events { worker_connections 256; }
http { access_log off; default_type application/octet-stream; sendfile on; keepalive_requests 100000;
  client_body_temp_path $work/nginx/tmp/cb; proxy_temp_path $work/nginx/tmp/p;
  fastcgi_temp_path $work/nginx/tmp/f; uwsgi_temp_path $work/nginx/tmp/u; scgi_temp_path $work/nginx/tmp/s;
  server { listen 127.0.0.1:$port; root $work/www; } }
EOF
# nsenter (not the in_ns function, which would run in a forked subshell) so that $! is the
# server's pid: nsenter execs it.
nsenter --net="/var/run/netns/$ns" nginx -c "$work/nginx/nginx.conf" -p "$work/nginx" -e "$work/nginx/error.log" &
servers+=($!)
nsenter --net="/var/run/netns/$ns" qemu-nbd -f raw -r -t -e 16 -x exp -b 127.0.0.1 -p "$nbdport" "$work/www/disk.qcow2" \
  2>"$work/qemu-nbd.log" & servers+=($!)
url=http://127.0.0.1:$port/disk.qcow2
nbd=nbd://127.0.0.1:$nbdport/exp
for _ in $(seq 100); do
  in_ns curl -sfI -o /dev/null "$url" && in_ns nbdinfo --size "$nbd" >/dev/null 2>&1 && break
  sleep 0.1
done
in_ns curl -sfI -o /dev/null "$url" || { echo "nginx did not come up: $(cat "$work/nginx/error.log")" >&2; exit 1; }
in_ns nbdinfo --size "$nbd" >/dev/null || { echo "qemu-nbd did not come up: $(cat "$work/qemu-nbd.log")" >&2; exit 1; }

# system_cmd SYSTEM MOUNTFILE: sets cmd to the command (in the namespace, in the foreground)
# that mounts SYSTEM's raw view of the image on MOUNTFILE.
system_cmd() {
  local sys=$1 mnt=$2 file
  case $sys in
    qcowfs-http) cmd=("$bin" -f -o "ro${QCOWFS_OPTS:+,$QCOWFS_OPTS}" "$url" "$mnt") ;;
    qcowfs-http-base)
      [ -x "${QCOWFS_BASE:-}" ] || { echo "qcowfs-http-base needs QCOWFS_BASE (a qcowfs binary)" >&2; return 1; }
      cmd=("$QCOWFS_BASE" -f -o "ro${QCOWFS_OPTS:+,$QCOWFS_OPTS}" "$url" "$mnt") ;;
    qcowfs-nbd)  cmd=("$bin" -f -o "ro,format=qcow2${QCOWFS_OPTS:+,$QCOWFS_OPTS}" "$nbd" "$mnt") ;;
    qsd-curl|qsd-nbd)
      file="driver=http,node-name=f,read-only=on,url=$url,timeout=30${QSD_CURL_OPTS:+,$QSD_CURL_OPTS}"
      [ "$sys" = qsd-nbd ] &&
        file="driver=nbd,node-name=f,read-only=on,server.type=inet,server.host=127.0.0.1,server.port=$nbdport,export=exp"
      cmd=(qemu-storage-daemon --blockdev "$file" --blockdev "driver=qcow2,node-name=q,file=f,read-only=on"
           --export type=fuse,id=e,node-name=q,mountpoint="$mnt",writable=off) ;;
    *) echo "unknown system $sys" >&2; return 1 ;;
  esac
  cmd=(nsenter --net="/var/run/netns/$ns" "${cmd[@]}")
}

# mount_system SYSTEM MOUNTFILE: starts SYSTEM's daemon (pid in MOUNTFILE.pid, output in
# MOUNTFILE.log), waits for its mount and reads the first 4 KiB (O_DIRECT); prints the ms from
# starting the daemon to the end of that read. Fails (and prints the log) if there is no mount
# within 60 s, the daemon exits, or the read fails.
mount_system() {
  local sys=$1 mnt=$2 ms
  system_cmd "$sys" "$mnt" || return 1
  touch "$mnt"
  if ! ms=$(timeout 90 python3 - "$mnt" "${cmd[@]}" <<'PY'
import mmap, os, subprocess, sys, time
mnt, cmd = sys.argv[1], sys.argv[2:]
dev0 = os.stat(mnt).st_dev
log = open(mnt + ".log", "wb")
t0 = time.monotonic()
proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
with open(mnt + ".pid", "w") as f:
    f.write(str(proc.pid))
while os.stat(mnt).st_dev == dev0:
    if proc.poll() is not None:
        sys.exit(f"{cmd[2]} exited ({proc.returncode}) without mounting")
    if time.monotonic() - t0 > 60:
        sys.exit("no mount within 60 s")
    time.sleep(0.0005)
fd = os.open(mnt, os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 4096)
if os.preadv(fd, [buf], 0) != 4096:
    sys.exit("short first read")
t1 = time.monotonic()
os.close(fd)
print(round((t1 - t0) * 1000))
PY
  ); then
    log "$sys: mount or first read failed; its output:"; sed 's/^/    /' "$mnt.log" >&2
    return 1
  fi
  echo "$ms"
}

first_byte_ms() {
  local mnt=$work/mnt-fb ms
  ms=$(mount_system "$1" "$mnt") || ms=failed
  umount_system "$mnt"
  echo "$ms"
}

# median VALUES...: of the numeric ones ("failed" if none).
median() {
  printf '%s\n' "$@" | grep -E '^[0-9.]+$' | sort -g |
    awk '{v[NR]=$1} END{if (!NR) print "failed"; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'
}

# nbdcopy_mibs ARGS...: MiB/s of `nbdcopy -C 1 ARGS nbd null:` (the whole export), "failed" on error.
nbdcopy_mibs() {
  local t0 t1 bytes
  bytes=$(in_ns nbdinfo --size "$nbd") || { echo failed; return; }
  t0=$(date +%s.%N)
  in_ns nbdcopy -C 1 "$@" "$nbd" null: || { echo failed; return; }
  t1=$(date +%s.%N)
  awk -v n="$bytes" -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", n/1048576/(b-a)}'
}

all_jobs=(seqread1m seqread1m-qd1 randread4k-qd1 randread4k)
read -ra jobs <<<"${JOBS:-${all_jobs[*]}}"
for job in "${jobs[@]}"; do
  case " ${all_jobs[*]} " in *" $job "*) ;; *) echo "unknown job $job (JOBS: ${all_jobs[*]})" >&2; exit 1;; esac
done
table=$work/table.md
{
  echo "| RTT (TCP connect) | system | seqread1m QD8 MiB/s | seqread1m QD1 MiB/s | randread4k QD1 IOPS | randread4k QD32 IOPS | mount to first byte ms |"
  echo "|---|---|---|---|---|---|---|"
} > "$table"

# curl_mibs: MiB/s of `curl -o /dev/null` downloading the whole file CURL_REPEAT times (default 4)
# one after the other on one connection: total bytes over total transfer time ("failed" on
# error). One download of 1 GiB lasts half a second here, too short a sample beside fio's runs.
curl_mibs() {
  local urls=() i
  for ((i = 0; i < ${CURL_REPEAT:-4}; i++)); do urls+=(-o /dev/null "$url"); done
  in_ns curl -sf -w '%{size_download} %{time_total}\n' "${urls[@]}" |
    awk '{b += $1; t += $2} END{if (t > 0 && NR == '"${CURL_REPEAT:-4}"') printf "%.1f", b/t/1048576; else print "failed"}'
}
speeds=()             # curl downloads of this RTT: the row's samples
declare -A ratios=()  # "SYSTEM JOB" -> per-round ratios to the curl download right before
notes=()
for rtt in $rtts_run; do
  in_ns tc qdisc del dev lo root 2>/dev/null
  # shellcheck disable=SC2046
  if [ "$rtt" != 0 ] && ! in_ns tc qdisc add dev lo root $(netem_args "$rtt"); then
    echo "tc netem failed for $rtt ms" >&2; exit 1
  fi
  conn=$(in_ns curl -s -o /dev/null -w '%{time_connect}' "$url" | awk '{printf "%.2f ms", $1*1000}')
  # The plain libnbd client: what qemu-nbd serves nbdcopy reading the whole export to null:, one
  # connection, 8 x 256 KiB commands in flight (QD8 column) and 1 MiB commands one at a time (QD1).
  if [ "${NBDCOPY:-1}" != 0 ]; then
    log "rtt $rtt ms: nbdcopy..."
    nc8=(); nc1=()
    for _ in $(seq "$ROUNDS"); do
      nc8+=("$(nbdcopy_mibs -R 8 --request-size=262144)"); nc1+=("$(nbdcopy_mibs -R 1 --request-size=1048576)")
    done
    echo "| $rtt ms ($conn) | nbdcopy (libnbd, 1 connection) | $(median "${nc8[@]}") | $(median "${nc1[@]}") | - | - | - |" >> "$table"
  fi
  for sys in $SYSTEMS; do
    log "rtt $rtt ms: $sys..."
    fb=-
    [ "${FIRST_BYTE:-1}" != 0 ] &&
      fb=$(median "$(first_byte_ms "$sys")" "$(first_byte_ms "$sys")" "$(first_byte_ms "$sys")")
    mnt=$work/mnt-$sys
    declare -A vals=()
    mounted=0
    for job in "${jobs[@]}"; do
      for _ in $(seq "$ROUNDS"); do
        if [ $mounted = 0 ]; then
          if mount_system "$sys" "$mnt" >/dev/null; then mounted=1; else vals[$job]+=" failed"; continue; fi
        fi
        # Over http the sequential rounds each follow a curl download of the same file, so the
        # ratio to curl is taken within the minute (curl's own figure moves 1.8x between runs).
        c=
        [[ $sys == qcowfs-http* && $job == seqread1m* && "${CURL:-1}" != 0 ]] && c=$(curl_mibs)
        res=$(RUNTIME=$RUNTIME SIZE=$SIZE timeout -k 5 $((RUNTIME + 30)) "$here/fio-suite.sh" "$mnt" "$sys" "$job")
        rc=$?
        [ -n "$res" ] && echo "$res" >&2
        if [ $rc -ne 0 ]; then  # 124/137: fio got no answer: the daemon hangs; kill it, mount again
          if [ $rc = 124 ] || [ $rc = 137 ]; then
            log "$sys $job: no answer within $((RUNTIME + 30)) s: the daemon hangs; killing it. Its output:"
            vals[$job]+=" hangs"
          else
            log "$sys $job: fio-suite.sh failed ($rc). The daemon's output:"; vals[$job]+=" failed"
          fi
          sed 's/^/    /' "$mnt.log" >&2
          umount_system "$mnt"; mounted=0; continue
        fi
        case $job in seqread*) f=5;; *) f=3;; esac
        v=$(awk -v j="$job" -v f=$f '$2==j{print $f}' <<<"$res")
        [ -z "$v" ] && { log "$sys: daemon output:"; sed 's/^/    /' "$mnt.log" >&2; }
        vals[$job]+=" ${v:-failed}"
        if [ -n "$c" ]; then
          speeds+=("$c")
          ratios[$sys $job]+=" $(awk -v a="${v:-0}" -v b="$c" 'BEGIN{if (b > 0 && a > 0) printf "%.2f", a/b; else print "failed"}')"
        fi
      done
    done
    umount_system "$mnt"
    row="| $rtt ms ($conn) | $sys |"
    for job in "${all_jobs[@]}"; do
      case " ${jobs[*]} " in *" $job "*) ;; *) row="$row - |"; continue;; esac
      # shellcheck disable=SC2086
      m=$(median ${vals[$job]:-})
      [ "$m" = failed ] && case " ${vals[$job]:-} " in *" hangs "*) m="hangs";; esac
      row="$row $m |"
    done
    echo "$row $fb |" >> "$table"
    unset vals
  done
  [ "${CURL:-1}" = 0 ] && continue
  log "rtt $rtt ms: curl..."
  for _ in $(seq "$ROUNDS"); do speeds+=("$(curl_mibs)"); done
  echo "| $rtt ms ($conn) | curl (whole file) | $(median "${speeds[@]}") | - | - | - | - |" >> "$table"
  for key in "${!ratios[@]}"; do
    # shellcheck disable=SC2086
    notes+=("$rtt ms: $key / the curl download right before each round: per round${ratios[$key]}, median $(median ${ratios[$key]})x")
  done
  speeds=(); ratios=()
done
in_ns tc qdisc del dev lo root 2>/dev/null
[ ${#notes[@]} -gt 0 ] && { echo; printf -- '- %s\n' "${notes[@]}"; } >> "$table"
[ -n "$skipped" ] && echo "
The ${skipped}ms rows were not run: no latency can be added on this machine: $netem_missing." >> "$table"

cat "$table"
[ -n "${OUT:-}" ] && cp "$table" "$OUT"
exit 0
