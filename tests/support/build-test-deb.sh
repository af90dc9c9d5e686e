#!/bin/sh
# Builds the Debian package the way test_package.py tests it:
#
#   tests/support/build-test-deb.sh OUT_DIR
#
# runs packaging/build-deb.sh OUT_DIR (dpkg-buildpackage, then lintian) with
# -g stripped from the compile flags and no -dbgsym package: the .deb's binary
# is stripped anyway (and -g does not change GCC's code), and debug info is
# close to half the compile time of a from-scratch build. build-deb.sh keeps
# its CMake object directory in OUT_DIR, so a second run with the same sources
# and flags compiles nothing and only packages and lints again.
#
# One build at a time per OUT_DIR (flock on OUT_DIR/.lock): tests/run-all.sh
# starts one at idle CPU priority while the main tests run, and
# test_package.py's own run waits for it if it is not done yet.
# Prints the path of the .deb on its last line (build-deb.sh's output).
set -eu
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$1"
DEB_CXXFLAGS_STRIP=-g DEB_CFLAGS_STRIP=-g DEB_BUILD_OPTIONS=noautodbgsym
export DEB_CXXFLAGS_STRIP DEB_CFLAGS_STRIP DEB_BUILD_OPTIONS
exec flock "$1/.lock" "$repo/packaging/build-deb.sh" "$1"
