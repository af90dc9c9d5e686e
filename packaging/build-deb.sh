#!/bin/sh
# Builds a Debian package of qcowfs: the binary, the man page qcowfs(1) and the
# bash completion, depending on the runtime libraries and fuse3.
#
#   packaging/build-deb.sh [OUT_DIR]      (default OUT_DIR: build-deb/ in the repo)
#
# Environment: BUILD_DIR (default OUT_DIR/build), JOBS (default 2), QCOWFS_BINARY (package
# this already built binary instead of building a Release one, e.g. in the test suite).
# Prints the path of the .deb on its last line. Install it with
#   apt-get install ./qcowfs_<version>_<arch>.deb
set -eu

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=$(mkdir -p "${1:-$REPO/build-deb}" && cd "${1:-$REPO/build-deb}" && pwd)
BUILD_DIR=${BUILD_DIR:-$OUT_DIR/build}
JOBS=${JOBS:-2}

VERSION=$(sed -n 's/^project(qcowfs VERSION \([0-9.]*\).*/\1/p' "$REPO/CMakeLists.txt")
[ -n "$VERSION" ] || { echo "build-deb: cannot find the version in CMakeLists.txt" >&2; exit 1; }
ARCH=$(dpkg --print-architecture)
DEPENDS="libc6, libstdc++6, libgcc-s1, libfuse3-3, liburing2, zlib1g, libzstd1, libfmt9, fuse3"

if [ -n "${QCOWFS_BINARY:-}" ]; then
    BINARY=$QCOWFS_BINARY
else
    cmake -S "$REPO" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DQCOWFS_TESTS=OFF >/dev/null
    cmake --build "$BUILD_DIR" --target qcowfs -j "$JOBS" >/dev/null
    BINARY=$BUILD_DIR/qcowfs
fi

STAGE=$OUT_DIR/stage
rm -rf "$STAGE"
install -D -m 0755 "$BINARY" "$STAGE/usr/bin/qcowfs"
strip --strip-unneeded "$STAGE/usr/bin/qcowfs"
install -d "$STAGE/usr/share/man/man1"
gzip -9n -c "$REPO/docs/qcowfs.1" >"$STAGE/usr/share/man/man1/qcowfs.1.gz"
chmod 0644 "$STAGE/usr/share/man/man1/qcowfs.1.gz"
install -D -m 0644 "$REPO/packaging/qcowfs.bash-completion" "$STAGE/usr/share/bash-completion/completions/qcowfs"
install -d "$STAGE/usr/share/doc/qcowfs"
printf 'qcowfs %s\n\nShows qcow2 and raw disk images as raw files over FUSE; see qcowfs(1).\n' "$VERSION" \
    >"$STAGE/usr/share/doc/qcowfs/README"

# Every shared library the binary needs must come from a declared dependency.
for lib in $(ldd "$STAGE/usr/bin/qcowfs" | awk '/=> \//{print $3}'); do
    pkg=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null | head -n1 | cut -d: -f1) || pkg=""
    [ -z "$pkg" ] && pkg=$(dpkg -S "$lib" 2>/dev/null | head -n1 | cut -d: -f1) || true
    case ", $DEPENDS," in
        *", $pkg,"*) ;;
        *) echo "build-deb: $lib comes from '${pkg:-no package}', not a declared dependency" >&2; exit 1 ;;
    esac
done

SIZE_KB=$(du -sk "$STAGE" | cut -f1)
install -d "$STAGE/DEBIAN"
cat >"$STAGE/DEBIAN/control" <<CONTROL
Package: qcowfs
Version: $VERSION
Architecture: $ARCH
Maintainer: qcowfs developers <qcowfs@localhost>
Installed-Size: $SIZE_KB
Depends: $DEPENDS
Section: admin
Priority: optional
Homepage: https://localhost/qcowfs
Description: FUSE file system showing qcow2 and raw disk images as raw files
 qcowfs mounts a qcow2 (or raw) virtual disk image as one plain raw file,
 byte for byte what QEMU shows a guest, with its internal snapshots and
 partitions as further files. It also creates, inspects, checks and repairs
 qcow2 images (qcowfs create, info, check, map) without QEMU installed.
CONTROL

DEB=$OUT_DIR/qcowfs_${VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group --build "$STAGE" "$DEB" >/dev/null
echo "$DEB"
