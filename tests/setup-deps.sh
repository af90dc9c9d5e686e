#!/usr/bin/env bash
# Installs what qcowfs needs on Debian 12 (bookworm): build dependencies, and
# with no argument also everything the tests use. Idempotent: when every
# package is already installed it changes nothing and does not touch apt.
#
#   tests/setup-deps.sh            build + test dependencies
#   tests/setup-deps.sh --build    build dependencies only (what run.sh needs)
set -euo pipefail

build_pkgs=(cmake g++ make pkg-config libfuse3-dev fuse3 liburing-dev zlib1g-dev libzstd-dev
            libfmt-dev libgtest-dev libgcrypt20-dev libcryptsetup-dev libjson-c-dev nettle-dev
            libcurl4-openssl-dev libnbd-dev libinih-dev)
# cryptsetup-bin: cryptsetup (LUKS2 images, key dumps for the cipher tests); qemu-utils: qemu-img/qemu-io (the referee); qemu-system-common: qemu-storage-daemon (bench); python3-cryptography: the independent AES-XTS decryption that checks LUKS2 images;
# util-linux: losetup; fdisk: sfdisk for the demo disk; e2fsprogs/dosfstools: filesystems on
# mounted images; kmod: modprobe fuse/loop; file: file -s on partitions; clang and
# libclang-rt-14-dev: the libFuzzer targets (fuzz.short); rsync: test_disk_tools.py;
# dpkg-dev (dpkg-buildpackage), build-essential (dpkg-checkbuilddeps requires it),
# debhelper, bash-completion (its dh_bash-completion addon, Build-Depends:
# dh-sequence-bash-completion) and lintian: test_package.py builds the package from debian/
# and lints it (no fakeroot: debian/control says Rules-Requires-Root: no); man-db: it
# reads the installed man page. nginx-light, openssl: test_remote.py serves images over
# http(s) on loopback; qemu-block-extra: QEMU's curl driver, so QEMU reads an overlay whose
# backing file is a URL; npm (only where no npm is on PATH: a machine's own Node.js, such as
# NodeSource's nodejs, conflicts with Debian's npm): s3rver, the S3 server test_remote.py starts;
# nbdkit: the second NBD server of test_remote.py; iproute2: ip/tc for bench/remote.sh's namespace.
# python3-botocore: the independent SigV4 signature check of test_remote.py's mock S3 server.
test_pkgs=(cryptsetup-bin python3-cryptography qemu-utils qemu-system-common fio python3 python3-pytest util-linux fdisk
           e2fsprogs dosfstools kmod file clang libclang-rt-14-dev rsync
           dpkg-dev build-essential debhelper bash-completion lintian man-db
           nginx-light openssl qemu-block-extra curl nbdkit iproute2 python3-botocore libnbd-bin)

case "${1:-}" in
  --build) pkgs=("${build_pkgs[@]}" qemu-utils fdisk e2fsprogs) ;;  # run.sh builds a demo disk
  "") pkgs=("${build_pkgs[@]}" "${test_pkgs[@]}")
      command -v npm >/dev/null || pkgs+=(npm) ;;
  *) echo "usage: $0 [--build]" >&2; exit 2 ;;
esac

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

missing=()
for p in "${pkgs[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [ "$status" = installed ] || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all ${#pkgs[@]} packages already installed"
else
  echo "setup-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -q
  as_root apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# FUSE needs /dev/fuse; loop-device tests need the loop driver (harmless when built in).
if [ ! -e /dev/fuse ]; then
  as_root modprobe fuse || echo "setup-deps: warning: /dev/fuse missing and modprobe fuse failed" >&2
fi
if [ -z "${1:-}" ] && [ ! -e /dev/loop-control ]; then
  as_root modprobe loop || echo "setup-deps: warning: loop devices unavailable" >&2
fi
# The S3-compatible server test_remote.py runs on loopback (from the npm registry).
if [ -z "${1:-}" ] && ! command -v s3rver >/dev/null; then
  echo "setup-deps: installing s3rver (npm)"
  as_root npm install -g --no-audit --no-fund s3rver@3.7.1
fi
