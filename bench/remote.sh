#!/usr/bin/env bash
# remote.sh [QCOWFS_BINARY] -- remote images (issue 33): a 1 GiB fully written qcow2 served on
# loopback, read through
#   qcowfs-http   qcowfs over http:// (nginx)              qsd-curl  qemu-storage-daemon's FUSE export,
#   qcowfs-nbd    qcowfs over nbd:// (qemu-nbd, raw bytes)  qsd-nbd   its curl / nbd driver under qcow2
#   curl          `curl -o /dev/null` of the whole file (sequential only: the download to beat)
# with fio (bench/fio-suite.sh): seqread1m (1 MiB, QD8), randread4k-qd1 (psync), randread4k
# (QD32), RUNTIME seconds each, O_DIRECT; and the time from starting a mount to the first 4 KiB
# read of the view (median of 3). Printed as a markdown table per round-trip time.
#
# Network: everything runs in a network namespace this script creates (ip netns) and deletes,
# on that namespace's own loopback interface (127.0.0.1): no address outside 127/8 is used and
# no interface of the host is touched. Latency: `tc qdisc netem delay RTT/2` on the namespace's
# lo (each packet crosses lo once per direction, so a request sees RTT). Kernels without
# sch_netem (such as this machine's) cannot add latency: those rows say so and are not measured.
# The processes enter only the namespace's network (nsenter --net), so their FUSE mounts are
# visible to fio in the host's mount namespace.
# Env: RTTS (ms, default "0 5"), RUNTIME (s per job, default 8), WORK (scratch dir, default
# /var/tmp), SIZE (default 1G), OUT (table file; default stdout only).
# Needs root, iproute2, nginx-light, qemu-utils, qemu-system-common, qemu-block-extra, fio, curl.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(readlink -f "${1:-$here/../build/qcowfs}")
[ -x "$bin" ] || { echo "no qcowfs binary at $bin (build first)" >&2; exit 1; }
RUNTIME=${RUNTIME:-8}; SIZE=${SIZE:-1G}; RTTS=${RTTS:-"0 5"}
work=$(mktemp -d "${WORK:-/var/tmp}/qcowfs-remote-bench.XXXXXX")
ns=qcowfs-rb-$$
port=18080; nbdport=18109
pids=()

cleanup() {
  for m in "$work"/mnt-*; do [ -e "$m" ] && [ "${m%.pid}" = "$m" ] && umount_system "$m"; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  ip netns del "$ns" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

in_ns() { nsenter --net="/var/run/netns/$ns" "$@"; }

ip netns add "$ns" || { echo "cannot create a network namespace (root needed)" >&2; exit 1; }
ip -n "$ns" link set lo up

echo "making a $SIZE qcow2 of random data..." >&2
head -c "$SIZE" /dev/urandom > "$work/disk.raw"
qemu-img convert -f raw -O qcow2 "$work/disk.raw" "$work/disk.qcow2"
rm -f "$work/disk.raw"
mkdir -p "$work/www" "$work/nginx/tmp"
mv "$work/disk.qcow2" "$work/www/"
cat > "$work/nginx/nginx.conf" <<EOF
daemon off; user root; worker_processes 1; pid $work/nginx/nginx.pid; error_log $work/nginx/error.log;
events { worker_connections 256; }
http { access_log off; default_type application/octet-stream; sendfile on; keepalive_requests 100000;
  client_body_temp_path $work/nginx/tmp/cb; proxy_temp_path $work/nginx/tmp/p;
  fastcgi_temp_path $work/nginx/tmp/f; uwsgi_temp_path $work/nginx/tmp/u; scgi_temp_path $work/nginx/tmp/s;
  server { listen 127.0.0.1:$port; root $work/www; } }
EOF
in_ns nginx -c "$work/nginx/nginx.conf" -p "$work/nginx" -e "$work/nginx/error.log" & pids+=($!)
in_ns qemu-nbd -f raw -r -t -e 8 -x exp -b 127.0.0.1 -p "$nbdport" "$work/www/disk.qcow2" & pids+=($!)
sleep 1
url=http://127.0.0.1:$port/disk.qcow2
nbd=nbd://127.0.0.1:$nbdport/exp

wait_mounted() { for _ in $(seq 2000); do grep -q " $1 fuse" /proc/mounts && return 0; sleep 0.01; done; return 1; }

# mount SYSTEM MOUNTFILE: starts the system's mount (in the namespace); prints nothing.
mount_system() {
  local sys=$1 mnt=$2
  touch "$mnt"
  case $sys in
    qcowfs-http) in_ns "$bin" -o ro "$url" "$mnt" ;;
    qcowfs-nbd)  in_ns "$bin" -o ro,format=qcow2 "$nbd" "$mnt" ;;
    qsd-curl|qsd-nbd)
      local file="driver=http,node-name=f,read-only=on,url=$url"
      [ "$sys" = qsd-nbd ] && file="driver=nbd,node-name=f,server.type=inet,server.host=127.0.0.1,server.port=$nbdport,export=exp,read-only=on"
      in_ns qemu-storage-daemon --blockdev "$file" --blockdev driver=qcow2,node-name=q,file=f,read-only=on \
        --export type=fuse,id=e,node-name=q,mountpoint="$mnt",writable=off >"$work/qsd.log" 2>&1 &
      echo $! > "$mnt.pid"
      wait_mounted "$mnt" ;;
  esac
}

# Unmounts, and ends the system's daemon (qsd runs until killed; qcowfs exits on unmount).
umount_system() {
  fusermount3 -u "$1" 2>/dev/null || umount -l "$1" 2>/dev/null
  [ -f "$1.pid" ] && { kill "$(cat "$1.pid")" 2>/dev/null; rm -f "$1.pid"; }
  sleep 0.3; rm -f "$1"
}

# First byte: ms from starting the mount to the end of a 4 KiB O_DIRECT read at offset 0.
first_byte_ms() {
  local sys=$1 mnt=$work/mnt-fb t0 t1
  t0=$(date +%s%N)
  if mount_system "$sys" "$mnt" && timeout 60 dd if="$mnt" of=/dev/null bs=4k count=1 iflag=direct status=none; then
    t1=$(date +%s%N)
    echo $(( (t1 - t0) / 1000000 ))
  else
    echo failed
  fi
  umount_system "$mnt"
}

median3() { printf '%s\n' "$@" | sort -n | sed -n 2p; }  # "failed" sorts first: a median of 3 still needs 2 good

table=$work/table.md
{
  echo "| RTT | system | seqread1m MiB/s | randread4k QD1 IOPS | randread4k QD32 IOPS | mount to first byte ms |"
  echo "|---|---|---|---|---|---|"
} > "$table"

for rtt in $RTTS; do
  in_ns tc qdisc del dev lo root 2>/dev/null
  if [ "$rtt" != 0 ]; then
    half=$(awk "BEGIN{print $rtt/2}")
    if ! in_ns tc qdisc add dev lo root netem delay "${half}ms" 2>"$work/tc.err"; then
      echo "| $rtt ms | all | not measured: tc netem refused ($(head -c 80 "$work/tc.err" | tr '\n|' '  ')) | | | |" >> "$table"
      continue
    fi
  fi
  for sys in qcowfs-http qsd-curl qcowfs-nbd qsd-nbd; do
    echo "rtt $rtt ms: $sys..." >&2
    fb=$(median3 "$(first_byte_ms "$sys")" "$(first_byte_ms "$sys")" "$(first_byte_ms "$sys")")
    mnt=$work/mnt-$sys
    res="$sys mount failed"
    mount_system "$sys" "$mnt" &&
      res=$(RUNTIME=$RUNTIME SIZE=$SIZE timeout $((RUNTIME * 3 + 120)) "$here/fio-suite.sh" "$mnt" "$sys" \
            seqread1m randread4k-qd1 randread4k)
    umount_system "$mnt"
    echo "$res" >&2
    seq=$(awk '$2=="seqread1m"{print $5}' <<<"$res"); qd1=$(awk '$2=="randread4k-qd1"{print $3}' <<<"$res")
    qd32=$(awk '$2=="randread4k"{print $3}' <<<"$res")
    echo "| $rtt ms | $sys | ${seq:-failed} | ${qd1:-failed} | ${qd32:-failed} | $fb |" >> "$table"
  done
  echo "rtt $rtt ms: curl..." >&2
  speed=$(in_ns curl -s -o /dev/null -w '%{speed_download}' "$url")
  echo "| $rtt ms | curl (whole file) | $(awk "BEGIN{printf \"%.1f\", $speed/1048576}") | - | - | - |" >> "$table"
done
in_ns tc qdisc del dev lo root 2>/dev/null

cat "$table"
[ -n "${OUT:-}" ] && cp "$table" "$OUT"
exit 0
