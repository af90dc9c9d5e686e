#!/usr/bin/env bash
# qsd-mount.sh IMAGE MOUNTFILE [direct=on|off] -- expose IMAGE (qcow2) as a raw file via
# qemu-storage-daemon's FUSE export (format from $FMT, default qcow2; writable unless
# WRITABLE=off) (the reference anchor). Prints the daemon pid. QSD_OBJECT adds an --object
# (a secret), QSD_FMT_OPTS options of the format node (",encrypt.format=luks,encrypt.key-secret=s0").
set -euo pipefail
img=$1; mnt=$2; direct=${3:-on}
touch "$mnt"
qemu-storage-daemon ${QSD_OBJECT:+--object "$QSD_OBJECT"} \
  --blockdev driver=file,node-name=f,filename="$img",cache.direct=$direct,aio=io_uring \
  --blockdev driver=${FMT:-qcow2},node-name=q,file=f${QSD_FMT_OPTS:-} \
  --export type=fuse,id=e,node-name=q,mountpoint="$mnt",writable=${WRITABLE:-on} \
  >/tmp/qsd.$$.log 2>&1 &
pid=$!
for i in $(seq 50); do mount | grep -q " $mnt type fuse" && break; sleep 0.1; done
echo $pid
