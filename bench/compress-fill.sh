#!/usr/bin/env bash
# compress-fill.sh [QCOWFS_BINARY] -- making a compressed qcow2 image of a disk: filling a fresh
# image through a compress=on qcowfs mount against `qemu-img convert -c -O qcow2` of the same raw
# file, in alternating rounds (the order flips each round).
#   source   a SIZE_MB (default 1024) raw disk: mkfs.ext4, then copies of /usr/share/doc,
#            /usr/share/man and /usr/include (text, and the gzip files Debian keeps there) until
#            about FILL_PCT (default 70) percent of it is used; the rest stays holes
#   qemu-img qemu-img convert -q -c -f raw -O qcow2 SRC OUT (skips zero ranges itself)
#   qcowfs   qemu-img create -f qcow2 OUT SIZE; qcowfs -o rw,compress=on OUT VIEW;
#            dd if=SRC of=VIEW bs=BS oflag=direct conv=sparse,notrunc,fsync (sparse: skips all-zero
#            megabytes as convert skips zeros); unmount (metadata written back, file closed)
# Throughput is the source's size over the wall time of the whole step (qcowfs: mount to the end
# of unmount). Each output is checked (qemu-img check) and compared with the source once.
# Env: ROUNDS (default 3), SIZE_MB, FILL_PCT, BS (dd's block size, default 1M: one 1 MiB FUSE
# request at a time; with 4M the kernel sends a write's four 1 MiB requests at once). Needs root (loop mount), qemu-utils, e2fsprogs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(readlink -f "${1:-$here/../build/qcowfs}")
[ -x "$bin" ] || { echo "no qcowfs binary at $bin (build first)" >&2; exit 1; }
rounds=${ROUNDS:-3}
size_mb=${SIZE_MB:-1024}
fill_pct=${FILL_PCT:-70}
bs=${BS:-1M}
work=$(mktemp -d /var/tmp/qcowfs-cfill.XXXXXX)
cleanup() {
  set +e
  mountpoint -q "$work/fs" && umount "$work/fs"
  [ -e "$work/view" ] && fusermount3 -u "$work/view" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

src=$work/src.raw
truncate -s "${size_mb}M" "$src"
mkfs.ext4 -q -F "$src"
mkdir "$work/fs"
mount -o loop "$src" "$work/fs"
n=0
while [ "$(df --output=pcent "$work/fs" | tail -1 | tr -dc 0-9)" -lt "$fill_pct" ]; do
  n=$((n + 1))
  mkdir "$work/fs/copy$n"
  for d in /usr/share/doc /usr/share/man /usr/include; do
    cp -a "$d" "$work/fs/copy$n/" 2>/dev/null || break 2  # full
  done
done
used=$(df --output=used -B1M "$work/fs" | tail -1 | tr -dc 0-9)
umount "$work/fs"
sync "$src"
data_mb=$(( $(du -B1M "$src" | cut -f1) ))
echo "source: ${size_mb} MiB ext4, ${used} MiB used ($n copies), ${data_mb} MiB allocated in the raw file"

mounted() { for _ in $(seq 200); do grep -q " $1 [^ ]* [^-]*- fuse" /proc/self/mountinfo && return 0; sleep 0.05; done; return 1; }

# run_one SYSTEM OUT: prints the seconds it took
run_one() {
  local sys=$1 out=$2 t0 t1
  rm -f "$out"
  sync
  echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
  t0=$(date +%s.%N)
  if [ "$sys" = qemu-img ]; then
    qemu-img convert -q -c -f raw -O qcow2 "$src" "$out"
  else
    qemu-img create -q -f qcow2 "$out" "${size_mb}M"
    : > "$work/view"
    "$bin" -f -o rw,compress=on "$out" "$work/view" & local pid=$!
    mounted "$work/view" || { echo "qcowfs did not mount" >&2; exit 1; }
    dd if="$src" of="$work/view" bs="$bs" oflag=direct conv=sparse,notrunc,fsync status=none
    fusermount3 -u "$work/view"
    wait "$pid"
  fi
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc -l
}

declare -A secs sizes
for r in $(seq "$rounds"); do
  order="qemu-img qcowfs"
  [ $((r % 2)) -eq 0 ] && order="qcowfs qemu-img"
  for sys in $order; do
    out=$work/$sys.qcow2
    s=$(run_one "$sys" "$out")
    secs[$sys]="${secs[$sys]:-} $s"
    sizes[$sys]=$(stat -c %s "$out")
    if [ "$r" = 1 ]; then
      qemu-img check -q "$out" || { echo "$sys: qemu-img check failed" >&2; exit 1; }
      qemu-img compare -q -f qcow2 -F raw "$out" "$src" || { echo "$sys: differs from the source" >&2; exit 1; }
    fi
    printf 'round %d %-8s %6.2f s  %7.1f MiB/s  %s bytes\n' "$r" "$sys" "$s" "$(echo "$size_mb / $s" | bc -l)" "${sizes[$sys]}"
  done
done

median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
q=$(echo "${secs[qemu-img]}" | median)
c=$(echo "${secs[qcowfs]}" | median)
echo
echo "| system | median time | throughput (source MiB/s) | image size | size / qemu-img's |"
echo "|---|---|---|---|---|"
printf '| qemu-img convert -c | %.2f s | %.1f | %d MiB | 1.00 |\n' "$q" "$(echo "$size_mb / $q" | bc -l)" \
  "$(( ${sizes[qemu-img]} >> 20 ))"
printf '| qcowfs compress=on, dd bs=%s |' "$bs"; printf ' %.2f s | %.1f | %d MiB | %.3f |\n' "$c" "$(echo "$size_mb / $c" | bc -l)" \
  "$(( ${sizes[qcowfs]} >> 20 ))" "$(echo "${sizes[qcowfs]} / ${sizes[qemu-img]}" | bc -l)"
printf 'qcowfs / qemu-img throughput: %.2fx (%d rounds, medians)\n' "$(echo "$q / $c" | bc -l)" "$rounds"
