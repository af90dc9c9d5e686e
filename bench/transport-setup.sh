# transport-setup.sh PREFIX -- sourced by bench/transport-cost.sh and bench/ring-cpu.sh: their common
# set-up. Makes a scratch directory /var/tmp/PREFIX.XXXXXX ($work) holding $img, a 1 GiB raw image
# of 0x5a bytes (written and synced), and on exit unmounts $work/mnt, waits for the daemon whose pid
# the caller keeps in $pid, restores fuse.enable_uring ($param) unless the caller set
# restore_uring=0 (a caller that never switches it must not write it), and removes $work. mounted MNT waits up to 10 s for a FUSE mount on MNT.
# shellcheck shell=bash
param=/sys/module/fuse/parameters/enable_uring
old=$(cat $param 2>/dev/null || echo N)
work=$(mktemp -d "/var/tmp/${1:?prefix}.XXXXXX")
pid=
cleanup() {
  fusermount3 -u "$work/mnt" 2>/dev/null || true
  if [ -n "$pid" ]; then wait "$pid" 2>/dev/null || true; fi
  if [ "${restore_uring:-1}" = 1 ]; then echo "$old" > $param; fi
  rm -rf "$work"
}
trap cleanup EXIT
img=$work/img
qemu-img create -q -f raw "$img" 1G
qemu-io -f raw -c 'write -P 0x5a 0 1G' "$img" >/dev/null
sync "$img"
mounted() { for _ in $(seq 100); do grep -q " $1 [^ ]* [^-]*- fuse" /proc/self/mountinfo && return 0; sleep 0.1; done; return 1; }
