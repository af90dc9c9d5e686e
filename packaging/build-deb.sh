#!/bin/sh
# Builds the Debian package of qcowfs from debian/ with dpkg-buildpackage, then
# checks it with lintian (any lintian error fails the build).
#
#   packaging/build-deb.sh [OUT_DIR]      (default OUT_DIR: build-deb/ in the repo)
#
# dpkg-buildpackage builds in the source tree and writes into its parent, so this
# copies the tracked files (git ls-files, as they are in the working tree) to
# OUT_DIR/qcowfs-VERSION and builds there: the .deb, .buildinfo and .changes land
# in OUT_DIR and the repo stays clean. The CMake object directory is kept across
# runs, so a rerun recompiles only what changed.
#
# Environment: JOBS (default 2) becomes DEB_BUILD_OPTIONS parallel= unless that
# already sets one. Prints the path of the .deb on its last line. Install it with
#   apt-get install ./qcowfs_<version>_<arch>.deb
set -eu

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=$(mkdir -p "${1:-$REPO/build-deb}" && cd "${1:-$REPO/build-deb}" && pwd)
JOBS=${JOBS:-2}

VERSION=$(sed -n 's/^project(qcowfs VERSION \([0-9.]*\).*/\1/p' "$REPO/CMakeLists.txt")
[ -n "$VERSION" ] || { echo "build-deb: cannot find the version in CMakeLists.txt" >&2; exit 1; }
DEB_VERSION=$(dpkg-parsechangelog -l "$REPO/debian/changelog" -S Version)
[ "$DEB_VERSION" = "$VERSION" ] || {
    echo "build-deb: debian/changelog is at $DEB_VERSION but CMakeLists.txt at $VERSION" >&2; exit 1; }
ARCH=$(dpkg --print-architecture)
OBJ=obj-$(dpkg-architecture -qDEB_HOST_GNU_TYPE)   # dh's CMake build directory

SRC=$OUT_DIR/qcowfs-$VERSION
KEPT=$OUT_DIR/$OBJ.kept
# A fresh copy of the tracked tree each time (so files deleted or untracked in
# the repo are gone here too), with the object directory carried over. tar keeps
# the mtimes, so make rebuilds only sources that really changed.
if [ -d "$SRC/$OBJ" ]; then rm -rf "$KEPT"; mv "$SRC/$OBJ" "$KEPT"; fi
rm -rf "$SRC"
mkdir -p "$SRC"
git -C "$REPO" ls-files -z >"$OUT_DIR/files"
# --ignore-failed-read: a tracked file deleted in the working tree is left out.
tar -C "$REPO" --null -T "$OUT_DIR/files" --ignore-failed-read --warning=no-failed-read -cf - \
    | tar -C "$SRC" -xf -
rm -f "$OUT_DIR/files"
if [ -d "$KEPT" ]; then mv "$KEPT" "$SRC/$OBJ"; fi

case " ${DEB_BUILD_OPTIONS:-} " in
    *" parallel="*) ;;
    *) DEB_BUILD_OPTIONS="${DEB_BUILD_OPTIONS:+$DEB_BUILD_OPTIONS }parallel=$JOBS" ;;
esac
export DEB_BUILD_OPTIONS

# -nc: the copy is fresh, so the only thing `debian/rules clean` would remove is
# the object directory this keeps on purpose.
LOG=$OUT_DIR/dpkg-buildpackage.log
if ! (cd "$SRC" && dpkg-buildpackage -b -nc -us -uc) >"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "build-deb: dpkg-buildpackage failed; the whole log is $LOG" >&2
    exit 1
fi

CHANGES=$OUT_DIR/qcowfs_${VERSION}_${ARCH}.changes
DEB=$OUT_DIR/qcowfs_${VERSION}_${ARCH}.deb
[ -f "$DEB" ] && [ -f "$CHANGES" ] || { echo "build-deb: dpkg-buildpackage made no $DEB" >&2; exit 1; }

# The .changes names the .deb and the .buildinfo: lintian checks all three.
# Its findings go to stderr (and OUT_DIR/lintian.log); errors fail the build.
if ! lintian --fail-on error --tag-display-limit 0 "$CHANGES" >"$OUT_DIR/lintian.log" 2>&1; then
    cat "$OUT_DIR/lintian.log" >&2
    echo "build-deb: lintian found errors in $CHANGES" >&2
    exit 1
fi
cat "$OUT_DIR/lintian.log" >&2
echo "$DEB"
