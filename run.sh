#!/usr/bin/env bash
# The main job: installs build dependencies, builds qcowfs, and mounts a disk
# image as a raw file (a demo qcow2 disk when no image is given).
#
#   ./run.sh [--daemon] [-o OPTIONS] [IMAGE [MOUNTPOINT]]
#
# IMAGE       a disk image: qcow2, LUKS, VMDK, VHDX, VHD, VDI, QED, Parallels or
#             raw (build/qcowfs --help); default: a demo qcow2 built under
#             /var/tmp/qcowfs-demo (a partitioned 64 MiB disk with an ext4
#             filesystem holding hello.txt).
# MOUNTPOINT  a directory (the raw view is MOUNTPOINT/<image name>.raw, the name
#             without its suffix such as .qcow2 or .vmdk) or a regular file
#             (the raw view replaces it; created if the name ends in .raw or
#             .img); default: the directory /var/tmp/qcowfs-mnt.
# -o OPTIONS  qcowfs mount options, e.g. rw or cache=none (see README.md).
# --daemon    leave the image mounted and return; otherwise stay in the
#             foreground until Ctrl-C, then unmount.
set -euo pipefail
cd "$(dirname "$0")"
repo=$(pwd)

daemon=0
options=()
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --daemon) daemon=1 ;;
    -o) [ $# -ge 2 ] || { echo "run.sh: -o needs a value" >&2; exit 2; }
        options=(-o "$2"); shift ;;
    -o*) options=(-o "${1#-o}") ;;
    -h|--help) sed -n '2,19s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    *) args+=("$1") ;;
  esac
  shift
done
[ ${#args[@]} -le 2 ] || { echo "run.sh: too many arguments (try --help)" >&2; exit 2; }

demo_dir=/var/tmp/qcowfs-demo

# Builds demo.qcow2: MBR disk, one Linux partition at 1 MiB, ext4 inside, made
# with mkfs.ext4 -d and sfdisk on plain files (no root, no loop devices).
make_demo_image() {
  local img=$demo_dir/demo.qcow2
  if [ -f "$img" ]; then echo "$img"; return; fi
  mkdir -p "$demo_dir"
  local tmp
  tmp=$(mktemp -d "$demo_dir/build.XXXXXX")
  mkdir "$tmp/files"
  echo "Hello from inside a qcow2 image, read through qcowfs." > "$tmp/files/hello.txt"
  head -c 4M /dev/urandom > "$tmp/files/random.bin"
  sha256sum "$tmp/files/random.bin" | sed "s|$tmp/files/||" > "$tmp/files/random.bin.sha256"
  truncate -s 64M "$tmp/disk.raw"
  printf 'label: dos\nstart=2048, type=83\n' | sfdisk -q "$tmp/disk.raw" >/dev/null
  truncate -s $(( (131072 - 2048) * 512 )) "$tmp/part.ext4"
  mkfs.ext4 -q -F -L qcowfs-demo -d "$tmp/files" "$tmp/part.ext4" >/dev/null
  dd if="$tmp/part.ext4" of="$tmp/disk.raw" bs=1M seek=1 conv=notrunc,sparse status=none
  qemu-img convert -f raw -O qcow2 "$tmp/disk.raw" "$img"
  rm -rf "$tmp"
  echo "$img"
}

find_binary() {
  local b
  for b in "$repo/build/qcowfs"; do
    if [ -x "$b" ]; then echo "$b"; return; fi
  done
  echo "run.sh: build finished but no qcowfs binary found under build/" >&2
  exit 1
}

is_mounted() {
  local target
  target=$(realpath "$1")
  awk -v t="$target" '{ split($0, s, " - "); split(s[1], f, " "); split(s[2], g, " ");
                        if (f[5] == t && g[1] ~ /^fuse/) found = 1 } END { exit !found }' \
      /proc/self/mountinfo
}

# The view's name as qcowfs makes it: the suffixes are raw_view_name()'s in
# fuse/inode_table.cc, in its order (tests/integration/test_mount_cli.py compares them).
view_name() {
  local name
  name=$(basename "$1")
  for suffix in .qcow2 .img .raw .vmdk .vhdx .vhd .vdi .qed .hds .luks; do
    if [ "${name%"$suffix"}" != "$name" ] && [ -n "${name%"$suffix"}" ]; then
      echo "${name%"$suffix"}.raw"; return
    fi
  done
  echo "$name.raw"
}

echo "== installing build dependencies"
bash tests/setup-deps.sh --build
echo "== building"
cmake -S . -B build -DQCOWFS_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target qcowfs
bin=$(find_binary)

if [ ${#args[@]} -ge 1 ]; then
  image=$(realpath "${args[0]}")
else
  echo "== building the demo image"
  image=$(make_demo_image)
fi
mountpoint=${args[1]:-/var/tmp/qcowfs-mnt}
if [ ! -e "$mountpoint" ]; then
  case "$mountpoint" in
    *.raw|*.img) touch "$mountpoint" ;;
    *) mkdir -p "$mountpoint" ;;
  esac
fi
mountpoint=$(realpath "$mountpoint")
if is_mounted "$mountpoint"; then
  echo "run.sh: $mountpoint is already a FUSE mount; unmount it first: fusermount3 -u $mountpoint" >&2
  exit 1
fi
if [ -d "$mountpoint" ]; then view=$mountpoint/$(view_name "$image"); else view=$mountpoint; fi

log=$(mktemp /var/tmp/qcowfs-run.XXXXXX.log)
echo "== mounting $image at $mountpoint"
if [ $daemon -eq 1 ]; then
  "$bin" "${options[@]}" "$image" "$mountpoint"
  pid=""
else
  "$bin" -f "${options[@]}" "$image" "$mountpoint" 2> >(tee "$log" >&2) &
  pid=$!
fi
for _ in $(seq 100); do
  is_mounted "$mountpoint" && break
  if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then break; fi
  sleep 0.1
done
if ! is_mounted "$mountpoint"; then
  echo "run.sh: mount failed; qcowfs said:" >&2
  cat "$log" >&2
  exit 1
fi

size=$(stat -c %s "$view")
cat <<EOF

Mounted: $image
Raw view: $view ($size bytes, $(awk -v s="$size" 'BEGIN { printf "%.1f MiB", s / 1048576 }'))
Options: ${options[1]:-defaults (read-only)}

Use it like any raw disk file:
  read it all:     dd if=$view of=/dev/null bs=1M iflag=direct status=progress
  random reads:    fio --name=rr --filename=$view --rw=randread --bs=4k --iodepth=32 \\
                       --ioengine=io_uring --direct=1 --runtime=10 --time_based
  as a block dev:  losetup -f --show -r -P $view     (partitions appear as /dev/loopNpM
                   where udev runs; losetup -d /dev/loopN when done)
  in a VM:         qemu-system-x86_64 ... -drive file=$view,format=raw,cache=none
  unmount:         fusermount3 -u $mountpoint
EOF
if [ "$image" = "$demo_dir/demo.qcow2" ]; then
  cat <<EOF
The demo disk has one ext4 partition at 1 MiB (hello.txt, random.bin and its sha256):
  sudo mount -o ro,loop,offset=1048576 $view /mnt && cat /mnt/hello.txt && sudo umount /mnt
EOF
fi

rm -f "$log"
if [ $daemon -eq 1 ]; then
  echo "Left mounted (--daemon)."
  exit 0
fi

stopping=0
stop() {
  stopping=1
  echo
  echo "== unmounting $mountpoint"
  fusermount3 -u "$mountpoint" 2>/dev/null || true
}
trap stop INT TERM
echo "Staying in the foreground; Ctrl-C unmounts."
status=0
wait "$pid" || status=$?
if [ $stopping -eq 1 ]; then
  # A trapped signal makes wait return early: wait again for qcowfs's own exit status.
  status=0
  wait "$pid" || status=$?
fi
echo "qcowfs exited with status $status"
exit "$status"
